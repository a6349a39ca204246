"""The one training loop, for full models and peft models alike.

Global batches of ``micro_batch_size * grad_accum_steps`` examples, gradient accumulation with
exact token normalisation, autocast (bf16, or fp16 with a grad scaler), clipping, a warm-up + decay
LR schedule, a progress bar, the loss history and optional TensorBoard logging.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from recipes_lib import data, train_state
from recipes_lib.device import PRECISIONS, resolve_precision, synchronize
from recipes_lib.distributed import all_reduce_sum, rank_slice, world
from recipes_lib.grad_accumulation import LossFn, count_target_tokens, forward_backward

SCHEDULES = ("cosine", "linear", "constant_with_warmup")


@dataclass
class TrainConfig:
    """Settings of one training run (plain values, overridable from a notebook's parameters).

    Attributes:
        steps: optimizer steps.
        micro_batch_size: examples per forward/backward.
        grad_accum_steps: micro-batches per optimizer step.
        lr: the peak learning rate.
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: linear warm-up steps, in [0, steps].
        schedule: the learning-rate schedule after warm-up: "cosine", "linear" or
            "constant_with_warmup".
        max_grad_norm: gradient clipping (None: none).
        precision: "fp32", "bf16", "fp16" or "auto" (the device's best, said aloud).
        seed: for the data order.
        progress: show a progress bar.
        desc: the progress bar's label.
        log_dir: write the losses there (None: nowhere).
        checkpoint_dir: resume from a checkpoint there if one exists, and save into it.
        checkpoint_every: steps between checkpoints (0: only at the end).
        eval_every: steps between calls of ``train``'s ``eval_fn`` (0: never).

    Example:
        >>> TrainConfig(steps=40, lr=3e-4).validate()
    """

    steps: int = 100
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"
    seed: int = 0
    progress: bool = True
    desc: str = "training"
    log_dir: str | None = None
    checkpoint_dir: str | None = None  # resume from here if a checkpoint exists; save into it
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)
    eval_every: int = 0  # steps between calls of train()'s eval_fn (0: never)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("steps", "micro_batch_size", "grad_accum_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr}: must be > 0")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be in [0, steps]")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: expected one of {SCHEDULES}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: expected one of {PRECISIONS}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"eval_every={self.eval_every!r}: must be an integer >= 0")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r}: must be an integer >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm}: must be > 0 or None")

    @property
    def global_batch_size(self) -> int:
        """Examples per optimizer step on one rank (times the world size in data parallel)."""
        return self.micro_batch_size * self.grad_accum_steps


@dataclass
class TrainResult:
    """What a run produced: per-step loss and time, the precision that actually ran.

    Attributes:
        losses: the loss of each optimizer step.
        step_times: each step's seconds.
        precision: the precision that ran ("auto" resolved).
        target_tokens: tokens that carried a loss, over the run.
        evals: ``(step, tokens, value)`` of each ``eval_fn`` call.
        resumed_from: the step a checkpoint resumed from (0: a fresh start).
    """

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    precision: str = "fp32"
    target_tokens: int = 0
    # (step, target tokens so far, eval_fn's value) every ``eval_every`` steps
    evals: list[tuple[int, int, float]] = field(default_factory=list)
    resumed_from: int = 0  # the checkpoint's step when the run resumed, else 0


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (peft leaves only the adapters trainable), fused
    where they are all on a GPU.

    On CUDA tensors torch's default is the foreach implementation, which steps every parameter
    at once and holds a temporary as large as all the second moments at the optimizer step (a
    full fine-tune of an 8 B model in bf16: 15 GiB more, ``fake_memory.Stack(optimizer=...)``);
    ``fused=True`` holds none and is what transformers' ``Trainer`` (``adamw_torch_fused``) and
    torchtitan run. On a CPU torch's own default, the for-loop, stays.

    Args:
        model: the model.
        config: gives the learning rate and weight decay.

    Returns:
        The optimizer.

    Raises:
        ValueError: if the model has no trainable parameters.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model: has no trainable parameters")
    on_gpu = all(p.device.type == "cuda" and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                             fused=True if on_gpu else None)


def optimizer_step(
    model: torch.nn.Module,
    optimizer: Any,
    max_grad_norm: float | None,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Unscale (fp16), clip, step and clear gradients.

    Args:
        model: the model whose gradients are clipped.
        optimizer: its optimizer.
        max_grad_norm: the clipping norm (None: no clipping).
        scaler: fp16's gradient scaler (None: none).
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                       max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_grad_scaler(model: torch.nn.Module, precision: str, device: torch.device) -> Any:
    """A loss scaler for fp16 (None otherwise): FSDP2 needs the sharded one, which reduces the
    inf/NaN check over ranks so every rank skips the same steps.

    Args:
        model: the model (an ``FSDPModule`` gets the sharded scaler).
        precision: the resolved precision.
        device: where it trains.

    Returns:
        The scaler, or None.
    """
    if precision != "fp16":
        return None
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def train(
    model: torch.nn.Module,
    examples: list[dict[str, list[int]]],
    pad_token_id: int,
    config: TrainConfig,
    optimizer: Any = None,
    batch_stream: Iterator[dict[str, torch.Tensor]] | None = None,
    loss_fn: LossFn | None = None,
    eval_fn: Callable[[torch.nn.Module], float] | None = None,
    on_step: Callable[[int, TrainResult], None] | None = None,
) -> TrainResult:
    """Train ``model`` on tokenized ``examples`` for ``config.steps`` optimizer steps.

    Inside a process group (DDP or FSDP, see ``recipes_lib.distributed``) every rank draws the
    same global batch of ``global_batch_size * world_size`` examples and trains on its own slice;
    the loss is normalised by the target tokens of the whole global batch, so the run matches a
    single process with the same global batch.

    Args:
        model: a transformers or peft causal LM (or its DDP / FSDP wrapper), on its device.
        examples: output of ``data.tokenize_examples``.
        pad_token_id: the tokenizer's pad id.
        config: the run's settings (validated here).
        optimizer: any optimizer with step/zero_grad (e.g. ``CPUOffloadOptimizer``); default
            AdamW over trainable parameters.
        batch_stream: this rank's batches (e.g. a DataLoader with a DistributedSampler) instead
            of drawing them from ``examples``.
        loss_fn: the loss summed over a micro-batch's target tokens, ``loss_fn(model, batch)``
            (e.g. ``distillation.DistillationLoss``); default next-token cross-entropy.
        eval_fn: called with the model every ``config.eval_every`` steps (and after the last);
            its values land in ``TrainResult.evals`` with the step and the tokens seen.
        on_step: called as ``on_step(step, result)`` after each optimizer step (``step`` counts
            from 1), before that step's eval and checkpoint: logging, early stopping by raising,
            or a fault injected by a test (``distributed.kill_rank_after``).

    With ``config.checkpoint_dir`` the run saves every ``checkpoint_every`` steps and at the end
    (``train_state``: atomic, safetensors + weights-only state) and, when a checkpoint is already
    there, resumes from it: weights, optimizer, scheduler, scaler, RNG and data position, so the
    losses continue exactly as an uninterrupted run's. Under torchrun every rank calls this and
    the checkpoint is sharded (``torch.distributed.checkpoint``), so a run restarted by
    ``torchrun --max-restarts`` after a rank died resumes from the last complete checkpoint.

    Returns:
        TrainResult with one loss (the global batch's) and one wall time per optimizer step.

    Raises:
        ValueError: for an invalid config, a global batch larger than the data, or a
            checkpoint that does not match the model or is past ``config.steps``.

    Example:
        >>> config = TrainConfig(steps=50)
        >>> result = train(model, examples, tok.pad_token_id, config)  # doctest: +SKIP
    """
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    config.validate()
    device = next(model.parameters()).device
    precision = resolve_precision(config.precision, device)
    torch.manual_seed(config.seed)
    optimizer = optimizer if optimizer is not None else make_optimizer(model, config)
    inner = getattr(optimizer, "optimizer", optimizer)  # wrappers expose the real one
    scheduler = get_scheduler(config.schedule, inner, num_warmup_steps=config.warmup_steps,
                              num_training_steps=config.steps)
    scaler = make_grad_scaler(model, precision, device)
    writer = None
    if config.log_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(config.log_dir)

    rank, world_size = world()
    if batch_stream is None:
        stream = data.batches(examples, config.global_batch_size * world_size, pad_token_id,
                              seed=config.seed)
        if world_size > 1:
            stream = (rank_slice(b, rank, world_size) for b in stream)
    else:
        stream = iter(batch_stream)
    result = TrainResult(precision=precision)
    start = 0
    if config.checkpoint_dir is not None:
        found = train_state.latest(config.checkpoint_dir)
        held = train_state.step_of(found) if found is not None else 0
        if held > config.steps:
            raise ValueError(
                f"checkpoint_dir={str(config.checkpoint_dir)!r}: holds step {held}, beyond "
                f"steps={config.steps} (a longer run's weights and losses): pass steps >= "
                f"{held} to continue it, or a new checkpoint_dir to start over")
        if found is not None:
            restored = train_state.load(found, model, optimizer, scheduler, scaler)
            start = result.resumed_from = restored["step"]
            history = restored["history"]
            result.losses, result.step_times = history["losses"], history["step_times"]
            result.target_tokens = history["target_tokens"]
            for _ in range(start):  # the data position: replay the seeded stream
                next(stream)
    model.train()
    bar = tqdm(range(start, config.steps), desc=config.desc, initial=start, total=config.steps,
               disable=not config.progress or rank != 0, leave=False)
    for step in bar:
        batch = next(stream)
        t0 = time.perf_counter()
        n_tokens = all_reduce_sum(count_target_tokens(batch["labels"]))
        loss = forward_backward(model, batch, config.grad_accum_steps, precision, scaler,
                                num_target_tokens=n_tokens / world_size, loss_fn=loss_fn)
        optimizer_step(model, optimizer, config.max_grad_norm, scaler)
        scheduler.step()
        # the one host read of the step: the loss stays on the device until here
        loss = all_reduce_sum(loss) / world_size
        synchronize(device)
        result.step_times.append(time.perf_counter() - t0)
        result.losses.append(loss)
        result.target_tokens += int(n_tokens)
        if on_step is not None:
            on_step(step + 1, result)
        bar.set_postfix(loss=f"{loss:.3f}")
        if writer is not None:
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
        done = step + 1
        if eval_fn is not None and config.eval_every and (
                done % config.eval_every == 0 or done == config.steps):
            result.evals.append((done, result.target_tokens, float(eval_fn(model))))
            model.train()
        every = config.checkpoint_every
        if config.checkpoint_dir is not None and (
                done == config.steps or (every and done % every == 0)):
            train_state.save(config.checkpoint_dir, done, model, optimizer, scheduler, scaler,
                             {"losses": result.losses, "step_times": result.step_times,
                              "target_tokens": result.target_tokens})
    bar.close()
    if writer is not None:
        writer.close()
    model.eval()
    return result


def compare_optimizers(load_model: Callable[[], torch.nn.Module],
                       examples: list[dict[str, list[int]]], pad_token_id: int,
                       config: TrainConfig,
                       optimizers: dict[str, Callable[[torch.nn.Module], Any] | None],
                       collect: Callable[[torch.nn.Module, TrainResult, Any], dict[str, Any]]
                       ) -> dict[str, dict[str, Any]]:
    """The same steps from the same weights and batches with each optimizer, through
    :func:`train` (what ``optim8bit`` and ``offload`` compare against AdamW).

    Args:
        load_model: returns a fresh copy of the starting model (called once per optimizer).
        examples, pad_token_id, config: as :func:`train` takes them.
        optimizers: name -> ``make(model)`` returning the optimizer, or None for
            :func:`make_optimizer`'s AdamW; run in this order.
        collect: ``collect(model, result, optimizer)`` after each run: what to keep of it.

    Returns:
        name -> what ``collect`` returned.

    Raises:
        ValueError: for no optimizers.
    """
    if not optimizers:
        raise ValueError("optimizers: name at least one")
    out = {}
    for name, make in optimizers.items():
        model = load_model()
        opt = make(model) if make is not None else make_optimizer(model, config)
        out[name] = collect(model, train(model, examples, pad_token_id, config, optimizer=opt),
                            opt)
    return out
