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
    """The largest power of two (up to 128) that divides ``n``."""
    a = 1
    while a < 128 and n % (2 * a) == 0:
        a *= 2
    return a


def sizing_table(sizes: list[int], tokens: int = 2048, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", repeats: int = 5
                 ) -> list[dict[str, float | int]]:
    """Throughput of ``(tokens x n) @ (n x n)`` for each n, timed in alternation.

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
