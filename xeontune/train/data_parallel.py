"""What the data-parallel ranks send each other beyond DDP's defaults (issue 49): the gradients on the
wire (``--grad-compression``) and the optimizer state sharded over the ranks (``--shard``).

Gradients: DDP hands each bucket to ``GradientExchange.hook`` as soon as the backward has filled it, so
the exchange overlaps the rest of the backward; the gradients DDP does not wrap (a trained text encoder's,
a LoRA's) go through the same exchange, flat, after the backward. Sharding: torch's
``ZeroRedundancyOptimizer`` (ZeRO-1): each rank keeps and updates the optimizer state of its share of
the weights, then sends that share of the updated weights to the others.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

log = logging.getLogger("xeontune.train")

WIRE_DTYPE = {"none": torch.float32, "bf16": torch.bfloat16}


class GradientExchange:
    """Averages gradients over the ranks, counting the bytes each rank hands the process group and the
    seconds until each bucket's mean is back (the step's "allreduce" phase).

    ``none``: one fp32 all-reduce per bucket (gloo's ring: 2(N-1)/N of the bucket each way). ``bf16``:
    bf16 on the wire, fp32 sums: an all-to-all hands each rank 1/N of every other rank's bucket, which
    it adds up in fp32 and averages; an all-gather hands the averaged slices (rounded once to bf16) back
    to every rank. (N-1)/N of the bucket each way in bf16: half the fp32 ring's bytes. gloo's own bf16
    all-reduce would add in bf16, rounding at every rank's addition."""

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
        size = buffer.numel()
        share = -(-size // world)
        sent = torch.zeros(share * world, dtype=self.wire)
        sent[:size].copy_(buffer)
        received = torch.empty_like(sent)
        ticket, self.tickets = self.tickets, self.tickets + 1
        scattered = torch.distributed.all_to_all_single(received, sent, group=self.scatter, async_op=True)

        def gather(_fut: torch.futures.Future) -> torch.Tensor:
            mine = received.view(world, share).float().sum(0).div_(world).to(self.wire)
            every = torch.empty_like(sent)
            with self.turn:
                self.turn.wait_for(lambda: self.next_gather == ticket)
                gathered = torch.distributed.all_gather_into_tensor(every, mine, group=self.gather, async_op=True)
                self.next_gather += 1
                self.turn.notify_all()
            gathered.wait()
            buffer.copy_(every[:size])
            # Freed now, not when DDP lets go of the futures at the end of the backward: held until then,
            # every bucket's three bf16 copies were 1.5x the gradients (5 GB a rank for SD1.5's UNet).
            for spent in (sent, received, every):
                spent.untyped_storage().resize_(0)
            return done(buffer)

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


def shard_choice(shard: str, world: int, unsharded_bytes: int, available_bytes: int, local_ranks: int) -> tuple[str, str]:
    """(none|optimizer, why) for ``--shard``. ``auto`` shards the optimizer only where the node's ranks would
    not fit unsharded: ZeRO-1 sends each step's updated weights once more, which costs time on Ethernet."""
    if world <= 1:
        return "none", "one rank: nothing to shard"
    if shard != "auto":
        return shard, f"--shard {shard}"
    need = unsharded_bytes * local_ranks
    if need > available_bytes:
        return "optimizer", (f"--shard auto: {local_ranks} unsharded rank(s) would hold {need / 2**30:.1f} GiB, "
                             f"this node has {available_bytes / 2**30:.1f} GiB free")
    return "none", (f"--shard auto: {local_ranks} unsharded rank(s) fit ({need / 2**30:.1f} of "
                    f"{available_bytes / 2**30:.1f} GiB free)")


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


def consolidate(optimizer: torch.optim.Optimizer) -> None:
    """Before rank 0 writes a checkpoint: every rank sends its share of the optimizer state to rank 0
    (a collective: every rank calls it). Nothing to do unsharded."""
    if is_sharded(optimizer):
        optimizer.consolidate_state_dict(to=0)


def weight_bytes_sent(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of updated weights a sharded step hands the process group (every weight once, from the
    rank that owns it); 0 unsharded."""
    if not is_sharded(optimizer):
        return 0
    return sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
