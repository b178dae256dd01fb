"""The training run: set-up, the step (on one screen), and what happens between steps.

Read ``train_step`` first: it is the whole of the math. ``setup`` builds what it needs,
``train`` calls it and handles logging, saving, checkpoints and validation around it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from xeontune import hardware
from xeontune.errors import TrainingError, UserError
from xeontune.io import atomic_write_json, atomic_write_text, cache_root, disk_errors, file_in_the_way
from xeontune.train import (
    attention,
    bf16_cast,
    checkpoint,
    data_parallel,
    families,
    latent_cache,
    lock,
    methods,
    preempt,
    prior,
    report,
    saving,
    validation,
)
from xeontune.train.buckets import (
    BucketLatents,
    TrainingImages,
    load_training_images,
)
from xeontune.train.components import (
    Components,
    cast_text_encoder_linears,
    frozen_dtype,
    load,
    load_denoiser,
    load_encoder,
    model_identity,
    pipeline_family,
    weights_files,
)
from xeontune.train.data import (
    Batch,
    SamplePlan,
    image_set_digest,
    mask_tensor,
    offset_noise,
    sample_loss,
    seed_global_rng,
)
from xeontune.train.data_check import masks_and_prompts
from xeontune.train.forecast import Forecast
from xeontune.train.fused_backward import FusedBackward
from xeontune.train.images import read_images
from xeontune.train.latent_cache import Latents, encode_latents
from xeontune.train.options import TrainOptions, fsdp_refusal
from xeontune.train.outputs import METRICS, RUN_CONFIG, RUN_FILE_RE, VALIDATION_IMAGE_RE
from xeontune.train.prompts import ImagePrompts, prompts_digest
from xeontune.train.ranks import encodes_first, keeps_text_encoders, memory_plan, rank_memory

log = logging.getLogger("xeontune.train")

PHASES = ("data", "latents", "text_encoder_forward", "denoiser_forward", "backward", "optimizer", "allreduce")


class Phases:
    """Seconds spent per phase of the current step (for the progress bar and `xeontune bench`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        out = {name: self.seconds.get(name, 0.0) for name in PHASES}
        self.seconds.clear()
        return out


class Sync:
    """Where ranks wait for each other outside the step.

    The default process group's ``--dist-timeout`` is short on purpose: inside a step a long wait means
    a rank hangs. Rank 0's work alone (checkpoints, validation, saving) and model loading, which takes
    each node its own time, can take minutes; ranks wait for those at barriers on a second gloo group
    whose timeout is ``--dist-wait-timeout``.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group  # None in a single process

    @classmethod
    def create(cls, world: int, timeout_s: float) -> Sync:
        if world <= 1:
            return cls()
        return cls(torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))

    @property
    def rank(self) -> int:
        return 0 if self.group is None else torch.distributed.get_rank(self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else torch.distributed.get_world_size(self.group)

    def wait(self) -> None:
        if self.group is not None:
            torch.distributed.barrier(group=self.group)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (pickled: for setup's data, not for a step's)."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(values, value, group=self.group)
        return values

    def all_true(self, value: bool) -> bool:
        """True on every rank when ``value`` is True on every rank (a decision all ranks must share)."""
        if self.group is None:
            return value
        flag = torch.tensor([int(value)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def check_same(self, value: str, what: str) -> None:
        """UserError on every rank unless all ranks hold the same ``value`` (issue 18: a node whose
        copy of --data-dir differs would train the same vectors on other images, silently)."""
        if self.group is None:
            return
        values = self.gather(value)
        odd = [rank for rank, v in enumerate(values) if v != values[0]]
        if odd:
            raise UserError(f"rank(s) {', '.join(map(str, odd))} loaded other {what} than rank 0 ({values[odd[0]]} "
                            f"vs {values[0]}): every node needs the same --data-dir; sync it again")


def pause_for_tests(where: str, rank: int) -> None:
    """Test hook: XEONTUNE_TEST_PAUSE="WHERE:RANK:SECONDS[,...]" makes a rank sleep at ``setup`` (as a
    slow model load would) or ``alone`` (rank 0's outputs between steps and at the end)."""
    for item in os.environ.get("XEONTUNE_TEST_PAUSE", "").split(","):
        parts = item.split(":")
        if len(parts) == 3 and parts[0] == where and int(parts[1]) == rank:
            time.sleep(float(parts[2]))


class TextCache:
    """The frozen text encoders' outputs for each prompt of the sample plan, computed once: with the
    encoders frozen they depend on the prompt alone (``Run.encode_text`` then only looks them up).
    ``all_prompt_ids``: one tensor of every prompt's ids per encoder (``SamplePlan.all_prompt_ids``).
    ``load_encoder`` (by folder): the encoders are not in ``components`` but loaded one at a time, each
    encoding every prompt and freed before the next loads (SD3.5's T5-XXL alone is 9.5 GB in bf16)."""

    def __init__(self, components: Components, all_prompt_ids: list[torch.Tensor],
                 autocast: contextlib.AbstractContextManager,
                 load_encoder: Callable[[str], Any] | None = None) -> None:
        family, count = components.family, len(all_prompt_ids[0])
        with torch.no_grad(), autocast:
            if load_encoder is None:
                rows = [family.encode(components.text_encoders, [ids[i : i + 1] for ids in all_prompt_ids])
                        for i in range(count)]
            else:
                outputs = []
                for index, (encoder, ids) in enumerate(zip(family.encoders, all_prompt_ids, strict=True)):
                    module = load_encoder(encoder.folder)
                    outputs.append([family.encoder_output(index, module, ids[i : i + 1]) for i in range(count)])
                    del module
                    hardware.release_freed_memory()
                rows = [family.join([each[i] for each in outputs]) for i in range(count)]
        self.hidden = torch.cat([hidden for hidden, _ in rows])
        self.pooled = None if rows[0][1] is None else torch.cat([pooled for _, pooled in rows])

    def lookup(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        index = batch.prompt_index
        return self.hidden[index], None if self.pooled is None else self.pooled[index]


@dataclass
class Run:
    """Everything the step needs, built once by ``setup``. What the method holds (a textual inversion's
    ``embedding`` and ``placeholder``, say) reads as the run's own attributes too."""

    opts: TrainOptions
    accelerator: Any
    components: Components
    method: methods.Method
    ddp_modules: list[torch.nn.Module]  # the method's modules that DDP wraps when there are several ranks
    plan: SamplePlan
    latents: BucketLatents
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    precision: str
    max_steps: int
    output_dir: Path
    sync: Sync = field(default_factory=Sync)
    phases: Phases = field(default_factory=Phases)
    exchange: data_parallel.GradientExchange | None = None  # with several ranks
    shard: str = "none"  # data_parallel.SHARD_LEVELS: what each rank keeps a share of
    sharded: list[torch.nn.Module] = field(default_factory=list)  # the method's modules under FSDP (--shard gradients|full)
    optimizer_state: dict[str, Any] | None = None  # rank 0, while it writes a checkpoint: the whole state (``outputs``)
    gradient_checked: bool = False
    backend_notes: list[str] = field(default_factory=list)  # what packing, IPEX, compile, checkpointing did
    text_cache: TextCache | None = None  # the frozen encoders' outputs per prompt
    reduced: list[torch.nn.Parameter] = field(default_factory=list)  # trainable, outside DDP: all-reduced here
    checkpoint_on_disk: Path | None = None  # the checkpoint this state is already in (resumed from or saved)
    model_identity: dict[str, str] | None = None  # components.model_identity, for the checkpoints (rank 0)
    fused: FusedBackward | None = None  # --fused-backward-pass: the optimizer steps inside the backward
    steps_done: int = 0  # optimizer steps this process made (DDP rebuilds its buckets in the second)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "method":  # copy/pickle probes; a method not set yet
            raise AttributeError(name)
        return getattr(self.method, name)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def samples_per_step(self) -> int:
        return self.opts.train_batch_size * self.world * self.opts.gradient_accumulation_steps

    def positions(self, step: int, micro: int) -> list[int]:
        """This rank's share of a global micro-batch: rank r takes samples [r*b, (r+1)*b)."""
        b, accum = self.opts.train_batch_size, self.opts.gradient_accumulation_steps
        start = ((step * accum + micro) * self.world + self.rank) * b
        return list(range(start, start + b))

    def autocast(self) -> contextlib.AbstractContextManager:
        return precision_autocast(self.precision)

    def encode_text(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """The denoiser's text conditioning, as the model's family makes it: (encoder_hidden_states,
        added_cond_kwargs or None); the added conditions from the pooled embedding and each sample's
        size and crop (SDXL's text_embeds and time_ids)."""
        if self.text_cache is not None:
            hidden, pooled = self.text_cache.lookup(batch)
        else:
            hidden, pooled = self.encode_prompts(batch.all_input_ids)
        if pooled is None:
            return hidden, None
        return hidden, self.components.family.conditions(pooled, self.latents.time_ids(batch))

    def encode_prompts(self, input_ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, a pooled embedding or None) of tokenized prompts, one id tensor per encoder."""
        c = self.components
        return c.family.encode(c.text_encoders, input_ids)

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return self.components.family.target(self.components.noise_scheduler, latents, noise, timesteps)

    def check_gradient_once(self) -> None:
        """Stop at the first step if the method's trainable parts got no usable gradient."""
        if self.gradient_checked:
            return
        self.gradient_checked = True
        if self.fused is not None:  # the gradients are gone: what the hooks saw of them
            self.method.check_gradient(self.fused.first_summary())
        else:
            self.method.check_gradient()

    @contextlib.contextmanager
    def outputs(self, checkpoint_due: bool) -> Iterator[None]:
        """Every rank, around what rank 0 writes: for a checkpoint, a sharded optimizer's state gathered
        whole to rank 0; under FSDP, plain copies of the whole weights standing in for the sharded modules
        on rank 0 (the method saves, samples and checkpoints from them)."""
        main = self.rank == 0
        self.optimizer_state = data_parallel.consolidate(self.optimizer, main) if checkpoint_due else None
        try:
            if not self.sharded:
                yield
                return
            with data_parallel.full_weights(self.sharded, main) as copies, self.method.stand_in(copies):
                yield
        finally:
            self.optimizer_state = None

    def zero_gradients(self) -> None:
        """Ready the gradients for the next step. Under DDP with accumulation, zeroed in place from the
        second step on: they are views of DDP's buckets then, so the micro-steps before the last add into
        the buckets; set to None, each step's first backward would make a second copy of every gradient
        beside the buckets (3.4 GB for SD1.5: two such ranks were OOM-killed in 24 GB). Set to None after
        the first step: DDP rebuilds its buckets in the next forward, and gradients still viewing the old
        ones would keep both (``accumulating`` then fills the new buckets)."""
        self.optimizer.zero_grad(set_to_none=not (self.steps_done and self._accumulates_under_ddp()))
        self.steps_done += 1

    def accumulating(self, micro: int) -> list[torch.nn.Module]:
        """The DDP modules whose all-reduce waits for the step's last micro-step. All of them, but on the
        first micro-step of the second step, which all-reduces as well: its gradients, None after the
        bucket rebuild, then go straight into the new buckets (one bucket at a time, as they are ready)
        instead of into a second copy of every gradient. The mean of the sums is the sum of the means:
        the step's gradient is the same (with --grad-compression bf16, up to one more bf16 rounding of that
        micro-step's part); its bytes on the wire are one all-reduce more, once."""
        if micro == 0 and self.steps_done == 1 and self._accumulates_under_ddp():
            return []
        return self.ddp_modules

    def _accumulates_under_ddp(self) -> bool:
        return self.world > 1 and bool(self.ddp_modules) and self.opts.gradient_accumulation_steps > 1

    def reduce_gradients(self) -> None:
        """Average the gradients DDP does not sync (a LoRA's, a trained text encoder's) over the ranks."""
        grads = [p.grad for p in self.reduced if p.grad is not None]
        if self.exchange is not None and grads:
            self.exchange.average_flat(grads)


def precision_autocast(precision: str) -> contextlib.AbstractContextManager:
    """What the text encoders and the UNet run under: bf16 autocast for bf16 (the UNet's weights are
    already bf16; the text encoders' LayerNorms stay fp32), nothing for fp32."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(run: Run, step: int) -> torch.Tensor:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the mean loss."""
    phase, c = run.phases, run.components
    losses = []
    for micro in range(run.opts.gradient_accumulation_steps):
        data_parallel.sync_gradients(run.sharded, micro == run.opts.gradient_accumulation_steps - 1, run.shard)
        if run.fused is not None:  # the weights step in this backward's hooks on the last micro-step only
            run.fused.final = micro == run.opts.gradient_accumulation_steps - 1
        with run.accelerator.accumulate(*run.accumulating(micro)):
            with phase("data"):
                batch = run.plan.batch(run.positions(step, micro))
                seed_global_rng(run.opts.seed, batch.positions[0])
            with phase("latents"):
                latents = run.latents.sample(batch)
                noise = batch.noise
                if run.opts.noise_offset:
                    noise = noise + run.opts.noise_offset * offset_noise(batch, noise.shape[1], run.opts.seed)
                noisy = c.family.noisy(c.noise_scheduler, latents, noise, batch.timesteps)
            with run.autocast():
                with phase("text_encoder_forward"):
                    hidden, added = run.encode_text(batch)
                with phase("denoiser_forward"):
                    pred = c.family.predict(c.noise_scheduler, c.denoiser, noisy, batch.timesteps, hidden, added)
            weights = c.family.loss_weights(c.noise_scheduler, batch.timesteps, run.opts)
            loss = sample_loss(pred, run.target(latents, noise, batch.timesteps), run.latents.mask(batch),
                               batch, run.opts.prior_loss_weight, weights)
            with phase("backward"):
                run.accelerator.backward(loss)  # divides by the accumulation steps; DDP all-reduces
            losses.append(loss.detach())
    with phase("allreduce"):
        run.reduce_gradients()
    with phase("optimizer"):
        run.check_gradient_once()
        if run.fused is None:
            run.method.before_update(step, run.max_steps)
            if run.opts.max_grad_norm:  # torch's, over FSDP's sharded gradients as well
                run.accelerator.clip_grad_norm_(run.method.parameters(), run.opts.max_grad_norm)
        # under --fused-backward-pass every weight whose gradient the last micro-step completed stepped in its
        # backward (its gradient None now): this steps what only earlier micro-steps gave a gradient, as the plain step
        run.optimizer.step()
        run.lr_scheduler.step()
        run.zero_gradients()
        run.method.after_step()
    return torch.stack(losses).mean()


# --- set-up ------------------------------------------------------------------------------------


def make_accelerator(opts: TrainOptions):
    """Accelerator on CPU; under mpirun, a process group with the chosen backend and timeout."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    from accelerate.utils.environment import get_cpu_distributed_information

    info = get_cpu_distributed_information()
    timeout = timedelta(seconds=opts.dist_timeout)
    if info.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Started by a plain mpirun: share this host's physical cores among the ranks on it.
        from xeontune.hardware import rank_threads

        torch.set_num_threads(rank_threads())
    if info.world_size > 1 and not torch.distributed.is_initialized():
        if opts.dist_backend == "ccl":
            from xeontune.hardware import ccl_available

            usable, why = ccl_available()  # importing the bindings is what registers the "ccl" backend
            if not usable:
                raise UserError(f"--dist-backend ccl needs oneccl_bindings_for_pytorch: {why}; use gloo")
        # accelerate only knows gloo/mpi on CPU, so the group is made here and accelerate adopts it.
        torch.distributed.init_process_group(
            backend=opts.dist_backend, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    return Accelerator(
        cpu=True,
        gradient_accumulation_steps=opts.gradient_accumulation_steps,
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timeout),
            # The splice keeps the frozen table out of DDP's sight; buffers never change either. The
            # gradients are views of DDP's buckets, not a second copy beside them: 3.4 GB a rank for a
            # trained SD1.5 UNet (two such ranks ran out of 24 GB without it).
            DistributedDataParallelKwargs(broadcast_buffers=False, gradient_as_bucket_view=True),
        ],
    )


def read_training_data(opts: TrainOptions) -> tuple[TrainingImages, list[torch.Tensor | None], ImagePrompts | None,
                                                    methods.Method]:
    """--data-dir as the run trains on it: its images (in buckets where --buckets says so), their masks
    and prompts (checked by the method's declaration), and the method. Every mistake in the folder is a one-line
    error here, before a model loads (data_check.check_training_data finds the same ones without decoding)."""
    if opts.with_prior_preservation:
        prior.check_class_dir(opts)
    if opts.cache_latents and (base := latent_cache_base(opts)) is not None:
        latent_cache.check_dir(base)
    images = load_training_images(opts)
    layout = [(part.size, part.members) for part in images.parts]
    weights, given = masks_and_prompts(opts, images.paths, images.sizes, layout, images.bucketed)
    return images, [mask_tensor(w) for w in weights], given, methods.create(opts)


def check_output_dir(opts: TrainOptions) -> Path:
    out = Path(opts.output_dir)
    blocker = file_in_the_way(out)
    if blocker is not None and blocker != out:  # found now, not after the model loads
        raise UserError(f"--output-dir {out}: {blocker} is a file, not a folder")
    pipeline = out / "pipeline"
    if opts.save_as_full_pipeline and pipeline.exists() and not (pipeline / "model_index.json").is_file():
        raise UserError(f"--save-as-full-pipeline: {pipeline} is there and is not a saved pipeline, which "
                        "the run would replace: move it or pick another --output-dir")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} exists and is not a directory")
    lock.acquire(out)  # held until train() ends: a second run in this dir stops here, naming this one
    if opts.resume_from_checkpoint:
        return out
    previous = sorted(p.name for p in out.iterdir() if RUN_FILE_RE.match(p.name) or checkpoint.CHECKPOINT_RE.match(p.name))
    metrics = out / METRICS
    if set(previous) <= {RUN_CONFIG, metrics.name} and (not metrics.is_file() or metrics.stat().st_size == 0):
        return out  # a run that ended before its first step: nothing to lose, and the same command may retry
    if previous and not opts.overwrite:
        resumable = checkpoint.list_checkpoints(out)
        raise UserError(
            f"--output-dir {out} holds another run ({', '.join(previous[:3])}); pass --overwrite to replace it"
            + (" or --resume-from-checkpoint latest to continue it" if resumable else " (it left no checkpoint "
               "to continue from)")
        )
    if previous and not (out / RUN_CONFIG).is_file():
        raise UserError(
            f"--output-dir {out} holds {', '.join(previous[:3])} but no {RUN_CONFIG}, so it is not a run's "
            "output dir and --overwrite will not clear it; move those files or pick another dir"
        )
    return out


def clear_previous_run(out: Path) -> None:
    """Delete what the run recorded in ``out``'s train_config.json wrote; nothing in a dir without one."""
    if not (out / RUN_CONFIG).is_file():
        return
    logging_dir, run_id = recorded_config(out).get("logging_dir") or "logs", recorded_run_id(out)
    for p in out.iterdir():
        if RUN_FILE_RE.match(p.name) and p.is_file():
            p.unlink()
        elif checkpoint.CHECKPOINT_RE.match(p.name) and p.is_dir():
            shutil.rmtree(p)
    if (out / "pipeline" / "model_index.json").is_file():
        shutil.rmtree(out / "pipeline")
    # Only the files the run wrote; the dir goes when that leaves it empty. Its logs are told apart by
    # the run's id: --logging-dir may be a folder that other runs log to.
    logs = out / logging_dir
    inside = logs.resolve().is_relative_to(out.resolve())  # a run of old, without an id: only its own dir
    for p in report.own_files(logs, run_id, inside):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    validation = out / "validation"
    for p in validation.iterdir() if validation.is_dir() else ():
        if VALIDATION_IMAGE_RE.match(p.name) and p.is_file():
            p.unlink()
    for sub in (validation, logs / "wandb", logs):  # each goes when that left it empty, inside the output dir only
        if sub.is_dir() and sub.resolve().is_relative_to(out.resolve()):
            with contextlib.suppress(OSError):
                sub.rmdir()


def setup(
    opts: TrainOptions, accelerator, components: Components | None = None
) -> tuple[Run, checkpoint.TrainState | None]:
    """Build a Run. ``components``: frozen models already loaded and prepared by the caller
    (`xeontune bench` shares one UNet and VAE between its variants); loaded here when None.
    Rank 0 holds the output dir's lock from here on; train() releases it, and so does a failed set-up."""
    try:
        return _setup(opts, accelerator, components)
    except BaseException:
        lock.release(Path(opts.output_dir))
        raise


def _setup(
    opts: TrainOptions, accelerator, components: Components | None
) -> tuple[Run, checkpoint.TrainState | None]:
    from diffusers.optimization import get_scheduler

    from xeontune import placement
    from xeontune.hardware import choose_precision
    from xeontune.train.backends import ipex_applied, module_bytes, prepare_frozen_models

    main, world = accelerator.is_main_process, accelerator.num_processes
    if opts.fused_backward_pass and world > 1:
        raise UserError(f"--fused-backward-pass runs in one process, not {world} ranks (DDP averages the gradients "
                        "after the weights would have stepped); across ranks --shard saves memory instead")
    sync = Sync.create(world, opts.dist_wait_timeout)
    # Everything that can fail on the user's input is checked before anything is written. The output
    # dir and the checkpoint are rank 0's: without a shared filesystem the other ranks have neither.
    output_dir = check_output_dir(opts) if main else Path(opts.output_dir)
    pause_for_tests("setup", accelerator.process_index)  # a slow model load, with the output dir locked
    resume_path: Path | None = None
    resume_state: checkpoint.TrainState | None = None
    identity = model_identity(opts.model, opts.revision) if main else None  # what rank 0's checkpoints record
    if main:
        families.check_method(pipeline_family(opts.model, opts.revision), opts.method, opts.model, opts)
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("MPI_LOCALNRANKS") or 1)
        fits, said = memory_plan(opts, choose_precision(opts.mixed_precision)[0], world, local)
        (log.info if fits else log.warning)("%s", said if fits else f"{said} (the load may swap or be killed: "
                                            f"{''.join(memory_hints(opts, world))}or a larger node)")
    if opts.resume_from_checkpoint and main:
        resume_path, resume_state = checkpoint.resolve(opts.resume_from_checkpoint, output_dir)
        checkpoint.check_model(resume_state, identity, opts.model, resume_path)
        # a checkpoint of other settings: found before the folder is read and the models load
        early = methods.create(opts)
        check_checkpoint_method(resume_state, early, resume_path)
        early.check_state(resume_state, str(resume_path))
    images, masks, given, method = read_training_data(opts)
    image_paths = images.paths
    sync.check_same(image_set_digest(image_paths), "training images")
    sync.check_same(prompts_digest(given), "training prompts")
    report.check(opts.report_to)  # fails now, not after the first outputs are written
    precision, reason = choose_precision(opts.mixed_precision)
    if precision == "bf16" and "slower" in reason:
        log.warning("--mixed-precision bf16: %s", reason)
    shared = components is not None
    first = not shared and encodes_first(opts)  # the prompts encoded and the encoders freed before the denoiser loads
    early_ids: list[torch.Tensor] | None = None
    early_cache: TextCache | None = None
    if components is None:
        # a part the method trains keeps fp32 master weights (autocast computes in bf16); a frozen one is
        # held in the training dtype
        family = pipeline_family(opts.model, opts.revision)
        trained = family.trained_parts(method.trains)
        denoiser_dtype = None if families.DENOISER in trained else frozen_dtype(precision)
        frozen_encoders = tuple(e for e in family.encoder_names if e not in trained)
        half_linears = frozenset(frozen_encoders if frozen_dtype(precision) is not None else ())
        components = load(opts.model, opts.revision, opts.variant, denoiser_dtype=denoiser_dtype, deferred=first,
                          half_linears=half_linears)
        for part in () if first else frozen_encoders:
            cast_text_encoder_linears(components, frozen_dtype(precision), opts.model, opts.revision,
                                      opts.variant, part)
    components.family = components.family.for_run(opts)
    # what the run holds beside the denoiser, counted before the method moves a token table out of sight
    beside_denoiser = sum(module_bytes(m) for m in (*components.text_encoders, components.vae) if m is not None)
    if first:
        def frozen_encoder(folder: str) -> Any:  # loaded and cast as a load of them all would, then handed over
            load_encoder(components, opts.model, folder, opts.revision, opts.variant, keep_linears=folder in half_linears)
            cast_text_encoder_linears(components, frozen_dtype(precision), opts.model, opts.revision, opts.variant, folder)
            encoder = getattr(components, folder)
            setattr(components, folder, None)
            return encoder

        early_ids = tokenize_prompts(components, method.prompts(given), main)
        early_cache = TextCache(components, early_ids, precision_autocast(precision), frozen_encoder)
        load_denoiser(components, opts.model, opts.revision, opts.variant, denoiser_dtype)
    method.install(components)  # before packing and compiling: they act on the models as the method left them
    notes: list[str] = []  # what the frozen models' preparation decided (none where ``shared``), then attention's
    ipex, ipex_off_because = opts.ipex, "--ipex off"
    if not method.uses_ipex:
        if ipex == "on":
            raise UserError(f"--ipex on: --method {opts.method} does not run on IPEX; use --ipex off")
        ipex, ipex_off_because = "off", f"--method {opts.method} does not run on it"
    pack, pack_note = opts.pack_weights, []
    if families.DENOISER in method.trains:  # packing reorders frozen weights; these train (on: refused by validate)
        pack, pack_note = "off", [f"packed weights: not used (--method {opts.method} trains the {components.family.denoiser}'s weights)"]
    # the latent's pixels at --resolution: no attention of the UNet sees more tokens (SDXL's first level,
    # without attention, sees them; its attentions a quarter)
    tokens = (opts.resolution // 2 ** (len(components.vae.config.block_out_channels) - 1)) ** 2
    kernel_mode, attention_note = (attention.use_kernel(opts.attention, precision, tokens=tokens)
                                   if attention.stock_blocks(components.denoiser) else
                                   (None, "the model's own attention processors (--attention applies to a UNet's)"))
    if kernel_mode:  # before compile and packing: they see the processors
        attention.install(components.denoiser, kernel_mode)
    if not shared:
        components.denoiser, components.vae, notes = prepare_frozen_models(
            components.denoiser, components.vae, precision=precision, ipex=ipex, compile=opts.compile,
            pack=pack, checkpointing=opts.gradient_checkpointing,
            step_bytes=placement.rank_memory_bytes(
                beside_denoiser, components.family.activation_bytes(opts.resolution, precision), opts.train_batch_size,
                opts.gradient_checkpointing),
            family=components.family.name, agree=sync.all_true, ipex_off_because=ipex_off_because,
        )
        notes += pack_note
    method.on_ipex = ipex_applied(notes)  # a broken gradient path then names IPEX as the likely cause
    notes.append(f"attention: {attention_note}")
    if main:
        log.info("precision %s (%s)%s", precision, reason, "".join(f"; {n}" for n in notes))

    num_class_images = 0
    if opts.with_prior_preservation:  # the class images join the instance images after them
        prior.ensure_class_images(components, method, opts, sync, lambda: precision_autocast(precision))
        class_paths: list[Path] = []

        def each_class_image() -> Iterator[tuple[Path, Any]]:
            for path, img in read_images(opts.class_data_dir, limit=opts.num_class_images):
                class_paths.append(path)
                yield path, img

        num_class_images = images.add(each_class_image(), opts)  # into every bucket (each batch is of one)
        sync.check_same(image_set_digest(class_paths), "class images")
        masks = [m if m is None else torch.cat([m, torch.ones(num_class_images, *m.shape[1:])]) for m in masks]
    latents = cache_latents(components, images, masks, opts, sync, main)
    if main and images.bucketed:
        log.info("aspect-ratio buckets (width x height: images): %s",
                 ", ".join(f"{p.size[0]}x{p.size[1]}: {len(p.members)}" for p in images.parts))
    if opts.cache_latents and not shared:
        release_vae_parts(components, latents, opts)
    prompts = method.prompts(given) + ([opts.class_prompt] if num_class_images else [])
    prompt_ids, *more_ids = early_ids or tokenize_prompts(components, prompts, main)
    shapes = latents.latent_shapes()
    plan = SamplePlan(
        seed=opts.seed, num_images=len(image_paths), repeats=opts.repeats, prompt_ids=prompt_ids,
        more_prompt_ids=tuple(more_ids), prompt_of_image=given.of_image if given else None,
        latent_shape=shapes[0], bucket_latent_shapes=shapes,
        buckets=[part.members for part in images.parts], group=opts.train_batch_size * world,
        num_train_timesteps=components.noise_scheduler.config.num_train_timesteps,
        timestep_density=components.family.timestep_density(opts), flip_p=opts.flip_p,
        num_class_images=num_class_images,
    )

    global_batch = opts.train_batch_size * world * opts.gradient_accumulation_steps
    max_steps = opts.max_train_steps or math.ceil(opts.num_train_epochs * plan.epoch_len / global_batch)
    lr = opts.learning_rate * (global_batch if opts.scale_lr else 1)
    shard, why = data_parallel.shard_choice(opts.shard, world, *_shard_memory(opts, precision, world))
    if main and opts.shard != "none":
        log.info("%s (%s)", SHARDED_SAYS[shard], why)
    if shard in data_parallel.FSDP_LEVELS:  # before the optimizer takes the weights: they become shards
        data_parallel.fully_shard_modules(method.sharded_modules(), shard, opts.grad_compression, precision)
        method.after_sharding()
        hardware.release_freed_memory()  # the whole weights each rank loaded (its EMA's): all but its shares are gone
    if precision == "bf16" and families.DENOISER in method.trains and shard not in data_parallel.FSDP_LEVELS \
            and not opts.compile:  # FSDP gathers bf16 weights (gathered_dtype); compile: its graphs cast
        layers = bf16_cast.install(method.sharded_modules())
        if main:
            log.info("trained weights: cast to bf16 in each layer's forward and again in its backward, no bf16 "
                     "copy kept for the backward (%d layers)", layers)
    optimizer = make_optimizer(opts, method.parameters(), lr, fused=bool(method.trains), sharded=shard == "optimizer")
    lr_scheduler = get_scheduler(
        opts.lr_scheduler, optimizer=optimizer, num_warmup_steps=opts.lr_warmup_steps,
        num_training_steps=max_steps, num_cycles=opts.lr_num_cycles, power=opts.lr_power,
    )

    ddp_modules, sharded = method.ddp_modules(), data_parallel.sharded_modules(method.sharded_modules())
    under_ddp = {id(p) for m in (sharded or ddp_modules) for p in m.parameters()}
    run = Run(
        opts=opts, accelerator=accelerator, components=components, method=method, ddp_modules=ddp_modules,
        plan=plan, latents=latents, optimizer=optimizer, lr_scheduler=lr_scheduler, precision=precision,
        max_steps=max_steps, output_dir=output_dir, sync=sync, backend_notes=notes, model_identity=identity,
        reduced=[p for p in method.parameters() if id(p) not in under_ddp], shard=shard,
        sharded=sharded,
    )
    if opts.fused_backward_pass:
        run.fused = FusedBackward(optimizer, method.parameters())
    if not method.trains_text_encoders and opts.cache_text:
        run.text_cache = early_cache or TextCache(components, plan.all_prompt_ids, run.autocast())
    if not shared and not keeps_text_encoders(opts):
        release_text_encoders(components)
    sync.wait()  # every rank has its models (each node loads at its own pace) before the first collective
    if world > 1:
        # Only the method's small modules are wrapped (textual inversion: one DDP per encoder's rows,
        # each called once a forward), so DDP syncs just what trains; the rest is all-reduced flat.
        run.exchange = data_parallel.GradientExchange(run.phases.seconds, opts.grad_compression)
        if run.sharded:  # FSDP reduce-scatters their gradients itself
            run.ddp_modules = []
        else:
            run.ddp_modules = [accelerator.prepare_model(module) for module in ddp_modules]
            for ddp in run.ddp_modules:
                ddp.register_comm_hook(None, run.exchange.hook)
            method.use_ddp(run.ddp_modules)

    state = None
    if opts.resume_from_checkpoint:
        where = resume_path or "rank 0's checkpoint"
        state = resume_state
        if world > 1:  # the others receive rank 0's file (they may see no output dir of its)
            received = checkpoint.share(resume_path / checkpoint.STATE_FILE if main else None, main, sync.group)
            if not main:
                try:
                    state = checkpoint.decode(received, where)
                finally:
                    received.unlink()  # its pages stay mapped while the state is in use
        check_checkpoint_method(state, method, where)
        if run.sharded:  # into whole copies on every rank, each then taking its share
            with data_parallel.full_weights(run.sharded, main, everywhere=True, write_back=True) as copies, \
                    method.stand_in(copies, write_back=True):
                method.load_state(state, str(where))
        else:
            method.load_state(state, str(where))
        optimizer.load_state_dict(data_parallel.localize(optimizer, state.optimizer))
        lr_scheduler.load_state_dict(state.lr_scheduler)
        checkpoint.restore_rng(state.rng)
        run.checkpoint_on_disk = resume_path
        if main:
            log.info("resumed from %s at step %d", where, state.step)
        if state.samples_per_step not in (None, run.samples_per_step) and main:
            log.warning("%s was written at a batch of %d a step (--train-batch-size x ranks x "
                        "--gradient-accumulation-steps), this run's is %d: it trains on from step %d, but "
                        "not on the images a straight run would have drawn", where, state.samples_per_step,
                        run.samples_per_step, state.step)
    return run, state


def memory_hints(opts: TrainOptions, world: int) -> list[str]:
    """What would make a run that does not fit smaller: the options it does not use yet (each followed by
    ", ")."""
    trains_unet = families.DENOISER in methods.get(opts.method).trains(opts)
    hints = [("--fused-backward-pass", trains_unet and world == 1 and not opts.fused_backward_pass
              and not opts.max_grad_norm and opts.gradient_accumulation_steps == 1 and not opts.compile),
             ("--optimizer adafactor", trains_unet and opts.optimizer != "adafactor"),
             ("--gradient-checkpointing", not opts.gradient_checkpointing),
             ("--mixed-precision bf16", opts.mixed_precision != "bf16"),
             ("fewer ranks a node", world > 1), ("--shard", trains_unet and world > 1 and opts.shard == "none")]
    return [f"{hint}, " for hint, useful in hints if useful]


def make_optimizer(opts: TrainOptions, params: list[torch.nn.Parameter], lr: float,
                   fused: bool = False, sharded: bool = False) -> torch.optim.Optimizer:
    """``fused``: torch's fused CPU AdamW, one vectorized pass over each parameter: 13x the default
    per-tensor loop on 100 M parameters on a 2-core AVX2 EPYC (0.12 against 1.53 s; foreach was slower
    still), so for a method that trains a model's own weights, where the optimizer is seconds a step.
    (For a token's rows or adapters it is milliseconds either way; they keep the loop the examples run.)
    ``sharded``: each rank keeps the state of its share of ``params`` (data_parallel.sharded_optimizer)."""
    optimizer_class: type
    if opts.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # a fixed learning rate (the schedule's), as kohya and the SDXL guides run it
        optimizer_class, kwargs = Adafactor, {"lr": lr, "weight_decay": opts.adam_weight_decay,
                                              "scale_parameter": False, "relative_step": False, "warmup_init": False}
    else:
        optimizer_class, kwargs = torch.optim.AdamW, {
            "lr": lr, "betas": (opts.adam_beta1, opts.adam_beta2), "weight_decay": opts.adam_weight_decay,
            "eps": opts.adam_epsilon, **({"fused": True} if fused else {})}
    if sharded:
        return data_parallel.sharded_optimizer(optimizer_class, params, **kwargs)
    return optimizer_class(params, **kwargs)


SHARDED_SAYS = {"none": "training state not sharded", "optimizer": "optimizer state sharded over the ranks (ZeRO-1)",
                "gradients": "gradients and optimizer state sharded over the ranks (FSDP, ZeRO-2)",
                "full": "weights, gradients and optimizer state sharded over the ranks (FSDP, ZeRO-3)"}


def _shard_memory(opts: TrainOptions, precision: str, world: int) -> tuple[dict[str, int], int, int, str]:
    """(a rank's bytes at each shard level, this node's available bytes, its ranks, the highest level
    the run can take) for --shard auto."""
    ceiling = "optimizer" if fsdp_refusal(opts) else "full"
    if opts.shard != "auto" or world <= 1:
        return {}, 0, 1, ceiling
    from xeontune import placement

    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("MPI_LOCALNRANKS") or 1)
    need = {level: rank_memory(opts, precision, world=world, shard=level) for level in data_parallel.SHARD_LEVELS}
    return need, placement.available_memory_bytes(), local, ceiling


def tokenize_prompts(components: Components, prompts: list[str], main: bool) -> list[torch.Tensor]:
    """The prompts' ids, one tensor per text encoder, each padded (or cut) to its encoder's length."""
    tokenizer = components.tokenizers[0]
    cut = sum(len(ids) > tokenizer.model_max_length for ids in tokenizer(prompts).input_ids)
    if cut and main:  # as the examples do, but said: the words past the limit never reach the model
        log.warning("%d of the %d distinct prompts are longer than the text encoder's %d tokens and are cut there", cut,
                    len(prompts), tokenizer.model_max_length)
    return [t(prompts, padding="max_length", truncation=True, max_length=e.max_length or t.model_max_length,
              return_tensors="pt").input_ids for t, e in zip(components.tokenizers, components.family.encoders, strict=True)]


def check_checkpoint_method(state: checkpoint.TrainState, method: methods.Method, where: Path | str) -> None:
    if state.method != method.name:
        raise UserError(f"checkpoint {where} was trained with --method {state.method}, not {method.name}")


def release_text_encoders(components: Components) -> None:
    """The frozen encoders freed, their outputs cached (SDXL's two are about 3.3 GB in fp32)."""
    for name in components.family.encoder_names:
        setattr(components, name, None)
    hardware.release_freed_memory()


def cache_latents(components: Components, images: TrainingImages, masks: list[torch.Tensor | None],
                  opts: TrainOptions, sync: Sync, main: bool) -> BucketLatents:
    """The latents of every bucket's images: encoded once, the ranks sharing the work out, kept in
    --latent-cache-dir for later runs and restarts (or every step, with --no-cache-latents), a bar on a
    terminal and the time in the log: minutes for many images."""
    from tqdm.auto import tqdm

    parts = [Latents(components.vae, part.pixels, cached=opts.cache_latents, crops=part.crops, masks=mask,
                     flip_p=opts.flip_p, encode=False) for part, mask in zip(images.parts, masks, strict=True)]
    if opts.cache_latents:
        started = time.perf_counter()
        root = latent_cache_root(opts, components, parts)
        count = sum(len(part.images) * len(part.sides) for part in parts)
        with tqdm(total=count, desc="latents", unit="latent", disable=not (main and sys.stderr.isatty())) as bar:
            read = encode_latents(parts, sync, lambda n: bar.update(min(n, bar.total - bar.n)), root)
            bar.update(bar.total - bar.n)
        if main:
            sides = {(False,): "each image", (True,): "each image's mirror image",
                     (False, True): "each image and its mirror image"}[tuple(parts[0].sides)]
            where = f"; {read} read from" if read else "; kept in"
            log.info("cached %d latents (%s) in %.1f s over %d rank(s)%s", count, sides,
                     time.perf_counter() - started, sync.world,
                     f"{where} {latent_cache.describe(root)}" if root else "")
    return BucketLatents(parts)


def latent_cache_base(opts: TrainOptions) -> Path | None:
    """--latent-cache-dir (default: the project's cache's latents/), None for none."""
    if opts.latent_cache_dir is not None and opts.latent_cache_dir.strip().lower() == "none":
        return None
    return Path(opts.latent_cache_dir).expanduser() if opts.latent_cache_dir else cache_root() / "latents"


def latent_cache_root(opts: TrainOptions, components: Components, parts: list[Latents]) -> Path | None:
    """The folder of these latents in --latent-cache-dir (None: in memory only), named by what decides
    them: the images and their crops (the parts'), the VAE's files and dtype, and how it runs."""
    base = latent_cache_base(opts)
    if base is None:
        return None
    local = Path(opts.model).expanduser()
    model = str(local.resolve()) if local.exists() else opts.model
    files = [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
             for f in weights_files(model, "vae", opts.revision, opts.variant)]
    identity = {"model": model, "revision": opts.revision, "variant": opts.variant, "vae_files": files,
                "vae_dtype": str(components.vae.dtype), "vae": type(components.vae).__name__,
                "precision": opts.mixed_precision, "fit": [opts.resolution, opts.center_crop, opts.random_crop,
                                                           opts.seed if opts.random_crop else None]}
    return base / latent_cache.cache_key(parts, identity)


def release_vae_parts(components: Components, latents: BucketLatents, opts: TrainOptions) -> None:
    """With latents cached, the VAE's encoder has done its work: free what nothing will use again
    (the whole VAE without validation, the encoder with it; all of it is kept to save a pipeline)."""
    if opts.save_as_full_pipeline:
        return
    latents.vae = None
    if opts.validation_prompt:
        components.vae.encoder = None  # validation decodes only
        components.vae.quant_conv = None
    else:
        components.vae = None
    hardware.release_freed_memory()


# --- the run -----------------------------------------------------------------------------------


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    learned: Any  # the method's learned(): a textual inversion's vectors, a LoRA's {name: tensor}
    final_loss: float | None
    result_path: Path | None  # the method's result file (rank 0)

    @property
    def vectors(self) -> Any:
        return self.learned


def keep_metrics_up_to(path: Path, step: int) -> None:
    """Drop metrics.jsonl's lines after ``step``, which a resume from that step trains again (each step
    would be logged twice), and a line a crash cut short (the next append would glue onto it)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)

    def logged_step(line: str) -> float:
        try:
            return float(json.loads(line)["step"]) if line.endswith("\n") else math.inf
        except (ValueError, KeyError, TypeError):
            return math.inf

    kept = [line for line in lines if logged_step(line) <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(kept))


StepCallback = Callable[[int, float, dict[str, float], int], None]


def train(opts: TrainOptions, on_step: StepCallback | None = None) -> TrainResult:
    from tqdm.auto import tqdm

    accelerator = make_accelerator(opts)
    run, state = setup(opts, accelerator)
    hardware.resume_gc()  # started: the process's GC as usual again (deferred by a rank's entry point)
    main = accelerator.is_main_process
    out = run.output_dir
    start_step = state.step if state else 0
    if start_step > run.max_steps:
        lock.release(out)
        raise UserError(f"--resume-from-checkpoint: the checkpoint is at step {start_step}, past --max-train-steps "
                        f"{run.max_steps}: raise --max-train-steps to train on from it")

    writer = metrics = bar = None  # opened in the try: closed whatever fails, validation at start included
    try:
        if main:
            out.mkdir(parents=True, exist_ok=True)
            # the run's id marks its files in places it shares (--logging-dir); a resume keeps it
            run_id = (recorded_run_id(out) if start_step else None) or uuid.uuid4().hex[:12]
            if opts.overwrite and not opts.resume_from_checkpoint:
                clear_previous_run(out)
            atomic_write_json(out / RUN_CONFIG, {**opts.to_json(), "precision": run.precision,
                                                 "world_size": run.world, "run_id": run_id})
            if start_step:
                keep_metrics_up_to(out / METRICS, start_step)
            writer = report.open_writer(opts.report_to, out / opts.logging_dir, run_id, opts.to_json())
            if opts.validate_at_start and opts.validation_prompt and not start_step:
                run_validation(run, 0, writer)  # before anything trained: what the base model draws
        run.sync.wait()  # rank 0 may have cleared a large previous run
        metrics = open(out / METRICS, "a") if main else None  # noqa: SIM115 (closed below)

        global_batch = run.samples_per_step
        # A bar on a terminal; under mpirun or in a log file, one plain line every ~5% of the run.
        interactive = main and sys.stderr.isatty()
        bar = tqdm(total=run.max_steps, initial=start_step, disable=not interactive, desc="train", unit="step")
        log_every = max(1, run.max_steps // 20)
        forecast = Forecast.for_run(run.max_steps, start_step) if main else None
        loss_value: float | None = None
        preempt.defer_term(True)
        for step in range(start_step, run.max_steps):
            started = time.perf_counter()
            loss = train_step(run, step)
            if run.world > 1:  # gloo has no AVG: sum, then divide
                torch.distributed.all_reduce(loss)
                loss = loss / run.world
            elapsed = time.perf_counter() - started
            loss_value = float(loss)
            if not math.isfinite(loss_value):
                raise TrainingError(f"loss became {loss_value} at step {step + 1}; lower --learning-rate")
            if not run.method.finite():  # small; the loss shows it one step late
                raise TrainingError(f"the {run.method.learns} became non-finite at step {step + 1}; "
                                    "lower --learning-rate")
            # the gradients' bytes, a sharded optimizer's updated weights, and the loss
            sent = (run.exchange.take() + data_parallel.weight_bytes_sent(run.optimizer)
                    + data_parallel.fsdp_bytes_sent(run.sharded, run.shard, opts.gradient_accumulation_steps,
                                                    opts.grad_compression, run.precision)
                    + loss.numel() * loss.element_size()) if run.exchange else 0
            phases = run.phases.take()
            done = step + 1
            if on_step:
                on_step(done, loss_value, phases, sent)
            if main:
                record = {"step": done, "loss": loss_value, "lr": run.lr_scheduler.get_last_lr()[0],
                          "step_time_s": elapsed, "images_per_s": global_batch / elapsed,
                          "allreduce_bytes": sent,
                          # FSDP's exchanges run inside the forward and backward: not timed apart
                          "allreduce_s": None if run.sharded else phases["allreduce"]}
                with disk_errors(out / METRICS):
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                if writer:
                    for key in ("loss", "lr", "step_time_s", "images_per_s"):
                        writer.add_scalar(f"train/{key}", record[key], done)
                bar.set_postfix(loss=f"{loss_value:.4f}", s_per_step=f"{elapsed:.2f}")
                bar.update(1)
                if not interactive and (done % log_every == 0 or done == run.max_steps):
                    log.info("step %d/%d  loss %.4f  %.2f s/step  %.1f images/s%s", done, run.max_steps,
                             loss_value, elapsed, global_batch / elapsed,
                             f"  sent {sent / 1e6:.1f} MB" + ("" if run.sharded else f" in {phases['allreduce']:.2f} s")
                             if sent else "")
            if outputs_due(opts, done, run.max_steps):
                with run.outputs(checkpoint_due(opts, done)):  # every rank: its shares to rank 0
                    if main:
                        _between_steps(run, done, writer)
                run.sync.wait()  # the others wait for rank 0 here, not in the next step's all-reduce
            # Slurm's notice, or a preemption's SIGTERM (train/preempt.py): checkpoint, then stop
            if done < run.max_steps and (signum := preempt.requested(run.world)):
                with run.outputs(checkpoint_due=True):
                    if main:
                        save_checkpoint(run, done)
                run.sync.wait()
                raise preempt.Preempted(done, signum)
            line = forecast.update(done, time.perf_counter()) if forecast else None
            if line and interactive:
                bar.write(line, file=sys.stderr)
            elif line:
                log.info("%s", line)
        preempt.defer_term(False)
        with run.outputs(checkpoint_due(opts, run.max_steps)):
            result_path = _finish(run, writer) if main else None
    finally:
        preempt.defer_term(False)
        if bar:
            bar.close()
        if metrics:
            metrics.close()
        if writer:
            writer.close()
        if main:
            lock.release(out)  # after the last file is written; an error releases it too
    run.sync.wait()
    return TrainResult(out, run.max_steps, run.method.learned(), loss_value, result_path)


def outputs_due(opts: TrainOptions, step: int, max_steps: int) -> bool:
    """Whether rank 0 writes outputs after ``step`` (every rank computes the same answer)."""
    if step == max_steps:
        return False  # _finish writes the final outputs
    every = (opts.save_steps, opts.checkpointing_steps, opts.validation_steps if opts.validation_prompt else 0)
    return any(n and step % n == 0 for n in every)


def checkpoint_due(opts: TrainOptions, step: int) -> bool:
    return bool(opts.checkpointing_steps) and step % opts.checkpointing_steps == 0


def _between_steps(run: Run, step: int, writer) -> None:
    """Main process only: intermediate embeddings, checkpoints, validation."""
    opts, out = run.opts, run.output_dir
    pause_for_tests("alone", run.rank)
    if opts.save_steps and step % opts.save_steps == 0:
        run.method.save(out, step, final=False)
    if opts.checkpointing_steps and step % opts.checkpointing_steps == 0:
        save_checkpoint(run, step)
    if opts.validation_prompt and opts.validation_steps and step % opts.validation_steps == 0:
        run_validation(run, step, writer)


def save_checkpoint(run: Run, step: int) -> Path:
    """``checkpoint-<step>``, unless it holds this very state already: a preemption on a checkpoint step,
    or a run resumed from its last step. Rewriting it would only spend the grace period, and replacing
    a directory is two renames, between which a SIGKILL would leave no checkpoint at all."""
    target = run.output_dir / f"checkpoint-{step}"
    if run.checkpoint_on_disk is not None and run.checkpoint_on_disk.resolve() == target.resolve():
        return target
    state = checkpoint.TrainState(
        step=step, optimizer=run.optimizer_state or run.optimizer.state_dict(), lr_scheduler=run.lr_scheduler.state_dict(),
        rng=checkpoint.rng_state(), method=run.method.name, samples_per_step=run.samples_per_step,
        model=run.model_identity,
        **run.method.state(),
    )
    run.checkpoint_on_disk = checkpoint.save(run.output_dir, state, run.opts.checkpoints_total_limit)
    return run.checkpoint_on_disk


def run_validation(run: Run, step: int, writer) -> list[Path]:
    """--num-validation-images per --validation-prompt, numbered on across the prompts (each PNG names its
    prompt in its metadata); every set from the same seeds, so sets of two steps compare image for image."""
    opts = run.opts
    images, prompts = [], []
    for prompt in opts.validation_prompt or []:
        images += validation.generate(
            run.components, run.method, prompt,
            num_images=opts.num_validation_images, steps=opts.validation_inference_steps,
            resolution=opts.resolution, seed=opts.seed, autocast=run.autocast,
        )
        prompts += [prompt] * opts.num_validation_images
    paths = validation.save_images(images, run.output_dir / "validation", step, prompts)
    if writer:
        import numpy as np

        stacked = np.stack([np.asarray(img) for img in images])
        writer.add_images("validation", stacked, step, dataformats="NHWC")
    log.info("validation images: %s", ", ".join(str(p) for p in paths))
    return paths


def _finish(run: Run, writer) -> Path:
    opts, out = run.opts, run.output_dir
    pause_for_tests("alone", run.rank)
    path = run.method.save(out, run.max_steps, final=True)
    if opts.save_steps and run.max_steps % opts.save_steps == 0:  # as every other N-th step has one
        run.method.save(out, run.max_steps, final=False)
    if opts.checkpointing_steps and run.max_steps % opts.checkpointing_steps == 0:
        save_checkpoint(run, run.max_steps)
    if opts.validation_prompt:
        run_validation(run, run.max_steps, writer)
    if opts.save_as_full_pipeline and families.DENOISER not in run.method.trains:  # else the method's save wrote it
        save_pipeline(run, out / "pipeline")
    return path


def save_pipeline(run: Run, target: Path) -> Path:
    return saving.save_pipeline(run.components, run.opts, run.method, target)


def recorded_config(out: Path) -> dict[str, Any]:
    """``out``'s train_config.json as a run wrote it, or {} where there is none readable."""
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads((out / RUN_CONFIG).read_text())
        return recorded if isinstance(recorded, dict) else {}
    return {}


def recorded_run_id(out: Path) -> str | None:
    run_id = recorded_config(out).get("run_id")
    return run_id if isinstance(run_id, str) and run_id.isalnum() else None

