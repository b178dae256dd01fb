"""Training methods as plug-ins: what trains, and what the run writes for it.

Each method is a package under train/methods/ that declares itself in its ``__init__`` (``METHOD``, a
``declaration.Declaration``: torch-free, so that the options, `--help`, `fetch` and the bench read it without
importing torch) and implements the ``Method`` contract below in its ``method`` module:

- ``textual_inversion``: a new token's vectors in the text encoder(s), all models frozen;
- ``lora``: peft's low-rank adapters beside the frozen (packed, bf16-copy) UNet, and the text
  encoders' when asked;
- ``full``: the UNet's own weights (and the text encoders' with --train-text-encoder).

A declaration holds what the rest of the toolkit knows of a method by name: what it trains in a phrase,
its options group (options.py's fields of that group are its own), the options it takes from others,
those it requires, its defaults, the stems of its learned files (outputs.py), whether it takes prior
preservation's shared group, and its bench baseline (the example script it is measured against, its
targets, how that script holds the models).

What a method trains of the pipeline itself it declares in ``trains``; the loop follows from that alone:
a trained part is loaded with fp32 master weights (never a frozen bf16 copy, never packed as frozen,
its text-encoder Linear layers never cast), runs under bf16 autocast where the run is bf16, is wrapped
in DDP, and the rank/memory plan counts its gradients and optimizer state (ranks.py).

A method is made from the options (``create``) and then, in this order, asked to ``install`` itself
into the loaded models (its declaration having checked the images' prompts, ``Declaration.check_prompts``,
before anything loaded), for the ``prompts`` the samples draw from, for its trainable ``parameters``
(the optimizer's) and the modules DDP wraps (``ddp_modules`` / ``use_ddp``; parameters outside them
are all-reduced by the loop; ``sharded_modules`` / ``after_sharding`` / ``stand_in`` where it shards them), once for ``check_gradient`` after the first backward, before every
optimizer step (``before_update``) and after it (``after_step``, ``finite``), for its checkpoint ``state`` /
``load_state`` (and, resuming, ``check_state`` before any model loads), to
``save`` its learned files, to apply itself for sample images (``inference``) and to merge itself into
a pipeline being saved (``merged_into``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from xeontune.train.methods.declaration import get

if TYPE_CHECKING:
    from torch import nn

    from xeontune.train.components import Components
    from xeontune.train.options import TrainOptions
    from xeontune.train.prompts import ImagePrompts

class Method:
    """The contract; see the module's docstring for when the loop calls what."""

    name: ClassVar[str]
    learns: ClassVar[str] = "trained weights"  # what its messages call what trains ("vectors", "adapters")
    uses_ipex: ClassVar[bool] = True  # False: `--ipex auto` leaves IPEX out, `--ipex on` is an error
    on_ipex: bool = False  # IPEX optimized the frozen models this run (the loop's setup says): its errors may name it

    def __init__(self, opts: TrainOptions) -> None:
        self.opts = opts

    @property
    def trains(self) -> frozenset[str]:
        """The pipeline parts (of ``PARTS``) whose own weights train: declared (``Declaration.trains``)."""
        return get(self.name).trains(self.opts)

    @property
    def trains_text_encoders(self) -> bool:
        """Whether gradients flow into the text encoders: declared (``Declaration.trains_text_encoders``)."""
        return get(self.name).trains_text_encoders(self.opts)

    @property
    def modified_parts(self) -> set[str]:
        """Pipeline parts whose modules the method changed in place (``save_pipeline`` reloads them
        as stored before ``merged_into``)."""
        return set()

    def install(self, components: Components) -> None:
        raise NotImplementedError

    def prompts(self, given: ImagePrompts | None) -> list[str]:
        """The prompts the samples draw from, as the tokenizers should read them: ``given.texts`` (same
        order) rewritten where the method must, or its own when ``given`` is None."""
        raise NotImplementedError

    def parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def ddp_modules(self) -> list[nn.Module]:
        return []

    def use_ddp(self, wrapped: list[nn.Module]) -> None:
        """Put the DDP wrappers of ``ddp_modules()`` (same order) where the models call them."""

    def sharded_modules(self) -> list[nn.Module]:
        """The modules the loop shards over the ranks in place of DDP (FSDP, ``--shard gradients|full``)."""
        return self.ddp_modules()

    def after_sharding(self) -> None:
        """The loop sharded ``sharded_modules()`` in place (their weights are now each rank's shares): what
        the method keeps beside those weights (an EMA of them) it keeps as shares too."""

    def stand_in(self, copies: list[nn.Module] | None, write_back: bool = False) -> contextlib.AbstractContextManager[None]:
        """Plain modules holding the whole weights of ``sharded_modules()`` (same order) take their places
        while rank 0 writes outputs or a resume loads into them. Every rank enters it (a collective:
        ``copies`` is None on a rank that holds none): what the method keeps as shares (``after_sharding``)
        is gathered whole beside the copies, and with ``write_back`` (a resume) cut back into the shares at
        the end. The loop shards only for a method that implements this."""
        raise NotImplementedError(f"--method {self.name} cannot have its modules sharded")

    def check_gradient(self, summary: dict[int, tuple[bool, bool]] | None = None) -> None:
        """After the first backward: raise TrainingError unless every trainable part got a usable gradient.
        ``summary`` (--fused-backward-pass, whose gradients are gone by then): each parameter's, by its id,
        as (finite throughout, not zero throughout)."""

    def before_update(self, step: int, max_steps: int) -> None:
        """Gradients complete (all-reduced), before clipping and the optimizer step ``step`` (0-based) of
        ``max_steps``: a part whose gradients it sets to None is left alone by the optimizer (AdamW
        moves neither it nor its state)."""

    def after_step(self) -> None:
        """After each optimizer step."""

    def finite(self) -> bool:
        return all(bool(p.detach().isfinite().all()) for p in self.parameters())

    def learned(self) -> Any:
        """A copy of what it learned (TrainResult.learned): a tensor or a dict of them."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The checkpoint fields of checkpoint.TrainState that hold what the method learned."""
        raise NotImplementedError

    def check_state(self, state: Any, where: str) -> None:
        """Before any model loads (rank 0, resuming): raise UserError (one line) when the options say the
        checkpoint was trained otherwise, so the mistake costs no model load and no latent cache.
        ``load_state`` checks again against the installed models."""

    def load_state(self, state: Any, where: str) -> None:
        """Load a checkpoint's learned state (UserError in one line when it was trained otherwise)."""
        raise NotImplementedError

    def save(self, output_dir: Path, step: int, final: bool) -> Path:
        """Write the learned files (atomically): the final ones, or the copies of ``step``; return the
        result file's path."""
        raise NotImplementedError

    @contextlib.contextmanager
    def inference(self, components: Components) -> Iterator[None]:
        """The models as a pipeline should run them for sample images, the learned part applied."""
        yield

    @contextlib.contextmanager
    def merged_into(self, pipeline: Any) -> Iterator[None]:
        """The learned part merged into ``pipeline`` (built from the frozen parts and, for
        ``modified_parts``, fresh copies as stored) while it is saved."""
        yield


def create(opts: TrainOptions) -> Method:
    entry = get(opts.method).implementation
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    return entry(opts)
