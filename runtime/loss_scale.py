"""Dynamic loss scaling for a compiled model whose embedding rows update inside backward.

fp16 dense compute (``CompileConfig(dense_dtype="fp16")``, CUDA) needs what ``torch.amp`` gives it:
the loss multiplied by a scale S so small gradients do not flush to zero in fp16, the gradients
divided by S before the optimizer reads them, and a step skipped — and S halved — when any
gradient overflowed. torch's ``GradScaler`` cannot do this for recc: the tables' fused optimizers
run inside ``loss.backward()``, before ``scaler.step`` could unscale or skip anything. So
``recc.GradScaler`` (the same methods: ``scale``, ``unscale_``, ``step``, ``update``,
``get_scale``, ``state_dict``) also tells every table group the scale in force:

- each fused update divides its gradient by S inside the kernel (folded into the per-id scale
  the kernels already apply: no pass over the gradient);
- a group whose gradient holds an inf or a NaN (checked after the exchanges that bring it, so
  every rank that holds the group decides on the same values) skips its update and says so;
- ``step`` skips the dense optimizer when a dense gradient or any group, on any rank, overflowed
  (one all-reduce of one flag per step on a world of several ranks, so all ranks skip together
  and their scales stay equal); ``update`` halves S then, or doubles it after
  ``growth_interval`` clean steps, as ``torch.amp.GradScaler`` does.

A group that saw only finite gradients applies them even when another overflowed: its rows got
a true (unscaled) gradient step, while rows under an inf would be destroyed. S is a power of two
by default, so scaling and unscaling are exact: with no overflow, training with the scaler gives
the bits training without it gives. It works with any ``dense_dtype`` (the tests run it on CPU
in fp32 and bf16); it is what makes fp16 train.

    scaler = recc.GradScaler(dmodel)
    for dense_x, lS_o, lS_i, y in batches:
        loss = F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y)
        scaler.scale(loss).backward()      # tables update here, unscaled, or skip on overflow
        scaler.step(opt)                   # the dense step, unless anything overflowed
        scaler.update()
        opt.zero_grad()
"""
from __future__ import annotations

from typing import Optional

import torch


def update_scale(group, grad: torch.Tensor) -> Optional[float]:
    """The factor a fused update multiplies each id's gradient by (the 1/world share, and 1/S
    when a scaler is in force), or None when ``grad`` overflowed: the update must be skipped
    (the group records it for its scaler). Called after any collective that brings ``grad``."""
    scale = getattr(group, "loss_scale", 1.0)
    if scale == 1.0:
        return group.grad_scale
    if not bool(torch.isfinite(grad).all()):
        group.found_inf = True
        return None
    return group.grad_scale / scale


class GradScaler:
    """``torch.amp.GradScaler``'s dynamic loss scaling for a ``recc`` model (see the module
    docstring): ``dmodel`` is what ``program.instantiate()`` returned."""

    def __init__(self, dmodel, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        if not init_scale > 0 or not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1:
            raise ValueError(f"recc.GradScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             f"and growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self._groups = list(dmodel.table_groups())
        self._scale, self._growth_factor, self._backoff_factor = float(init_scale), growth_factor, backoff_factor
        self._growth_interval, self._growth_tracker, self._enabled = growth_interval, 0, enabled
        self._unscaled: dict[int, bool] = {}   # optimizer id -> its dense gradients had an inf/NaN
        self._found: Optional[bool] = None     # this step's decision, once taken (all ranks)

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; from here to ``update`` the tables' fused updates unscale by S."""
        if not self._enabled:
            return loss
        for g in self._groups:
            g.loss_scale, g.found_inf = self._scale, False
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by S in place (once per step), noting an inf/NaN."""
        if not self._enabled or id(optimizer) in self._unscaled:
            return
        inv = 1.0 / self._scale
        bad = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not bad and not bool(torch.isfinite(p.grad).all()):
                    bad = True
                p.grad.mul_(inv)
        self._unscaled[id(optimizer)] = bad

    def _overflowed(self) -> bool:
        """Whether anything overflowed this step, on any rank (one flag all-reduced)."""
        if self._found is None:
            found = any(self._unscaled.values()) or any(getattr(g, "found_inf", False) for g in self._groups)
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                flag = torch.tensor([1.0 if found else 0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                found = bool(flag.item())
            self._found = found
        return self._found

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``optimizer.step()`` on unscaled gradients, unless anything overflowed (then None)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        self.unscale_(optimizer)
        if self._overflowed():
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Halve S after an overflow; double it after ``growth_interval`` clean steps."""
        if not self._enabled:
            return
        if self._overflowed():
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        self._unscaled.clear()
        self._found = None

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._growth_factor, self._backoff_factor = state["growth_factor"], state["backoff_factor"]
        self._growth_interval, self._growth_tracker = state["growth_interval"], state["_growth_tracker"]
