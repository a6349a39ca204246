"""Attention implementations side by side: eager (materialised softmax), SDPA's backends,
flash-attn.

Eager attention builds the (s x s) score matrix per head, softmaxes it and keeps it for backward:
``O(s^2)`` memory and memory traffic. FlashAttention (Dao et al., 2022) tiles q, k and v, keeps a
running max and sum (online softmax) and never writes the score matrix: memory ``O(s)`` (the
output plus one log-sum-exp per row) and the same FLOPs, recomputing tiles in backward.
PyTorch's ``scaled_dot_product_attention`` (SDPA) picks among backends: ``flash`` (CUDA and
CPU), ``efficient`` (xformers-style, CUDA), ``cudnn`` (CUDA) and ``math`` (the eager formula).
``sdpa_backend_used`` reports which one actually ran.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from recipes_lib.device import has_module

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
IMPLEMENTATIONS = ("eager",) + tuple(f"sdpa-{b}" for b in SDPA_BACKENDS) + ("sdpa", "flash-attn")
# the aten op each SDPA backend dispatches to (CPU and CUDA flavours)
_BACKEND_OPS = {
    "flash": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu"),
    "efficient": ("_scaled_dot_product_efficient_attention",),
    "cudnn": ("_scaled_dot_product_cudnn_attention",),
}


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
                    ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with the score matrix materialised (the baseline).

    Args:
        q, k, v: (batch, heads, seq, head_dim); k and v may have fewer heads (GQA), repeated.
        causal: mask future positions.

    Returns:
        The output, shaped as ``q``.
    """
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _sdpa_backend_enum(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   backend: str | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, optionally restricted to one backend.

    Args:
        q: queries, (batch, heads, seq, head_dim).
        k: keys (fewer heads with GQA).
        v: values, as ``k``.
        causal: mask future positions.
        backend: one of ``SDPA_BACKENDS`` (None: PyTorch chooses).

    Returns:
        The output, shaped as ``q``.

    Raises:
        ValueError: for an unknown backend, or one this device / dtype cannot run.
    """
    enable_gqa = k.shape[1] != q.shape[1]
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {SDPA_BACKENDS} or None")
    if not backend_available(backend, q.device.type, q.dtype):
        raise ValueError(f"backend={backend!r}: not available for {q.dtype} on {q.device.type}; "
                         f"available: {available_backends(q.device, q.dtype)}")
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend_enum(backend)]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)


@cache
def backend_available(backend: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether SDPA's ``backend`` runs forward and backward here (tried on a tiny input)."""
    from torch.nn.attention import sdpa_kernel

    if backend not in SDPA_BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {SDPA_BACKENDS}")
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    q = torch.randn(1, 2, 16, 64, device=device_type, dtype=dtype, requires_grad=True)
    try:
        with sdpa_kernel([_sdpa_backend_enum(backend)]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError:  # "No available kernel": this backend cannot run these inputs
        return False
    return True


def available_backends(device: torch.device | str, dtype: torch.dtype = torch.float32
                       ) -> list[str]:
    """SDPA backends that run on ``device`` in ``dtype``.

    Args:
        device: where attention would run.
        dtype: the inputs' dtype.

    Returns:
        The backends' names, e.g. ``['flash', 'math']`` on a CPU.
    """
    device_type = torch.device(device).type
    return [b for b in SDPA_BACKENDS if backend_available(b, device_type, dtype)]


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def sdpa_backend_used(fn: Callable[[], object]) -> str:
    """Run ``fn`` and name the attention kernel that ran: an SDPA backend, or "math"/"none".

    "math" means attention was computed from plain matmuls and softmax (eager attention or SDPA's
    math fallback); "none" means no softmax ran at all.

    Args:
        fn: the call to watch, e.g. a model's forward.

    Returns:
        The kernel's name: "flash", "efficient", "cudnn", "math" or "none".

    Example:
        >>> q = torch.randn(1, 2, 8, 16)
        >>> sdpa_backend_used(lambda: sdpa_attention(q, q, q, backend="math"))
        'math'
    """
    with _OpNames() as ops:
        fn()
    names = set(ops.names)
    for backend, op_names in _BACKEND_OPS.items():
        if names.intersection(op_names):
            return backend
    return "math" if names.intersection({"_softmax", "softmax", "_safe_softmax"}) else "none"


def flash_attn_available(device: torch.device | str) -> bool:
    """Whether flash-attn (Dao-AILab) can run: installed, and ``device`` is a CUDA GPU.

    Args:
        device: where attention would run.

    Returns:
        True where ``attn_implementation="flash_attention_2"`` can be asked for.
    """
    return torch.device(device).type == "cuda" and has_module("flash_attn")


def attention_fn(impl: str, device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The attention callable for an implementation name in ``IMPLEMENTATIONS``.

    Args:
        impl: "eager", "sdpa", "sdpa-<backend>" or "flash-attn".
        device: where it will run.

    Returns:
        ``fn(q, k, v, causal=True) -> output``.

    Raises:
        ValueError: for an unknown name, or one that cannot run on ``device`` (with what can).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLEMENTATIONS}")
    if impl == "eager":
        return eager_attention
    if impl == "sdpa":
        return sdpa_attention
    if impl == "flash-attn":
        if not flash_attn_available(device):
            raise ValueError("impl='flash-attn': needs a CUDA GPU and `pip install flash-attn`; "
                             "use 'sdpa' (PyTorch's own flash backend) instead")
        from flash_attn import flash_attn_func

        def flash(q, k, v, causal=True):  # flash-attn wants (batch, seq, heads, head_dim)
            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  causal=causal)
            return out.transpose(1, 2)
        return flash
    backend = impl.removeprefix("sdpa-")
    if not backend_available(backend, torch.device(device).type, torch.float32) and \
            not backend_available(backend, torch.device(device).type, torch.float16):
        raise ValueError(f"impl={impl!r}: SDPA backend not available on "
                         f"{torch.device(device).type}; available: "
                         f"{available_backends(device)}")
    return lambda q, k, v, causal=True: sdpa_attention(q, k, v, causal, backend)


def benchmark_attention(
    seq_lens: list[int],
    impls: list[str],
    batch_size: int = 1,
    num_heads: int = 8,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    progress: bool = True,
) -> list[dict[str, float | str | int]]:
    """Time and measure each implementation over sequence lengths, forward and forward+backward.

    Memory is the attention op's own peak (outputs, what autograd saves, input gradients), measured
    with the one memory meter; q, k and v exist before and are not counted.

    Args:
        seq_lens: sequence lengths to try.
        impls: names from ``IMPLEMENTATIONS``.
        batch_size, num_heads, head_dim: the q/k/v shape (batch, heads, seq, head_dim).
        dtype, device: where it runs.
        repeats: timed repetitions (median), after one warm-up.
        progress: show a progress bar.

    Returns:
        One row per (impl, seq_len): ``forward_s``, ``forward_backward_s`` (and its
        ``forward_backward_spread``, (max - min) / median), ``peak_bytes``, ``backend`` (which
        kernel ran). A length that runs out of device memory (eager's s x s scores on a GPU)
        ends the benchmark there, with a warning; the rows are the lengths that fit.

    Raises:
        ValueError: for an empty or non-positive seq_lens, or an implementation this device lacks.
    """
    from tqdm.auto import tqdm

    from recipes_lib.memory import measure_memory
    from recipes_lib.sweep import until_out_of_memory
    from recipes_lib.timing import time_interleaved

    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens={seq_lens!r}: expected positive lengths")
    device = torch.device(device)
    fns = {impl: attention_fn(impl, device) for impl in impls}

    def measure(s: int) -> list[dict[str, float | str | int]]:
        g = torch.Generator(device="cpu").manual_seed(s)
        q, k, v = (torch.randn(batch_size, num_heads, s, head_dim, generator=g).to(device, dtype)
                   .requires_grad_() for _ in range(3))
        grad = torch.randn(batch_size, num_heads, s, head_dim, generator=g).to(device, dtype)
        fwd, fwd_bwd = {}, {}
        for impl, fn in fns.items():
            def forward(fn=fn, q=q, k=k, v=v):
                with torch.no_grad():
                    return fn(q, k, v, causal=True)

            def forward_backward(fn=fn, q=q, k=k, v=v, grad=grad):
                fn(q, k, v, causal=True).backward(grad)
                q.grad = k.grad = v.grad = None
            fwd[impl], fwd_bwd[impl] = forward, forward_backward
        # the implementations' runs alternate, so a burst of load on a shared machine does not
        # land on one of them
        t_f = time_interleaved(fwd, warmup=1, repeats=repeats, device=device)
        t_fb = time_interleaved(fwd_bwd, warmup=1, repeats=repeats, device=device)
        return [{"impl": impl, "seq_len": s, "forward_s": t_f[impl].median_s,
                 "forward_backward_s": t_fb[impl].median_s,
                 "forward_backward_spread": t_fb[impl].spread,
                 "peak_bytes": measure_memory(fwd_bwd[impl], device=device).peak_bytes,
                 "backend": sdpa_backend_used(fwd[impl])} for impl in fns]

    lengths = tqdm(seq_lens, desc="attention benchmark", disable=not progress, leave=False)
    done, _ = until_out_of_memory(lengths, measure, device, "attention benchmark over seq_len")
    return [row for rows in done for row in rows]


def max_abs_error(impl: str, reference: str = "eager", seq_len: int = 256, num_heads: int = 4,
                  head_dim: int = 64, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Largest |difference| of output and input gradients between two implementations.

    Causal attention on seeded random inputs of shape ``(2, num_heads, seq_len, head_dim)``.

    Args:
        impl: the implementation checked (see :func:`attention_fn`).
        reference: the implementation it is compared with.
        seq_len: tokens per sequence.
        num_heads: attention heads.
        head_dim: width of each head.
        device: where both run.
        dtype: the inputs' dtype.

    Returns:
        ``{"output", "grad"}``: the largest difference of the outputs, and of the gradients of
        q, k and v.
    """
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, num_heads, seq_len, head_dim, generator=g).to(device, dtype)
            for _ in range(3)]
    grad = torch.randn(2, num_heads, seq_len, head_dim, generator=g).to(device, dtype)
    results = []
    for name in (impl, reference):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = attention_fn(name, device)(q, k, v, causal=True)
        out.backward(grad)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    (o1, *g1), (o2, *g2) = results
    return {"output": float((o1 - o2).abs().max()),
            "grad": max(float((a - b).abs().max()) for a, b in zip(g1, g2))}


def seq_len_sweep(seq_lens: list[int], impl: str = "sdpa", baseline: str = "eager",
                  batch_size: int = 1, num_heads: int = 8, head_dim: int = 64,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  repeats: int = 5):
    """Where ``impl`` starts to beat ``baseline`` attention: forward + backward over sequence
    length, timed in alternation (``sweep.run_sweep``).

    Work per call (for the regime): causal attention's ``2 * 2 * b*h*s^2*d`` FLOPs forward
    (half the square) times 3.5 with backward; the baseline's bytes are its s x s scores
    (written and read in fp32 or the dtype) plus q, k, v and the output.

    Args:
        seq_lens: the lengths, at least three, growing.
        impl: the attention timed as the recipe (see :func:`attention_fn`).
        baseline: the attention it is timed against.
        batch_size: sequences per call.
        num_heads: attention heads.
        head_dim: width of each head.
        dtype: the inputs' dtype.
        device: where it runs.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "attention", dimension "seq_len").

    Raises:
        ValueError: for sizes a sweep cannot use, or an implementation this device lacks.
    """
    return _attention_sweep("attention", "seq_len", seq_lens, lambda s: (num_heads, s), impl,
                            baseline, batch_size, head_dim, dtype, device, repeats)


def heads_sweep(head_counts: list[int], seq_len: int = 1024, impl: str = "sdpa",
                baseline: str = "eager", batch_size: int = 1, head_dim: int = 64,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                repeats: int = 5):
    """:func:`seq_len_sweep`'s comparison over the number of heads at one length: more heads
    is more of the same independent work (the s x s scores once per head), so the speed-up
    should hold steady once the work fills the machine; a small head count at a short length is
    where per-call overhead shows.

    Args:
        head_counts: the head counts, at least three, growing.
        seq_len: tokens per sequence.
        impl: the attention timed as the recipe (see :func:`attention_fn`).
        baseline: the attention it is timed against.
        batch_size: sequences per call.
        head_dim: width of each head.
        dtype: the inputs' dtype.
        device: where it runs.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "flash_attention", as notebook 03 names it; dimension
        "heads").

    Raises:
        ValueError: for sizes a sweep cannot use, or an implementation this device lacks.
    """
    return _attention_sweep("flash_attention", "heads", head_counts, lambda h: (h, seq_len),
                            impl, baseline, batch_size, head_dim, dtype, device, repeats)


def _attention_sweep(recipe: str, dimension: str, sizes: list[int],
                     shape_at: Callable[[int], tuple[int, int]], impl: str, baseline: str,
                     batch_size: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device | str, repeats: int):
    """Forward + backward of ``impl`` against ``baseline`` at each size, whose (heads, length)
    ``shape_at`` gives."""
    from recipes_lib.sweep import run_sweep

    device = torch.device(device)
    fns = {"baseline": attention_fn(baseline, device), "recipe": attention_fn(impl, device)}
    size = torch.empty((), dtype=dtype).element_size()

    def make(n: int):
        heads, s = shape_at(n)
        g = torch.Generator(device="cpu").manual_seed(n)
        q, k, v = (torch.randn(batch_size, heads, s, head_dim, generator=g).to(device, dtype)
                   .requires_grad_() for _ in range(3))
        grad = torch.randn(batch_size, heads, s, head_dim, generator=g).to(device, dtype)

        def step(fn):
            fn(q, k, v, causal=True).backward(grad)
            q.grad = k.grad = v.grad = None
        return {name: (lambda fn=fn: step(fn)) for name, fn in fns.items()}

    def work(n: int) -> tuple[float, float]:
        heads, s = shape_at(n)
        bh = batch_size * heads
        flops = 3.5 * 2 * bh * s * s * head_dim
        scores = 4 * bh * s * s * size * 2  # scores and probabilities, written and read
        return flops, scores + 4 * bh * s * head_dim * size
    return run_sweep(recipe, dimension, sizes, make, work, device, repeats=repeats,
                     progress=False, dtype=dtype)
