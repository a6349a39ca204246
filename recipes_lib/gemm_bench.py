"""GEMM sizing: matmul throughput against the alignment of the sizes (EleutherAI cookbook style).

Matmul kernels tile their operands (tensor-core tiles of 8/16 elements on GPUs, 8/16-float
vector registers on CPUs, cache blocks of 64-256). A dimension that is not a multiple of the tile
leaves partly filled tiles and slower edge code, which is why model dimensions are multiples of
64 or 128 (and why nanoGPT pads GPT-2's 50257-token vocabulary to 50304).
"""

from __future__ import annotations

import torch

from recipes_lib.timing import time_interleaved


def alignment(n: int) -> int:
    """The largest power of two (up to 128) that divides ``n``.

    Args:
        n: a size.

    Returns:
        The power of two.

    Example:
        >>> alignment(4096), alignment(4100), alignment(4097)
        (128, 4, 1)
    """
    a = 1
    while a < 128 and n % (2 * a) == 0:
        a *= 2
    return a


def sizing_table(sizes: list[int], tokens: int = 2048, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", repeats: int = 5
                 ) -> list[dict[str, float | int]]:
    """Throughput of ``(tokens x n) @ (n x n)`` for each n, timed in alternation.

    Args:
        sizes: the widths ``n``.
        tokens: rows of the left operand.
        dtype: the operands' dtype.
        device: where the matmuls run.
        repeats: timed calls of each, in alternation.

    Returns:
        One row per size: ``size``, ``alignment``, ``gflops``, ``seconds`` and the ``spread``
        of the timed runs ((max - min) / median).

    Raises:
        ValueError: for an empty list or a size < 1.
    """
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes={sizes!r}: expected positive sizes")
    if tokens < 1:
        raise ValueError(f"tokens={tokens}: must be >= 1")
    g = torch.Generator().manual_seed(0)
    fns = {}
    for n in sizes:
        a = torch.randn(tokens, n, generator=g).to(device, dtype)
        b = torch.randn(n, n, generator=g).to(device, dtype)
        fns[n] = lambda a=a, b=b: a @ b
    times = time_interleaved(fns, warmup=2, repeats=repeats, device=torch.device(device))
    return [{"size": n, "alignment": alignment(n), "seconds": t.median_s, "spread": t.spread,
             "gflops": 2 * tokens * n * n / t.median_s / 1e9} for n, t in times.items()]


def dtype_sweep(sizes: list[int], tokens: int = 2048, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu", repeats: int = 5):
    """Where a 16-bit matmul starts to beat fp32: ``(tokens x n) @ (n x n)`` over n, fp32 against
    ``dtype``, timed in alternation (``sweep.run_sweep``). On a CPU without native bf16
    (``device.supports_bf16``: no AVX512-BF16 / AMX) bf16 is emulated and loses at every size;
    the sweep says so rather than hide it. Work per call: ``2 t n^2`` FLOPs; fp32 operands and
    output in bytes.

    Args:
        sizes: the widths ``n``, at least three, growing.
        tokens: rows ``t`` of the left operand.
        dtype: the 16-bit dtype, ``torch.bfloat16`` or ``torch.float16``.
        device: where the matmuls run.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "bf16" or "fp16", dimension "hidden").

    Raises:
        ValueError: for sizes a sweep cannot use, or a dtype that is not 16-bit.
    """
    from recipes_lib.sweep import run_sweep

    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype}: expected torch.bfloat16 or torch.float16")
    device = torch.device(device)

    def make(n: int):
        g = torch.Generator().manual_seed(n)
        a = torch.randn(tokens, n, generator=g).to(device)
        b = torch.randn(n, n, generator=g).to(device)
        a16, b16 = a.to(dtype), b.to(dtype)
        return {"baseline": lambda: a @ b, "recipe": lambda: a16 @ b16}

    def work(n: int) -> tuple[float, float]:
        return 2.0 * tokens * n * n, 4.0 * (2 * tokens * n + n * n)
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return run_sweep(name, "hidden", sizes, make, work, device, repeats=repeats, progress=False)
