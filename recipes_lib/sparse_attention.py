"""Attention that skips most of the s x s matrix: sliding-window and local + global patterns.

Full causal attention costs ``O(s^2)`` time (and memory, unless a flash kernel is used). Many
long-context models restrict each query to a local window of the ``W`` previous tokens (Mistral,
Longformer's local part, Gemma 2's local layers): ``O(s W)``. A few *global* tokens that every
query may see (Longformer's global tokens, StreamingLLM's "attention sinks") keep a path to the
beginning of the sequence.

Both patterns are computed here block by block with PyTorch's SDPA: queries are split into blocks
of ``W``; each block attends only to the keys its pattern can reach (the global prefix plus the
previous and its own block), with a boolean mask inside, in one batched call. Forward and
backward are ordinary autograd through SDPA, so they run on CPU and GPU alike. FlexAttention
expresses the same patterns as a ``mask_mod`` and skips empty blocks in a fused kernel; on CPU its
backward is not available, so it is an option on GPUs only (``flex_available``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recipes_lib.architectures import padding_mask_only

PATTERNS = ("causal", "sliding_window", "local_global")


def _check(seq_len: int, window: int | None, n_global: int) -> None:
    if window is not None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r}: must be an integer >= 1")
        if window > seq_len:
            raise ValueError(f"window={window}: larger than the sequence ({seq_len} tokens); "
                             "use full causal attention instead")
    if not isinstance(n_global, int) or n_global < 0:
        raise ValueError(f"n_global={n_global!r}: must be an integer >= 0")
    if n_global > seq_len:
        raise ValueError(f"n_global={n_global}: more global tokens than the sequence has "
                         f"({seq_len})")


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, n_global: int
             ) -> torch.Tensor:
    """Boolean (len(q_pos), len(k_pos)) mask: causal, within the window or a global key."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if window is not None:
        ok = ok & ((diff < window) | (k_pos[None, :] < n_global))
    return ok


def attention_mask(seq_len: int, window: int | None = None, n_global: int = 0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The dense (s, s) boolean mask of a pattern (True = may attend); the reference.

    Args:
        seq_len: s.
        window: each query sees itself and the ``window - 1`` tokens before it (None = all).
        n_global: the first ``n_global`` tokens are visible to every later query.
        device: where the mask is made.

    Returns:
        The ``(seq_len, seq_len)`` boolean mask.

    Raises:
        ValueError: for window < 1, window > seq_len, or n_global outside [0, seq_len].

    Example:
        >>> attention_mask(4, window=2).int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    _check(seq_len, window, n_global)
    pos = torch.arange(seq_len, device=device)
    return _allowed(pos, pos, window, n_global)


def dense_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           softcap: float | None = None, scale: float | None = None
                           ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) masked) v, materialised: the reference for every pattern.

    ``scale`` replaces 1/sqrt(d); ``softcap`` caps the scores as Gemma-2 does,
    ``softcap * tanh(scores / softcap)``, before the mask.

    Args:
        q: queries, (batch, heads, seq, head_dim).
        k: keys, the same shape (or fewer heads: GQA).
        v: values, as ``k``.
        mask: (seq, seq) boolean, True where a query may attend.
        softcap: Gemma-2's soft-capping value (None: none).
        scale: the scores' scale (None: 1/sqrt(head_dim)).

    Returns:
        The attention output, shaped as ``q``.
    """
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        window: int | None = None, n_global: int = 0,
                        softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention restricted to a sliding window (+ a global prefix), in blocks of W.

    The sequence is cut into blocks of ``W`` queries; block ``i`` attends to key blocks ``i - 1``
    and ``i`` (which hold every key within ``W`` of its queries) plus the ``n_global`` first
    keys, with a boolean mask inside: one batched SDPA call over all blocks, ``O(s (2W + G))``
    time and memory instead of ``O(s^2)``. Equal to ``dense_masked_attention`` with
    ``attention_mask(s, window, n_global)``.

    Args:
        q, k, v: (batch, heads, seq, head_dim); k and v may have fewer heads (GQA).
        window: local window W (None: full causal attention through SDPA).
        n_global: leading tokens visible to every query.
        softcap: Gemma-2's attention soft-capping, ``softcap * tanh(scores / softcap)``. SDPA
            cannot cap scores, so with it each block's scores are written out (the same
            ``O(s (2W + G))`` memory; ``O(s^2)`` without a window, as transformers' eager path).
        scale: the scores' scale (None: 1/sqrt(head_dim)).

    Returns:
        The attention output, shaped as ``q``.

    Raises:
        ValueError: for a bad window or n_global.
    """
    s = q.shape[-2]
    _check(s, window, n_global)
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap={softcap!r}: must be a number > 0 (or None)")
    gqa = k.shape[1] != q.shape[1]
    if window is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                              scale=scale)
    if gqa:  # grouped-query attention: share each kv head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if window is None:  # soft-capped full causal attention: the scores written out
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return dense_masked_attention(q, k, v, causal, softcap, scale)
    w = window
    n = -(-s // w)  # blocks
    pad = n * w - s  # padded queries are dropped; padded keys lie after every real query

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (b, h, n, w, d)
        x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(*x.shape[:2], n, w, x.shape[-1])

    kb, vb = blocks(k), blocks(v)
    def prev(x: torch.Tensor) -> torch.Tensor:  # block i - 1 at position i (zeros for block 0)
        return F.pad(x, (0, 0, 0, 0, 1, 0))[:, :, :-1]

    keys = [torch.cat([prev(kb), kb], dim=3)]
    values = [torch.cat([prev(vb), vb], dim=3)]
    q_pos = torch.arange(n * w, device=q.device).reshape(n, w, 1)
    k_pos = (torch.arange(n, device=q.device).reshape(n, 1, 1) * w - w
             + torch.arange(2 * w, device=q.device).reshape(1, 1, 2 * w))
    diff = q_pos - k_pos
    masks = [(diff >= 0) & (diff < w) & (k_pos >= 0)]
    if n_global:
        g_shape = (k.shape[0], k.shape[1], n, n_global, k.shape[-1])
        keys.insert(0, k[:, :, None, :n_global].expand(g_shape))
        values.insert(0, v[:, :, None, :n_global].expand(g_shape))
        g_pos = torch.arange(n_global, device=q.device).reshape(1, 1, n_global)
        masks.insert(0, q_pos - g_pos >= w)  # global keys outside the window (no duplicates)
    b, h, d = q.shape[0], q.shape[1], q.shape[-1]

    def as_batch(x: torch.Tensor) -> torch.Tensor:  # (b, h, n, len, d) -> (b * n, h, len, d)
        return x.transpose(1, 2).reshape(b * n, h, x.shape[3], d)
    # 4-D inputs (blocks folded into the batch) let SDPA pick its flash kernel, CPU included
    mask = torch.cat(masks, -1)
    mask = mask.expand(b, *mask.shape).reshape(b * n, 1, w, mask.shape[-1])
    qs, ks, vs = as_batch(blocks(q)), as_batch(torch.cat(keys, 3)), as_batch(torch.cat(values, 3))
    out = (F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
           if softcap is None else dense_masked_attention(qs, ks, vs, mask, softcap, scale))
    return out.reshape(b, n, h, w, d).transpose(1, 2).reshape(b, h, n * w, d)[:, :, :s]


def flex_available(device: torch.device | str) -> bool:
    """Whether FlexAttention trains (forward and backward) here: CUDA only; on CPU it is
    forward-only.

    Args:
        device: where attention would run.

    Returns:
        True on a CUDA device with FlexAttention installed.
    """
    from recipes_lib.device import has_module

    return torch.device(device).type == "cuda" and has_module("torch.nn.attention.flex_attention")


def flex_attention_fn(window: int | None, n_global: int = 0):
    """A compiled FlexAttention callable for the pattern (GPU training path).

    Args:
        window: the local window (None: full causal attention).
        n_global: leading tokens every query sees.

    Returns:
        ``fn(q, k, v) -> output``.

    Raises:
        ValueError: on a device where FlexAttention cannot train (see ``flex_available``).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx
        if window is not None:
            ok = ok & ((q_idx - kv_idx < window) | (kv_idx < n_global))
        return ok

    def fn(q, k, v):
        if not flex_available(q.device):
            raise ValueError(f"device={q.device.type!r}: FlexAttention has no backward here; "
                             "use blockwise_attention")
        mask = create_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2],
                                 device=q.device)
        return compiled(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return fn


def register_with_transformers(window: int | None, n_global: int = 0) -> str:
    """Register the pattern as a transformers attention implementation; return its name.

    Load or switch a model with ``attn_implementation=<name>``. The function applies no padding
    mask, which is exact on the real tokens of right-padded batches (pad keys come after every
    real query); it refuses left padding, and packed documents (``position_ids`` restarting),
    where each document must attend only to itself. transformers hands a registered function no
    mask unless a mask function is registered under the same name: the one registered here
    passes the 2-D padding mask through (nothing of size s x s is built), so the check can see it.

    Args:
        window: the local window (None: full causal attention).
        n_global: leading tokens every query sees.

    Returns:
        The implementation's name, for ``attn_implementation``.

    Raises:
        ValueError: (from the registered function) for a left-padded batch or packed documents.

    Example:
        >>> name = register_with_transformers(window=256)  # doctest: +SKIP
        >>> model.set_attn_implementation(name)  # doctest: +SKIP
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"blockwise_w{window}_g{n_global}"

    def attention_forward(module, query, key, value, attention_mask=None, scaling=None,
                          dropout=0.0, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2 and \
                bool((attention_mask[:, 0] == 0).any()):
            raise ValueError("attention_mask: left padding is not supported by blockwise "
                             "attention; pad on the right")
        positions = kwargs.get("position_ids")
        if positions is not None and positions.shape[-1] > 1 and \
                bool((positions.diff(dim=-1) != 1).any()):
            raise ValueError("position_ids: packed documents (positions restarting at each one) "
                             "are not supported by blockwise attention, which would let each "
                             "document attend to the ones before it; use sdpa or "
                             "flash_attention_2 for padding-free batches")
        # a layer with its own sliding window (Mistral, Qwen2, Gemma-2's local layers) sees the
        # narrower of the two windows; the global tokens stay global
        own = kwargs.get("sliding_window")
        s = query.shape[-2]
        w = window if own is None else own if window is None else min(window, own)
        w = None if w is None or w >= s else w
        # Gemma-2's soft-capping and its own scale pass through
        out = blockwise_attention(query, key, value, w, min(n_global, s),
                                  softcap=kwargs.get("softcap"), scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask_only)
    return name


def time_exponent(seq_lens: list[int], seconds: list[float]) -> float:
    """Slope of log(time) against log(seq_len) (least squares): 1 linear, 2 quadratic.

    Args:
        seq_lens: the lengths.
        seconds: the time at each length.

    Returns:
        The exponent.

    Raises:
        ValueError: for fewer than two (length, time) pairs.

    Example:
        >>> round(time_exponent([1024, 2048, 4096], [1.0, 4.0, 16.0]), 6)
        2.0
    """
    if len(seq_lens) != len(seconds) or len(seq_lens) < 2:
        raise ValueError("seq_lens, seconds: need two or more (length, time) pairs")
    x = torch.log(torch.tensor(seq_lens, dtype=torch.float64))
    y = torch.log(torch.tensor(seconds, dtype=torch.float64))
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def benchmark(seq_lens: list[int], window: int, n_global: int = 0, num_heads: int = 4,
              head_dim: int = 64, repeats: int = 3, device: torch.device | str = "cpu",
              progress: bool = True) -> list[dict[str, float | int | str]]:
    """Forward+backward time of full causal SDPA, sliding-window and local+global attention.

    Args:
        seq_lens: the lengths timed, each longer than ``window``.
        window: the local window.
        n_global: leading tokens every query sees, for the local+global pattern.
        num_heads: attention heads.
        head_dim: width of each head.
        repeats: timed calls of each, in alternation.
        device: where it runs.
        progress: show a progress bar.

    Returns:
        One row per (pattern, seq_len) with ``forward_backward_s`` and its ``spread``; a length
        that runs out of device memory ends the benchmark there, with a warning.

    Raises:
        ValueError: for no length, or one not longer than ``window``.
    """
    from tqdm.auto import tqdm

    from recipes_lib.sweep import until_out_of_memory
    from recipes_lib.timing import time_interleaved

    if not seq_lens or min(seq_lens) <= window:
        raise ValueError(f"seq_lens={seq_lens!r}: expected lengths larger than window={window}")

    def measure(s: int) -> list[dict[str, float | int | str]]:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(1, num_heads, s, head_dim, generator=g).to(device).requires_grad_()
                   for _ in range(3))
        patterns = {"full causal (SDPA flash)": (None, 0),
                    f"sliding window W={window}": (window, 0),
                    f"local W={window} + {n_global} global": (window, n_global)}

        def step(w, g_, q=q, k=k, v=v):
            blockwise_attention(q, k, v, w, g_).sum().backward()
            q.grad = k.grad = v.grad = None
        fns = {name: (lambda w=w, g_=g_: step(w, g_)) for name, (w, g_) in patterns.items()}
        times = time_interleaved(fns, warmup=1, repeats=repeats, device=torch.device(device))
        return [{"pattern": name, "seq_len": s, "forward_backward_s": t.median_s,
                 "spread": t.spread} for name, t in times.items()]

    lengths = tqdm(seq_lens, desc="attention patterns", disable=not progress, leave=False)
    done, _ = until_out_of_memory(lengths, measure, device, "attention patterns over seq_len")
    return [row for rows in done for row in rows]
