"""Inference latency with the one timer: batched prefill, token-by-token generation, and where
the time goes (the share spent in one kind of module, for an Amdahl's-law prediction)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from recipes_lib.device import synchronize
from recipes_lib.timing import Timing, time_interleaved


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def prefill_time(model: torch.nn.Module, batch: dict[str, torch.Tensor], repeats: int = 5,
                 warmup: int = 1) -> Timing:
    """Time one forward pass over a padded batch (the prompt-processing "prefill" phase).

    Args:
        model: a causal LM.
        batch: ``input_ids`` (and ``attention_mask``).
        repeats: timed passes.
        warmup: untimed passes first.

    Returns:
        The ``timing.Timing`` of the passes.

    Raises:
        ValueError: for a batch without ``input_ids``.
    """
    return prefill_times({"model": model}, batch, repeats, warmup)["model"]


def prefill_times(models: dict[str, torch.nn.Module], batch: dict[str, torch.Tensor],
                  repeats: int = 5, warmup: int = 1) -> dict[str, Timing]:
    """``prefill_time`` for several models, their runs alternating (A B A B ...) so machine drift
    does not favour one of them.

    Args:
        models: name -> causal LM.
        batch: the same batch for every model.
        repeats: timed passes of each.
        warmup: untimed passes of each first.

    Returns:
        name -> its ``timing.Timing``.

    Raises:
        ValueError: for a batch without ``input_ids``.
    """
    if "input_ids" not in batch:
        raise ValueError("batch: needs 'input_ids' (and optionally 'attention_mask')")
    fns = {}
    for name, model in models.items():
        device = _device(model)
        inputs = {k: v.to(device) for k, v in batch.items()
                  if k in ("input_ids", "attention_mask")}
        model.eval()

        def run(model=model, inputs=inputs):
            with torch.inference_mode():
                model(**inputs, use_cache=False)
        fns[name] = run
    device = _device(next(iter(models.values())))
    return time_interleaved(fns, warmup=warmup, repeats=repeats, device=device)


def generation_speed(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int = 32,
                     use_cache: bool = True, cache_implementation: str | None = None,
                     repeats: int = 3) -> dict[str, float]:
    """Greedy generation of exactly ``new_tokens`` tokens: median seconds, tokens per second and
    the spread of the timed runs ((max - min) / median).

    Args:
        model: a causal LM.
        input_ids: (batch, prompt_len) prompt.
        new_tokens: tokens to generate (eos is ignored so every run does the same work).
        use_cache: keep keys and values of past tokens (the KV cache) instead of recomputing them.
        cache_implementation: e.g. "static" (preallocated, what torch.compile needs).
        repeats: timed runs after one warm-up.

    Returns:
        ``{"seconds", "tokens_per_s", "spread"}``.

    Raises:
        ValueError: for new_tokens < 1.
    """
    return generation_speeds({"model": model}, input_ids, new_tokens, repeats, use_cache,
                             cache_implementation)["model"]


def generation_speeds(models: dict[str, torch.nn.Module], input_ids: torch.Tensor,
                      new_tokens: int = 32, repeats: int = 5, use_cache: bool = True,
                      cache_implementation: str | None = None) -> dict[str, dict[str, float]]:
    """``generation_speed`` for several models, their runs alternating so machine drift does not
    favour one of them.

    Args:
        models: name -> causal LM.
        input_ids: the same prompt for every model.
        new_tokens: tokens to generate.
        repeats: timed runs of each after one warm-up.
        use_cache: keep the KV cache.
        cache_implementation: e.g. "static".

    Returns:
        name -> ``{"seconds", "tokens_per_s", "spread"}``.

    Raises:
        ValueError: for new_tokens < 1.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens}: must be >= 1")
    fns = {}
    for name, model in models.items():
        ids = input_ids.to(_device(model))
        kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
                  "use_cache": use_cache, "pad_token_id": model.config.pad_token_id}
        if cache_implementation is not None:
            kwargs["cache_implementation"] = cache_implementation
        model.eval()

        def run(model=model, ids=ids, kwargs=kwargs):
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        fns[name] = run
    times = time_interleaved(fns, warmup=1, repeats=repeats,
                             device=_device(next(iter(models.values()))))
    return {name: {"seconds": t.median_s,
                   "tokens_per_s": new_tokens * input_ids.shape[0] / t.median_s,
                   "spread": t.spread}
            for name, t in times.items()}


def module_time_share(model: torch.nn.Module, fn: Callable[[], object],
                      is_target: Callable[[torch.nn.Module], bool]) -> float:
    """Fraction of ``fn``'s wall time spent inside modules for which ``is_target`` is true.

    Forward pre/post hooks time each target module (synchronising the device), so this is for
    inference-mode forwards, not for backward.

    Args:
        model: the model whose modules are timed.
        fn: the call to time, e.g. a forward pass.
        is_target: picks the modules, e.g. ``lambda m: type(m) is torch.nn.Linear``.

    Returns:
        The share, in [0, 1] (a target inside another target is counted twice: choose
        modules that do not nest).
    """
    device = _device(model)
    spent = [0.0]
    start: dict[int, float] = {}
    hooks = []
    for module in model.modules():
        if is_target(module):
            def pre(mod, args):
                synchronize(device)
                start[id(mod)] = time.perf_counter()

            def post(mod, args, out):
                synchronize(device)
                spent[0] += time.perf_counter() - start.pop(id(mod))
            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        fn()  # warm-up
        spent[0] = 0.0
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        total = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    return spent[0] / total
