"""The course's recipes in the trainers people use: transformers' ``Trainer``, TRL's
``SFTTrainer``, and ``accelerate`` / ``torchrun`` for FSDP2.

Each recipe is one or two settings there (:data:`SETTINGS`). :func:`run_trainer` runs a few steps
of the real trainer on the course's model and data, with one training step measured by the
course's own meter (``memory.measure_memory``), so a notebook can put the trainer's figure beside
its own loop's. Where the two differ, the notebook says by how much and why.

Pitfalls the settings avoid, each a known issue:

- checkpointing: transformers >= 5 checkpoints non-reentrant by default and makes the embeddings'
  output require grad when it must; reentrant checkpointing of a model with frozen inputs gives
  the adapters no gradient (transformers #26221) and is slower (peft #1142): see
  :func:`check_settings`.
- accumulation: the 2024 bug (transformers #34191), a mean per micro-batch instead of one over the
  accumulated tokens, is fixed by passing ``num_items_in_batch`` to the loss; the course's loop
  divides by the global token count too (``grad_accumulation``).
- bf16 on a GPU without it (a T4, unsloth #780): :func:`precision_settings` picks fp16 there.
  TRL's ``SFTConfig`` defaults to ``bf16=True``, which a CPU without native bf16 emulates (one
  padded SFT step of the course model ran 35 s on a 2-core AVX2 EPYC): :func:`run_trainer` asks
  :func:`precision_settings` instead, so such a CPU trains in fp32, said aloud.
- a loss of one's own in ``compute_loss`` that reads the decoder and the head itself (a chunked
  cross-entropy, a distillation loss) skips the model's forward, where accelerate puts its
  autocast and DDP prepares its all-reduce: :func:`run_trainer` runs its ``loss_fn`` as that
  forward, through Trainer's wrappers (:func:`course_loss_against_own` checks it).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version as installed_version
from typing import Any

import torch
from packaging.version import Version

from recipes_lib import calc, data, device
from recipes_lib.architectures import as_forward
from recipes_lib.compare import measure_training_step
from recipes_lib.memory import MemoryReport, measure_memory, tensor_bytes
from recipes_lib.optim8bit import forget_overrides, state_bytes


def checkpointing_settings(use_reentrant: bool = False, version: str | None = None
                           ) -> dict[str, Any]:
    """Activation checkpointing as ``TrainingArguments`` / ``SFTConfig`` settings, in the names
    of transformers ``version`` (default: the installed one): ``activation_checkpointing`` and
    ``activation_checkpointing_kwargs`` from 5.23, which renamed them; ``gradient_checkpointing``
    and ``gradient_checkpointing_kwargs`` before (accepted, deprecated, until v6). The kwargs
    also take ``every_n_layers`` from 5.16 and ``offload`` from 5.17.

    Args:
        use_reentrant: PyTorch's reentrant checkpointing (False: the non-reentrant mode, which
            works with frozen inputs).
        version: a transformers version (default: the installed one).

    Returns:
        The two settings, name -> value.

    Example:
        >>> checkpointing_settings(version="5.22.2")
        {'gradient_checkpointing': True, 'gradient_checkpointing_kwargs': {'use_reentrant': False}}
    """
    renamed = Version(version or installed_version("transformers")) >= Version("5.23")
    name = "activation_checkpointing" if renamed else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"use_reentrant": use_reentrant}}


# recipe -> the TrainingArguments / SFTConfig settings that apply it, in the installed
# transformers' names
SETTINGS: dict[str, dict[str, Any]] = {
    "activation_checkpointing": checkpointing_settings(),
    "grad_accumulation": {"gradient_accumulation_steps": 4},
    "optim8bit": {"optim": "adamw_bnb_8bit"},
    "bf16": {"bf16": True},
    "padding_free": {"padding_free": True},  # SFTConfig (TRL)
    "chunked_ce": {"use_liger_kernel": True},  # Liger's fused linear CE: CUDA (Triton) only
}


def precision_settings(where: torch.device | str) -> dict[str, bool]:
    """``bf16`` / ``fp16`` for TrainingArguments on the device ``where``, said aloud when bf16
    cannot run (a T4: fp16 with a gradient scaler; a CPU without native bf16: fp32).

    Args:
        where: the device the trainer runs on.

    Returns:
        ``{"bf16": True}``, ``{"fp16": True}`` or ``{}`` (fp32).
    """
    where = torch.device(where)
    if device.supports_bf16(where):
        return {"bf16": True}
    if where.type == "cuda":
        warnings.warn(f"{device.describe_device(where)} has no bf16: fp16=True (Trainer adds "
                      "the gradient scaler)", stacklevel=2)
        return {"fp16": True}
    warnings.warn(f"{device.describe_device(where)} has no native bf16: training in fp32",
                  stacklevel=2)
    return {}


def predicted_8bit_state_ratio(model: torch.nn.Module) -> float:
    """``optim="adamw_bnb_8bit"`` states over AdamW's, as ``Trainer`` builds them: 8-bit
    blockwise moments (``calc.adamw_8bit_state_bytes``) except for every ``nn.Embedding``,
    which ``Trainer`` keeps in 32 bits (a bitsandbytes ``GlobalOptimManager`` override).

    Args:
        model: the model, whose trainable parameters are counted.

    Returns:
        8-bit state bytes over AdamW's.
    """

    embedding = {p.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)
                 for p in m.parameters() if p.requires_grad}
    seen, eight, fp32 = set(), [], 0
    for p in model.parameters():
        if not p.requires_grad or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() in embedding:
            fp32 += p.numel()
        else:
            eight.append(p.numel())
    total = sum(eight) + fp32
    return ((calc.adamw_8bit_state_bytes(eight) + calc.optimizer_bytes(fp32, "adamw"))
            / calc.optimizer_bytes(total, "adamw"))


def check_settings(model: torch.nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """Refuse, or fix aloud, settings that conflict with a recipe before a trainer runs.

    - reentrant checkpointing (``use_reentrant=True``) of a model whose inputs do not require
      grad (LoRA's frozen embeddings): transformers >= 5 calls ``enable_input_require_grads``
      itself, so the adapters get gradients; said aloud, since it recomputes through a slower
      path than non-reentrant (peft #1142), and the fix is ``use_reentrant=False``;
    - ``optim="adamw_bnb_8bit"`` without bitsandbytes: an error naming it.

    Args:
        model: the model the trainer will run.
        settings: TrainingArguments / SFTConfig fields.

    Returns:
        The settings to use.

    Raises:
        ValueError: naming the setting, for a conflict that has no fix here.
    """
    out = dict(settings)
    ckpt = out.get("activation_checkpointing") or out.get("gradient_checkpointing")
    kwargs = (out.get("activation_checkpointing_kwargs")
              or out.get("gradient_checkpointing_kwargs") or {})
    frozen = not any(p.requires_grad for p in model.get_input_embeddings().parameters())
    if ckpt and kwargs.get("use_reentrant", False) and frozen:
        warnings.warn("use_reentrant=True with frozen input embeddings (LoRA): reentrant "
                      "checkpointing would give the adapters no gradient (transformers #26221); "
                      "transformers makes the embeddings' output require grad for it "
                      "(enable_input_require_grads). Prefer use_reentrant=False: the same "
                      "memory, no hook, and faster (peft #1142)", stacklevel=2)
    if str(out.get("optim", "")).endswith("bnb_8bit") and not device.has_module("bitsandbytes"):
        raise ValueError(f"optim={out['optim']!r}: needs bitsandbytes (pip install "
                         "bitsandbytes), or use optim='adamw_torch'")
    return out


@dataclass
class TrainerRun:
    """What a few trainer steps produced: the logged losses, the measured step, the optimizer.

    Attributes:
        losses: the logged loss of each step.
        step: the measured training step's ``MemoryReport`` (None: not measured).
        optimizer_state_bytes: the optimizer's state bytes after the last step.
        settings: the settings the trainer ran with.
        trainer: the trainer itself.
    """

    losses: list[float] = field(default_factory=list)
    step: MemoryReport | None = None  # the measured training step (forward + backward)
    optimizer_state_bytes: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    trainer: Any = None


def _measured(base: type) -> type:
    """A subclass of the trainer ``base`` whose ``training_step`` number ``measure_step`` runs
    under the course's memory meter."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._steps_done = getattr(self, "_steps_done", 0) + 1
        if self._steps_done != self._measure_step:
            return base.training_step(self, model, inputs, num_items_in_batch)
        out = []
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        self._report = measure_memory(
            lambda: out.append(base.training_step(self, model, inputs, num_items_in_batch)),
            model, inner)
        return out[0]

    return type(f"Measured{base.__name__}", (base,), {"training_step": training_step})


def _course_loss(base: type) -> type:
    """A subclass of the trainer ``base`` whose ``compute_loss`` is a course ``loss_fn`` (the
    loss summed over a micro-batch's target tokens, from the model itself, e.g.
    ``chunked_loss.ChunkedCausalLMLoss``) divided by ``num_items_in_batch``: the target tokens
    of the whole accumulated batch, which makes it the mean over them, as Trainer's own loss
    since transformers #34191. ``compute_loss_func`` cannot serve: it receives the model's
    outputs, logits already made.

    A loss that reads the decoder and the LM head itself (``bypasses_forward = True``: the
    chunked and distillation losses) runs as the model's forward, called through whatever
    Trainer wrapped it in (``architectures.as_forward``): called on the bare model it would
    leave out accelerate's autocast (``bf16=True`` trained the decoder in fp32) and DDP's
    gradient synchronisation (prepared by DDP's own forward). And where Trainer counts the
    target tokens of every rank (``average_tokens_across_devices``, the default) the loss is
    multiplied by the ranks sharing that count, as Trainer's own ``compute_loss`` does, since
    DDP and FSDP average the ranks' gradients. A model whose forward takes no loss keywords
    gets no count from Trainer: the loss is then the micro-batch's own mean, which Trainer
    divides by the accumulation steps, as it does its own loss for such a model."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("loss_fn: a course loss returns no model outputs "
                             "(return_outputs=True, e.g. evaluation with predictions)")
        if getattr(self._loss_fn, "bypasses_forward", False):
            inner = self.accelerator.unwrap_model(model)

            def loss() -> torch.Tensor:
                with self.accelerator.autocast():  # as accelerate's own forward wrapper
                    return self._loss_fn(inner, inputs)

            with as_forward(inner, loss):  # through Trainer's wrappers, as the model's forward
                total = model()
        else:  # a loss that calls the model (its wrappers and their forward) itself
            total = self._loss_fn(model, inputs)
        self.loss_is_scaled_for_ga = num_items_in_batch is not None
        if num_items_in_batch is None:  # no count from Trainer: this micro-batch's own
            return total / (inputs["labels"][:, 1:] != -100).sum()
        loss = total / num_items_in_batch
        if self.args.average_tokens_across_devices:  # Trainer does (transformers #34373)
            shared = self.accelerator.num_processes // self.get_tp_size()
            loss = loss * (shared if self.args.n_gpu <= 1 else self.args.n_gpu)
        return loss

    return type(f"CourseLoss{base.__name__}", (base,), {"compute_loss": compute_loss})


def run_trainer(
    model: torch.nn.Module,
    examples: list[dict[str, list[int]]],
    tokenizer: Any,
    settings: dict[str, Any] | None = None,
    steps: int = 2,
    micro_batch_size: int = 4,
    lr: float = 1e-3,
    optim: str = "adamw_torch",
    sft: bool = False,
    measure_step: int = 1,
    seed: int = 0,
    peft_config: Any = None,
    loss_fn: Any = None,
) -> TrainerRun:
    """A few steps of ``transformers.Trainer`` (or TRL's ``SFTTrainer``) on ``examples``.

    The examples are taken in order (``train_sampling_strategy="sequential"``) and padded by the
    course's collator, so the trainer sees the batches the course's loop sees; TRL's own collator
    is used with ``sft=True`` (that is what ``padding_free`` changes). Constant learning rate,
    no weight decay, nothing saved or reported; checkpointing off unless ``settings`` turn it on
    (TRL's ``SFTConfig`` has it on by default). ``SFTTrainer`` runs in the precision
    :func:`precision_settings` picks for the model's device unless ``settings`` name ``bf16`` or
    ``fp16`` (``SFTConfig`` alone would take bf16 where it is only emulated).

    Args:
        model: a causal LM (peft-wrapped for LoRA / QLoRA).
        examples: tokenized examples with ``input_ids`` and ``labels`` (``data.tokenize_examples``).
        tokenizer: gives the pad id (and TRL its processing class).
        settings: the recipe's TrainingArguments / SFTConfig fields (:data:`SETTINGS`).
        steps: optimizer steps.
        micro_batch_size: ``per_device_train_batch_size``.
        lr, optim: learning rate and Trainer's optimizer name (``settings`` may override it).
        sft: run TRL's ``SFTTrainer`` with an ``SFTConfig`` instead.
        measure_step: the micro-step (1-based) measured by the course's meter; 0: none.
        seed: the trainer's seed.
        peft_config: a ``LoraConfig`` for ``SFTTrainer`` to apply, as TRL users pass it (for a
            quantized model TRL casts the adapters to bf16 and, since trl #4577, runs no k-bit
            preparation: see ``quantization.held_bytes_by_kind``).
        loss_fn: a course loss, ``loss_fn(model, batch) -> sum over target tokens`` (e.g.
            ``chunked_loss.ChunkedCausalLMLoss``), as ``Trainer``'s ``compute_loss``, divided by
            ``num_items_in_batch``; None: the model's own loss.

    Returns:
        A :class:`TrainerRun`: logged losses, the measured step, the optimizer's state bytes.

    Raises:
        ValueError: for steps < 1, no examples, or settings :func:`check_settings` refuses.

    Example:
        >>> run = run_trainer(model, examples, tok, SETTINGS["activation_checkpointing"])
        ... # doctest: +SKIP
        >>> run.step.activation_bytes  # doctest: +SKIP
    """
    from datasets import Dataset
    from transformers import PrinterCallback, Trainer, TrainingArguments

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: must be an integer >= 1")
    if not examples:
        raise ValueError("examples: empty list, nothing to train on")
    where = next(model.parameters()).device
    settings = dict(settings or {})
    if sft and not {"bf16", "fp16"} & settings.keys():  # SFTConfig's default is bf16=True
        settings = {"bf16": False, **precision_settings(where), **settings}
    settings = check_settings(model, {"optim": optim, **settings})
    common = dict(output_dir=tempfile.mkdtemp(prefix="trainer-"), max_steps=steps,
                  per_device_train_batch_size=micro_batch_size, learning_rate=lr,
                  lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1,
                  report_to="none", save_strategy="no", disable_tqdm=True, seed=seed,
                  use_cpu=where.type == "cpu",  # on MPS too, Trainer runs where the model is
                  train_sampling_strategy="sequential",
                  dataloader_num_workers=0,
                  # explicit: TRL's SFTConfig turns checkpointing on by default, Trainer off
                  **{next(iter(checkpointing_settings())): False, **settings})
    dataset = Dataset.from_list([{"input_ids": e["input_ids"], "labels": e["labels"]}
                                 for e in examples])
    if sft:
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(max_length=None, **common)
        base = _course_loss(SFTTrainer) if loss_fn is not None else SFTTrainer
        trainer = _measured(base)(model=model, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, peft_config=peft_config)
    else:
        if peft_config is not None:
            raise ValueError("peft_config: only SFTTrainer applies it (sft=True); wrap the "
                             "model with peft first for Trainer")
        args = TrainingArguments(remove_unused_columns=False, **common)
        pad = tokenizer.pad_token_id
        base = _course_loss(Trainer) if loss_fn is not None else Trainer
        trainer = _measured(base)(model=model, args=args, train_dataset=dataset,
                                  data_collator=lambda rows: data.collate(rows, pad))
    trainer._measure_step, trainer._report, trainer._loss_fn = measure_step, None, loss_fn
    trainer.remove_callback(PrinterCallback)  # the losses come back in TrainerRun instead
    try:
        trainer.train()
    finally:  # nothing is saved there (save_strategy="no"): the folder goes with the run
        shutil.rmtree(args.output_dir, ignore_errors=True)
    state = state_bytes(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
    # optim="adamw_bnb_8bit" left its embeddings' 32-bit override in bitsandbytes' process-wide
    # manager, which would hold them after this run and apply to later optimizers
    forget_overrides(trainer.model)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return TrainerRun(losses=losses, step=trainer._report, optimizer_state_bytes=state,
                      settings=settings, trainer=trainer)


def compare_runs(make_model: Any, examples: list[dict[str, list[int]]], tokenizer: Any,
                 settings: dict[str, Any], metric: str = "activation_bytes", steps: int = 1,
                 **kwargs: Any) -> dict[str, Any]:
    """The trainer without and with a recipe's ``settings``, each on a fresh model from
    ``make_model``: ``metric`` of the recipe run over the baseline's, and both runs.

    Args:
        metric: "activation_bytes" (the measured step's activations and temporaries at its
            peak) or "optimizer_state_bytes" (after the last step).
        **kwargs: passed to :func:`run_trainer` (``micro_batch_size``, ``sft``...).

    Returns:
        ``{"ratio", "baseline", "recipe"}``: the recipe run's metric over the baseline's, and
        both :class:`TrainerRun` s.

    Raises:
        ValueError: for an unknown metric.

    Example:
        >>> out = compare_runs(lambda: load_model(path), examples, tok,
        ...                    SETTINGS["activation_checkpointing"])  # doctest: +SKIP
        >>> out["ratio"]  # doctest: +SKIP
        0.21
    """
    if metric not in ("activation_bytes", "optimizer_state_bytes"):
        raise ValueError(f"metric={metric!r}: expected 'activation_bytes' or "
                         "'optimizer_state_bytes'")
    measure = 1 if metric == "activation_bytes" else 0
    runs = [run_trainer(make_model(), examples, tokenizer, s, steps=steps, measure_step=measure,
                        **kwargs) for s in ({}, settings)]

    def value(run: TrainerRun) -> float:
        return run.step.activation_bytes if measure else run.optimizer_state_bytes

    return {"ratio": value(runs[1]) / value(runs[0]), "baseline": runs[0], "recipe": runs[1]}


def compare_losses(make_model: Any, examples: list[dict[str, list[int]]], tokenizer: Any,
                   loss_fns: dict[str, Any], micro_batch_size: int = 8) -> dict[str, Any]:
    """One training step with each loss, in the course's loop and in ``Trainer``, each on a
    fresh model from ``make_model`` and measured by the same meter: does the trainer keep what
    the loop shows?

    Args:
        make_model: returns a fresh copy of the same model.
        examples: one batch's worth of tokenized examples (``micro_batch_size`` of them).
        loss_fns: name -> course loss (``loss_fn(model, batch)``, summed over target tokens;
            None: the model's own). The first is the baseline of both ratios.

    Returns:
        ``loop_ratio`` and ``trainer_ratio`` (activation bytes of the last loss over the
        first's), ``trainer_losses`` (name -> Trainer's logged loss) and ``rows`` (name ->
        ``loop MiB`` / ``Trainer MiB`` / ``Trainer loss``, for a table).

    Raises:
        ValueError: for fewer than two losses, or examples that are not one batch.

    Example:
        >>> out = compare_losses(make_model, examples, tok,
        ...                      {"own loss": None, "chunked CE": ChunkedCausalLMLoss(128)})
        ... # doctest: +SKIP
        >>> out["trainer_ratio"] / out["loop_ratio"]  # doctest: +SKIP
    """
    if len(loss_fns) < 2:
        raise ValueError(f"loss_fns: {list(loss_fns)}; give a baseline and at least one loss")
    if len(examples) != micro_batch_size:
        raise ValueError(f"examples: {len(examples)} given, one batch of micro_batch_size="
                         f"{micro_batch_size} needed")
    batch = data.collate(examples, tokenizer.pad_token_id)
    loop = {name: measure_training_step(make_model(), batch, repeats=0, loss_fn=fn).memory
            for name, fn in loss_fns.items()}
    runs = {name: run_trainer(make_model(), examples, tokenizer, steps=1,
                              micro_batch_size=micro_batch_size, loss_fn=fn)
            for name, fn in loss_fns.items()}
    first, *_, last = loss_fns
    return {
        "loop_ratio": loop[last].activation_bytes / loop[first].activation_bytes,
        "trainer_ratio": (runs[last].step.activation_bytes
                          / runs[first].step.activation_bytes),
        "trainer_losses": {name: run.losses[0] for name, run in runs.items()},
        "rows": {name: {"loop MiB": loop[name].activation_bytes / 2**20,
                        "Trainer MiB": runs[name].step.activation_bytes / 2**20,
                        "Trainer loss": runs[name].losses[0]} for name in loss_fns},
    }


def course_loss_against_own(model_path: str, settings: dict[str, Any] | None = None,
                            chunk_size: int = 16, steps: int = 2, micro_batch_size: int = 2,
                            grad_accum_steps: int = 2, max_length: int = 128,
                            accepts_loss_kwargs: bool = True) -> dict[str, Any]:
    """Trainer's own loss and a course loss (chunked cross-entropy, ``loss_fn`` of
    :func:`run_trainer`) from the same weights over the same accumulated batches, in one process
    or on every rank of a ``torchrun`` / ``accelerate launch`` job (``distributed.launch``):
    plain SGD at learning rate 1 without clipping, so the update is the gradient and any scale
    the loss gets wrong shows in it.

    Args:
        model_path: the model's folder.
        settings: further TrainingArguments fields of both runs (e.g. ``{"bf16": True}``).
        chunk_size: the chunked loss's tokens per chunk.
        steps: optimizer steps.
        micro_batch_size: examples per rank per micro-batch.
        grad_accum_steps: micro-batches per step.
        max_length: the longest example kept.
        accepts_loss_kwargs: False sets the model's ``accepts_loss_kwargs`` so (as Qwen2.5-VL's
            is): Trainer then counts no tokens and divides each micro-batch's mean loss by the
            accumulation steps, and so must the course loss.

    Returns:
        ``{"world_size", "own_losses", "course_losses", "update_rel_diff"}`` (the largest
        difference between the two runs' updates over the largest update) and
        ``{"own_dtype", "course_dtype"}``: the output dtype of the decoder's first linear layer
        in each run (autocast's, when a mixed precision is asked for).

    Example:
        >>> out = course_loss_against_own(path, {"bf16": True})  # doctest: +SKIP
        >>> out["course_dtype"], out["update_rel_diff"] < 1e-4  # doctest: +SKIP
        ('torch.bfloat16', True)
    """
    from recipes_lib import model as models
    from recipes_lib.chunked_loss import ChunkedCausalLMLoss
    from recipes_lib.distributed import world

    _, world_size = world()
    tok = models.load_tokenizer(model_path)
    examples = data.tokenize_examples(data.load_corpus("topic", "train"), tok, max_length, "sft")
    examples = examples[:micro_batch_size * grad_accum_steps * world_size * steps]
    out: dict[str, Any] = {"world_size": world_size}
    updates: dict[str, list[torch.Tensor]] = {}
    for name, loss_fn in (("own", None), ("course", ChunkedCausalLMLoss(chunk_size))):
        model = models.load_model(model_path)
        if not accepts_loss_kwargs:
            model.accepts_loss_kwargs = False
        linear = next(m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
        dtypes: set[str] = set()
        hook = linear.register_forward_hook(
            lambda mod, args, y, seen=dtypes: seen.add(str(y.dtype)))
        run, updates[name] = _sgd_update(model, examples, tok, grad_accum_steps,
                                         micro_batch_size, steps, settings, loss_fn)
        hook.remove()
        out[f"{name}_losses"], out[f"{name}_dtype"] = run.losses, ", ".join(sorted(dtypes))
    out["update_rel_diff"] = _update_gap(updates["own"], updates["course"])
    return out


def _sgd_update(model: torch.nn.Module, examples: list[dict[str, list[int]]], tokenizer: Any,
                accumulation_steps: int, micro_batch_size: int, steps: int = 1,
                settings: dict[str, Any] | None = None, loss_fn: Any = None
                ) -> tuple[TrainerRun, list[torch.Tensor]]:
    """``steps`` of Trainer's plain SGD (lr 1, no clipping: the update is the gradient) on
    ``model``: the run, and each parameter's update (fp32)."""
    before = [p.detach().clone() for p in model.parameters()]
    settings = {"gradient_accumulation_steps": accumulation_steps, "max_grad_norm": 0.0,
                **(settings or {})}
    run = run_trainer(model, examples, tokenizer, settings, steps=steps,
                      micro_batch_size=micro_batch_size, lr=1.0, optim="sgd", measure_step=0,
                      loss_fn=loss_fn)
    return run, [p.detach().float() - b.float()
                 for p, b in zip(model.parameters(), before, strict=True)]


def _update_gap(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """The largest difference of two updates over the reference's largest update."""
    scale = max(float(u.abs().max()) for u in reference)
    return max(float((a - b).abs().max()) for a, b in zip(reference, other, strict=True)) / scale


def update_gap(make_model: Any, examples: list[dict[str, list[int]]], tokenizer: Any,
               micro_batch_size: int, accumulation_steps: int) -> float:
    """Gradient accumulation in ``Trainer``: one SGD step (lr 1, no clipping) over the same
    examples as one batch and as ``accumulation_steps`` micro-batches; the largest difference of
    the two updates, relative to the largest update. 0 up to float rounding when the loss is
    divided by the accumulated token count (``num_items_in_batch``, transformers #34191).

    Args:
        make_model: returns a fresh copy of the same model (called twice).
        examples: ``micro_batch_size * accumulation_steps`` examples of different lengths.
        tokenizer: gives the pad id.
        micro_batch_size: examples per micro-batch.
        accumulation_steps: micro-batches accumulated.

    Returns:
        The largest difference of the two updates over the largest update.

    Raises:
        ValueError: if the examples do not fill the accumulated batch exactly.
    """
    if len(examples) != micro_batch_size * accumulation_steps:
        raise ValueError(f"examples: {len(examples)} given, one step of {accumulation_steps} x "
                         f"{micro_batch_size} needs {micro_batch_size * accumulation_steps}")
    one, accumulated = (_sgd_update(make_model(), examples, tokenizer, k, micro)[1]
                        for micro, k in ((micro_batch_size * accumulation_steps, 1),
                                         (micro_batch_size, accumulation_steps)))
    return _update_gap(one, accumulated)


def fsdp_settings(model: torch.nn.Module) -> dict[str, Any]:
    """TrainingArguments for FSDP2 over every decoder block of ``model`` (the block class read
    from the model, not assumed), what an accelerate FSDP2 config file says too.

    Args:
        model: the model, whose decoder block class is read.

    Returns:
        ``{"fsdp", "fsdp_config"}`` for ``TrainingArguments``.

    Raises:
        ValueError: naming the architecture, where no decoder block class is found.
    """
    from recipes_lib.architectures import architecture_name, decoder_layers

    return _fsdp_args(architecture_name(decoder_layers(model)[0]))


def _fsdp_args(block: str) -> dict[str, Any]:
    return {"fsdp": "full_shard auto_wrap",
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": [block],
                            "reshard_after_forward": True}}


def fsdp_rank_state(model_path: str, steps: int = 2, micro_batch_size: int = 2,
                    max_length: int = 128) -> dict[str, Any]:
    """Run on every rank of a ``torchrun`` / ``accelerate launch`` job (``distributed.launch``):
    ``Trainer`` with :func:`fsdp_settings` on the topic task; this rank's bytes of parameters,
    gradients and optimizer state after training (``fsdp.local_state_bytes``), the model's
    parameter bytes before wrapping, its losses, and how accelerate ran it
    (``distributed_type``). With one process it is the unsharded baseline.

    accelerate (1.x) turns FSDP on only for accelerator ranks (GPU, NPU, XPU, HPU...): on CPU
    ranks the same settings run as DDP (``MULTI_CPU``), each rank keeping the whole state, and
    nothing says so; the returned ``distributed_type`` does.

    Args:
        model_path: the model's folder.
        steps: optimizer steps.
        micro_batch_size: examples per rank per step.
        max_length: the longest example kept.

    Returns:
        ``{"rank", "world_size", "losses", "state_bytes", "unsharded_parameter_bytes",
        "distributed_type"}``.
    """
    from recipes_lib import model as models
    from recipes_lib.distributed import world
    from recipes_lib.fsdp import local_state_bytes

    rank, world_size = world()
    tok = models.load_tokenizer(model_path)
    examples = data.tokenize_examples(data.load_corpus("topic", "train"), tok, max_length,
                                      "sft")[:micro_batch_size * world_size * steps]
    model = models.load_model(model_path)
    unsharded = tensor_bytes(model.parameters())
    settings = fsdp_settings(model) if world_size > 1 else {}
    run = run_trainer(model, examples, tok, settings, steps=steps,
                      micro_batch_size=micro_batch_size, measure_step=0)
    wrapped = run.trainer.model_wrapped
    optimizer = getattr(run.trainer.optimizer, "optimizer", run.trainer.optimizer)
    return {"rank": rank, "world_size": world_size, "losses": run.losses,
            "state_bytes": local_state_bytes(wrapped, optimizer),
            "unsharded_parameter_bytes": unsharded,
            "distributed_type": str(run.trainer.accelerator.distributed_type.value)}


def accelerate_config(model: torch.nn.Module, num_processes: int,
                      mixed_precision: str = "bf16") -> str:
    """An ``accelerate launch --config_file`` YAML for FSDP2 over ``num_processes`` GPUs of one
    node, wrapping the model's own block class (the file ``accelerate config`` would write).

    Args:
        model: the model, whose decoder block class is read.
        num_processes: GPUs (ranks).
        mixed_precision: "no", "fp16" or "bf16".

    Returns:
        The YAML text.

    Raises:
        ValueError: for fewer than 2 processes or an unknown mixed precision.

    Example:
        >>> print(accelerate_config(model, 8))  # doctest: +SKIP
    """
    import yaml

    if not isinstance(num_processes, int) or num_processes < 2:
        raise ValueError(f"num_processes={num_processes!r}: FSDP needs at least 2")
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"mixed_precision={mixed_precision!r}: expected 'no', 'fp16' or 'bf16'")
    block = fsdp_settings(model)["fsdp_config"]["transformer_layer_cls_to_wrap"][0]
    return yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
        "mixed_precision": mixed_precision, "num_machines": 1, "num_processes": num_processes,
        "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                        "fsdp_transformer_layer_cls_to_wrap": block,
                        "fsdp_reshard_after_forward": True,
                        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                        "fsdp_cpu_ram_efficient_loading": True}}, sort_keys=False)


# fake_memory.Stack's optimizers as TrainingArguments' ``optim`` names ("adamw": the course's
# loop, fused on a GPU, as Trainer's default is)
OPTIM_NAMES = {"adamw": "adamw_torch_fused", "adamw-fused": "adamw_torch_fused",
               "adamw-foreach": "adamw_torch", "adamw-8bit": "adamw_bnb_8bit", "sgd": "sgd"}
_DTYPES = {"bf16-mixed": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# FSDP + QLoRA with bitsandbytes (its docs' fsdp_qlora guide) beside what fake_memory measures
FSDP_QLORA_NOTE = (
    "FSDP + QLoRA: bnb_4bit_quant_storage the load dtype, so FSDP shards the 4-bit weights as "
    "16-bit tensors with the rest of each block (bitsandbytes' FSDP-QLoRA guide), and no k-bit "
    "preparation, which would make the blocks' dtypes differ; measured as the course runs it, "
    "torchao's NF4 under FSDP2 (fsdp_qlora: the same 4-bit codes and block scales; the "
    "planner's row dequantizes them into the output alone, as bitsandbytes' kernel does), with "
    "the unquantized weights in fp32, which these settings keep in 16 bits")
# FSDP's CPU offload (fake_memory.Stack.fsdp_cpu_offload) in a trainer
FSDP_OFFLOAD_NOTE = (
    "FSDP's CPU offload: fsdp_config's cpu_offload (the 'offload' of fsdp='full_shard auto_wrap "
    "offload'; fsdp_offload_params: true in an accelerate config) keeps the shards, their "
    "gradients and the optimizer's states in CPU RAM and steps the optimizer there; each "
    "block's weights cross PCIe to the GPU for its all-gather, in forward and again in "
    "backward, every step")
# a GPU without bf16 (bf16=False): what fp16=True does to the stack as measured
FP16_NOTE = ("no bf16 on this GPU: fp16=True in place of bf16=True, the same bytes (autocast "
             "runs fp16 where it ran bf16; Trainer adds the gradient scaler fp16 needs)")
FP16_PURE_NOTE = ("no bf16 on this GPU: the base in fp16, the same bytes, and fp16=True for "
                  "the gradient scaler fp16's range needs; its autocast also runs the fp32 "
                  "adapters' matmuls in fp16, which the stack as measured (no autocast) does "
                  "not")


# Hub checkpoints that ship their own quantization, which from_pretrained keeps over a
# quantization_config passed to it: model type -> (what they ship, what loads the bf16 model the
# planner measures)
CHECKPOINT_QUANTIZATION = {"gpt_oss": ("MXFP4 experts", "Mxfp4Config(dequantize=True)")}


def stack_settings(stack: Any, batch_size: int,
                   model: torch.nn.Module | None = None, bf16: bool = True) -> dict[str, Any]:
    """A stack of the course's recipes (``fake_memory.Stack``: what the planner measures) as
    the settings that run it under transformers' ``Trainer`` (TRL's ``SFTConfig`` takes the same
    ``args``) with peft and bitsandbytes.

    On a GPU without bf16 (``bf16=False``: a T4, a V100) the stack's 16-bit tensors are fp16,
    the same bytes, and every stack trains with ``fp16=True``: Trainer's autocast and gradient
    scaler, which fp16's narrow range needs and which unscales fp32 gradients only, so the
    trainable weights must be fp32 (a full fine-tune loads in fp32; peft keeps adapters in fp32
    by default).

    Args:
        stack: the recipes.
        batch_size: sequences per optimizer step, over every rank.
        model: the model (built on the meta device is enough) whose decoder block class FSDP
            wraps (:func:`fsdp_settings`); None writes a placeholder for it. On a model where
            peft's "all-linear" fails (Llama 4's routers, Falcon-H1's Mamba ``out_proj``:
            ``architectures.lora_target_modules``), the LoRA targets are the layers it can
            adapt, with a note saying why; one whose hub checkpoints ship their own quantization
            (GPT-OSS: ``CHECKPOINT_QUANTIZATION``) is loaded as the bf16 model measured, or
            noted. A model whose
            config computes GELU as ``gelu_new`` (Phi-1/1.5/2) gets a note on the one-op
            ``gelu_pytorch_tanh``.
        bf16: the GPU runs bf16 (compute capability 8.0 and up); False: fp16 in its place, as
            above.

    Returns:
        ``{"load": from_pretrained keyword arguments, "quantization": BitsAndBytesConfig's or
        None, "kbit_preparation": prepare_model_for_kbit_training's or None, "lora": LoraConfig's
        or None, "args": TrainingArguments', "notes": what has no setting there}``; dtypes as
        ``torch`` attribute names ("bfloat16").

    Raises:
        ValueError: naming ``batch_size`` where the ranks and micro-batches do not divide it;
            naming the stack's field where it measures a past library's behaviour, or
            litgpt's own loss, which no setting of today's brings back (``loss``,
            ``bf16_embeddings``, ``nf4_keeps_input``).
            With ``bf16=False``, naming the stack's field whose 16-bit trainable weights the
            gradient scaler cannot unscale (``precision`` of a full fine-tune in pure 16 bits,
            ``autocast_adapter_dtype=False``).

    Example:
        >>> from recipes_lib.fake_memory import Stack
        >>> stack_settings(Stack(method="qlora", precision="bf16-mixed"), 4)["lora"]
        {'r': 16, 'lora_alpha': 32, 'target_modules': 'all-linear', 'lora_dropout': 0.0}
    """
    past = [name for name, then in {"loss": stack.loss != "course",
                                    "bf16_embeddings": stack.bf16_embeddings,
                                    "nf4_keeps_input": stack.nf4_keeps_input}.items() if then]
    if past:
        raise ValueError(f"stack.{past[0]}={getattr(stack, past[0])!r}: how a past library "
                         "version, or another library's own loop, ran (fake_memory.Stack), which "
                         "no setting of today's brings back")
    if not bf16:
        adapted = stack.method != "full"
        pure = {"precision": not adapted and stack.precision in ("bf16", "fp16"),
                "autocast_adapter_dtype": adapted and not stack.autocast_adapter_dtype}
        field = next((k for k, v in pure.items() if v), None)
        if field:
            raise ValueError(f"stack.{field}={getattr(stack, field)!r}: 16-bit trainable weights, "
                             "which fp16=True's gradient scaler cannot unscale (Trainer: "
                             "'Attempting to unscale FP16 gradients'); on a GPU without bf16 "
                             "train fp32 weights under autocast ('bf16-mixed' here, fp16 there)")
    shares = stack.fsdp_ranks * stack.grad_accum_steps
    if not isinstance(batch_size, int) or batch_size < 1 or batch_size % shares:
        raise ValueError(f"batch_size={batch_size!r}: must be a positive multiple of the ranks "
                         f"x micro-batches, {stack.fsdp_ranks} x {stack.grad_accum_steps}")
    mixed = stack.precision == "bf16-mixed"
    half = "bfloat16" if bf16 else "float16"  # the 16-bit dtype the GPU runs
    out: dict[str, Any] = {"load": {"dtype": _DTYPES[stack.precision].replace("bfloat16", half)},
                           "quantization": None, "kbit_preparation": None, "lora": None,
                           "notes": []}
    args: dict[str, Any] = {"per_device_train_batch_size": batch_size // shares,
                            "gradient_accumulation_steps": stack.grad_accum_steps,
                            "optim": OPTIM_NAMES[stack.optimizer]}
    if mixed and bf16:
        args["bf16"] = True
    elif not bf16 and stack.precision != "fp32":
        args["fp16"] = True  # autocast and the gradient scaler, for every 16-bit stack
        out["notes"].append(FP16_NOTE if mixed else FP16_PURE_NOTE)
    if stack.method == "qlora":
        out["load"] = {"dtype": half}  # the weights left unquantized, before k-bit prep.
        out["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                               "bnb_4bit_use_double_quant": True,
                               "bnb_4bit_compute_dtype": half}
        if stack.fsdp_ranks > 1:  # FSDP-QLoRA as bitsandbytes' guide runs it
            out["quantization"]["bnb_4bit_quant_storage"] = half
            out["notes"].append(FSDP_QLORA_NOTE)
        elif mixed:  # the course's QLoRA: norms, embeddings and head to fp32 (peft);
            # checkpointing is the args' (non-reentrant), not peft's call of transformers'
            # deprecated name
            out["kbit_preparation"] = {"use_gradient_checkpointing": False}
    if stack.method in ("lora", "qlora"):
        out["lora"] = {"r": stack.lora_rank, "lora_alpha": 2 * stack.lora_rank,
                       "target_modules": (stack.lora_targets if isinstance(stack.lora_targets, str)
                                          else list(stack.lora_targets)),
                       "lora_dropout": stack.lora_dropout}
        if stack.lora_parameters:  # a mixture of experts' 3-D experts
            out["lora"]["target_parameters"] = list(stack.lora_parameters)
        if model is not None and stack.lora_targets == "all-linear":
            from recipes_lib.architectures import lora_target_modules

            with warnings.catch_warnings(record=True) as caught:  # said below, as a note
                warnings.simplefilter("always")
                names = lora_target_modules(model, "all-linear", "target_modules")
            if names != "all-linear":  # Falcon-H1's Mamba out_proj, Llama 4's routers
                out["lora"]["target_modules"] = names
                out["notes"] += [str(w.message) for w in caught]
        if not stack.autocast_adapter_dtype:
            out["notes"].append("adapters in the base's dtype: get_peft_model(model, "
                                "peft_config, autocast_adapter_dtype=False)")
    if stack.checkpointing and stack.selective_checkpointing:  # no setting: on the model
        out["notes"].append("selective checkpointing has no setting of its own: "
                            "checkpointing.enable_activation_checkpointing(model, "
                            "selective=True) before Trainer(model=...), the args' left off")
    elif stack.checkpointing:
        args |= checkpointing_settings()
    if stack.attention_mask:
        out["notes"].append("an attention mask in every layer: padded rows (the collator's "
                            "padding, SFTConfig's default) or packed documents kept apart "
                            "(SFTConfig(padding_free=True)) under SDPA; "
                            "attn_implementation='flash_attention_2' builds none for either")
    if stack.fsdp_ranks > 1:
        fsdp = fsdp_settings(model) if model is not None else _fsdp_args("<decoder block>")
        if stack.fsdp_cpu_offload:
            fsdp["fsdp_config"]["cpu_offload"] = True
            out["notes"].append(FSDP_OFFLOAD_NOTE)
        args |= fsdp
        out["notes"].append(f"launch on {stack.fsdp_ranks} GPUs: torchrun --nproc-per-node "
                            f"{stack.fsdp_ranks} (or accelerate launch, accelerate_config)")
    if stack.chunked_loss:
        out["notes"].append("chunked cross-entropy: use_liger_kernel=True on a CUDA GPU "
                            "(Liger's fused linear cross-entropy)")
    if stack.offload_optimizer:
        out["notes"].append("optimizer states on the CPU: no Trainer setting of its own; "
                            "DeepSpeed ZeRO-Offload (zero_optimization.offload_optimizer.device "
                            "'cpu' in the deepspeed config TrainingArguments takes)")
    if stack.offload_activations:
        out["notes"].append("activations on the CPU: activation_checkpointing_kwargs "
                            "{'offload': True} (transformers >= 5.17)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in CHECKPOINT_QUANTIZATION:
        what, loader = CHECKPOINT_QUANTIZATION[model_type]
        if stack.method == "qlora":
            out["notes"].append(f"the hub's {model_type} checkpoints ship {what}, and "
                                "from_pretrained keeps a checkpoint's own quantization over the "
                                "BitsAndBytesConfig passed to it: for this NF4 base, load with "
                                f"quantization_config={loader}, save_pretrained that bf16 copy "
                                "and load the copy")
        else:
            out["load"]["quantization_config"] = _Source(loader)
            out["notes"].append(f"the hub's {model_type} checkpoints ship {what}: "
                                f"quantization_config={loader} loads the bf16 weights this stack "
                                "trains")
    if getattr(getattr(model, "config", None), "hidden_act", None) == "gelu_new":
        out["notes"].append(GELU_NEW_NOTE)
    out["args"] = args
    return out


# transformers' gelu_new is GELU's tanh approximation written as eight elementwise ops, each
# keeping a tensor for backward; gelu_pytorch_tanh is the same function in one op
# (the published phi-1.5 rows measure the difference: transformers' Phi with each, beside litgpt's)
GELU_NEW_NOTE = ("this model computes GELU as gelu_new, eight elementwise ops that each keep a "
                 "tensor for backward: from_pretrained(..., hidden_act='gelu_pytorch_tanh') "
                 "computes the same function in one op and keeps less (the published table of "
                 "docs/planner.md measures it on phi-1.5); a plan's figures are gelu_new's")


def format_settings(settings: dict[str, Any], model_id: str) -> str:
    """:func:`stack_settings` as the lines a training script writes.

    Args:
        settings: :func:`stack_settings`' result.
        model_id: the hub id or folder to load.

    Returns:
        Python source, one statement per line, then the notes as comments.
    """
    def call(name: str, kwargs: dict[str, Any]) -> str:
        dtypes = ("dtype", "bnb_4bit_compute_dtype")
        return f"{name}(" + ", ".join(
            f"{k}=torch.{v}" if k in dtypes else f"{k}={v!r}" for k, v in kwargs.items()) + ")"

    load = dict(settings["load"])
    if settings["quantization"]:
        load["quantization_config"] = _Source(call("BitsAndBytesConfig",
                                                   settings["quantization"]))
    lines = [f"model = AutoModelForCausalLM.from_pretrained({model_id!r}, "
             + call("", load)[1:]]
    if settings["kbit_preparation"] is not None:
        lines.append("model = " + call("prepare_model_for_kbit_training",
                                       {"model": _Source("model"),
                                        **settings["kbit_preparation"]}))
    if settings["lora"]:
        lines.append("peft_config = " + call("LoraConfig", settings["lora"])
                     + "  # Trainer: model = get_peft_model(model, peft_config)")
    lines.append("args = " + call("TrainingArguments", settings["args"]))
    return "\n".join(lines + [f"# {note}" for note in settings["notes"]])


class _Source(str):
    """Source text that :func:`format_settings` writes as it is, not as a string literal."""

    def __repr__(self) -> str:
        return str(self)
