"""Baseline vs recipe, side by side: one measured training step, a ratio table and plots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from recipes_lib.grad_accumulation import LossFn, forward_backward, split_micro_batches
from recipes_lib.memory import CATEGORIES, MemoryReport, measure_memory
from recipes_lib.timing import Timing, time_interleaved
from recipes_lib.train import optimizer_step


@dataclass
class StepMeasurement:
    """Peak memory (by category) and median time of one training step.

    Attributes:
        memory: the step's ``MemoryReport``.
        timing: its ``Timing`` (None when measured with ``repeats=0``: memory only).
    """

    memory: MemoryReport
    timing: Timing | None  # None when measured with repeats=0 (memory only)


def _step_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor], optimizer: Any,
             grad_accum_steps: int, precision: str, loss_fn: LossFn | None = None):
    def step() -> None:
        forward_backward(model, batch, grad_accum_steps, precision, loss_fn=loss_fn)
        if optimizer is not None:
            optimizer_step(model, optimizer, max_grad_norm=None)
        else:
            model.zero_grad(set_to_none=True)
    return step


def measure_training_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    optimizer: Any = None,
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    repeats: int = 3,
    warmup: bool = True,
    loss_fn: LossFn | None = None,
) -> StepMeasurement:
    """Measure one step (forward + backward, and the optimizer step if one is given).

    A warm-up step runs first (unless ``warmup=False``, for a model that has already trained),
    so optimizer states exist when memory is measured, as in every step after the first.
    ``repeats=0`` measures memory only (``timing`` is None). ``loss_fn`` replaces the default
    next-token cross-entropy as in ``grad_accumulation.forward_backward`` (e.g.
    ``chunked_loss.ChunkedCausalLMLoss``).

    Args:
        model: the model to step.
        batch: ``input_ids``, ``attention_mask`` and ``labels``.
        optimizer: stepped after backward when given.
        grad_accum_steps: micro-batches the batch is split into.
        precision: "fp32", "bf16" or "fp16" (autocast).
        repeats: timed steps (0: memory only).
        warmup: run one step before measuring.
        loss_fn: replaces the default loss.

    Returns:
        ``StepMeasurement``: the memory report and the timing.

    Raises:
        ValueError: for ``repeats`` < 0.
    """
    return measure_training_steps({"model": model}, batch, {"model": optimizer},
                                  grad_accum_steps, precision, repeats, warmup,
                                  {"model": loss_fn})["model"]


def measure_accumulation(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                         grad_accum_steps: int) -> dict[str, MemoryReport]:
    """What gradient accumulation holds: the memory of one step over ``batch`` in
    ``grad_accum_steps`` micro-batches, beside the memory of a step on each micro-batch alone,
    the largest of which it should match (plus the gradients, which stay allocated while the
    next micro-batches run). Memory only, no optimizer.

    Args:
        model: the model.
        batch: the global batch.
        grad_accum_steps: micro-batches it is split into.

    Returns:
        ``{"accumulated", "largest_micro_batch"}``: the two ``MemoryReport`` s (the largest by
        peak).

    Raises:
        ValueError: if ``grad_accum_steps`` < 1 or does not divide the batch size.

    Example:
        >>> m = measure_accumulation(model, batch, 4)  # doctest: +SKIP
        >>> m["accumulated"].activation_bytes / m["largest_micro_batch"].activation_bytes
        ... # doctest: +SKIP
    """
    micro = split_micro_batches(batch, grad_accum_steps)
    accumulated = measure_training_step(model, batch, grad_accum_steps=grad_accum_steps,
                                        repeats=0).memory
    largest = max((measure_training_step(model, mb, repeats=0).memory for mb in micro),
                  key=lambda r: r.peak_bytes)
    return {"accumulated": accumulated, "largest_micro_batch": largest}


def measure_training_steps(
    models: dict[str, torch.nn.Module],
    batch: dict[str, torch.Tensor],
    optimizers: dict[str, Any] | None = None,
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    repeats: int = 3,
    warmup: bool = True,
    loss_fns: dict[str, LossFn] | None = None,
) -> dict[str, StepMeasurement]:
    """``measure_training_step`` for several variants, their step times taken in alternation.

    Each model's memory is measured alone; the timed steps alternate between models
    (``timing.time_interleaved``), so machine drift does not favour the one measured first.

    Args:
        models: name -> model.
        batch: the same batch for every model.
        optimizers: name -> optimizer, for the models stepped with one.
        grad_accum_steps: micro-batches the batch is split into.
        precision: "fp32", "bf16" or "fp16" (autocast).
        repeats: timed steps of each (0: memory only).
        warmup: run one step of each before measuring.
        loss_fns: name -> a loss replacing the default.

    Returns:
        name -> ``StepMeasurement``.

    Raises:
        ValueError: for ``repeats`` < 0.

    Example:
        >>> steps = {"plain": plain, "checkpointed": ckpt}  # doctest: +SKIP
        >>> m = measure_training_steps(steps, batch)  # doctest: +SKIP
        >>> m["checkpointed"].timing.median_s / m["plain"].timing.median_s  # doctest: +SKIP
    """
    optimizers, loss_fns = optimizers or {}, loss_fns or {}
    steps = {name: _step_fn(m, batch, optimizers.get(name), grad_accum_steps, precision,
                            loss_fns.get(name))
             for name, m in models.items()}
    if repeats < 0:
        raise ValueError(f"repeats={repeats}: must be >= 0 (0 = memory only)")
    memory = {}
    for name, model in models.items():
        model.train()
        if warmup:
            steps[name]()
        memory[name] = measure_memory(steps[name], model, optimizers.get(name))
    if repeats == 0:
        return {name: StepMeasurement(memory[name], None) for name in models}
    device = next(next(iter(models.values())).parameters()).device
    timings = time_interleaved(steps, warmup=0, repeats=repeats, device=device)
    return {name: StepMeasurement(memory[name], timings[name]) for name in models}


def side_by_side(rows: dict[str, tuple[float, float]], names: tuple[str, str] = ("baseline",
                                                                                 "recipe")):
    """A table with one row per metric: baseline, recipe and recipe / baseline.

    Args:
        rows: metric -> (baseline value, recipe value).
        names: column titles for the two runs.
    """
    import pandas as pd

    table = pd.DataFrame({m: {names[0]: b, names[1]: r, "ratio": (r / b if b else float("nan"))}
                          for m, (b, r) in rows.items()}).T
    return table


def memory_table(reports: dict[str, MemoryReport], unit: float = 2**20):
    """Peak memory by category (MiB by default), one column per run.

    Args:
        reports: run name -> its ``MemoryReport``.
        unit: bytes per unit shown (2**20: MiB).

    Returns:
        A pandas DataFrame: one row per category and one for the peak.
    """
    import pandas as pd

    data = {name: {**{c: r.by_category.get(c, 0) / unit for c in CATEGORIES},
                   "peak": r.peak_bytes / unit} for name, r in reports.items()}
    return pd.DataFrame(data).round(2)


def plot_memory_breakdown(reports: dict[str, MemoryReport], title: str = "Peak memory",
                          unit: float = 2**20, share: bool = False):
    """Stacked bars of peak memory by category, one bar per run; with ``share``, each bar as
    fractions of its own peak (the anatomy of runs of very different sizes, side by side).

    Args:
        reports: run name -> its ``MemoryReport``.
        title: the plot's title.
        unit: bytes per unit shown (2**20: MiB).
        share: show each category's share of its run's peak instead of bytes.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(reports), 3.6))
    bottom = [0.0] * len(reports)
    for cat in CATEGORIES:
        vals = [r.by_category.get(cat, 0) / (sum(r.by_category.values()) if share else unit)
                for r in reports.values()]
        if any(vals):
            ax.bar(list(reports), vals, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("share of the peak" if share else
                  {2**20: "MiB", 2**30: "GiB"}.get(unit, f"x {unit:g} B") + " at peak")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_losses(curves: dict[str, list[float]], title: str = "Training loss"):
    """Loss per optimizer step for several runs on one plot.

    Args:
        curves: run name -> its loss at each step.
        title: the plot's title.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
