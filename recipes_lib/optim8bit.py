"""8-bit optimizer states: AdamW's two moments in 1 byte each instead of 4.

AdamW keeps two fp32 moments per trainable parameter, 8 of the 16 bytes per parameter of a
mixed-precision full fine-tune. bitsandbytes' blockwise 8-bit AdamW (Dettmers et al., 2022,
"8-bit Optimizers via Block-wise Quantization") stores each moment as uint8 codes of a dynamic
(non-linear) quantization map, with one fp32 absmax per block of 256 values, and dequantizes,
updates and requantizes them inside the step. Per parameter of a large tensor that is
``2 + 2 * 4 / 256`` bytes, about 0.254x AdamW's 8 (``calc.adamw_8bit_state_bytes`` counts the
exact bytes, including the tensors below ``min_8bit_size`` that stay in fp32). Its CPU kernels
exist since bitsandbytes 0.50; on CUDA the *paged* variant also lets the states spill to CPU
memory under pressure (unified memory), instead of an out-of-memory error.

torchao's ``AdamW8bit`` / ``AdamW4bit`` do the same with tensor subclasses and
``torch.compile``; in one development run on this 2-core CPU, five steps of the tiny model took
~10x (8-bit) and ~16x (4-bit) AdamW's time, compilation included, so the course uses
bitsandbytes here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

BACKENDS = ("bitsandbytes",)


def make_adamw_8bit(params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                    weight_decay: float = 0.0, paged: bool = False,
                    backend: str = "bitsandbytes",
                    fp32_states: Iterable[torch.nn.Parameter] = ()) -> torch.optim.Optimizer:
    """bitsandbytes' blockwise 8-bit AdamW over ``params`` (the paged variant with ``paged``).

    Args:
        params: the trainable parameters.
        lr: learning rate.
        weight_decay: decoupled weight decay, as ``torch.optim.AdamW``.
        paged: states in CUDA unified memory, paged to the CPU under memory pressure (CUDA
            only).
        backend: "bitsandbytes" (the only one whose 8-bit kernels run on a CPU).
        fp32_states: parameters among ``params`` whose moments stay in fp32, as Trainer keeps
            every embedding's (bitsandbytes' advice for an embedding that trains unstably).
            Overrides registered in bitsandbytes' process-wide ``GlobalOptimManager`` do not
            apply: that manager keys them by parameter position too, so one left by an earlier
            optimizer (Trainer's embeddings) would reach this one's parameters.

    Raises:
        ValueError: for an unknown backend, ``paged`` without CUDA, a parameter on a device the
            backend has no kernel for, an ``fp32_states`` tensor not in ``params``, or
            bitsandbytes missing.

    Returns:
        The optimizer.

    Example:
        >>> opt = make_adamw_8bit(model.parameters(),  # doctest: +SKIP
        ...                       fp32_states=[model.get_input_embeddings().weight])
    """
    from recipes_lib.device import has_module

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if not has_module("bitsandbytes"):
        raise ValueError("backend='bitsandbytes': not installed (pip install bitsandbytes)")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("params: no trainable parameters")
    fp32_states = list(fp32_states)
    if not {id(p) for p in fp32_states} <= {id(p) for p in params}:
        raise ValueError("fp32_states: every tensor must be one of params' trainable "
                         "parameters")
    devices = {p.device.type for p in params}
    if not devices <= {"cpu", "cuda"}:
        raise ValueError(f"params: on {sorted(devices)}; bitsandbytes' 8-bit AdamW runs on CPU "
                         "and CUDA only")
    if paged and devices != {"cuda"}:
        raise ValueError("paged=True: paged optimizer states need CUDA (unified memory); "
                         "on a CPU use paged=False")
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    optimizer = cls(params, lr=lr, weight_decay=weight_decay)
    # bitsandbytes' GlobalOptimManager is one per process, and keeps every override it was given
    # keyed by (group, index) position as well as by id(): after transformers' Trainer ran with
    # optim="adamw_bnb_8bit" (it keeps each nn.Embedding in 32 bits), any later 8-bit optimizer
    # keeps whichever of its parameters sits at that position in 32 bits too (bitsandbytes
    # 0.50). This one reads a manager of its own, so its states are always those of
    # calc.adamw_8bit_state_bytes, whatever ran before in the process.
    optimizer.mng = _empty_override_manager()
    if fp32_states:
        optimizer.mng.override_config(fp32_states, "optim_bits", 32)
    return optimizer


def _empty_override_manager() -> Any:
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.__new__(GlobalOptimManager)  # its __init__ refuses: singleton
    manager.initialize()
    return manager


def forget_overrides(model: torch.nn.Module) -> int:
    """Remove from bitsandbytes' process-wide ``GlobalOptimManager`` every override registered
    for ``model``'s modules or parameters; return how many module overrides it held.

    transformers' ``Trainer`` with ``optim="adamw_bnb_8bit"`` registers each ``nn.Embedding``
    there (states in 32 bits) and never removes it: the manager then holds those modules, and
    their weights, for the life of the process (0.98 GiB for Llama-3.1-8B's bf16 embedding), and
    applies the override to the parameter at the same position in any later 8-bit optimizer.
    An optimizer that already took its first step keeps the states it has (bitsandbytes reads
    their dtype, not the override, from then on).

    Args:
        model: the model a trainer ran.

    Returns:
        The module overrides removed.

    Example:
        >>> trainer.train(); forget_overrides(trainer.model)  # doctest: +SKIP
    """
    if "bitsandbytes" not in sys.modules:  # nothing can have registered an override
        return 0
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    modules = {id(m) for m in model.modules()}
    params = {id(p) for p in model.parameters()}
    mine = [t for t in manager.module_weight_config_triple if id(t[0]) in modules]
    configs = {id(cfg) for _, _, cfg in mine}
    configs |= {id(cfg) for pid, cfg in manager.pid2config.items() if pid in params}
    manager.module_weight_config_triple = [t for t in manager.module_weight_config_triple
                                           if id(t[0]) not in modules]
    manager.pid2config = {pid: cfg for pid, cfg in manager.pid2config.items()
                          if pid not in params}
    manager.index2config = {k: cfg for k, cfg in manager.index2config.items()
                            if id(cfg) not in configs}
    return len(mine)


def state_bytes(optimizer: Any) -> int:
    """Bytes of an optimizer's state tensors (each storage once: shared quantization maps count
    once), after its first step.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (or a wrapper holding one).

    Returns:
        Bytes of its states.
    """
    from recipes_lib.memory import tensor_bytes

    return tensor_bytes(v for st in optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)


def compare_with_adamw(load_model: Callable[[], torch.nn.Module],
                       examples: list[dict[str, list[int]]], pad_token_id: int,
                       config: Any) -> dict[str, dict[str, Any]]:
    """The same steps from the same weights and batches with the training loop's AdamW and with
    8-bit AdamW (``train.compare_optimizers``: the one training loop for both).

    Args:
        load_model: returns a fresh copy of the starting model (called once per optimizer).
        examples, pad_token_id, config: as ``train.train`` takes them.

    Returns:
        ``{"AdamW": ..., "8-bit AdamW": ...}``, each ``{"losses", "step_times",
        "state_bytes"}``.
    """
    from recipes_lib import train

    return train.compare_optimizers(
        load_model, examples, pad_token_id, config,
        {"AdamW": None,
         "8-bit AdamW": lambda m: make_adamw_8bit(m.parameters(), config.lr, config.weight_decay)},
        lambda _, run, opt: {"losses": run.losses, "step_times": run.step_times,
                             "state_bytes": state_bytes(opt)})
