"""Collective-communication benchmark: all-reduce and all-gather bandwidth over message sizes.

Bandwidths follow nccl-tests (PERFORMANCE.md): algorithm bandwidth ``algbw = S / t`` for a
message of ``S`` bytes (all-gather: ``S`` is the gathered output), and bus bandwidth, which
corrects for how much each rank must actually send so the figure is comparable with the link's
peak whatever the rank count: all-reduce ``busbw = algbw * 2 (n - 1) / n``, all-gather and
reduce-scatter ``busbw = algbw * (n - 1) / n``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather")
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}


def bus_bandwidth(op: str, size_bytes: float, seconds: float, world_size: int
                  ) -> tuple[float, float]:
    """Algorithm and bus bandwidth of one collective (nccl-tests' definitions).

    Args:
        op: "all_reduce" or "all_gather".
        size_bytes: the message's bytes.
        seconds: the time one call took.
        world_size: ranks taking part.

    Returns:
        ``(algbw, busbw)`` in GB/s (1e9 bytes).

    Raises:
        ValueError: for an unknown ``op`` or a size, time or rank count out of range.

    Example:
        >>> bus_bandwidth("all_reduce", 1e9, 1.0, 8)
        (1.0, 1.75)
    """
    if op not in _BUS_FACTOR:
        raise ValueError(f"op={op!r}: expected one of {OPS}")
    if seconds <= 0 or size_bytes <= 0 or world_size < 1:
        raise ValueError(f"size_bytes={size_bytes}, seconds={seconds}, world_size={world_size}: "
                         "must all be > 0")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * _BUS_FACTOR[op](world_size)


def run(sizes: list[int] | None = None, ops: tuple[str, ...] = OPS, iters: int = 10,
        warmup: int = 3, dtype: str = "float32") -> list[dict[str, Any]]:
    """Time each collective at each message size on every rank (call inside a process group).

    Each size is timed over ``iters`` calls after ``warmup``; the slowest rank's time counts (a
    collective is as slow as its last participant).

    Args:
        sizes: message sizes in bytes (default 4 KiB .. 64 MiB, x4 steps).
        ops: collectives to time ("all_reduce", "all_gather").
        iters, warmup: timed and untimed calls per size.
        dtype: element type of the message.

    Returns:
        One row per (op, size): op, bytes, time_us, algbw_gbps, busbw_gbps, world_size, backend.

    Raises:
        RuntimeError: outside a process group of at least 2 ranks.
        ValueError: for an unknown collective.
    """
    from recipes_lib.distributed import world

    _, n = world()
    if n < 2:
        raise RuntimeError("comm_bench.run: needs a process group with >= 2 ranks "
                           "(run it through distributed.launch or torchrun)")
    for op in ops:
        if op not in OPS:
            raise ValueError(f"ops: {op!r} is not one of {OPS}")
    sizes = sizes or [4096 * 4**k for k in range(8)]
    # all_gather_into_tensor's new name; torch before 2.13 (a GPU machine's own build) has the old
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    dt = getattr(torch, dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    rows = []
    for op in ops:
        for size in sizes:
            numel = max(n, size // elem // n * n)  # all-gather needs n equal chunks
            buf = torch.ones(numel, dtype=dt, device=device)
            chunk = torch.ones(numel // n, dtype=dt, device=device)

            def call(op=op, buf=buf, chunk=chunk):
                if op == "all_reduce":
                    dist.all_reduce(buf)
                else:
                    all_gather(buf, chunk)

            for _ in range(warmup):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds = float(elapsed.item())
            nbytes = numel * elem
            algbw, busbw = bus_bandwidth(op, nbytes, seconds, n)
            rows.append({"op": op, "bytes": nbytes, "time_us": seconds * 1e6,
                         "algbw_gbps": algbw, "busbw_gbps": busbw, "world_size": n,
                         "backend": dist.get_backend()})
    return rows


def plot(rows: list[dict[str, Any]], title: str = "Collective bandwidth"):
    """Plot bus bandwidth against message size, one line per collective.

    Args:
        rows: :func:`run`'s rows (``op``, ``bytes``, ``busbw_gbps``).
        title: the plot's title.
    """
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(6, 3.5))
    for op in sorted({r["op"] for r in rows}):
        pts = [r for r in rows if r["op"] == op]
        ax.plot([r["bytes"] for r in pts], [r["busbw_gbps"] for r in pts], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return ax
