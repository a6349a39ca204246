"""Losses on the output projection computed in chunks of tokens, so the full logits never exist.

A causal LM's last step is ``logits = hidden @ W.T`` (tokens x vocab) followed by a loss. For a
128k vocabulary and 8k tokens that tensor alone is 4 GiB in fp32, and autograd keeps it (or its
softmax) until backward. Here the tokens are split into chunks; for each chunk the logits are
made, the loss and its gradients with respect to ``hidden`` and ``W`` are computed at once, and the
chunk's logits are freed. Backward then only scales the stored gradients. This is the scheme of
Liger-Kernel's fused linear cross-entropy, written with plain PyTorch ops: peak memory is one
chunk's logits, and no matmul is recomputed (3 matmuls per chunk, as unchunked).

``chunked_linear_loss`` takes any per-chunk loss (cross-entropy, knowledge distillation);
``chunked_cross_entropy`` is the common case.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from recipes_lib.architectures import (
    final_hidden_states,
    final_logit_softcap,
    lm_head_weight,
    softcap,
)

IGNORE_INDEX = -100
ChunkLoss = Callable[..., torch.Tensor]


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 / fp16 logits lose too much in softmax); fp64 stays fp64.

    Args:
        x: any floating tensor.

    Returns:
        ``x`` in fp32, or itself if it is fp32 or fp64 already.
    """
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int,
           extras: tuple[torch.Tensor, ...]) -> None:
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r}: must be an integer > 0")
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected (tokens, hidden_size), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected (vocab, {hidden.shape[1]}), got {tuple(weight.shape)}")
    for i, t in enumerate(extras):
        if t.shape[0] != hidden.shape[0]:
            raise ValueError(f"targets[{i}]: first dimension {t.shape[0]} != tokens "
                             f"{hidden.shape[0]}")


class ChunkGrad:
    """A chunk's loss *and* the gradient of its logits, written out instead of taken by
    autograd: ``fn(logits_chunk, *target_chunks) -> loss_sum``, which overwrites
    ``logits_chunk`` with d(loss_sum)/d(logits) in place. Written out, the softmax, its gradient
    and the loss are elementwise over one logits tile, which ``torch.compile`` fuses into a pass
    or two (what Cut Cross-Entropy's kernels do by hand); in place, one logits buffer serves
    every chunk (as Liger-Kernel's fused linear cross-entropy writes the gradient over the
    logits), so no chunk allocates, and first touches, a fresh tokens x vocab tile.

    Args:
        fn: the chunk's loss and gradient, as above.
    """

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


def target_logits(z: torch.Tensor, y: torch.Tensor, ignore_index: int, cap: float | None
                  ) -> torch.Tensor:
    """Each row's logit at its label (row 0's column where the label is ``ignore_index``),
    upcast to at least fp32 and soft-capped as :func:`_ce_chunk_` caps its logits.

    Args:
        z: a chunk's logits, (tokens, vocab).
        y: its labels, (tokens,).
        ignore_index: the label of positions without a loss.
        cap: the final-logit soft-capping value (None: none).

    Returns:
        (tokens,) logits.
    """
    safe = torch.where(y != ignore_index, y, 0)
    return softcap(upcast(z.gather(1, safe[:, None])[:, 0]), cap)


def _ce_chunk_(z: torch.Tensor, y: torch.Tensor, picked: torch.Tensor, ignore_index: int,
               cap: float | None) -> torch.Tensor:
    """Cross-entropy summed over a chunk of logits ``z``, whose values it replaces with
    d(loss)/d(logits): ``softmax(z) - onehot(y)`` on labelled rows (times ``1 - tanh^2`` under a
    soft cap), computed in at least fp32 and stored in ``z``'s dtype. ``picked`` is
    :func:`target_logits` of ``z``, read before ``z`` is overwritten (see
    :func:`compiled_ce_chunk`)."""
    zf = upcast(z)
    if cap is not None:
        t = torch.tanh(zf / cap)
        zf = t * cap
    lse = torch.logsumexp(zf, dim=-1)
    valid = y != ignore_index
    safe = torch.where(valid, y, 0)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    g = torch.exp(zf - lse[:, None])
    g = g - torch.nn.functional.one_hot(safe, zf.shape[1]).to(g.dtype)
    g = g * valid[:, None].to(g.dtype)
    if cap is not None:
        g = g * (1 - t * t)
    z.copy_(g)
    return loss


def ce_chunk(ignore_index: int = IGNORE_INDEX, logit_softcap: float | None = None,
             body: Callable[..., torch.Tensor] = _ce_chunk_) -> ChunkGrad:
    """:func:`_ce_chunk_` as a :class:`ChunkGrad`, ``fn(logits_chunk, labels_chunk)``, eager
    unless ``body`` is its compiled form: the labels' logits are gathered here, before
    ``body`` overwrites the chunk.

    Args:
        ignore_index: the label of positions without a loss.
        logit_softcap: the final-logit soft-capping value (None: none).
        body: the chunk's loss-and-gradient function.

    Returns:
        The :class:`ChunkGrad`.
    """
    return ChunkGrad(lambda z, y: body(z, y, target_logits(z, y, ignore_index, logit_softcap),
                                       ignore_index, logit_softcap))


_COMPILED_CE: dict[tuple[int, float | None], ChunkGrad] = {}


def compiled_ce_chunk(ignore_index: int = IGNORE_INDEX, logit_softcap: float | None = None
                      ) -> ChunkGrad:
    """The cross-entropy chunk (:func:`ce_chunk`) with :func:`_ce_chunk_` compiled once per
    setting (Inductor: C++ on a CPU, Triton on a GPU), for
    ``chunked_cross_entropy(..., compiled=True)``.

    The labels' logits are gathered eagerly, outside the compiled function: compiled with it,
    torch 2.11's Inductor fused that gather into one C++ kernel after the loop that writes the
    gradient over the logits, so it read gradients instead of logits and returned wrong losses
    (7.149 for 5.996 in ``tests/test_chunked_loss.py``; torch 2.12.1 and 2.13 order it right).
    Read outside, it costs one small eager gather per chunk and no time measured (19.8 ms either
    way for a 512 x 32,000 fp32 chunk, one thread, torch 2.13).

    Args:
        ignore_index: the label of positions without a loss.
        logit_softcap: the final-logit soft-capping value (None: none).

    Returns:
        The compiled :class:`ChunkGrad`.

    Raises:
        ValueError: where ``torch.compile`` cannot run (no C++ compiler, no Triton).
    """
    key = (ignore_index, logit_softcap)
    if key not in _COMPILED_CE:
        _COMPILED_CE[key] = ce_chunk(ignore_index, logit_softcap, torch.compile(_ce_chunk_))
    return _COMPILED_CE[key]


def _full_ce(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(upcast(h @ w.T), y, ignore_index=IGNORE_INDEX)


@functools.cache
def compiled_full_cross_entropy() -> Callable[..., torch.Tensor]:
    """``F.cross_entropy(upcast(hidden @ weight.T), labels)`` under
    ``torch.compile(fullgraph=True, dynamic=True)``: the computation Cut Cross-Entropy's CPU
    path (``linear_cross_entropy(..., impl="torch_compile")``) compiles (apple/ml-cross-entropy,
    ``cut_cross_entropy/torch_compile.py``), here without that package or the Triton it
    imports. The logits exist whole: a fused speed baseline, not a memory recipe.

    Raises:
        ValueError: where ``torch.compile`` cannot run (no C++ compiler, no Triton).
    """
    return torch.compile(_full_ce, fullgraph=True, dynamic=True)


class _ChunkedLinearLoss(torch.autograd.Function):
    """Loss and gradients chunk by chunk in forward; backward scales the stored gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, loss_fn, chunk_size, *extras):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype, ctx.n_extras = weight.dtype, len(extras)
        grad_h = torch.zeros_like(hidden) if need_h else None
        # accumulate the weight gradient in (at least) fp32, in place: it sums over every chunk
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        w = weight.detach()
        total = torch.zeros((), dtype=acc, device=hidden.device)
        if isinstance(loss_fn, ChunkGrad):  # one logits buffer, reused by every chunk
            buffer = hidden.new_empty(min(chunk_size, hidden.shape[0]), weight.shape[0])
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end].detach()
            if isinstance(loss_fn, ChunkGrad):  # the loss, its logits' gradient in their place
                g_logits = torch.mm(h, w.T, out=buffer[:end - start])
                loss = loss_fn(g_logits, *(t[start:end] for t in extras))
            else:
                with torch.enable_grad():
                    logits = (h @ w.T).requires_grad_()
                    loss = loss_fn(logits, *(t[start:end] for t in extras))
                (g_logits,) = torch.autograd.grad(loss, logits)  # one chunk of tokens x vocab
            # the two matmuls of the Linear's backward, written out so nothing weight-sized is
            # allocated per chunk
            if need_h:
                grad_h[start:end] = g_logits @ w
            if need_w:
                grad_w.addmm_(g_logits.T.to(acc), h.to(acc))
            total += upcast(loss.detach())
        # kept as attributes (not saved tensors) so backward can drop ctx's references and
        # autograd can take the gradient buffers over instead of copying them
        ctx.grads = (grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grads
        del ctx.grads  # backward runs once (retain_graph is not supported)
        # the loss as the graph's output needs no copy; a fake tensor (fake_memory) has no value
        # to test, and a training step divides the loss sum by its token count, so it scales
        one = not is_fake(grad_out) and bool(grad_out == 1)
        gh = grad_h if grad_h is None or one else grad_h * grad_out
        gw = None if grad_w is None else (grad_w if one else grad_w * grad_out).to(ctx.weight_dtype)
        return (gh, gw, None, None) + (None,) * ctx.n_extras


def default_chunk_size(tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Liger-Kernel's rule: chunks whose logits are about as large as the hidden states,
    ``next_pow2(ceil(tokens / ceil(vocab / hidden)))``.

    Args:
        tokens: tokens in the batch.
        vocab_size: the vocabulary.
        hidden_size: the hidden states' width.

    Returns:
        Tokens per chunk, a power of 2.

    Example:
        >>> default_chunk_size(2048, 32000, 256)  # 125x more vocab than hidden: 32-token chunks
        32
    """
    ratio = -(-vocab_size // hidden_size)
    n = max(1, -(-tokens // ratio))
    return 1 << (n - 1).bit_length()


def chunked_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    loss_fn: ChunkLoss,
    chunk_size: int,
    *targets: torch.Tensor,
) -> torch.Tensor:
    """``sum over chunks of loss_fn(hidden[c] @ weight.T, *(t[c] for t in targets))``, chunked.

    Args:
        hidden: (tokens, hidden_size) final hidden states.
        weight: (vocab, hidden_size) output projection (the LM head's weight).
        loss_fn: ``loss_fn(logits_chunk, *target_chunks) -> scalar``, or a :class:`ChunkGrad`
            (which also leaves the logits' gradient in place of the logits); it must be a *sum*
            over the chunk's tokens (divide inside it by a global count if a mean is wanted),
            so chunks add.
        chunk_size: tokens per chunk; peak memory is about ``chunk_size * vocab`` logits.
        *targets: per-token tensors (first dimension = tokens) sliced alongside ``hidden``.

    Returns:
        The scalar loss, differentiable with respect to ``hidden`` and ``weight``.

    Raises:
        ValueError: if chunk_size <= 0 or the shapes do not match.

    Example:
        >>> h, w = torch.randn(6, 4), torch.randn(10, 4)
        >>> y = torch.tensor([1, 2, 3, 4, 5, 6])
        >>> ce = lambda logits, y: F.cross_entropy(logits, y, reduction="sum")
        >>> bool(torch.allclose(chunked_linear_loss(h, w, ce, 4, y), ce(h @ w.T, y)))
        True
    """
    _check(hidden, weight, chunk_size, targets)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32),
                            device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            chunk = [t[start:end] for t in targets]
            total += upcast(loss_fn(hidden[start:end] @ weight.T, *chunk))
        return total
    return _ChunkedLinearLoss.apply(hidden, weight, loss_fn, chunk_size, *targets)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    logit_softcap: float | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without the full logits.

    Equal to ``F.cross_entropy(hidden @ weight.T, labels, ignore_index=...)`` (forward and
    gradients) up to float rounding; the logits are upcast to at least fp32 per chunk.

    Args:
        hidden: (..., hidden_size) hidden states; leading dimensions are flattened.
        weight: (vocab, hidden_size) output projection.
        labels: hidden.shape[:-1] target ids; ``ignore_index`` marks tokens without a loss.
        chunk_size: tokens per chunk (> 0).
        ignore_index: label value that carries no loss.
        reduction: "mean" (over non-ignored tokens) or "sum".
        logit_softcap: Gemma-2's final soft-capping, applied to each chunk's logits as the
            model applies it to all of them (None: plain logits).
        compiled: compute each chunk's loss and logits gradient with one ``torch.compile``d
            function (:func:`compiled_ce_chunk`) instead of autograd over eager ops (training
            only; a no-grad call takes the plain path).

    Returns:
        A scalar loss (fp32, or fp64 for fp64 inputs).

    Raises:
        ValueError: for chunk_size <= 0, mismatched shapes or an unknown reduction.

    Example:
        >>> h, w, y = torch.randn(2, 5, 8), torch.randn(32, 8), torch.randint(0, 32, (2, 5))
        >>> ref = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten())
        >>> bool(torch.allclose(chunked_cross_entropy(h, w, y, chunk_size=3), ref, atol=1e-6))
        True
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean' or 'sum'")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels: shape {tuple(labels.shape)} != hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)

    def ce_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(softcap(upcast(logits), logit_softcap), target,
                               ignore_index=ignore_index, reduction="sum")

    if compiled:
        from recipes_lib.compiling import require_compile

        require_compile(hidden.device)
    fn = compiled_ce_chunk(ignore_index, logit_softcap) if compiled else ce_sum
    total = chunked_linear_loss(h, weight, fn, chunk_size, y)
    if reduction == "sum":
        return total
    # F.cross_entropy's mean is over non-ignored targets (nan when there are none, as here)
    return total / (y != ignore_index).sum()


class ChunkedCausalLMLoss:
    """``loss_fn`` for ``train.train``: next-token cross-entropy from the final hidden states,
    chunked so the tokens x vocab logits never exist. Returns the sum over target tokens.

    Args:
        chunk_size: tokens whose logits exist at a time.

    Raises:
        ValueError: for a ``chunk_size`` that is not an integer > 0.

    Example:
        >>> train.train(model, examples, pad_id, config,
        ...             loss_fn=ChunkedCausalLMLoss(1024))  # doctest: +SKIP
    """

    # it calls the decoder and reads the head itself, not the model's forward: a loop runs it
    # as that forward where a wrapper needs its own to run (architectures.through_wrappers)
    bypasses_forward = True

    def __init__(self, chunk_size: int = 1024):
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an integer > 0")
        self.chunk_size = chunk_size

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = lm_head_weight(model)  # tied or not: the same matrix the model multiplies by
        hidden = final_hidden_states(model, batch)  # packed rows stay packed
        # the labels shift, not the hidden states (as Liger-Kernel's LigerForCausalLMLoss and
        # transformers' loss): slicing several rows' last position off would copy them all
        labels = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        return chunked_cross_entropy(hidden, weight, labels, self.chunk_size, reduction="sum",
                                     logit_softcap=final_logit_softcap(model))


def liger_available(device: torch.device | str) -> bool:
    """Whether Liger-Kernel's fused linear cross-entropy can run: installed, and a CUDA device.

    Args:
        device: where the loss would run.

    Returns:
        True where ``include_liger`` can be asked for.
    """
    from recipes_lib.device import has_module

    return torch.device(device).type == "cuda" and has_module("liger_kernel")


def compare_with_full(tokens: int, vocab_size: int, hidden_size: int, chunk_size: int,
                      seed: int = 0, repeats: int = 3, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32, include_liger: bool = False
                      ) -> dict[str, float]:
    """Chunked vs full cross-entropy on random data: peak bytes and time of a loss step
    (forward + backward, timed in alternation, with the spread of each side's timed runs) and
    the largest gradient difference.

    A tenth of the labels are ``-100``, so ignored positions are part of the comparison. With
    ``include_liger`` (CUDA, Liger-Kernel installed) Liger's ``LigerFusedLinearCrossEntropyLoss``
    is measured the same way, under keys ending in ``_liger``.

    Args:
        tokens: rows of the hidden states.
        vocab_size: rows of the LM head's weight.
        hidden_size: the hidden states' width.
        chunk_size: tokens per chunk.
        seed: for the random hidden states, weight and labels.
        repeats: timed loss steps of each, in alternation.
        device: where they run.
        dtype: the hidden states' and weight's dtype.
        include_liger: measure Liger's fused kernel too.

    Returns:
        ``peak_full``, ``time_full``, ``spread_full``, the same three for ``chunked`` (and
        ``liger``), and ``max_grad_error`` (``max_grad_error_liger``): peak bytes, median
        seconds, spreads, and the largest gradient difference from the full loss.

    Raises:
        ValueError: ``include_liger`` where Liger cannot run (see ``liger_available``).
    """
    from recipes_lib.memory import measure_memory
    from recipes_lib.timing import time_interleaved

    if include_liger and not liger_available(device):
        raise ValueError(f"include_liger=True: Liger-Kernel is not installed or device={device!s} "
                         "is not CUDA")
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden_size, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab_size, hidden_size, generator=g) / hidden_size**0.5
         ).to(device, dtype).requires_grad_()
    y = torch.randint(0, vocab_size, (tokens,), generator=g).to(device)
    y[: tokens // 10] = IGNORE_INDEX
    losses = {"full": lambda: F.cross_entropy(upcast(h @ w.T), y),
              "chunked": lambda: chunked_cross_entropy(h, w, y, chunk_size)}
    if include_liger:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        losses["liger"] = lambda: fused(w, h, y)
    # backward(), not autograd.grad: Liger's hooks refuse the latter
    steps = {name: (lambda f=f: f().backward()) for name, f in losses.items()}
    device = torch.device(device)
    peaks, grads = {}, {}
    for name, step in steps.items():  # each memory run also leaves its gradients to compare
        h.grad = w.grad = None
        peaks[name] = measure_memory(step, device=device).peak_bytes
        grads[name] = (h.grad, w.grad)
    h.grad = w.grad = None  # the timed runs accumulate into new tensors, not the ones kept
    # the memory runs above were the warm-up
    times = time_interleaved(steps, warmup=0, repeats=repeats, device=device)
    out = {"peak_full": peaks["full"], "time_full": times["full"].median_s,
           "spread_full": times["full"].spread}
    for name in losses.keys() - {"full"}:
        out[f"peak_{name}"] = peaks[name]
        out[f"time_{name}"] = times[name].median_s
        out[f"spread_{name}"] = times[name].spread
        err = max(float((a.float() - b.float()).abs().max())
                  for a, b in zip(grads["full"], grads[name]))
        out["max_grad_error" if name == "chunked" else f"max_grad_error_{name}"] = err
    return out


def cce_available() -> bool:
    """Whether Apple's Cut Cross-Entropy can run here: ``cut-cross-entropy`` and Triton
    installed (its ``torch_compile`` implementation runs on a CPU, but the package imports
    Triton).

    Returns:
        True where ``include_cce`` can be asked for.
    """
    from recipes_lib.device import has_module

    return has_module("cut_cross_entropy") and has_module("triton")


def record_compiled_ratios(ce_sweep: Any, results: Any, chunk_size: int,
                           compiled_chunk_size: int, strict: bool | None = None) -> None:
    """Compiled against compiled, from a :func:`tokens_sweep` run with ``include_compiled`` and
    ``compiled_chunk_size``: the full loss compiled as Cut Cross-Entropy's CPU path compiles it,
    over our chunks compiled at ``chunk_size`` and at ``compiled_chunk_size`` tokens, each
    recorded at the largest size (``Sweep.record_ratio``); the second is the speed claim
    (``strict`` as ``checks.check_speed``'s).

    Args:
        ce_sweep: the sweep.
        results: the notebook's ``results.Results``.
        chunk_size: the chunk size the sweep's plain chunks ran at.
        compiled_chunk_size: the sweep's ``compiled_chunk_size``.
        strict: True asserts the claim, None reports it.
    """
    unit = "x the full loss compiled as Cut Cross-Entropy's CPU path compiles it"
    ce_sweep.record_ratio(results, "full (compiled)", "chunked (compiled)", "compiled_speedup",
                          f"{unit}, {chunk_size}-token chunks")
    ce_sweep.record_ratio(results, "full (compiled)",
                          f"chunked (compiled, {compiled_chunk_size} tokens)",
                          f"compiled_speedup_chunk_{compiled_chunk_size}",
                          f"{unit}, {compiled_chunk_size}-token chunks",
                          claim=f"compiled chunks ({compiled_chunk_size} tokens) vs the full loss "
                                "compiled as CCE's CPU path, largest tokens", strict=strict)


def tokens_sweep(tokens: list[int], vocab_size: int, hidden_size: int, chunk_size: int = 1024,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 repeats: int = 5, include_liger: bool = False, include_compiled: bool = False,
                 include_cce: bool = False, compiled_chunk_size: int | None = None):
    """Where chunked cross-entropy stops costing time against the full logits: a loss step
    (forward + backward) over the number of tokens, timed in alternation
    (``sweep.run_sweep``). Timed beside it where asked: Liger's fused kernel
    (``include_liger``, CUDA), ours with each chunk compiled and the full loss compiled as Cut
    Cross-Entropy's CPU path compiles it (``include_compiled``: ``compiled_ce_chunk``,
    :func:`compiled_full_cross_entropy`; ``Sweep.ratio`` compares the two) and Apple's
    Cut Cross-Entropy itself (``include_cce``; its ``torch_compile`` implementation on a CPU,
    its Triton kernels on CUDA). Compilation happens in the warm-up call, outside the timing.

    Args:
        compiled_chunk_size: with ``include_compiled``, also time the compiled chunks at this
            many tokens per chunk (variant ``"chunked (compiled, <n> tokens)"``): the size
            that suits the device's matmuls may not be the one chosen for memory.

    Returns:
        A ``sweep.Sweep`` (recipe "chunked_ce", dimension "tokens").

    Raises:
        ValueError: for a comparison asked where it cannot run, naming it, or a
            ``compiled_chunk_size`` without ``include_compiled``.
    """
    if compiled_chunk_size is not None and not include_compiled:
        raise ValueError(f"compiled_chunk_size={compiled_chunk_size}: times compiled chunks, "
                         "so it needs include_compiled=True")
    return _ce_sweep("tokens", tokens, lambda n: (n, vocab_size), hidden_size, chunk_size,
                     device, dtype, repeats, include_liger, include_compiled, include_cce,
                     compiled_chunk_size)


def vocab_sweep(vocab_sizes: list[int], tokens: int, hidden_size: int, chunk_size: int = 1024,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                repeats: int = 5, include_liger: bool = False, include_compiled: bool = False,
                include_cce: bool = False):
    """:func:`tokens_sweep`'s comparison over the vocabulary at one token count: the logits,
    ``tokens x vocab``, grow with both, and with the vocabulary each chunk's matmul also grows
    (more work per chunk against the same per-chunk overhead).

    Args:
        vocab_sizes: the vocabularies, at least three, growing.
        tokens: tokens per loss step.
        hidden_size: the hidden states' width.
        chunk_size: tokens per chunk.
        device: where it runs.
        dtype: the hidden states' and weight's dtype.
        repeats: timed loss steps of each, in alternation.
        include_liger: time Liger's fused kernel too (CUDA).
        include_compiled: time the compiled chunked and full losses too.
        include_cce: time Cut Cross-Entropy too, where it installs.

    Returns:
        A ``sweep.Sweep`` (recipe "chunked_ce", dimension "vocab").

    Raises:
        ValueError: for sizes a sweep cannot use, or a comparison asked where it cannot run.
    """
    return _ce_sweep("vocab", vocab_sizes, lambda v: (tokens, v), hidden_size, chunk_size,
                     device, dtype, repeats, include_liger, include_compiled, include_cce)


def _ce_sweep(dimension: str, sizes: list[int], shape_at: Callable[[int], tuple[int, int]],
              hidden_size: int, chunk_size: int, device: torch.device | str, dtype: torch.dtype,
              repeats: int, include_liger: bool, include_compiled: bool, include_cce: bool,
              compiled_chunk_size: int | None = None):
    """The loss step (forward + backward) of each comparison at each size, whose (tokens,
    vocabulary) ``shape_at`` gives."""
    from recipes_lib.sweep import run_sweep

    if include_liger and not liger_available(device):
        raise ValueError(f"include_liger=True: Liger-Kernel is not installed or device={device!s} "
                         "is not CUDA")
    if include_cce and not cce_available():
        raise ValueError("include_cce=True: cut-cross-entropy (and Triton, which it imports) "
                         "is not installed: pip install cut-cross-entropy")
    if include_compiled:
        from recipes_lib.compiling import require_compile

        require_compile(device)
    device = torch.device(device)
    elem = torch.empty((), dtype=dtype).element_size()

    def make(x: int):
        n, vocab_size = shape_at(x)
        g = torch.Generator().manual_seed(x)
        h = torch.randn(n, hidden_size, generator=g).to(device, dtype).requires_grad_()
        w = (torch.randn(vocab_size, hidden_size, generator=g) / hidden_size**0.5
             ).to(device, dtype).requires_grad_()
        y = torch.randint(0, vocab_size, (n,), generator=g).to(device)
        c = min(chunk_size, n)
        losses = {"baseline": lambda: F.cross_entropy(upcast(h @ w.T), y),
                  "recipe": lambda: chunked_cross_entropy(h, w, y, c)}
        if include_compiled:
            losses["chunked (compiled)"] = lambda: chunked_cross_entropy(h, w, y, c,
                                                                         compiled=True)
            if compiled_chunk_size is not None:
                c2 = min(compiled_chunk_size, n)
                losses[f"chunked (compiled, {compiled_chunk_size} tokens)"] = (
                    lambda: chunked_cross_entropy(h, w, y, c2, compiled=True))
            full = compiled_full_cross_entropy()
            losses["full (compiled)"] = lambda: full(h, w, y)
        if include_cce:
            from cut_cross_entropy import linear_cross_entropy

            impl = "cce" if device.type == "cuda" else "torch_compile"
            losses["cut cross-entropy"] = lambda: linear_cross_entropy(h, w, y, impl=impl)
        if include_liger:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
            losses["liger"] = lambda: fused(w, h, y)

        def step(f):
            f().backward()
            h.grad = w.grad = None
        return {name: (lambda f=f: step(f)) for name, f in losses.items()}

    def work(x: int) -> tuple[float, float]:
        n, vocab_size = shape_at(x)
        # three tokens x hidden x vocab matmuls; the logits written, read by softmax, the
        # fp32 copy and its gradient
        return 6.0 * n * hidden_size * vocab_size, n * vocab_size * (2 * elem + 3 * 4)
    return run_sweep("chunked_ce", dimension, sizes, make, work, device, repeats=repeats,
                     progress=False, dtype=dtype)
