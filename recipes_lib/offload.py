"""CPU offload of optimizer states: AdamW's moments and fp32 master weights live in CPU RAM.

AdamW keeps two fp32 moments per trainable parameter (8 bytes), plus a 4-byte fp32 master copy
when the model trains in 16-bit: 12 of the 16 bytes/param of mixed-precision training. Offloading
them leaves the accelerator with the weights and gradients only; each step copies gradients to the
CPU, runs AdamW there and copies the updated weights back.

Why not torchao's ``CPUOffloadOptimizer``: it only runs on CUDA/XPU, and it copies gradients to the
CPU in a post-accumulate-grad hook, i.e. before the training loop's ``clip_grad_norm_`` runs, so
clipping never reaches the CPU copy. This version copies at ``step()``, after clipping; it is
slower (no overlap of the copy with backward) and exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class CPUOffloadOptimizer:
    """Wrap an optimizer so that its states and fp32 master weights stay on the CPU.

    Args:
        params: the trainable parameters (on any device, any float dtype).
        optimizer_class: the optimizer run on the CPU copies (default AdamW).
        host: where the copies and states live (the CPU; ``fake_memory`` passes "meta" so that a
            fake step on a CPU counts them apart from the device's bytes).
        **kwargs: passed to ``optimizer_class`` (lr, weight_decay, betas, ...).

    Raises:
        ValueError: if no parameter requires grad.

    Example:
        >>> opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 host: torch.device | str = "cpu", **kwargs: Any):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params: no parameter requires grad")
        host = torch.device(host)
        # pinned host memory makes the copies asynchronous
        pin = host.type == "cpu" and torch.cuda.is_available()
        masters = []
        for p in self.params:
            m = torch.empty(p.shape, dtype=torch.float32, device=host, pin_memory=pin)
            m.copy_(p.detach())
            m = torch.nn.Parameter(m)
            m.grad = torch.zeros_like(m, pin_memory=pin)
            masters.append(m)
        # a ParameterList, so the memory meter counts the masters and their gradients
        self.master = torch.nn.ParameterList(masters)
        self.optimizer = optimizer_class(list(self.master), **kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @torch.no_grad()
    def step(self) -> None:
        """Copy gradients to the CPU, step there, copy updated weights back."""
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            m.grad.copy_(p.grad, non_blocking=True)
        if any(p.is_cuda for p in self.params):
            torch.cuda.synchronize()
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def state_bytes(self, device_type: str = "cpu") -> int:
        """Bytes of optimizer states plus master weights held on ``device_type``."""
        total = 0
        for m in self.master:
            if m.device.type == device_type:
                total += m.nbytes
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.device.type == device_type:
                    total += v.nbytes
        return total


def compare_with_adamw(load_model: Callable[[], torch.nn.Module],
                       examples: list[dict[str, list[int]]], pad_token_id: int,
                       config: Any) -> dict[str, dict[str, Any]]:
    """The same steps from the same weights and batches with the training loop's AdamW and with
    :class:`CPUOffloadOptimizer` (``train.compare_optimizers``: the one training loop for both).

    Args:
        load_model: returns a fresh copy of the starting model (called once per optimizer).
        examples, pad_token_id, config: as ``train.train`` takes them (``config`` also gives
            the offloaded AdamW its learning rate and weight decay).

    Returns:
        ``{"AdamW": ..., "CPU-offloaded AdamW": ...}``, each ``{"losses", "parameters"}`` (the
        parameters after the last step, ``numerics.collect_parameters``).
    """
    from recipes_lib import numerics, train

    return train.compare_optimizers(
        load_model, examples, pad_token_id, config,
        {"AdamW": None,
         "CPU-offloaded AdamW": lambda m: CPUOffloadOptimizer(
             m.parameters(), lr=config.lr, weight_decay=config.weight_decay)},
        lambda model, run, _: {"losses": run.losses,
                               "parameters": numerics.collect_parameters(model)})
