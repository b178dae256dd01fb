"""Trained weights under bf16 autocast without their bf16 copies held through the step.

Autocast casts each fp32 weight of a Linear or Conv2d to bf16 for its product and autograd keeps that copy
for the backward: a whole bf16 copy of the trained model is held from the end of the forward until the
backward passes each layer (1.7 GB for SD1.5's UNet, on top of its fp32 weights and AdamW's state). Here
those layers cast in the forward and cast again in the backward, saving only the fp32 parameter, which is
held anyway. The products are autocast's own (bf16 inputs, the gradients of the weights cast back to fp32),
so the results are the same (bit for bit on the tiny model, tests/train/test_full.py); the backward's second
cast costs about 1 % of an SD1.5 step at 512 px (docs/performance.md, issue 47).

Outside a bf16 autocast a layer runs its stock forward: inference, validation and anything else see no change.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BF16 = torch.bfloat16


def _autocasting() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.to(BF16)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight.to(BF16), None if bias is None else bias.to(BF16))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.to(BF16)
        grad_x = grad.matmul(weight.to(BF16)) if ctx.needs_input_grad[0] else None
        rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_weight = rows.t().matmul(inputs).float() if ctx.needs_input_grad[1] else None
        grad_bias = rows.sum(0).float() if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


class _Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any,
                padding: Any, dilation: Any, groups: int) -> torch.Tensor:
        x = x.to(BF16)
        ctx.save_for_backward(x, weight)
        ctx.conv = (list(stride), list(padding), list(dilation), groups, bias is not None)
        return F.conv2d(x, weight.to(BF16), None if bias is None else bias.to(BF16), stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias = ctx.conv
        wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
        grad_x, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad.to(BF16), x, weight.to(BF16), [weight.shape[0]] if has_bias else None, stride, padding, dilation,
            False, [0, 0], groups, wanted)
        return (grad_x, None if grad_weight is None else grad_weight.float(),
                None if grad_bias is None else grad_bias.float(), None, None, None, None)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _autocasting():
        return nn.Linear.forward(self, x)
    return _Linear.apply(x, self.weight, self.bias)


def _conv2d_forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    if not _autocasting():
        return nn.Conv2d.forward(self, x)
    return _Conv2d.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def install(models: list[nn.Module]) -> int:
    """Cast-in-the-backward forwards on every plain Linear and zero-padded Conv2d of ``models`` (a method's
    trained models); how many layers."""
    count = 0
    for model in models:
        for module in model.modules():
            if type(module) is nn.Linear:
                module.forward = types.MethodType(_linear_forward, module)
            elif type(module) is nn.Conv2d and module.padding_mode == "zeros" and not isinstance(module.padding, str):
                module.forward = types.MethodType(_conv2d_forward, module)
            else:
                continue
            count += 1
    return count
