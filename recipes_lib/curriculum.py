"""Sequence-length curriculum: train on short sequences first, growing to the full length.

Attention's cost per token grows with the sequence length, and early in training a model learns
mostly local statistics that short sequences teach as well. Li et al. (2022, "The stability-
efficiency dilemma") and MosaicML Composer's ``SeqLengthWarmup`` start at a short length and grow
it (linearly or in steps) over a warm-up period, then train at full length.

Two ways to shorten a batch of full-length sequences:
- ``"crop"``: keep the first L tokens of each sequence (fewer tokens per step: the token budget
  then buys more steps, and the LR schedule must be laid out over those steps:
  ``steps_for_token_budget``);
- ``"split"``: cut each sequence into S / L sequences of length L (same tokens per step, as
  Composer's default), so the step count and the LR schedule are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from recipes_lib.data import IGNORE_INDEX

SCHEDULES = ("linear", "step")
MODES = ("crop", "split")


@dataclass(frozen=True)
class SeqLenCurriculum:
    """The training sequence length as a function of the step.

    Args:
        min_len: length at step 0.
        max_len: full length, reached at ``warmup_steps`` and kept after.
        warmup_steps: steps over which the length grows (0 = full length from the start).
        schedule: "linear" (every step) or "step" (``n_stages`` equal plateaus).
        multiple_of: lengths are rounded down to a multiple of this (kernels like aligned sizes).
        n_stages: plateaus of the "step" schedule.
        mode: "crop" or "split" (see the module docstring).

    Raises:
        ValueError: for min_len > max_len, non-positive lengths, an unknown schedule or mode.

    Example:
        >>> c = SeqLenCurriculum(64, 512, warmup_steps=100)
        >>> [c.length_at(s) for s in (0, 50, 100, 500)]
        [64, 288, 512, 512]
    """

    min_len: int
    max_len: int
    warmup_steps: int
    schedule: str = "linear"
    multiple_of: int = 8
    n_stages: int = 4
    mode: str = "crop"

    def __post_init__(self):
        for name in ("min_len", "max_len", "multiple_of", "n_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.min_len > self.max_len:
            raise ValueError(f"min_len={self.min_len} > max_len={self.max_len}: the curriculum "
                             "must grow from the shorter to the longer length")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r}: must be an integer >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: expected one of {SCHEDULES}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {MODES}")
        if self.mode == "split" and self.max_len % self.min_len:
            raise ValueError(f"min_len={self.min_len}: must divide max_len={self.max_len} in "
                             "'split' mode")

    def length_at(self, step: int) -> int:
        """The sequence length to train on at ``step``."""
        if step >= self.warmup_steps:
            return self.max_len
        frac = step / self.warmup_steps
        if self.schedule == "step":
            frac = int(frac * self.n_stages) / self.n_stages
        length = self.min_len + frac * (self.max_len - self.min_len)
        length = max(self.min_len, int(length) // self.multiple_of * self.multiple_of)
        if self.mode == "split":  # a length that divides max_len, so sequences split evenly
            while self.max_len % length:
                length -= 1
        return length

    def shorten(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """The batch at ``step``'s length (cropped, or split into shorter rows)."""
        length = self.length_at(step)
        width = batch["input_ids"].shape[1]
        if length >= width:
            return batch
        if self.mode == "crop":
            return {k: v[:, :length] for k, v in batch.items()}
        n = width // length
        out = {k: v[:, :n * length].reshape(-1, length) for k, v in batch.items()}
        keep = (out["labels"] != IGNORE_INDEX).any(1)  # drop rows that are only padding
        return {k: v[keep] for k, v in out.items()}

    def wrap(self, batches: Iterable[dict[str, torch.Tensor]]
             ) -> Iterator[dict[str, torch.Tensor]]:
        """Shorten a stream of full-length batches step by step (for ``train(batch_stream=)``)."""
        for step, batch in enumerate(batches):
            yield self.shorten(batch, step)

    def tokens_until(self, steps: int, batch_size: int) -> int:
        """Token slots (batch x length) the first ``steps`` steps use in "crop" mode."""
        if self.mode == "split":
            return steps * batch_size * self.max_len
        return sum(batch_size * self.length_at(s) for s in range(steps))

    def steps_for_token_budget(self, tokens: int, batch_size: int) -> int:
        """How many steps spend ``tokens`` token slots: lay the LR schedule out over these."""
        if tokens < 1 or batch_size < 1:
            raise ValueError(f"tokens={tokens}, batch_size={batch_size}: must be >= 1")
        steps, used = 0, 0
        while used < tokens:
            used += batch_size * (self.max_len if self.mode == "split" else self.length_at(steps))
            steps += 1
        return steps


def train_with_curriculum(model: torch.nn.Module, packed: list[dict[str, list[int]]],
                          pad_token_id: int, schedule: SeqLenCurriculum, token_budget: int,
                          batch_size: int, lr: float, eval_fn=None, eval_points: int = 8,
                          seed: int = 0, desc: str = "training"):
    """Train on full-length packed sequences shortened by ``schedule``, for a token budget.

    The number of steps is what the budget buys under the schedule (more steps when early
    sequences are short, in "crop" mode), and the cosine LR schedule is laid out over exactly
    those steps. ``eval_fn`` runs at ``eval_points`` evenly spaced steps.

    Args:
        model: the model to train.
        packed: full-length packed sequences (``data_loading.pack_examples``).
        pad_token_id: the tokenizer's padding id.
        schedule: the sequence-length curriculum.
        token_budget: training tokens in all.
        batch_size: sequences per step.
        lr: the peak learning rate.
        eval_fn: ``eval_fn(model) -> float``, run during training.
        eval_points: how many times ``eval_fn`` runs.
        seed: for the order of the sequences.
        desc: the progress bar's label.

    Returns:
        The ``train.TrainResult`` (``evals`` holds (step, tokens, eval value)).
    """
    from recipes_lib import data, train

    steps = schedule.steps_for_token_budget(token_budget, batch_size)
    stream = schedule.wrap(data.batches(packed, batch_size, pad_token_id, seed=seed))
    config = train.TrainConfig(steps=steps, micro_batch_size=batch_size, lr=lr,
                               warmup_steps=max(1, steps // 10), seed=seed, desc=desc,
                               eval_every=max(1, steps // eval_points) if eval_fn else 0)
    return train.train(model, [], pad_token_id, config, batch_stream=stream, eval_fn=eval_fn)


def tokens_to_reach(evals: list[tuple[int, int, float]], target: float) -> float | None:
    """Tokens seen when the eval value first reaches ``target`` (linear between evals).

    Args:
        evals: ``(step, tokens, value)`` in training order, as ``TrainResult.evals`` holds them.
        target: the value to reach (lower is better).

    Returns:
        The tokens, interpolated between the two evals around the crossing, or None if no eval
        reached ``target``.

    Example:
        >>> tokens_to_reach([(1, 100, 3.0), (2, 200, 2.0)], 2.5)
        150.0
    """
    prev = None
    for _, tokens, value in evals:
        if value <= target:
            if prev is None or prev[1] == value:
                return float(tokens)
            t0, v0 = prev
            return t0 + (v0 - target) / (v0 - value) * (tokens - t0)
        prev = (tokens, value)
    return None
