"""`xeontune train --nproc-per-node N|auto`: N data-parallel ranks on this machine.

How many ranks fit (``plan_ranks``: cores and the memory each rank holds) and the bf16 weight
copies they share are decided here; the ranks are started by the elastic engine
(xeontune/job/engines/elastic.py). Each rank pins itself to its slice of the physical cores
(`placement.pin_this_rank`) before torch starts. The result equals one process with N times the
per-rank batch, as across nodes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

from xeontune import placement
from xeontune.errors import UserError
from xeontune.train import families
from xeontune.train.methods.declaration import get as declared
from xeontune.train.options import TrainOptions

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def inside_a_launch(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """True in a rank that a launcher (this one, mpirun, torchrun) started."""
    return any(env.get(v, "").isdigit() and int(env[v]) > 1 for v in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


def _folder_bytes(folder: Path) -> int:
    """A part's weights as the trainer loads them, in fp32: a safetensors file's half-precision tensors count
    twice their size (SD3.5's and Flux.1's transformer and T5 ship in bf16; the loader upcasts them), read
    from its header. A variant's files (``*.fp16.safetensors``) count only where the plain ones are absent."""
    if not folder.is_dir():
        return 0
    files = [p for p in folder.glob("*") if p.name.endswith(WEIGHT_SUFFIXES)]
    plain = [p for p in files if p.name.count(".") == 1]
    return sum(_as_fp32_bytes(p) for p in (plain or files))


def _header(path: Path) -> dict | None:
    """A safetensors file's header (its tensors' dtypes and shapes), None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return None


def _as_fp32_bytes(path: Path) -> int:
    size = path.stat().st_size
    header = _header(path) if path.suffix == ".safetensors" else None
    if header is None:
        return size
    half = sum(int(math.prod(t["shape"])) * 2 for name, t in header.items()
               if name != "__metadata__" and t.get("dtype") in ("F16", "BF16"))
    return size + half


# A trained part's optimizer state as a multiple of its fp32 weights (beside the weights and gradients,
# 1 each; --use-ema adds one fp32 copy of the UNet, sharded as its weights are): AdamW's two moments (16 bytes a parameter in all);
# Adafactor's, from the part's shapes (``adafactor_state_share``), this where they cannot be read and the family
# names none (Family.adafactor_shares: its reference model's).
ADAMW_STATE = 2.0
ADAFACTOR_STATE_UNREAD = 0.5


def adafactor_state_numel(shape: list[int]) -> int:
    """The second moments transformers' Adafactor keeps for a tensor of ``shape`` (its row and column
    factors for two or more dimensions, the tensor's own size for a vector)."""
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]


def adafactor_state_share(folder: Path | None, unread: float = ADAFACTOR_STATE_UNREAD) -> float:
    """transformers' Adafactor (no first moment, as make_optimizer runs it) keeps a row and a column of
    second moments for a tensor of two or more dimensions (the shape without its last, and without its
    last but one) and a vector's own size: a 3x3 convolution's state is 2/3 of it, a Linear layer's next to
    nothing. Summed from the part's safetensors headers: SD1.5's UNet 0.53 of its weights, SDXL's 0.10
    (peak RSS measured: docs/performance.md). ``unread``: the share where the files cannot be read."""
    state = total = 0
    for path in sorted(folder.glob("*.safetensors")) if folder is not None and folder.is_dir() else ():
        for name, tensor in (_header(path) or {}).items():
            if name == "__metadata__":
                continue
            total += math.prod(tensor["shape"])
            state += adafactor_state_numel(tensor["shape"])
    return state / total if total else unread


def frozen_weight_bytes(model: str, precision: str, packed: bool = False, family: str | None = None,
                        text_encoders: bool = True, trained: frozenset[str] = frozenset(), optimizer: str = "adamw",
                        ema: bool = False, shares: tuple[float, float, float] = (1.0, 1.0, 1.0),
                        encoding: bool = False) -> int:
    """Bytes of weights one rank holds: a frozen UNet and the text encoders' Linear layers in the
    training dtype, the rest as stored. With packed weights (`--pack-weights`, see packs()) a frozen UNet
    counts twice: its layers are held reordered for the forward and again for the input gradient, each
    rank its own, while the plain weights' pages are handed back once reordered. A part the method
    ``trained`` (families.PARTS) is held in fp32 with its gradients and optimizer state, never packed.
    ``text_encoders``: False where the run frees them once their outputs are cached (``keeps_text_encoders``).
    ``shares``: of a trained part's (weights, gradients, optimizer state), what a rank keeps
    (``shares``: 1/N of the state with --shard optimizer on N ranks, of all three with FSDP).
    ``model`` "": the family's reference model (its default sizes). ``encoding``: what a run that encodes its
    prompts first (``encodes_first``) holds while it does: the largest text encoder and the VAE."""
    root = Path(model).expanduser() if model else None
    if family is None:  # a local pipeline's own (its model_index.json), else SD's
        from xeontune.train.components import pipeline_family

        family = pipeline_family(str(root)).name if root is not None and root.is_dir() else "sd"
    kind = families.get(family)
    if root is None or not root.is_dir():  # the family's reference model's sizes (``family``: where the hub said which)
        stored = kind.default_bytes()
    else:
        stored = {part: _folder_bytes(root / part) for part in (kind.denoiser, "vae", *kind.encoder_names)}
        # one copy per weights file kind is loaded; a folder holding both .bin and .safetensors counts twice
        if any((root / kind.denoiser).glob("*.safetensors")) and any((root / kind.denoiser).glob("*.bin")):
            stored[kind.denoiser] //= 2
    weight_share, grad_share, state_share = shares

    def factor(folder: str) -> float:  # a trained part's bytes as a multiple of its fp32 weights
        state = ADAMW_STATE if optimizer == "adamw" else adafactor_state_share(
            root / folder if root else None, kind.adafactor_shares.get(folder, ADAFACTOR_STATE_UNREAD))
        return weight_share + grad_share + state * state_share

    denoiser = 0 if encoding else stored[kind.denoiser]
    if families.DENOISER in trained:
        denoiser = denoiser * (factor(kind.denoiser) + (weight_share if ema else 0))  # sharded as the weights are
    else:
        # a bf16 run casts it once at load (stored in fp32 in the common pipelines)
        denoiser = (denoiser // 2 if precision == "bf16" else denoiser) * (2 if packed else 1)
    held = []
    for encoder in kind.encoders:  # each held as its Linear layers' share says under bf16
        if encoder.folder in trained and encoder.trainable:
            held.append(stored[encoder.folder] * factor(encoder.folder))
        elif text_encoders:
            held.append(_text_encoder_bytes(stored[encoder.folder], precision, encoder.linear_share))
    encoders = max(held, default=0.0) if encoding else sum(held)  # one at a time, or all together
    return int(denoiser + stored["vae"] + encoders)


def shares(level: str, world: int) -> tuple[float, float, float]:
    """The shares of a trained part's (weights, gradients, optimizer state) that one rank holds between
    steps at ``level`` on ``world`` ranks."""
    part = 1 / world if world > 1 else 1.0
    return {"none": (1.0, 1.0, 1.0), "optimizer": (1.0, 1.0, part), "gradients": (part, part, part),
            "full": (part, part, part)}[level if world > 1 else "none"]


def held_shares(level: str, world: int, opts: TrainOptions) -> tuple[float, float, float]:
    """``shares`` as the run holds them at its peak: FSDP's micro-steps before a step's last
    (--gradient-accumulation-steps) add up whole gradients, which only the last reduce-scatters;
    --fused-backward-pass frees each gradient as its weight steps (no whole set is held, unless
    micro-steps accumulate them)."""
    weights, gradients, state = shares(level, world)
    if opts.gradient_accumulation_steps > 1:
        return weights, 1.0, state
    return weights, 0.0 if opts.fused_backward_pass else gradients, state


def packs(pack_weights: str, precision: str, family: str, here: bool = True) -> bool:
    """Whether the ranks may hold packed weights, to count them in their memory. `auto` follows
    packed.auto_choice where the ranks run on this machine's CPU (``here``); for another machine's
    ranks (a cluster's nodes) it counts them, the safe side: their CPU is not known here. Nor are the
    threads a rank will have (they follow the ranks' count, not chosen yet): counted as for one thread,
    where auto packs wherever the kernels run."""
    if pack_weights != "auto":
        return pack_weights == "on"
    if not here:
        return True
    from xeontune.train.packed import auto_choice

    return auto_choice(precision, family, threads=1)[0]


def _text_encoder_bytes(stored: float, precision: str, linear_share: float) -> float:
    """Under bf16 its Linear layers are held in bf16 (components.cast_text_encoder_linears)."""
    return stored * (1 - linear_share / 2) if precision == "bf16" else stored


def rank_memory(opts: TrainOptions, precision: str, here: bool = True, world: int = 1,
                shard: str | None = None) -> int:
    """What one rank of this run holds (what `--nproc-per-node auto` and `launch --ppn auto` divide
    memory by): the model's frozen weights as the rank holds them and its activations, both by family
    (read from model_index.json: a local folder, or the hub's when reachable; else SD1.x is assumed).
    ``here``: the ranks run on this machine's CPU (see packs()). ``world``: the job's ranks, which
    --shard divides the training state by (1, the safe side, where it is not known yet); ``shard``: the
    level to count at (--shard's own where it is not auto)."""
    from xeontune.train.components import pipeline_family

    kind = pipeline_family(str(opts.model), opts.revision)
    family = kind.name
    level = shard or opts.shard
    weights = frozen_weight_bytes(str(opts.model), precision, packs(opts.pack_weights, precision, family, here), family,
                                  text_encoders=keeps_text_encoders(opts), trained=declared(opts.method).trains(opts),
                                  optimizer=opts.optimizer, ema=opts.use_ema,
                                  shares=held_shares(level if level != "auto" else "none", world, opts))
    return placement.rank_memory_bytes(weights, kind.activation_bytes(opts.resolution, precision),
                                       opts.train_batch_size, opts.gradient_checkpointing)


def memory_plan(opts: TrainOptions, precision: str, world: int, local_ranks: int) -> tuple[bool, str]:
    """Whether this node's ranks fit in its available memory, by the rank plan's figures (the family's model
    sizes, its activations, the method's training state), and a line that says so: told before any weight
    loads, so a model too large for the node (Flux.1 in fp32 on 64 GB, say) costs no load."""
    steady = rank_memory(opts, precision, world=world)
    # at load every text encoder is held too, even those freed once the prompts are cached (T5-XXL: 19 GB in fp32),
    # unless the run encodes its prompts one encoder at a time before the denoiser loads
    loading = frozen_weight_bytes(str(opts.model), precision, family=_family_of(opts), encoding=encodes_first(opts))
    need = max(steady, loading) * local_ranks
    have = placement.available_memory_bytes()
    fits = need <= have
    ranks = f"{local_ranks} ranks need" if local_ranks > 1 else "this run needs"
    return fits, (f"memory plan: {ranks} about {need / 1e9:.1f} GB ({precision}); this node has "
                  f"{have / 1e9:.1f} GB available{'' if fits else ': it does not fit'}")


def _family_of(opts: TrainOptions) -> str:
    from xeontune.train.components import pipeline_family

    return pipeline_family(str(opts.model), opts.revision).name


def reference_lora_bytes(family: str, precision: str, resolution: int) -> int:
    """What a LoRA run of ``family``'s reference model (its default sizes: Flux.1-dev's, SD3.5 Medium's...)
    holds at its peak, one rank, batch 1: the larger of the load (the largest text encoder in the training
    dtype and the VAE: the encoders load one at a time, then the denoiser once they are freed) and
    the steps (the denoiser and the activations). From the family's figures, whose modules say how they were
    measured."""
    kind = families.get(family)
    # the prompts encoded and the encoders freed before the denoiser loads (ranks.encodes_first)
    loading = frozen_weight_bytes("", precision, family=family, encoding=True)
    steady = placement.rank_memory_bytes(frozen_weight_bytes("", precision, family=family, text_encoders=False),
                                         kind.activation_bytes(resolution, precision), 1)
    return max(loading, steady)


def encodes_first(opts: TrainOptions) -> bool:
    """Whether a run encodes its prompts and frees the text encoders before its denoiser loads (loop._setup),
    so that the two are never held together: where it frees them at all and needs no images of the base
    model before its steps (prior preservation's class images)."""
    return not keeps_text_encoders(opts) and not opts.with_prior_preservation


def keeps_text_encoders(opts: TrainOptions) -> bool:
    """Whether a rank holds the text encoders through the steps: the one rule the loop frees them by and
    ``rank_memory`` counts them by. Not where the method trains none of them and their outputs are
    computed once (loop.TextCache), unless sample images or a saved pipeline need them again.
    (A LoRA's own adapters and their optimizer state are a few to ~100 MB: within the activations' margin.)"""
    if declared(opts.method).trains_text_encoders(opts) or not opts.cache_text:
        return True
    return bool(opts.validation_prompt or opts.save_as_full_pipeline)


def plan_ranks(opts: TrainOptions, precision: str) -> placement.RankPlan:
    """How many ranks `--nproc-per-node` asks for on this machine, and how many cores each gets."""
    cores = placement.physical_cores()
    numa_nodes = len({c.numa_node for c in cores})
    if opts.nproc_per_node == "auto":
        per_rank = rank_memory(opts, precision)
        return placement.auto_ranks(len(cores), numa_nodes, placement.available_memory_bytes(), per_rank)
    ranks = int(opts.nproc_per_node)
    if ranks > len(cores):
        raise UserError(f"--nproc-per-node {ranks} is more than this machine's {len(cores)} physical cores "
                        "(each rank needs a core of its own); try --nproc-per-node auto")
    return placement.RankPlan(ranks=ranks, cores_per_rank=len(cores) // ranks, why="--nproc-per-node")


def prepare_shared_weights(opts: TrainOptions, precision: str) -> None:
    """In bf16, make the bf16 copies (UNet, text encoder Linear layers) before the ranks start, so that they all memory-map one
    file (its pages held once for the node) and none converts. In a child process, so that nothing
    it reads stays in this launcher for the whole run: the copies are written a tensor at a time (0.66 GB
    peak for SDXL), but a UNet in an old pickled .bin is still converted at its fp32 size."""
    if precision != "bf16" or families.DENOISER in declared(opts.method).trains(opts):  # a trained one is no bf16 copy
        return
    code = "import sys; from xeontune.train.components import ensure_bf16_copies; ensure_bf16_copies(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, str(opts.model), opts.revision or "", opts.variant or ""],
                          capture_output=True, text=True)
    if done.returncode != 0:  # the ranks load on their own and report the real problem
        log.warning("could not prepare the bf16 weight copies: %s", (done.stderr.strip().splitlines() or ["?"])[-1])
