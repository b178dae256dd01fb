"""--fused-backward-pass: the optimizer steps each trained parameter inside the backward, as soon as its
gradient is complete, and frees that gradient, so that no moment of the step holds every gradient at once
(4 bytes a parameter less at the peak in fp32: 3.4 GB of SD1.5's UNet). kohya's ``--fused_backward_pass``
and OneTrainer's fused back pass do the same; the hook is torch's ``register_post_accumulate_grad_hook``.

The loop's one optimizer is kept, so its state dict, the LR scheduler and checkpoints are what they are
without the option: each hook runs its ``step()`` with every param group narrowed to the one parameter
(torch's optimizers and transformers' Adafactor step group by group, parameter by parameter, each from its
own gradient and state: the same update as one step over all of them). Not with gradient clipping (it
needs every gradient first) nor across ranks (DDP averages the gradients after these hooks have run).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class FusedBackward:
    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.final = True  # whether this backward is the last micro-step's (--gradient-accumulation-steps)
        # of the first step's gradients, by id(parameter): (finite throughout, not zero throughout), for the
        # method's check_gradient, since they are gone by the time the loop could look
        self.summary: dict[int, tuple[bool, bool]] | None = {}
        for p in params:  # for the parameters' life: the run owns the model
            p.register_post_accumulate_grad_hook(self._step)

    def _step(self, p: torch.Tensor) -> None:
        if not self.final:  # a micro-step before the last: the gradient accumulates
            return
        if self.summary is not None:
            self.summary[id(p)] = (bool(p.grad.isfinite().all()), bool(p.grad.ne(0).any()))
        groups = self.optimizer.param_groups
        kept = [group["params"] for group in groups]
        mine = self.group_of[id(p)]
        for i, group in enumerate(groups):
            group["params"] = [p] if i == mine else []
        try:
            self.optimizer.step()
        finally:
            for group, params in zip(groups, kept, strict=True):
                group["params"] = params
        p.grad = None

    def first_summary(self) -> dict[int, tuple[bool, bool]]:
        """The first step's gradient summary (taken once: later steps record none)."""
        summary, self.summary = self.summary or {}, None
        return summary
