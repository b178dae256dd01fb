"""Placeholder tokens, the trainable-rows splice, and saving/loading learned embeddings.

The text encoder's token table stays frozen. The new tokens' vectors are one small parameter,
spliced into the embedding output by a gather and a masked select, so the text encoder sees an
ordinary embedding while the optimizer, the gradient all-reduce and checkpoints touch only
``num_vectors x dim`` floats, and frozen rows can never drift.

SDXL has two text encoders, and the token trains in both: one splice per encoder, held together by
``EncoderPair``, whose vectors read as one ``num_vectors x (768 + 1280)`` tensor (checkpoints,
results) and are saved as A1111's SDXL layout, ``clip_l`` and ``clip_g``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from xeontune.errors import UserError
from xeontune.io import atomic_path


@dataclass
class Placeholder:
    tokens: list[str]  # "<tok>", "<tok>_1", ...
    first_id: int  # ids are first_id .. first_id + len(tokens) - 1
    initializer_id: int

    @property
    def ids(self) -> list[int]:
        return list(range(self.first_id, self.first_id + len(self.tokens)))

    @property
    def prompt_text(self) -> str:
        """What stands for the concept in a prompt: every vector's token, in order."""
        return " ".join(self.tokens)

    def in_prompt(self, text: str) -> str:
        """``text`` with the token standing for every vector (``<tok>`` -> ``<tok> <tok>_1 ...``)."""
        return text.replace(self.tokens[0], self.prompt_text) if len(self.tokens) > 1 else text


def add_placeholder_tokens(tokenizer, placeholder: str, num_vectors: int, initializer: str) -> Placeholder:
    tokens = [placeholder] + [f"{placeholder}_{i}" for i in range(1, num_vectors)]
    vocab = tokenizer.get_vocab()
    # A token is taken if it is a vocab entry or already reads as one known token (as "toy" does).
    taken = [t for t in tokens if t in vocab or len(tokenizer.encode(t, add_special_tokens=False)) == 1]
    if taken:
        raise UserError(f"placeholder token {taken[0]!r} is already in the tokenizer's vocabulary; pick another")
    init_ids = tokenizer.encode(initializer, add_special_tokens=False)
    if len(init_ids) != 1:
        raise UserError(
            f"initializer token {initializer!r} must be exactly one token, but the tokenizer splits it into "
            f"{len(init_ids)}; pick a single common word"
        )
    if tokenizer.add_tokens(tokens) != num_vectors:
        raise UserError(f"could not add placeholder tokens {tokens} to the tokenizer")
    ids = tokenizer.convert_tokens_to_ids(tokens)
    if ids != list(range(ids[0], ids[0] + num_vectors)):
        raise UserError(f"placeholder tokens got non-contiguous ids {ids}")
    return Placeholder(tokens=tokens, first_id=ids[0], initializer_id=init_ids[0])


class SplicedEmbedding(nn.Module):
    """A frozen token table plus trainable rows for the placeholder ids."""

    def __init__(self, table: torch.Tensor, placeholder: Placeholder) -> None:
        super().__init__()
        # A plain attribute, not a buffer: DDP would otherwise broadcast the whole table.
        self.table = table.detach().requires_grad_(False)
        self.first_id = placeholder.first_id
        init = table[placeholder.initializer_id].detach().clone()
        self.vectors = nn.Parameter(init.repeat(len(placeholder.tokens), 1))

    @property
    def embedding_dim(self) -> int:
        return self.table.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids.clamp(max=self.table.shape[0] - 1), self.table)
        rel = input_ids - self.first_id
        is_new = (rel >= 0) & (rel < self.vectors.shape[0])
        new = F.embedding(rel.clamp(0, self.vectors.shape[0] - 1), self.vectors)
        return torch.where(is_new.unsqueeze(-1), new.to(out.dtype), out)

    def learned(self) -> torch.Tensor:
        return self.vectors.detach().clone()

    def new_rows_grad(self) -> torch.Tensor | None:
        return self.vectors.grad

    def load_learned(self, vectors: torch.Tensor) -> None:
        with torch.no_grad():
            self.vectors.copy_(vectors)

    def after_step(self) -> None:
        """Nothing to restore: frozen rows are never touched."""


class FullTableEmbedding(nn.Module):
    """The common example script's approach, kept for the benchmark's baseline.

    The whole table (grown by the new rows) is trainable and all-reduced; after every optimizer
    step the original rows are copied back.
    """

    def __init__(self, table: torch.Tensor, placeholder: Placeholder) -> None:
        super().__init__()
        n = len(placeholder.tokens)
        self.first_id = placeholder.first_id
        rows = max(table.shape[0], placeholder.first_id + n)
        weight = torch.zeros(rows, table.shape[1], dtype=table.dtype)
        weight[: table.shape[0]] = table
        weight[self.first_id : self.first_id + n] = table[placeholder.initializer_id]
        self.original = weight.detach().clone()
        self.weight = nn.Parameter(weight)
        self._keep = torch.ones(rows, dtype=torch.bool)
        self._keep[self.first_id : self.first_id + n] = False
        self.n = n

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def learned(self) -> torch.Tensor:
        return self.weight.detach()[self.first_id : self.first_id + self.n].clone()

    def new_rows_grad(self) -> torch.Tensor | None:
        grad = self.weight.grad
        return None if grad is None else grad[self.first_id : self.first_id + self.n]

    def load_learned(self, vectors: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight[self.first_id : self.first_id + self.n] = vectors

    def after_step(self) -> None:
        with torch.no_grad():
            self.weight[self._keep] = self.original[self._keep]


class EncoderPair(nn.Module):
    """SDXL: the trainable rows of both text encoders (each a splice, or the baseline's full table).

    Each half is installed in its own encoder (and, with several ranks, wrapped by its own DDP); this
    module only gathers them for the optimizer and reads their vectors as one tensor, clip_l | clip_g."""

    def __init__(self, clip_l: nn.Module, clip_g: nn.Module) -> None:
        super().__init__()
        self.clip_l, self.clip_g = clip_l, clip_g

    @property
    def split_dim(self) -> int:
        return self.clip_l.embedding_dim

    def learned(self) -> torch.Tensor:
        return torch.cat([self.clip_l.learned(), self.clip_g.learned()], dim=-1)

    def load_learned(self, vectors: torch.Tensor) -> None:
        self.clip_l.load_learned(vectors[:, : self.split_dim])
        self.clip_g.load_learned(vectors[:, self.split_dim :])

    def after_step(self) -> None:
        self.clip_l.after_step()
        self.clip_g.after_step()


def parts(module: nn.Module) -> list[nn.Module]:
    """The per-encoder embedding modules, in the order of Components.text_encoders."""
    return [module.clip_l, module.clip_g] if isinstance(module, EncoderPair) else [module]


def install(text_encoder: nn.Module, placeholder: Placeholder, full_table: bool = False) -> nn.Module:
    """Replace the text encoder's token embedding by a splice (or the baseline's full table)."""
    table = text_encoder.get_input_embeddings().weight
    module = (FullTableEmbedding if full_table else SplicedEmbedding)(table, placeholder)
    text_encoder.set_input_embeddings(module)
    return module


def merged_table(module: nn.Module, placeholder: Placeholder, dtype: torch.dtype | None = None) -> nn.Embedding:
    """An ordinary nn.Embedding holding the frozen rows and the learned ones (for saving a pipeline),
    in ``dtype`` (the saved encoder's) or the table's own."""
    base = module.table if isinstance(module, SplicedEmbedding) else module.weight.detach()
    rows = max(base.shape[0], placeholder.first_id + len(placeholder.tokens))
    weight = torch.zeros(rows, base.shape[1], dtype=dtype or base.dtype)
    weight[: base.shape[0]] = base
    weight[placeholder.first_id : placeholder.first_id + len(placeholder.tokens)] = module.learned()
    return nn.Embedding.from_pretrained(weight, freeze=True)


def save_learned_embeds(path: Path, placeholder: Placeholder, vectors: torch.Tensor, fmt: str, step: int,
                        split_dim: int | None = None) -> Path:
    """Write learned vectors atomically: diffusers ({token: (n, dim)}) or a1111 ({"emb_params": (n, dim)}).

    ``split_dim`` (SDXL: the first encoder's width): the one layout A1111, ComfyUI and kohya read for
    SDXL, in either format: {"clip_l": (n, 768), "clip_g": (n, 1280)}, the token's name in the metadata."""
    from safetensors.torch import save_file

    token = placeholder.tokens[0]
    tensor = vectors.detach().float().contiguous().cpu()
    if split_dim is not None:
        tensors = {"clip_l": tensor[:, :split_dim].contiguous(), "clip_g": tensor[:, split_dim:].contiguous()}
        metadata = {"name": token, "step": str(step)}
    elif fmt == "a1111":
        tensors = {"emb_params": tensor}
        metadata = {"name": token, "step": str(step), "sd_checkpoint_name": "xeontune"}
    else:
        tensors = {token: tensor}
        metadata = {"step": str(step)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


def load_learned_embeds(path: str | Path) -> tuple[str | None, torch.Tensor]:
    """Return (token or None for a1111 files, vectors) from a learned_embeds file (an SDXL file's
    vectors as one tensor, clip_l | clip_g, as EncoderPair reads them)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if sorted(keys) == ["clip_g", "clip_l"]:
            vectors = torch.cat([f.get_tensor("clip_l"), f.get_tensor("clip_g")], dim=-1)
            return (f.metadata() or {}).get("name"), vectors
        if "emb_params" in keys:
            return (f.metadata() or {}).get("name"), f.get_tensor("emb_params")
        if len(keys) != 1:
            raise UserError(f"{path}: expected one token in the file, found {len(keys)}")
        return keys[0], f.get_tensor(keys[0])
