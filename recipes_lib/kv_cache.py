"""The KV cache: what it costs per token, measured from the cache transformers actually keeps.

Without a cache, generating token t re-runs the whole prefix: O(t) work per token, O(n^2) for n
tokens. With it, each layer keeps the keys and values of past tokens and a new token attends to
them: O(1) new projections per token, paid for in memory,
``2 (k and v) * layers * kv_heads * head_dim * bytes`` per token (``calc.kv_cache_bytes``).
Grouped-query attention (fewer kv heads than query heads) divides that by the group size.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def measure_kv_cache(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, float]:
    """Run a prefill with ``use_cache=True`` and count the bytes of the cache it returns.

    Args:
        model: a transformers causal LM.
        input_ids: (batch, seq) tokens.

    Returns:
        ``{"bytes": total, "bytes_per_token": total / (batch * seq), "layers": n}``; beyond a
        sliding window the per-token figure falls (``calc.kv_cache_bytes`` predicts the total).

    Raises:
        ValueError: if the model returns no cache (e.g. ``use_cache`` unsupported).

    Example:
        >>> measure_kv_cache(model, ids)["bytes_per_token"]  # doctest: +SKIP
        12288.0
    """
    model.eval()
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), use_cache=True)
    # transformers 5.24 renamed the output's past_key_values to cache (the old name warns)
    cache = out.get("cache") if "cache" in out else getattr(out, "past_key_values", None)
    if cache is None:
        raise ValueError("model: returned no cache (past_key_values) with use_cache=True")
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    tokens = input_ids.shape[0] * input_ids.shape[1]
    return {"bytes": float(total), "bytes_per_token": total / tokens,
            "layers": float(len(cache.layers))}


def length_sweep(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: list[int],
                 repeats: int = 3):
    """Greedy generation with and without the KV cache over the number of generated tokens,
    timed in alternation (``sweep.run_sweep``). Without a cache token ``t`` re-runs the whole
    prefix, so the cache's gain grows with the length; at a few tokens the cache's bookkeeping
    is all there is. Work per call (the baseline's): ``2 N`` FLOPs per token of every prefix it
    recomputes; bytes: the weights read once per generated token.

    Args:
        model: a causal LM.
        input_ids: the prompt, one row.
        new_tokens: the generated lengths, at least three, growing.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "kv_cache", dimension "new_tokens").

    Raises:
        ValueError: for sizes a sweep cannot use.
    """
    from recipes_lib.sweep import run_sweep

    model.eval()
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = ids.shape[1]

    def make(n: int):
        def run(cache: bool):
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               use_cache=cache, pad_token_id=model.config.pad_token_id)
        return {"baseline": lambda: run(False), "recipe": lambda: run(True)}

    def work(n: int) -> tuple[float, float]:
        tokens = sum(prompt + t for t in range(n)) * ids.shape[0]
        return 2.0 * n_params * tokens, float(weight_bytes * n)
    return run_sweep("kv_cache", "new_tokens", new_tokens, make, work, device, repeats=repeats,
                     progress=False)
