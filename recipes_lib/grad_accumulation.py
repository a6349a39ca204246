"""Gradient accumulation that equals one large batch, padding and variable lengths included.

The trap: averaging each micro-batch's mean loss weights every micro-batch equally, so a micro-batch
with few target tokens counts as much as one with many. The large-batch loss is the mean over
*all target tokens of the global batch*; to reproduce it, each micro-batch contributes
``sum(token losses) / N_global`` where ``N_global`` counts the targets of all micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from recipes_lib.architectures import model_inputs, through_wrappers
from recipes_lib.data import IGNORE_INDEX
from recipes_lib.device import autocast

NORMALIZATIONS = ("global_tokens", "mean_of_means")
# loss_fn(model, micro_batch) -> the loss summed over the micro-batch's target tokens
LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def split_micro_batches(
    batch: dict[str, torch.Tensor], grad_accum_steps: int
) -> list[dict[str, torch.Tensor]]:
    """Split a padded batch into ``grad_accum_steps`` micro-batches, each trimmed of the pad
    columns at its end (all of them under right padding, the course's; a left-padded batch
    keeps its leading pad columns and every token).

    Args:
        batch: ``input_ids``, ``attention_mask`` and ``labels`` of the global batch.
        grad_accum_steps: the number of micro-batches.

    Returns:
        The micro-batches, in order.

    Raises:
        ValueError: if grad_accum_steps < 1 or does not divide the batch size.
    """
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps!r}: must be an integer >= 1")
    n = batch["input_ids"].shape[0]
    if n % grad_accum_steps:
        raise ValueError(
            f"grad_accum_steps={grad_accum_steps}: does not divide the batch size {n}"
        )
    size = n // grad_accum_steps
    micro = []
    for i in range(0, n, size):
        mb = {k: v[i:i + size] for k, v in batch.items()}
        if "attention_mask" in mb:  # up to the last column any row attends to
            used = mb["attention_mask"].any(0).nonzero()
            width = int(used[-1]) + 1 if len(used) else 0
            mb = {k: v[:, :width] for k, v in mb.items()}
        micro.append(mb)
    return micro


def count_target_tokens(labels: torch.Tensor) -> int:
    """Number of tokens that carry a loss after the causal shift (labels != -100).

    Args:
        labels: ``(batch, seq)`` labels, -100 where no loss is taken.

    Returns:
        The count, over the batch.

    Example:
        >>> count_target_tokens(torch.tensor([[5, 6, 7, -100]]))  # the first label has no input
        2
    """
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over target tokens, computed in fp32.

    The labels are shifted, not the logits (as transformers' loss since #35646): slicing off
    the last position of several sequences leaves a view that flattens only by copying, one
    more tokens x vocab tensor while the cross-entropy runs; the padded last position carries
    no loss.

    Args:
        logits: (batch, seq, vocab).
        labels: (batch, seq), -100 where no loss is taken.

    Returns:
        The 0-dim fp32 sum.

    Example:
        >>> logits, labels = torch.randn(2, 5, 11), torch.randint(11, (2, 5))
        >>> ref = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
        ...                       reduction="sum")
        >>> torch.allclose(causal_lm_loss_sum(logits, labels), ref)
        True
    """
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def forward_backward(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    normalization: str = "global_tokens",
    num_target_tokens: float | None = None,
    loss_fn: LossFn | None = None,
) -> torch.Tensor:
    """Accumulate the gradients of one global batch over ``grad_accum_steps`` micro-batches.

    Args:
        model: a causal LM returning ``.logits`` (transformers or peft).
        batch: ``input_ids``, ``labels`` (-100 = no loss) and, unless every row is full,
            ``attention_mask``; packed rows carry ``position_ids`` instead (restarting at each
            document, ``packing.collate_padding_free``); on any device.
        grad_accum_steps: micro-batches per global batch; must divide the batch size.
        precision: resolved precision ("fp32", "bf16", "fp16") used for autocast.
        scaler: a GradScaler for fp16, else None.
        normalization: "global_tokens" (exact, the default) or "mean_of_means" (the common
            mistake, kept to show its error).
        num_target_tokens: the loss denominator when ``batch`` is one rank's share of a larger
            batch (data parallel): the global batch's target tokens divided by the world size,
            since DDP and FSDP average gradients over ranks. Default: ``batch``'s own count.
        loss_fn: ``loss_fn(model, micro_batch) -> loss summed over the micro-batch's target
            tokens`` (e.g. ``distillation.DistillationLoss``); default next-token cross-entropy.
            One that calls the decoder and reads the head itself, not the model's forward
            (``bypasses_forward = True``: the chunked and distillation losses), runs as that
            forward inside a DDP wrapper or an FSDP2 root (``architectures.through_wrappers``),
            so the wrapper's hooks run.

    Returns:
        The loss sum over ``batch`` divided by the denominator: the global batch's mean loss per
        target token (in data parallel, the mean of this value over ranks is), as a detached
        0-dim tensor on the model's device: no host synchronisation per micro-batch; read it
        with ``float()`` once per step.

    Raises:
        ValueError: for a bad grad_accum_steps, a batch with no target tokens, or an unknown
            normalization.

    Example:
        >>> loss = forward_backward(model, batch, grad_accum_steps=4)  # doctest: +SKIP
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: expected one of {NORMALIZATIONS}")
    device = next(model.parameters()).device
    micro = split_micro_batches(batch, grad_accum_steps)
    n_global = count_target_tokens(batch["labels"]) if num_target_tokens is None \
        else num_target_tokens
    if n_global == 0:
        raise ValueError("batch: no target tokens (every label is -100)")
    total = torch.zeros((), device=device, dtype=torch.float32)
    for mb in micro:
        mb = {k: v.to(device) for k, v in mb.items()}
        with autocast(device, precision):
            if getattr(loss_fn, "bypasses_forward", False):  # as the model's forward
                loss_sum = through_wrappers(model, lambda m, mb=mb: loss_fn(m, mb))
            elif loss_fn is not None:  # it calls the model, wrappers and all, itself
                loss_sum = loss_fn(model, mb)
            else:
                logits = model(**model_inputs(mb)).logits  # packed rows stay packed
        if loss_fn is None:
            loss_sum = causal_lm_loss_sum(logits, mb["labels"])
            # autograd saved what backward needs; a reference held here would keep one more
            # tokens x vocab tensor alive through backward (Trainer drops the model's outputs
            # before its backward too; torchtitan's train step does `del pred`)
            del logits
        total += loss_sum.detach().float()
        if normalization == "global_tokens":
            loss = loss_sum / n_global
        else:
            loss = loss_sum / max(count_target_tokens(mb["labels"]), 1) / len(micro)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    return total / n_global


def batch_gradients(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    grad_accum_steps: int = 1,
    normalization: str = "global_tokens",
) -> dict[str, torch.Tensor]:
    """Gradients of one global batch (accumulated over micro-batches), leaving ``.grad`` cleared.

    Args:
        model: the model.
        batch: the global batch (``input_ids``, ``attention_mask``, ``labels``).
        grad_accum_steps: micro-batches it is split into.
        normalization: "global_tokens" (divide by the batch's target tokens: exact) or the
            per-micro-batch mean that ``forward_backward`` offers as the naive baseline.

    Returns:
        Parameter name -> its gradient (a detached fp32 copy), trainable parameters only.

    Example:
        >>> ref = batch_gradients(model, batch, 1)  # doctest: +SKIP
        >>> max_rel_error(batch_gradients(model, batch, 4), ref)  # ~1e-7 in fp32  # doctest: +SKIP
    """
    from recipes_lib.numerics import collect_gradients

    model.zero_grad(set_to_none=True)
    forward_backward(model, batch, grad_accum_steps, normalization=normalization)
    grads = collect_gradients(model)
    model.zero_grad(set_to_none=True)
    return grads
