"""What the data-parallel ranks send each other beyond DDP's defaults (issue 49): the gradients on the
wire (``--grad-compression``) and the training state sharded over the ranks (``--shard``).

Gradients: DDP hands each bucket to ``GradientExchange.hook`` as soon as the backward has filled it, so
the exchange overlaps the rest of the backward; the gradients DDP does not wrap (a trained text encoder's,
a LoRA's) go through the same exchange, flat, after the backward.

Sharding, each level holding less on a rank than the one before (``SHARD_LEVELS``):
- ``optimizer``: torch's ``ZeroRedundancyOptimizer`` (ZeRO-1): each rank keeps and updates the optimizer
  state of its share of the weights, then sends that share of the updated weights to the others;
- ``gradients`` and ``full``: torch's FSDP2 (``fully_shard``) in place of DDP: each rank holds 1/N of the
  weights, their gradients (reduce-scattered block by block while the backward runs) and AdamW's state;
  every block's weights are gathered for its forward, and ``full`` frees them after it and gathers them
  again for the backward (ZeRO-3), where ``gradients`` keeps them to the end of the backward (of the
  step's last micro-step). A bf16 run gathers them in bf16.
Rank 0 writes its files from plain copies of the whole weights (``full_weights``) and a checkpoint
holds a plain optimizer's state (``consolidate``), so a checkpoint resumes at any level, on any number of
ranks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

log = logging.getLogger("xeontune.train")

WIRE_DTYPE = {"none": torch.float32, "bf16": torch.bfloat16}
# The bf16 exchange's copies, bounded: a buffer goes out in pieces of at most PIECE elements (DDP's first
# step hands over the whole model as one bucket: its three bf16 copies and an fp32 sum were 2.9 GB more
# than fp32 on the wire for a 1.5 GB model, 5-6 GB for SD1.5's UNet), and a backward that runs ahead of
# the wire waits once the pieces not yet back hold IN_FLIGHT_BYTES of copies (about 7 pieces).
PIECE = 25 * 2**20 // 4  # DDP's default bucket of fp32
IN_FLIGHT_BYTES = 256 * 2**20
SHARD_LEVELS = ("none", "optimizer", "gradients", "full")  # what a rank keeps a share of: less and less
FSDP_LEVELS = ("gradients", "full")


class GradientExchange:
    """Averages gradients over the ranks, counting the bytes each rank hands the process group and the
    seconds until each bucket's mean is back (the step's "allreduce" phase).

    ``none``: one fp32 all-reduce per bucket (gloo's ring: 2(N-1)/N of the bucket each way). ``bf16``:
    bf16 on the wire, fp32 sums: an all-to-all hands each rank 1/N of every other rank's bucket, which
    it adds up in fp32 and averages; an all-gather hands the averaged slices (rounded once to bf16) back
    to every rank. (N-1)/N of the bucket each way in bf16: half the fp32 ring's bytes. gloo's own bf16
    all-reduce would add in bf16, rounding at every rank's addition. A bucket goes out in pieces
    (``PIECE``), with at most ``IN_FLIGHT_BYTES`` of copies held at once."""

    def __init__(self, seconds: dict[str, float], compression: str = "none") -> None:
        self.bytes = 0
        self.seconds = seconds  # Phases.seconds: the time is the step's "allreduce"
        self.wire = WIRE_DTYPE[compression]
        if self.wire != torch.float32:
            # Two groups of their own (every rank makes them, in this order): the all-to-alls go out from
            # the backward, bucket after bucket; each all-gather goes out from a callback once its bucket's
            # all-to-all is in, in the buckets' order (the tickets). On one group, ranks could issue the
            # two kinds in different orders, and gloo pairs collectives by the order they were issued in.
            self.scatter = torch.distributed.new_group(backend="gloo")
            self.gather = torch.distributed.new_group(backend="gloo")
            self.turn = threading.Condition()
            self.tickets = self.next_gather = 0
            self.in_flight = 0  # bytes of wire copies held by exchanges not yet back
            self.failed: BaseException | None = None  # a collective's error (a rank lost): every wait ends

    # No annotations: DDP inspects them and rejects the strings that `from __future__` makes.
    def hook(self, _state, bucket):
        return self.average(bucket.buffer())

    def average(self, buffer: torch.Tensor) -> torch.futures.Future:
        """A future of ``buffer`` (fp32) holding its mean over the ranks, written in place."""
        world = torch.distributed.get_world_size()
        start = time.perf_counter()
        self.bytes += buffer.numel() * self.wire.itemsize

        def done(result: torch.Tensor) -> torch.Tensor:
            self.seconds["allreduce"] += time.perf_counter() - start
            return result

        if self.wire == buffer.dtype:
            buffer.div_(world)
            return torch.distributed.all_reduce(buffer, async_op=True).get_future().then(
                lambda fut: done(fut.value()[0]))
        pieces = [self._average_piece(piece, world) for piece in buffer.split(PIECE)]
        return torch.futures.collect_all(pieces).then(lambda _fut: done(buffer))

    def _average_piece(self, buffer: torch.Tensor, world: int) -> torch.futures.Future:
        """``average``'s bf16 exchange of one piece (a view of the buffer, written in place)."""
        size = buffer.numel()
        share = -(-size // world)
        held = 3 * share * world * self.wire.itemsize  # sent, received and the gathered copy
        with self.turn:  # the same waits on every rank: they issue the same buckets in the same order
            self.turn.wait_for(lambda: self.failed or self.in_flight == 0 or self.in_flight + held <= IN_FLIGHT_BYTES)
            if self.failed:
                raise self.failed
            self.in_flight += held
            ticket, self.tickets = self.tickets, self.tickets + 1
        sent = torch.zeros(share * world, dtype=self.wire)
        sent[:size].copy_(buffer)
        received = torch.empty_like(sent)
        scattered = torch.distributed.all_to_all_single(received, sent, group=self.scatter, async_op=True)

        def gather(scattered: torch.futures.Future) -> torch.Tensor:
            # Each copy freed as soon as it is spent, not when DDP lets go of the futures at the end of the
            # backward: held until then, every bucket's three bf16 copies were 1.5x the gradients.
            every = None
            try:
                scattered.value()  # the all-to-all's error (a rank lost) fails this piece, and every wait
                sent.untyped_storage().resize_(0)
                mine = received.view(world, share).float().sum(0).div_(world).to(self.wire)
                received.untyped_storage().resize_(0)
                every = torch.empty(share * world, dtype=self.wire)
                with self.turn:
                    self.turn.wait_for(lambda: self.failed or self.next_gather == ticket)
                    if self.failed:
                        raise self.failed
                    gathered = torch.distributed.all_gather_into_tensor(every, mine, group=self.gather, async_op=True)
                    self.next_gather += 1
                    self.turn.notify_all()
                gathered.wait()
                buffer.copy_(every[:size])
                return buffer
            except BaseException as exc:
                with self.turn:
                    self.failed = self.failed or exc
                raise
            finally:
                for spent in (sent, received, every):
                    if spent is not None:
                        spent.untyped_storage().resize_(0)
                with self.turn:
                    self.in_flight -= held
                    self.turn.notify_all()

        return scattered.get_future().then(gather)

    def average_flat(self, grads: list[torch.Tensor]) -> None:
        """The mean of gradients no DDP bucket holds, in place: one flat exchange after the backward."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.average(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def take(self) -> int:
        count, self.bytes = self.bytes, 0
        return count


def shard_choice(shard: str, world: int, need: dict[str, int], available_bytes: int, local_ranks: int,
                 ceiling: str = "full") -> tuple[str, str]:
    """(level of SHARD_LEVELS, why) for ``--shard``. ``auto`` takes the first level up to ``ceiling`` at
    which the node's ranks fit (``need``: one rank's bytes at each level): each level shards more, and
    sends more (ZeRO-1 the updated weights once a step, FSDP the weights once or twice each micro-step)."""
    if world <= 1:
        return "none", "one rank: nothing to shard"
    if shard != "auto":
        return shard, f"--shard {shard}"
    levels = SHARD_LEVELS[: SHARD_LEVELS.index(ceiling) + 1]
    free = f"this node has {available_bytes / 2**30:.1f} GiB free"
    for level in levels:
        if need[level] * local_ranks <= available_bytes:
            return level, (f"--shard auto: {local_ranks} rank(s) fit at {level} "
                           f"({need[level] * local_ranks / 2**30:.1f} GiB; {free})")
    return levels[-1], (f"--shard auto: {local_ranks} rank(s) would hold "
                        f"{need[levels[-1]] * local_ranks / 2**30:.1f} GiB even at {levels[-1]}; {free}")


def fully_shard_modules(modules: list[nn.Module], level: str, compression: str = "none",
                        precision: str = "fp32") -> None:
    """FSDP2 on each module, in place: every block of its top-level ModuleLists (a UNet's down and up
    blocks) a unit of its own, gathered for its forward and backward only; the rest with the root.
    ``compression`` bf16: each unit's gradients reduce-scattered as bf16, summed in fp32. ``precision``
    bf16: the fp32 shares are cast to bf16 before each gather (``gathered_dtype``: half the bytes, and
    the whole weights held in bf16), the gradients reduced and accumulated in fp32; the inputs are left
    to autocast, as unsharded (a float timestep cast to bf16 would lose its digits)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=gathered_dtype(precision), reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    shard = lambda m: fully_shard(m, reshard_after_forward=level == "full", mp_policy=policy)  # noqa: E731
    units = []
    for module in modules:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                units += [shard(block) for block in child]
        units.append(shard(module))
        _keep_output_capture(module)
    if WIRE_DTYPE[compression] != torch.float32:
        for unit in units:
            unit.set_custom_reduce_scatter(WireReduceScatter(WIRE_DTYPE[compression]))


def gathered_dtype(precision: str) -> torch.dtype:
    """The dtype FSDP gathers a run's weights in: bf16 for a bf16 run (autocast would cast them for each
    product anyway), fp32 otherwise."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


class WireReduceScatter:
    """FSDP's reduce-scatter (``set_custom_reduce_scatter``: its ``allocate`` and call) with ``wire`` on the
    wire and fp32 sums, as ``GradientExchange`` sends DDP's buckets: an all-to-all hands each rank every
    rank's copy of its share, which it adds up in fp32 (gloo's own reduce-scatter would add in the wire's
    dtype)."""

    def __init__(self, wire: torch.dtype) -> None:
        self.wire = wire

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        world = group.size()
        sent = input_tensor.to(self.wire)
        received = torch.empty_like(sent)
        torch.distributed.all_to_all_single(received, sent, group=group)
        torch.sum(received.view(world, -1).float(), dim=0, out=output_tensor)
        if op == torch.distributed.ReduceOp.AVG:
            output_tensor.div_(world)


def _keep_output_capture(module: nn.Module) -> None:
    """transformers finds the outputs a model may record (SDXL's penultimate hidden states) by the name of
    the model's class, which fully_shard changes: register them under the new one too."""
    flags = getattr(module, "_can_record_outputs", None)
    if flags is None:
        return
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # a transformers that reads them from the model itself
        return
    _CAN_RECORD_REGISTRY[module] = flags


def sharded_modules(modules: list[nn.Module]) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in modules if isinstance(m, FSDPModule)]


def sync_gradients(modules: list[nn.Module], final_micro_step: bool, level: str) -> None:
    """FSDP's no_sync: the micro-steps before the last keep whole gradients, which the last one reduce-scatters.
    At ``gradients``, which holds every gathered weight to the end of the backward anyway, they also keep
    the weights gathered for the next micro-step: one gather a step, at the same peak."""
    for module in modules:
        module.set_requires_gradient_sync(final_micro_step)
        if level == "gradients":
            module.set_reshard_after_backward(final_micro_step)


@contextlib.contextmanager
def full_weights(modules: list[nn.Module], main: bool, everywhere: bool = False,
                 write_back: bool = False) -> Iterator[list[nn.Module] | None]:
    """Every rank: plain copies of the sharded ``modules`` holding their whole weights, on rank 0 (or on
    every rank, ``everywhere``), None elsewhere. ``write_back``: what the copies hold when the block ends
    becomes each rank's share (a resume loads into them). One module at a time is gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor

    copies = []
    for module in modules:
        whole = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=not everywhere))
        if not (main or everywhere):
            continue
        plain_class = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
        with torch.device("meta"):  # diffusers' models, transformers' (the text encoders)
            plain = getattr(plain_class, "from_config", None) or plain_class._from_config
            plain = plain(module.config)
        plain.load_state_dict(whole, assign=True)
        for name, buffer in list(plain.named_buffers()):  # those a state dict leaves out (CLIP's position ids)
            if buffer.is_meta:
                owner, _, leaf = name.rpartition(".")
                plain.get_submodule(owner).register_buffer(leaf, module.get_buffer(name).clone(), persistent=False)
        plain.train(module.training)
        if hasattr(module, "attn_processors"):  # the processors the run chose (backends.py), not the defaults
            plain.set_attn_processor(dict(module.attn_processors))
        copies.append(plain)
    yield copies if copies else None
    if write_back:
        with torch.no_grad():
            for module, plain in zip(modules, copies, strict=True):
                whole = dict(plain.named_parameters())
                for name, p in module.named_parameters():
                    p.copy_(distribute_tensor(whole[name].detach(), p.device_mesh, p.placements, src_data_rank=None))


def gather_whole(shares: list[torch.Tensor], keep: bool) -> list[torch.Tensor] | None:
    """Every rank (a collective): tensors sharded as FSDP's weights are (DTensor) gathered whole, one at a
    time, and kept on ``keep`` ranks (None elsewhere)."""
    whole = []
    for share in shares:
        gathered = share.full_tensor()
        if keep:
            whole.append(gathered)
    return whole if keep else None


def cut_to_shares(whole: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors every rank holds whole, sharded as FSDP's weights ``like`` (same order) are: each rank keeps
    its share (nothing is sent)."""
    from torch.distributed.tensor import distribute_tensor

    return [distribute_tensor(w.detach(), p.device_mesh, p.placements, src_data_rank=None)
            for w, p in zip(whole, like, strict=True)]


def sharded_optimizer(optimizer_class: type, params: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    """ZeRO-1 over the default process group. Its consolidated state (``consolidate``) is a plain
    optimizer's state dict, so a checkpoint resumes sharded or not, on any number of ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # One broadcast per weight tensor after each step. (Its bucket views, one broadcast per rank's share,
    # trained other weights than DDP alone from the second step on: the weights became views after DDP
    # had registered them.)
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, parameters_as_bucket_view=False, **kwargs)


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def consolidate(optimizer: torch.optim.Optimizer, main: bool) -> dict[str, Any] | None:
    """Before rank 0 writes a checkpoint (every rank calls it: a collective): the optimizer's state as a
    plain optimizer's, on rank 0 (None elsewhere). ZeRO-1 sends each rank's share to rank 0; under FSDP
    each sharded state tensor is gathered whole, one at a time."""
    from torch.distributed.tensor import DTensor

    if is_sharded(optimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if main else None
    if not _over_shards(optimizer):  # a plain optimizer's state: rank 0 reads its own, the others nothing
        return optimizer.state_dict() if main else None
    state = optimizer.state_dict()
    whole = {}
    for index, entry in state["state"].items():  # in the same order on every rank
        gathered = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in entry.items()}
        if main:
            whole[index] = gathered
    return {"state": whole, "param_groups": state["param_groups"]} if main else None


def _over_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer steps FSDP's sharded (DTensor) weights."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


def localize(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A plain optimizer's state (a checkpoint's) for an optimizer over FSDP's sharded weights: each
    state tensor of a weight's shape cut to this rank's share, as the weight is. Unchanged otherwise."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not _over_shards(optimizer):
        return state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    position = {index: i for i, index in enumerate(i for group in state["param_groups"] for i in group["params"])}

    def local(p: torch.Tensor, value: Any) -> Any:
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.shape == p.shape:
            return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
        return value

    return {"state": {index: {k: local(params[position[index]], v) for k, v in s.items()}
                      for index, s in state["state"].items()},
            "param_groups": state["param_groups"]}


def weight_bytes_sent(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of updated weights a ZeRO-1 step hands the process group (every weight once, from the
    rank that owns it); 0 otherwise."""
    if not is_sharded(optimizer):
        return 0
    return sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])


def fsdp_bytes_sent(modules: list[nn.Module], level: str, micro_steps: int, compression: str = "none",
                    precision: str = "fp32") -> int:
    """The bytes FSDP hands the process group in a step, counted as the other exchanges are: the
    gradients once (reduce-scattered on the last micro-step, in the wire's dtype), and the weights once
    per gather (in ``gathered_dtype``), every weight from the rank that holds it: one gather a step
    (``gradients``, ``sync_gradients``), two a micro-step (``full``). (Counted from the plan: FSDP's
    collectives are its own.)"""
    count = sum(p.numel() for m in modules for p in m.parameters())
    gradients = count * WIRE_DTYPE[compression].itemsize
    gathers = 2 * micro_steps if level == "full" else 1
    return gradients + count * gathered_dtype(precision).itemsize * gathers if modules else 0
