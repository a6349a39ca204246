"""The longest sequence that trains within a memory budget, found by measurement.

Activation memory grows with the sequence length s: linearly for the layers' tensors, as s^2 for
eager attention's score matrices, and as s x vocab for the logits. Each recipe removes one term
(flash / blockwise attention the s^2, checkpointing most of the per-layer tensors, chunked
cross-entropy the logits); ``max_seq_len`` finds, by measuring real training steps with the one
memory meter, how far each combination goes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def check_positions(config: Any, seq_len: int) -> None:
    """Refuse a sequence longer than the model's positional capacity, saying how to extend it.

    Args:
        config: the model's transformers config, or a ``calc.ModelShape`` (the planner's); a
            ``max_position_embeddings`` of None is no limit.
        seq_len: the sequence length asked for.

    Raises:
        ValueError: if seq_len < 1 or seq_len > config.max_position_embeddings.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len}: beyond the model's max_position_embeddings={limit}. RoPE models "
            f"can be stretched: max_context.load_with_rope_scaling(path, {seq_len}) sets "
            "config.rope_parameters = {**config.rope_parameters, 'rope_type': 'linear', "
            f"'factor': {seq_len / limit:.2g}}} (position interpolation; or 'dynamic' / 'yarn') "
            "and max_position_embeddings; fine-tune briefly at the new length (transformers 5 "
            "deprecates config.rope_scaling, and setting it on a built config drops rope_theta)")


def training_step_peak(model: torch.nn.Module, seq_len: int, batch_size: int = 1,
                       loss_fn: Callable | None = None) -> int:
    """Measured peak bytes of one forward + backward at ``seq_len`` (random tokens, no padding).

    Args:
        model: a causal LM.
        seq_len: tokens per sequence.
        batch_size: sequences.
        loss_fn: replaces the default loss (e.g. ``chunked_loss.ChunkedCausalLMLoss``).

    Returns:
        The memory meter's peak, in bytes.
    """
    from recipes_lib.grad_accumulation import forward_backward
    from recipes_lib.memory import measure_memory

    check_positions(model.config, seq_len)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=g)
    batch = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids, device=device),
             "labels": ids.to(device)}
    model.train()

    def step():
        forward_backward(model, batch, loss_fn=loss_fn)
        model.zero_grad(set_to_none=True)
    return measure_memory(step, model, device=device).peak_bytes


def checkpointing_peaks(model: torch.nn.Module, seq_lens: list[int]) -> list[dict[str, float]]:
    """Measured peak of one training step at each length, without and with activation
    checkpointing (``training_step_peak``), beside the calculator's ratio.

    The prediction adds ``calc.activation_bytes`` (fp32, flash attention; nothing recomputed
    against full recomputation) to the fp32 weights and gradients, 8 bytes a parameter: what
    checkpointing leaves alone. The model leaves without checkpointing, as it came.

    Args:
        model: a causal LM without checkpointing.
        seq_lens: the lengths measured.

    Returns:
        One dict per length: ``seq_len``, ``plain MiB``, ``checkpointed MiB``, ``ratio``
        (checkpointed / plain) and ``predicted ratio``.
    """
    from recipes_lib import calc, checkpointing

    shape = calc.ModelShape.from_config(model.config)
    fixed = 8 * sum(p.numel() for p in model.parameters())  # fp32 weights + gradients
    rows = []
    for s in seq_lens:
        plain = training_step_peak(model, s)
        checkpointing.enable_activation_checkpointing(model)
        try:
            ckpt = training_step_peak(model, s)
        finally:
            checkpointing.disable_activation_checkpointing(model)
        pred = {r: calc.activation_bytes(shape, s, 1, r, 4, flash_attention=True)["total"]
                for r in ("none", "full")}
        rows.append({"seq_len": s, "plain MiB": plain / 2**20, "checkpointed MiB": ckpt / 2**20,
                     "ratio": ckpt / plain,
                     "predicted ratio": (fixed + pred["full"]) / (fixed + pred["none"])})
    return rows


def max_seq_len(peak_at: Callable[[int], float], budget_bytes: float, start: int = 256,
                limit: int = 65536, multiple_of: int = 128,
                probes: dict[int, float] | None = None) -> dict[str, Any]:
    """Largest multiple of ``multiple_of`` whose measured peak fits ``budget_bytes``.

    A step's memory grows almost linearly with its length, so the search interpolates: it
    measures ``start``, then 8x that, extrapolates to the budget, and narrows the bracket between
    the longest length that fit and the shortest that did not by linear interpolation (bisecting
    when that stalls) until they are one ``multiple_of`` apart. Assumes the peak grows with the
    length. Pass the same ``probes`` to several searches (other budgets) to share measurements.

    Args:
        peak_at: ``seq_len -> peak bytes``.
        budget_bytes: the memory available.
        start: the first length measured.
        limit: the longest length tried.
        multiple_of: lengths are multiples of this.
        probes: length -> peak measured already (filled in).

    Returns:
        ``{"seq_len": best (0 if not even ``multiple_of`` tokens fit), "probes": {length:
        peak}}``; ``seq_len`` was measured to fit and ``multiple_of`` more measured not to (or is
        ``limit``).

    Raises:
        ValueError: for a non-positive budget, start, limit or multiple_of, or start > limit.
    """
    for name, v in (("budget_bytes", budget_bytes), ("start", start), ("limit", limit),
                    ("multiple_of", multiple_of)):
        if v <= 0:
            raise ValueError(f"{name}={v}: must be > 0")
    if start > limit:
        raise ValueError(f"start={start} > limit={limit}")
    probes = {} if probes is None else probes
    top = limit // multiple_of

    def measured() -> dict[int, float]:  # in units of multiple_of
        return {n // multiple_of: v for n, v in probes.items()
                if n % multiple_of == 0 and n <= top * multiple_of}

    stalls = 0
    while True:
        need = measured()
        lo = max((u for u, v in need.items() if v <= budget_bytes), default=0)
        hi = min((u for u, v in need.items() if v > budget_bytes), default=top + 1)
        if hi - lo <= 1 or lo >= top:
            return {"seq_len": min(lo, top) * multiple_of, "probes": probes}
        if not need:
            guess = max(1, start // multiple_of)
        elif len(need) == 1:
            guess = 8 * next(iter(need))
        else:  # the secant through the bracket's ends, or the two points nearest it
            pts = sorted(need)
            a, b = ((lo, hi) if lo and hi <= top else (pts[-2], pts[-1]) if hi > top
                    else (pts[0], pts[1]))
            slope = (need[b] - need[a]) / (b - a)
            guess = (int(a + (budget_bytes - need[a]) / slope) if slope > 0
                     else 2 * max(lo, 1))
            if stalls >= 2:  # interpolation creeps along one side: halve the bracket
                guess, stalls = (lo + hi) // 2, 0
        guess = max(lo + 1, min(hi - 1, guess))
        probes[guess * multiple_of] = float(peak_at(guess * multiple_of))
        need = measured()
        new_lo = max((u for u, v in need.items() if v <= budget_bytes), default=0)
        new_hi = min((u for u, v in need.items() if v > budget_bytes), default=top + 1)
        stalls = stalls + 1 if (new_hi - new_lo) * 2 > hi - lo else 0


def load_with_rope_scaling(model_path, max_positions: int, rope_type: str | None = None,
                           device: torch.device | str | None = None) -> torch.nn.Module:
    """Load a RoPE model able to take ``max_positions`` tokens: its positions stretched where it
    was trained on fewer (position interpolation: ``factor = max_positions / trained
    positions``), as trained, said aloud, where it already takes them (Llama-3.2's 131072).
    Quality at a new length needs a short fine-tune there; memory and time do not depend on it.

    A RoPE already scaled (Llama-3.1's ``"llama3"``, YaRN, linear) keeps its type, its factor
    multiplied by the same ratio; rebuilding it as plain linear would drop that scaling. Where
    each layer type has its own RoPE (Gemma-3), the full-attention layers are stretched: a
    sliding layer sees no distance beyond its window. Loaded through ``model.load_model`` (its
    attention choice, a multimodal checkpoint's language model).

    Args:
        model_path: a folder or hub id.
        max_positions: the positional capacity wanted.
        rope_type: transformers' RoPE scaling type for an unscaled RoPE ("linear", "dynamic",
            "yarn"; None: "linear"); for a scaled one, None or its own type.
        device: where to load it (None: the CPU).

    Returns:
        The model, its config's ``max_position_embeddings`` and RoPE parameters updated.

    Raises:
        ValueError: for ``max_positions`` not a positive integer, a model with no RoPE
            parameters, a ``rope_type`` other than an already scaled RoPE's, a scaling
            without one factor (Phi-3's ``"longrope"``: per-dimension factors), or a model
            ``model.load_model`` cannot load.

    Example:
        >>> m = load_with_rope_scaling("my-llama", 16384)  # doctest: +SKIP
        >>> m.config.rope_parameters["factor"]  # doctest: +SKIP
        8.0
    """
    import warnings

    from transformers import AutoConfig

    from recipes_lib.calc import language_model_config
    from recipes_lib.model import load_model, model_source

    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 1:
        raise ValueError(f"max_positions={max_positions!r}: must be a positive integer")
    try:
        cfg = language_model_config(AutoConfig.from_pretrained(model_source(model_path)))
    except (OSError, ValueError) as err:
        raise ValueError(f"model_path={str(model_path)!r}: no config to read ({err})") from err
    trained = cfg.max_position_embeddings
    if max_positions <= trained:
        warnings.warn(f"{model_path}: trained on {trained} positions, max_positions="
                      f"{max_positions} needs no stretching: loaded as trained", stacklevel=2)
        return load_model(model_path, device=device)
    rope = getattr(cfg, "rope_parameters", None)
    if not rope:
        raise ValueError(f"model_path={str(model_path)!r}: the model has no rope_parameters "
                         "(not a RoPE model)")
    cfg.rope_parameters = _stretched(rope, max_positions / trained, rope_type)
    cfg.max_position_embeddings = max_positions
    return load_model(model_path, device=device, config=cfg)


def _stretched(rope: dict, factor: float, rope_type: str | None) -> dict:
    """``rope`` (a config's ``rope_parameters``) stretched ``factor`` times (above)."""
    if rope and all(isinstance(v, dict) for v in rope.values()):  # one RoPE per layer type
        if "full_attention" not in rope:
            raise ValueError(f"model_path: RoPE per layer type ({', '.join(rope)}) with no "
                             "'full_attention' entry to stretch")
        return {**rope, "full_attention": _stretched(rope["full_attention"], factor, rope_type)}
    own = rope.get("rope_type", "default")
    if own == "default":
        return {**rope, "rope_type": rope_type or "linear", "factor": factor}
    if rope_type not in (None, own):
        raise ValueError(f"rope_type={rope_type!r}: the model's RoPE is already scaled by "
                         f"{own!r}; stretch it with its own type (rope_type=None or {own!r})")
    if isinstance(rope.get("factor"), (int, float)):
        return {**rope, "factor": rope["factor"] * factor}
    raise ValueError(f"model_path: its RoPE scaling {own!r} has no single factor to multiply "
                     "(per-dimension factors); it cannot be stretched here")


def search_recipes(variants: dict[str, dict[str, Any]], budget_bytes: float, limit: int,
                   vocab_size: int, multiple_of: int = 128) -> list[dict[str, Any]]:
    """``max_seq_len`` for each variant of a small Llama, with the calculator's prediction.

    Args:
        variants: name -> ``{"attn": "eager" | "sdpa" | registered name, "ckpt": bool,
            "chunk": tokens per loss chunk or None}``, measured in order.
        budget_bytes: the memory budget.
        limit: the longest length tried (a result at the limit is a lower bound).
        vocab_size: the model's vocabulary (large vocabularies make the logits matter).
        multiple_of: the lengths' granularity.

    Returns:
        One row per variant: measured and predicted longest length, whether the search hit the
        limit, and how many lengths it measured.
    """
    from recipes_lib import calc
    from recipes_lib.checkpointing import enable_activation_checkpointing
    from recipes_lib.chunked_loss import ChunkedCausalLMLoss
    from recipes_lib.model import small_llama

    rows = []
    for name, v in variants.items():
        model = small_llama(None, limit, vocab_size=vocab_size, attn_implementation=v["attn"])
        if v.get("ckpt"):
            enable_activation_checkpointing(model)
        loss_fn = ChunkedCausalLMLoss(v["chunk"]) if v.get("chunk") else None
        found = max_seq_len(lambda s, m=model, f=loss_fn: training_step_peak(m, s, loss_fn=f),
                            budget_bytes, start=multiple_of, limit=limit, multiple_of=multiple_of)
        fixed = 8 * sum(p.numel() for p in model.parameters())  # fp32 weights + gradients
        predicted = calc.max_seq_len(calc.ModelShape.from_config(model.config), budget_bytes,
                                     fixed, recompute="full" if v.get("ckpt") else "none",
                                     flash_attention=v["attn"] != "eager",
                                     loss_chunk=v.get("chunk"), limit=limit)
        rows.append({"variant": name, "max seq_len (measured)": found["seq_len"],
                     "predicted": predicted, "at the search limit": found["seq_len"] >= limit,
                     "probes": len(found["probes"])})
    return rows
