"""`xeontune bench --attention`: xeontune's attention kernel against torch's SDPA at SD1.5's and SDXL's shapes,
forward and backward, at several thread counts: time, GFLOP/s and share of this CPU's matmul peak at the
same threads (fp32's on a CPU without bf16 instructions) (bench.py gives it: bench.machine_peak_gflops). The backward's FLOPs are counted as 2.5x the forward's (its five
products against two)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# (name, batch, heads, queries, keys, head): the UNets' attention at batch 1 (SD1.5 at 512 px: 64x64
# latents, its first level 4096 tokens of 8 heads of 40, then 80 and 160; SDXL at 1024 px: 128x128
# latents, 4096 tokens of 10 heads of 64 at its second level, 1024 of 20 at its third)
SHAPES = (
    ("sd15 self 4096", 1, 8, 4096, 4096, 40),
    ("sd15 cross 4096x77", 1, 8, 4096, 77, 40),
    ("sd15 self 1024", 1, 8, 1024, 1024, 80),
    ("sd15 self 256", 1, 8, 256, 256, 160),
    ("sdxl self 4096", 1, 10, 4096, 4096, 64),
    ("sdxl self 1024", 1, 20, 1024, 1024, 64),
    ("one head 4096", 1, 1, 4096, 4096, 40),  # fewer heads than threads: where torch's backward idles
)


def thread_counts(spec: str, physical: int) -> list[int]:
    """``1,2,all`` -> [1, 2, physical cores], each once, in order."""
    counts: list[int] = []
    for item in spec.split(","):
        count = physical if item.strip() == "all" else int(item)
        if count < 1:
            raise ValueError(f"--threads: {item!r} is not a thread count")
        if count not in counts:
            counts.append(count)
    return counts


def _best(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm-up: kernels chosen, buffers allocated
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(precision: str, threads: list[int], repeats: int, log: Callable[[str], None],
            peak_gflops: Callable[[str], float]) -> dict[str, Any]:
    """Each shape at each thread count; ``peak_gflops(precision)``: this CPU's matmul peak at the threads set."""
    import torch
    import torch.nn.functional as F

    from xeontune.train import attention

    why = attention.kernel()
    if why is not None:
        raise RuntimeError(f"xeontune's attention kernel could not be built here: {why}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rows = []
    before = torch.get_num_threads()
    try:
        for count in threads:
            torch.set_num_threads(count)
            # the matmul peak in the precision where the CPU has bf16 instructions (the kernel's products
            # run in bf16 there); else fp32's (the kernel widens bf16 to fp32, and an emulated bf16
            # matmul's "peak" measures the emulation)
            peak = peak_gflops(precision if attention.native_bf16() else "fp32")
            for name, batch, heads, queries, keys, head in SHAPES:
                row = _one_shape(dtype, batch, heads, queries, keys, head, repeats, peak, F, attention)
                row.update(shape=name, threads=count)
                rows.append(row)
                log(render_row(row))
    finally:
        torch.set_num_threads(before)
    return {"precision": precision, "bf16_products": attention.bf16_products(), "rows": rows}


def _one_shape(dtype: Any, batch: int, heads: int, queries: int, keys: int, head: int, repeats: int, peak: float,
               functional: Any, attention: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, tokens, heads, head, generator=g).transpose(1, 2).to(dtype).requires_grad_(True)
               for tokens in (queries, keys, keys))
    cotangent = torch.randn(batch, heads, queries, head, generator=g).to(dtype)
    flops = 4 * batch * heads * queries * keys * head
    row: dict[str, Any] = {"batch": batch, "heads": heads, "queries": queries, "keys": keys, "head": head}
    for who, call in (("torch", lambda: functional.scaled_dot_product_attention(q, k, v)),
                      ("xeontune", lambda: attention.attention(q, k, v))):
        forward = _best(call, repeats)
        backward = max(_best(lambda call=call: call().backward(cotangent), repeats) - forward, 1e-9)
        row[who] = {"forward_ms": forward * 1e3, "backward_ms": backward * 1e3,
                    "forward_gflops": flops / forward / 1e9, "backward_gflops": 2.5 * flops / backward / 1e9,
                    "peak_share": 3.5 * flops / (forward + backward) / 1e9 / peak}
    row["speedup"] = ((row["torch"]["forward_ms"] + row["torch"]["backward_ms"])
                      / (row["xeontune"]["forward_ms"] + row["xeontune"]["backward_ms"]))
    return row


def render_row(row: dict[str, Any]) -> str:
    ours, theirs = row["xeontune"], row["torch"]
    return (f"{row['shape']:<20} {row['threads']:>3} thr  torch {theirs['forward_ms']:8.1f} + {theirs['backward_ms']:8.1f} ms"
            f" ({theirs['peak_share']:4.0%})  xeontune {ours['forward_ms']:8.1f} + {ours['backward_ms']:8.1f} ms"
            f" ({ours['peak_share']:4.0%}; {ours['forward_gflops']:5.0f} / {ours['backward_gflops']:5.0f} GFLOP/s)"
            f"  {row['speedup']:5.2f}x")


def render(figures: dict[str, Any]) -> str:
    head = (f"attention, {figures['precision']}: forward + backward, best of the repeats (share of the matmul peak "
            "at those threads; xeontune's forward / backward GFLOP/s); speedup = torch's time / xeontune's")
    if figures["precision"] == "bf16":
        head += ("\nxeontune's bf16 products: " + ("bf16 (brgemm on VNNI pairs)" if figures.get("bf16_products")
                                                  else "fp32 (bf16 widened: no bf16 brgemm here)"))
    return "\n".join([head, *(render_row(row) for row in figures["rows"])])
