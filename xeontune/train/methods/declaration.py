"""What the toolkit knows of a training method without importing it: its declaration (each method
package's ``METHOD``), found by name. Torch-free: the options, `--help`, `fetch` and the bench read it
(train/methods/__init__.py has the contract a method implements)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from xeontune.registry import Registry


@dataclass(frozen=True)
class Bench:
    """A method's baseline in `xeontune bench`: the example script it is measured against and its targets."""

    example: str  # the diffusers example script(s), for the report
    # speedup_min (steps/s over the example's) and rss_ratio_max (peak RSS over its), each a number or
    # {"bf16": ..., "fp32": ...} (a model family may override them: Family.bench_targets)
    targets: Mapping[str, Any]
    # the trainer's options of each variant beyond the shared ones: (baseline?, bench args) -> options
    options: Callable[[bool, Any], dict[str, Any]]


@dataclass(frozen=True)
class Declaration:
    """What the toolkit knows of a method without importing it (its package's ``METHOD``)."""

    name: str
    summary: str  # what trains, for --method's help
    implementation: str | type  # "module:Class" of its methods.Method (imported when a run makes it), or the class
    group: str  # its options' group in --help: options.py's fields of this group are its own
    files: tuple[str, ...]  # the stems of its learned files, its result first (outputs.py)
    defaults: Mapping[str, Any]  # learning_rate, output_dir, random_flip: what differs by method
    required: tuple[str, ...] = ()
    own: tuple[str, ...] = ()  # its options filed in another group ("outputs")
    borrows: tuple[str, ...] = ()  # options of another method's group that it takes too
    prior_preservation: bool = False  # takes the shared "prior preservation" group (DreamBooth's class images)
    bench: Bench | None = field(default=None, compare=False)
    # what trains, from the options alone (torch-free, so that `xeontune run` sizes the ranks and checks the
    # prompts without importing the method): the pipeline parts of families.PARTS whose own weights train
    # (none for a method that trains beside frozen models), whether gradients flow into the text encoders
    # (when not, the loop computes their outputs once per prompt), and a check of the images' prompts
    # (train/prompts.ImagePrompts, None when they have none) that raises UserError in one line
    trains: Callable[[Any], frozenset[str]] = field(default=lambda opts: frozenset(), compare=False)
    trains_text_encoders: Callable[[Any], bool] = field(default=lambda opts: True, compare=False)
    check_prompts: Callable[[Any, Any], None] = field(default=lambda opts, given: None, compare=False)


_REGISTRY: Registry[Declaration] = Registry("method", "METHOD", Declaration)
for _name in ("textual_inversion", "lora", "full"):
    _REGISTRY.register(_name, f"xeontune.train.methods.{_name}")
register, unregister, names, get = _REGISTRY.register, _REGISTRY.unregister, _REGISTRY.names, _REGISTRY.get


def declarations() -> list[Declaration]:
    return [get(name) for name in names()]
