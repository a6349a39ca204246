"""Where a speed recipe starts to pay: time recipe and baseline over growing sizes, mark the
crossover, name the regime.

A recipe that saves FLOPs or bytes gains nothing while a step is bound by kernel launches and
Python (tiny shapes), and may cost: its extra bookkeeping is then the whole bill. So a speed
claim is a curve, not a point: ``run_sweep`` times the two variants in alternation (the one
timer, ``timing.time_interleaved``) at each size, ``Sweep.crossover`` interpolates where the
speed-up crosses 1, and ``Sweep.regimes`` names each size's regime from the baseline's achieved
FLOP/s and bytes/s against the machine's measured peaks (``machine_peaks``).

Sizes grow, so on an accelerator the last ones may not fit (eager attention's s x s scores at
16k tokens need tens of GiB): ``until_out_of_memory`` stops a sweep at the first size that runs
out of device memory, says so, and keeps the sizes that fit, instead of losing the whole run.
"""

from __future__ import annotations

import gc
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from recipes_lib.checks import spread_of
from recipes_lib.device import describe_device
from recipes_lib.results import Results
from recipes_lib.timing import Timing, time_fn, time_interleaved

# Below this fraction of both peaks a workload is bound by launches and Python, not the hardware.
OVERHEAD_FRACTION = 0.10
T = TypeVar("T")


@dataclass(frozen=True)
class OutOfMemory:
    """Where a sweep stopped: the first size that ran out of device memory, and the error's
    first line (e.g. "CUDA out of memory. Tried to allocate 8.00 GiB ...").

    Attributes:
        size: the size that did not fit.
        message: the error's first line.
    """

    size: int
    message: str


def until_out_of_memory(sizes: Iterable[int], measure: Callable[[int], T],
                        device: torch.device | str = "cpu", what: str = "sweep"
                        ) -> tuple[list[T], OutOfMemory | None]:
    """``measure(size)`` for each size in order, stopping at the first that raises
    ``torch.OutOfMemoryError`` (an accelerator's; a CPU that runs out is killed by the OS, not
    told). The larger sizes would not fit either, so they are not tried. The stop is said aloud
    (a warning) and returned, and the device's cache is emptied for what runs next.

    Args:
        sizes: the sizes, in the order tried.
        measure: ``measure(size)``.
        device: the device whose cache is emptied after a stop.
        what: the sweep's name in the warning.

    Returns:
        The measurements of the sizes that fit, and where it stopped (None: every size ran).

    Raises:
        torch.OutOfMemoryError: when even the first size does not fit (naming ``sizes``).

    Example:
        >>> def f(n):
        ...     if n > 2:
        ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
        ...     return n
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     until_out_of_memory([1, 2, 4], f)
        ([1, 2], OutOfMemory(size=4, message='CUDA out of memory. Tried to allocate 8 GiB'))
    """
    done: list[T] = []
    stop = None
    for size in sizes:
        try:
            done.append(measure(size))
        except torch.OutOfMemoryError as err:
            lines = str(err).strip().splitlines()
            stop = OutOfMemory(int(size), lines[0] if lines else "out of memory")
            break  # leaving the handler drops the traceback's frames and their tensors
    if stop is None:
        return done, None
    gc.collect()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not done:
        raise torch.OutOfMemoryError(
            f"sizes: {what} ran out of {device} memory at its smallest size, {stop.size} "
            f"({stop.message}); choose smaller sizes")
    warnings.warn(f"{what}: out of {device} memory at {stop.size} ({stop.message}); "
                  f"stopped there, keeping the {len(done)} sizes that fit", stacklevel=2)
    return done, stop


@dataclass
class Peaks:
    """Measured ceilings of one device: matrix FLOP/s (``dtype``) and copy bandwidth (B/s).

    Attributes:
        flops_per_s: a large matmul's FLOP/s.
        bytes_per_s: a large copy's bytes read plus written per second.
        dtype: the matmul's dtype.
        device: the device.
        matmul_size: n of the n x n by n x n matmul timed (0: not said).
        copy_bytes: the bytes of the tensor copied (0: not said).
        repeats: the timed runs each figure is the median of (0: not said).
    """

    flops_per_s: float
    bytes_per_s: float
    dtype: str
    device: str
    matmul_size: int = 0
    copy_bytes: int = 0
    repeats: int = 0


_PEAKS: dict[tuple[str, str], Peaks] = {}


def machine_peaks(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                  ) -> Peaks:
    """Measure (once per device and dtype) a large matmul's FLOP/s and a large copy's bytes/s.

    The copy counts bytes read plus bytes written. CPU sizes are kept small enough to take
    about a second on a laptop.

    Args:
        device: the device measured.
        dtype: the matmul's dtype.

    Returns:
        The :class:`Peaks`.
    """
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key not in _PEAKS:
        n = 4096 if device.type == "cuda" else 1024
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        repeats = 5
        mm = time_fn(lambda: a @ b, warmup=2, repeats=repeats, device=device).median_s
        numel = (256 if device.type == "cuda" else 32) * 2**20
        src = torch.randn(numel, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        cp = time_fn(lambda: dst.copy_(src), warmup=2, repeats=repeats, device=device).median_s
        _PEAKS[key] = Peaks(2 * n**3 / mm, 2 * src.nbytes / cp, str(dtype), str(device),
                            matmul_size=n, copy_bytes=src.nbytes, repeats=repeats)
    return _PEAKS[key]


def record_machine_peaks(devices: Sequence[torch.device | str] = ("cpu",),
                         results_dir: Path | str | None = None) -> Path:
    """Write ``machine.json``: each device's ceilings (:func:`machine_peaks`) beside its
    description, so that a run's speed figures can be read against the host they came from.
    Two hosts a cloud names alike ("AMD EPYC", 2 threads, AVX2) can differ twofold in FLOP/s,
    and a kernel bound by compute gains or loses against one bound by memory with them.

    Args:
        devices: the devices measured.
        results_dir: where the file goes (default: ``results.output_dir()``).

    Returns:
        The file's path.

    Example:
        >>> record_machine_peaks(["cpu"])  # doctest: +SKIP
        PosixPath('results/machine.json')
    """
    devices = [torch.device(d) for d in devices]
    r = Results("machine", "; ".join(describe_device(d) for d in devices), results_dir)
    for d in devices:
        p = machine_peaks(d)
        n = p.matmul_size
        r.add("peaks", f"{d.type}: fp32 matmul", p.flops_per_s / 1e9,
              unit=f"GFLOP/s, one {n} x {n} matmul, median of {p.repeats}")
        r.add("peaks", f"{d.type}: copy", p.bytes_per_s / 1e9,
              unit=f"GB/s read + written, one {p.copy_bytes / 2**20:.0f} MiB tensor copied, "
                   f"median of {p.repeats}")
    return r.save()


@dataclass
class Sweep:
    """Baseline and recipe timed over growing sizes of one dimension.

    ``flops`` and ``bytes`` are the baseline's work per call at each size (optional; they name
    the regime). ``extra`` holds timings of further variants measured in the same alternation
    (e.g. another library's implementation).

    Attributes:
        recipe: the recipe's name (results key).
        dimension: the size's name.
        sizes: the sizes timed.
        baseline: the baseline's timing at each size.
        candidate: the recipe's timing at each size.
        flops: the baseline's FLOPs per call at each size (or None).
        bytes: its bytes per call at each size (or None).
        peaks: the device's :class:`Peaks` (or None).
        extra: variant name -> its timing at each size.
        out_of_memory: where the sweep stopped (None: every size ran).
    """

    recipe: str
    dimension: str
    sizes: list[int]
    baseline: list[Timing]
    candidate: list[Timing]
    flops: list[float] | None = None
    bytes: list[float] | None = None
    peaks: Peaks | None = None
    extra: dict[str, list[Timing]] = field(default_factory=dict)
    out_of_memory: OutOfMemory | None = None  # where it stopped, if a size did not fit

    @property
    def speedups(self) -> list[float]:
        """Baseline time / recipe time at each size (> 1: the recipe is faster)."""
        return self.ratio("baseline", "recipe")[0]

    def crossover(self) -> float | None:
        """The size where the speed-up last crosses 1, interpolated linearly in log(size) and
        log(speed-up): going up (the recipe pays above it, the usual case of a recipe that saves
        FLOPs or bytes) or going down (it pays below it: a fusion or compilation whose gain
        shrinks once large matmuls dominate); :meth:`pays_above` says which. None when it never
        crosses: it wins at every size or at none (see ``verdict``)."""
        s = self.speedups
        if all(x >= 1 for x in s) or all(x < 1 for x in s):
            return None
        # the last size on the other side of 1 from the largest size
        i = max(k for k in range(len(s)) if (s[k] >= 1) != (s[-1] >= 1))
        x0, x1 = math.log(self.sizes[i]), math.log(self.sizes[i + 1])
        y0, y1 = math.log(s[i]), math.log(s[i + 1])
        return math.exp(x0 + (x1 - x0) * (0 - y0) / (y1 - y0))

    def pays_above(self) -> bool:
        """Whether the recipe wins at the largest size swept (a crossover is then one it pays
        above; otherwise one it pays below)."""
        return self.speedups[-1] >= 1

    def within_noise(self) -> list[int]:
        """Sizes whose speed-up is within its timings' spread of 1x (the noisier side's
        (max - min) / median, as ``checks.check_speed`` prints it): which side of 1 they fall on
        is not settled by this run."""
        return [n for n, b, c, x in zip(self.sizes, self.baseline, self.candidate, self.speedups)
                if abs(x - 1) <= spread_of(b, c)]

    def verdict(self) -> str:
        """One sentence: where the recipe wins, per the sizes swept (and where the sweep ran out
        of memory, if it did)."""
        s, cross = self.speedups, self.crossover()
        lo, hi = self.sizes[0], self.sizes[-1]
        wins = [n for n, x in zip(self.sizes, s) if x >= 1]
        flips = sum((a >= 1) != (b >= 1) for a, b in itertools.pairwise(s))
        if len(wins) == len(s):
            text = (f"wins at every {self.dimension} swept ({lo}..{hi}), "
                    f"{min(s):.2f}x..{max(s):.2f}x")
        elif cross is None:
            text = (f"wins at no {self.dimension} swept ({lo}..{hi}): best {max(s):.2f}x, "
                    f"at the largest {s[-1]:.2f}x")
        elif flips > 1:
            text = (f"wins only at {self.dimension} {', '.join(map(str, wins))} of {lo}..{hi} "
                    f"(last crosses 1 going {'up' if self.pays_above() else 'down'} at "
                    f"~{cross:.0f}; {s[0]:.2f}x at {lo}, {s[-1]:.2f}x at {hi})")
        else:
            text = (f"pays {'above' if self.pays_above() else 'below'} {self.dimension} ~ "
                    f"{cross:.0f} ({s[0]:.2f}x at {lo}, {s[-1]:.2f}x at {hi})")
        if even := self.within_noise():
            text += (f"; within the timings' spread of 1x at {self.dimension} "
                     f"{', '.join(map(str, even))}")
        if self.out_of_memory is not None:
            text += f"; out of memory at {self.dimension} {self.out_of_memory.size}"
        return text

    def regimes(self) -> list[str]:
        """Each size's regime from the baseline's achieved rates vs ``peaks``: 'overhead' when
        both are under ``OVERHEAD_FRACTION`` of their peak, else 'compute' or 'memory' by the
        larger fraction; 'unknown' without flops/bytes/peaks."""
        if self.peaks is None or self.flops is None or self.bytes is None:
            return ["unknown"] * len(self.sizes)
        out = []
        for t, f, b in zip(self.baseline, self.flops, self.bytes):
            fc = f / t.median_s / self.peaks.flops_per_s
            fm = b / t.median_s / self.peaks.bytes_per_s
            if max(fc, fm) < OVERHEAD_FRACTION:
                out.append("overhead")
            else:
                out.append("compute" if fc >= fm else "memory")
        return out

    def times(self, name: str) -> list[Timing]:
        """The timings, by size, of ``"baseline"``, ``"recipe"`` or a variant of ``extra``.

        Raises:
            ValueError: naming ``name`` and the variants this sweep timed.
        """
        timed = {"baseline": self.baseline, "recipe": self.candidate, **self.extra}
        if name not in timed:
            raise ValueError(f"name={name!r}: not timed in this sweep (it timed "
                             f"{', '.join(map(repr, timed))})")
        return timed[name]

    def ratio(self, numerator: str, denominator: str) -> tuple[list[float], list[float]]:
        """``numerator``'s median time over ``denominator``'s at each size (> 1: the
        denominator is faster), e.g. two variants of ``extra`` raced against each other, and
        at each size the spread of the two timings behind it (the noisier side's)."""
        a, b = self.times(numerator), self.times(denominator)
        return ([x.median_s / y.median_s for x, y in zip(a, b)],
                [spread_of(x, y) for x, y in zip(a, b)])

    def record_ratio(self, results, numerator: str, denominator: str, metric: str, unit: str,
                     claim: str | None = None, strict: bool | None = None) -> list[float]:
        """Race two timed variants (:meth:`ratio`): print the ratio at every size, record the
        largest size's as ``<recipe>/<metric>_at_<dimension>_<size>`` (baseline 1) and, given
        ``claim``, check it as a speed claim, at least 1x with that size's spread
        (``checks.check_speed``; ``strict`` as there).

        Returns:
            The ratio at each size.
        """
        from recipes_lib.checks import check_speed

        ratios, spreads = self.ratio(numerator, denominator)
        results.add(self.recipe, f"{metric}_at_{self.dimension}_{self.sizes[-1]}", ratios[-1],
                    baseline=1.0, unit=unit)
        print(f"{self.recipe}: {numerator} time over {denominator}'s: "
              + ", ".join(f"{x:.2f}x at {n}" for n, x in zip(self.sizes, ratios)))
        if claim is not None:
            check_speed(results, self.recipe, claim, ratios[-1], 1.0, spread=spreads[-1],
                        strict=strict)
        return ratios

    def spread(self) -> float:
        """The largest (max - min) / median over every timing of the sweep."""
        return spread_of(*self.baseline, *self.candidate)

    def rows(self) -> list[dict[str, Any]]:
        """One row per size, for a table."""
        out = []
        for i, (size, reg) in enumerate(zip(self.sizes, self.regimes())):
            row = {self.dimension: size, "baseline_ms": 1e3 * self.baseline[i].median_s,
                   "recipe_ms": 1e3 * self.candidate[i].median_s,
                   "speedup": self.speedups[i], "regime": reg}
            for name, times in self.extra.items():
                row[f"{name}_ms"] = 1e3 * times[i].median_s
            out.append(row)
        return out

    def record(self, results, unit: str = "") -> None:
        """Write ``<recipe>/crossover_<dimension>`` (the size; 0 when it wins at every size,
        -1 when at none; the verdict, which says whether it pays above or below that size,
        always in the unit, after ``unit``), the speed-up at the largest size that ran and,
        if the sweep stopped short, ``<recipe>/out_of_memory_<dimension>`` (the size)."""
        cross = self.crossover()
        s = self.speedups
        value = cross if cross is not None else (0.0 if all(x >= 1 for x in s) else -1.0)
        results.add(self.recipe, f"crossover_{self.dimension}", value,
                    unit=f"{unit}: {self.verdict()}" if unit else self.verdict())
        results.add(self.recipe, f"speedup_at_{self.dimension}_{self.sizes[-1]}", s[-1],
                    baseline=1.0, unit="x baseline")
        if self.out_of_memory is not None:
            results.add(self.recipe, f"out_of_memory_{self.dimension}", self.out_of_memory.size,
                        unit=f"first {self.dimension} that did not fit: "
                             f"{self.out_of_memory.message}")

    def plot(self, title: str | None = None):
        """Speed-up against size (log-log), 1x drawn, the crossover marked."""
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(self.sizes, self.speedups, "o-", label=self.recipe)
        for name, times in self.extra.items():
            ax.plot(self.sizes, [b.median_s / t.median_s for b, t in zip(self.baseline, times)],
                    "s--", label=name)
        ax.axhline(1.0, color="grey", lw=1)
        cross = self.crossover()
        if cross is not None:
            side = "above" if self.pays_above() else "below"
            ax.axvline(cross, color="red", ls=":", label=f"crossover ~{cross:.0f} (pays {side})")
        if self.out_of_memory is not None:
            ax.axvline(self.out_of_memory.size, color="black", ls="--",
                       label=f"out of memory at {self.out_of_memory.size}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(self.dimension)
        ax.set_ylabel("speed-up vs baseline")
        ax.set_title(title or f"{self.recipe}: {self.verdict()}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig


def from_rows(recipe: str, dimension: str, rows: list[dict[str, Any]]) -> Sweep:
    """A ``Sweep`` rebuilt from ``Sweep.rows()`` saved earlier (medians only), e.g. a GPU run's
    file, to table and plot it where that GPU is not present.

    Args:
        recipe: the sweep's recipe name.
        dimension: the swept size's name, a key of every row.
        rows: the saved rows (``baseline_ms``, ``recipe_ms`` and the size).

    Returns:
        The ``Sweep`` (each timing a single median: no spread).
    """
    sizes = [int(r[dimension]) for r in rows]
    base = [Timing(r["baseline_ms"] / 1e3, [r["baseline_ms"] / 1e3]) for r in rows]
    cand = [Timing(r["recipe_ms"] / 1e3, [r["recipe_ms"] / 1e3]) for r in rows]
    return Sweep(recipe, dimension, sizes, base, cand)


def check_sizes(sizes: Sequence[int], name: str = "sizes") -> list[int]:
    """At least three positive sizes, strictly growing.

    Args:
        sizes: the sizes.
        name: the parameter named in the error.

    Returns:
        The sizes, as a list.

    Raises:
        ValueError: naming ``name`` otherwise.
    """
    sizes = [int(s) for s in sizes]
    if len(sizes) < 3:
        raise ValueError(f"{name}={sizes}: a sweep needs at least three sizes to place a "
                         "crossover")
    if sizes[0] <= 0 or any(b <= a for a, b in itertools.pairwise(sizes)):
        raise ValueError(f"{name}={sizes}: sizes must be positive and strictly growing")
    return sizes


def run_sweep(recipe: str, dimension: str, sizes: Sequence[int],
              make: Callable[[int], dict[str, Callable[[], Any]]],
              work: Callable[[int], tuple[float, float]] | None = None,
              device: torch.device | str = "cpu", warmup: int = 1, repeats: int = 5,
              progress: bool = True, dtype: torch.dtype = torch.float32) -> Sweep:
    """Time ``make(size)["baseline"]`` and ``make(size)["recipe"]`` (and any further entries) in
    alternation at each size.

    Args:
        recipe: the recipe's name (results key).
        dimension: the size's name (e.g. ``"seq_len"``).
        sizes: at least three, strictly growing.
        make: builds the callables for one size; they are dropped before the next size.
        work: the baseline's (FLOPs, bytes) at a size, to name the regime.
        device: synchronised around each timed call.
        dtype: the dtype whose matmul peak the regime is judged against.

    A size that runs out of device memory ends the sweep there (``until_out_of_memory``): the
    returned sweep holds the sizes that fit and ``out_of_memory`` says where it stopped.

    Returns:
        The :class:`Sweep`.

    Raises:
        ValueError: on fewer than three sizes, or sizes that do not grow.
        torch.OutOfMemoryError: when even the first size does not fit.

    Example:
        >>> s = run_sweep("sum", "n", [10, 100, 1000], lambda n: {
        ...     "baseline": lambda: sum(range(n)), "recipe": lambda: sum(range(n))},
        ...     repeats=1, progress=False)
        >>> len(s.speedups)
        3
    """
    sizes = check_sizes(sizes)
    device = torch.device(device)

    def measure(size: int) -> tuple[dict[str, Timing], tuple[float, float] | None]:
        fns = make(size)
        missing = {"baseline", "recipe"} - set(fns)
        if missing:
            raise ValueError(f"make({size}) must return 'baseline' and 'recipe'; "
                             f"missing {sorted(missing)}")
        t = time_interleaved(fns, warmup=warmup, repeats=repeats, device=device)
        return t, (work(size) if work is not None else None)  # fns dropped before the next size

    it: Iterable[int] = sizes
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(sizes, desc=f"{recipe} over {dimension}", leave=False)
    done, stop = until_out_of_memory(it, measure, device, f"{recipe} over {dimension}")
    extra: dict[str, list[Timing]] = {}
    for t, _ in done:
        for name in t:
            if name not in ("baseline", "recipe"):
                extra.setdefault(name, []).append(t[name])
    flops = [float(w[0]) for _, w in done if w is not None]
    nbytes = [float(w[1]) for _, w in done if w is not None]
    peaks = machine_peaks(device, dtype) if work is not None else None
    return Sweep(recipe, dimension, sizes[:len(done)], [t["baseline"] for t, _ in done],
                 [t["recipe"] for t, _ in done], flops or None, nbytes or None, peaks, extra,
                 stop)
