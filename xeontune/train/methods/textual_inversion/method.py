"""Textual inversion: a new token's vectors, spliced into the frozen text encoder(s) (train/tokens.py).

SDXL: the token trains in both encoders, and its file holds ``clip_l`` and ``clip_g``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xeontune.errors import TrainingError, UserError
from xeontune.train import tokens
from xeontune.train.data import templates_for
from xeontune.train.methods import Method
from xeontune.train.methods.textual_inversion import METHOD as DECLARED
from xeontune.train.outputs import learned_file

STEM = DECLARED.files[0]


class TextualInversion(Method):
    name = "textual_inversion"
    learns = "vectors"

    placeholder: tokens.Placeholder
    placeholder_2: tokens.Placeholder | None = None  # SDXL: the token's ids in the second tokenizer
    embedding: nn.Module  # SplicedEmbedding (or the baseline's FullTableEmbedding); SDXL: an EncoderPair

    def install(self, components: Any) -> None:
        opts = self.opts
        self.placeholder, *more = [tokens.add_placeholder_tokens(t, opts.placeholder_token, opts.num_vectors,
                                                                 opts.initializer_token) for t in components.tokenizers]
        self.placeholder_2 = more[0] if more else None
        self.encoders = components.text_encoders
        embedding = tokens.install(components.text_encoder, self.placeholder, full_table=opts.train_full_table)
        if self.placeholder_2 is not None:  # SDXL: the token trains in both encoders
            embedding = tokens.EncoderPair(embedding, tokens.install(
                components.text_encoder_2, self.placeholder_2, full_table=opts.train_full_table))
        self.embedding = embedding

    def prompts(self, given: Any) -> list[str]:
        texts = given.texts if given else [t.format(self.opts.placeholder_token)
                                           for t in templates_for(self.opts.learnable_property)]
        return [self.placeholder.in_prompt(text) for text in texts]

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.embedding.parameters() if p.requires_grad]

    def ddp_modules(self) -> list[nn.Module]:
        # One DDP per encoder's rows (SDXL: each called once a forward): DDP syncs just the new rows.
        return tokens.parts(self.embedding)

    def use_ddp(self, wrapped: list[nn.Module]) -> None:
        for encoder, ddp in zip(self.encoders, wrapped, strict=True):
            encoder.set_input_embeddings(ddp)

    def check_gradient(self) -> None:
        """Stop at the first step if no finite, non-zero gradient reached every new vector (of both
        text encoders for SDXL)."""
        for index, part in enumerate(tokens.parts(self.embedding)):
            grad = part.new_rows_grad()
            if grad is None or not torch.isfinite(grad).all() or (grad.abs().sum(dim=-1) == 0).any():
                which = f" of text encoder {index + 1}" if len(self.encoders) > 1 else ""
                hint = (" (e.g. IPEX weight prepacking of Linear layers). Try --ipex off."
                        if self.on_ipex else "")
                raise TrainingError(
                    f"the placeholder vectors{which} received no usable gradient after the first backward pass "
                    f"({'none' if grad is None else 'non-finite or zero'}); a backend broke the gradient path{hint}"
                )

    def after_step(self) -> None:
        self.embedding.after_step()

    def finite(self) -> bool:
        return bool(torch.isfinite(self.embedding.learned()).all())  # a few KB

    def learned(self) -> torch.Tensor:
        return self.embedding.learned()

    def state(self) -> dict[str, Any]:
        return {"vectors": self.embedding.learned(), "placeholder_tokens": self.placeholder.tokens}

    def load_state(self, state: Any, where: str) -> None:
        if state.placeholder_tokens != self.placeholder.tokens or state.vectors.shape != self.embedding.learned().shape:
            raise UserError(
                f"checkpoint {where} was trained for {state.placeholder_tokens} with vectors "
                f"{tuple(state.vectors.shape)}; this run has {self.placeholder.tokens} "
                f"{tuple(self.embedding.learned().shape)}"
            )
        self.embedding.load_learned(state.vectors)

    def save(self, output_dir: Path, step: int, final: bool) -> Path:
        """learned_embeds in --save-format; SDXL's in the clip_l / clip_g layout whatever the format."""
        path = output_dir / learned_file(STEM, None if final else step)
        return tokens.save_learned_embeds(path, self.placeholder, self.embedding.learned(), self.opts.save_format,
                                          step, split_dim=getattr(self.embedding, "split_dim", None))

    @contextlib.contextmanager
    def inference(self, components: Any) -> Iterator[None]:
        encoders = components.text_encoders
        wrapped = [e.get_input_embeddings() for e in encoders]
        for encoder, embedding in zip(encoders, tokens.parts(self.embedding), strict=True):
            encoder.set_input_embeddings(embedding)  # the bare module: no DDP hooks on one rank
        try:
            yield
        finally:
            for encoder, module in zip(encoders, wrapped, strict=True):
                encoder.set_input_embeddings(module)

    @contextlib.contextmanager
    def merged_into(self, pipeline: Any) -> Iterator[None]:
        """Each encoder's table grown by the learned rows, as an ordinary embedding; the encoders'
        own modules are put back afterwards (they may be the ones training used)."""
        parts = tokens.parts(self.embedding)
        names = ("text_encoder", "text_encoder_2")[: len(parts)]
        placeholders = (self.placeholder, self.placeholder_2)[: len(parts)]
        saved = []
        try:
            for name, part, placeholder in zip(names, parts, placeholders, strict=True):
                encoder = getattr(pipeline, name)
                saved.append((encoder, encoder.get_input_embeddings()))
                encoder.set_input_embeddings(tokens.merged_table(part, placeholder, encoder.dtype))
                encoder.config.vocab_size = encoder.get_input_embeddings().weight.shape[0]
            yield
        finally:
            for encoder, wrapped in saved:
                encoder.set_input_embeddings(wrapped)
