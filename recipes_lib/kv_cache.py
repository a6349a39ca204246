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
        ``{"bytes": total, "bytes_per_token": total / (batch * seq), "layers": n}``.

    Raises:
        ValueError: if the model returns no cache (e.g. ``use_cache`` unsupported).

    Example:
        >>> measure_kv_cache(model, ids)["bytes_per_token"]  # doctest: +SKIP
        12288.0
    """
    model.eval()
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), use_cache=True)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise ValueError("model: returned no past_key_values with use_cache=True")
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    tokens = input_ids.shape[0] * input_ids.shape[1]
    return {"bytes": float(total), "bytes_per_token": total / tokens,
            "layers": float(len(cache.layers))}
