"""The one timer: warm-up calls, then the median of repeated, synchronised wall-clock runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from recipes_lib.device import synchronize


@dataclass
class Timing:
    """Median and spread of repeated runs, in seconds."""

    median_s: float
    times_s: list[float] = field(default_factory=list)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the measurement was."""
        return (max(self.times_s) - min(self.times_s)) / self.median_s if self.median_s else 0.0


def time_fn(
    fn: Callable[[], Any],
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device | None = None,
) -> Timing:
    """Time ``fn``: ``warmup`` unmeasured calls, then the median of ``repeats`` calls.

    Args:
        fn: the work to time.
        warmup: calls first run and discarded (allocator, caches, compilation).
        repeats: measured calls.
        device: synchronised before and after each call (CUDA/MPS), so queued kernels count.

    Raises:
        ValueError: if warmup < 0 or repeats < 1.

    Example:
        >>> time_fn(lambda: sum(range(1000)), warmup=1, repeats=3).median_s > 0
        True
    """
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: must be >= 0")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return Timing(median_s=statistics.median(times), times_s=times)
