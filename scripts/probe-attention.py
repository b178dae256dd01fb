"""Times bf16 attention candidates against stock SDPA at the UNets' shapes, forward and backward, with
their error against fp32 SDPA on the same inputs (docs/performance.md, "Attention candidates").

    CUDA_VISIBLE_DEVICES= .venv/bin/python scripts/probe-attention.py [--repeats 7]

One process, best of --repeats; run it alone on the machine. A probe, not part of the trainer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (heads, queries, keys, head dim): SDXL at 512 px (self 1024 / 256 tokens, cross over 77 text tokens),
# SD1.5 at 512 px (4096 tokens, 8 heads of 40)
SHAPES = [(10, 1024, 1024, 64), (20, 256, 256, 64), (10, 1024, 77, 64), (20, 256, 77, 64),
          (8, 4096, 4096, 40), (8, 4096, 77, 40), (8, 1024, 1024, 40), (8, 256, 256, 40)]


class SavedProbabilities(torch.autograd.Function):
    """Logits in fp32, the bf16 probabilities saved for the backward (no recompute)."""

    @staticmethod
    def forward(ctx, q, k, v):
        scale = q.shape[-1] ** -0.5
        p = torch.softmax(torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale), -1).to(q.dtype)
        ctx.save_for_backward(q, k, v, p)
        return torch.matmul(p, v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dout = dout.contiguous()
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout.float(), v.float().transpose(-1, -2))
        pf = p.float()
        ds = pf.mul_(dp.sub_((dp * pf).sum(-1, keepdim=True))).mul_(scale).to(q.dtype)
        return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


def math_backend(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v)


def padded_head(multiple: int) -> Callable:
    """Stock SDPA with the head dim zero-padded to a multiple of ``multiple`` (the zeros add nothing to
    q k^T, their output columns are dropped; the scale stays the real dim's): SD1.5's heads of 40 and 80
    are not a multiple of AMX's 32-element bf16 tiles. The same arithmetic as stock, more of it."""

    def attention(q, k, v):
        dim = q.shape[-1]
        pad = -dim % multiple
        if pad == 0:
            return F.scaled_dot_product_attention(q, k, v)
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, scale=dim**-0.5)[..., :dim]

    return attention


CANDIDATES: dict[str, Callable] = {
    "stock": F.scaled_dot_product_attention, "math": math_backend, "saved-p": SavedProbabilities.apply,
    "pad-32": padded_head(32), "pad-64": padded_head(64)}


def timed(fn: Callable, shape: tuple[int, ...], repeats: int) -> tuple[float, float]:
    h, n, m, d = shape
    q, k, v = (torch.randn(1, h, s, d).bfloat16().requires_grad_() for s in (n, m, m))
    grad = torch.randn(1, h, n, d).bfloat16()
    best = [float("inf")] * 2
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(q, k, v)
        middle = time.perf_counter()
        out.backward(grad)
        best = [min(best[0], middle - start), min(best[1], time.perf_counter() - middle)]
    return best[0] * 1e3, best[1] * 1e3


def errors(fn: Callable, shape: tuple[int, ...]) -> list[float]:
    """Relative norm error of the output and dq, dk, dv against fp32 SDPA."""
    h, n, m, d = shape
    q, k, v = (torch.randn(1, h, s, d).requires_grad_() for s in (n, m, m))
    grad = torch.randn(1, h, n, d)
    F.scaled_dot_product_attention(q, k, v).backward(grad)
    reference = [F.scaled_dot_product_attention(q, k, v).detach(), q.grad, k.grad, v.grad]
    q2, k2, v2 = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    out = fn(q2, k2, v2)
    out.backward(grad.bfloat16())
    return [float((a.float() - b).norm() / b.norm()) for a, b in
            zip([out.detach(), q2.grad, k2.grad, v2.grad], reference, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print("heads x queries x keys x dim | candidate | forward / backward ms | error out, dq, dk, dv")
    for shape in SHAPES:
        for name, fn in CANDIDATES.items():
            forward, backward = timed(fn, shape, args.repeats)
            print(f"{' x '.join(map(str, shape))} | {name} | {forward:.2f} / {backward:.2f} | "
                  + ", ".join(f"{e:.4f}" for e in errors(fn, shape)), flush=True)


if __name__ == "__main__":
    main()
