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
    """Median and spread of repeated runs, in seconds.

    Attributes:
        median_s: the median.
        times_s: every timed run.
    """

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

    Returns:
        The :class:`Timing`.

    Raises:
        ValueError: if warmup < 0 or repeats < 1.

    Example:
        >>> time_fn(lambda: sum(range(1000)), warmup=1, repeats=3).median_s > 0
        True
    """
    return time_interleaved({"fn": fn}, warmup, repeats, device)["fn"]


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device | None = None,
) -> dict[str, Timing]:
    """Time several functions in alternation (A B A B ...), the median of each.

    Comparing two variants measured one after the other lets slow drift of the machine (clock
    speed, other processes, the allocator's state) land on one of them; alternating spreads it
    over both.

    Args:
        fns: name -> the work to time.
        warmup: rounds first run and discarded.
        repeats: measured rounds.
        device: synchronised around each call.

    Returns:
        name -> its :class:`Timing`.

    Raises:
        ValueError: for no functions, warmup < 0 or repeats < 1.

    Example:
        >>> t = time_interleaved({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))})
        >>> sorted(t)
        ['a', 'b']
    """
    if not fns:
        raise ValueError("fns: nothing to time")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: must be >= 0")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    device = device or torch.device("cpu")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: Timing(median_s=statistics.median(t), times_s=t) for name, t in times.items()}
