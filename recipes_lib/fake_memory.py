"""Will it fit? One training step of a real-size model, measured on fake tensors.

PyTorch's ``FakeTensorMode`` runs a transformers model's forward, backward and optimizer step
with tensors that have shapes, dtypes and devices but no storage; the one memory meter
(``memory.measure_memory``, PyTorch's dispatch-level ``MemTracker``) counts every storage they
would allocate, by category. So an 8 B model's step is *measured*, not computed from formulas,
on a laptop, in under a minute, with almost no RAM.

How: the model is built on the meta device (so peft can wrap it: peft fails inside fake mode),
then ``to_empty`` materialises its parameters as fake tensors on the target device, tied
embeddings re-tied. The same function with ``fake=False`` builds the model for real, which is how
the method is checked (``fake_vs_real``: equal on every category, on this CPU and on a GPU).
Batches have no padding (every token counts): fake tensors cannot be read back, so nothing in
the step may depend on their values.

What a fake trace cannot see (the CUDA context, the caching allocator's rounding and
fragmentation, library workspaces) is added by ``gpu_overhead`` as its own row, never hidden in
the measured figure.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recipes_lib import calc
from recipes_lib.checkpointing import enable_activation_checkpointing
from recipes_lib.grad_accumulation import forward_backward
from recipes_lib.memory import MemoryReport, allocator_peak, measure_memory
from recipes_lib.train import TrainConfig, make_optimizer, optimizer_step

METHODS = ("full", "lora")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-mixed")
OPTIMIZERS = ("adamw", "sgd")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "bf16-mixed": torch.float32}
_AUTOCAST = {"bf16-mixed": "bf16"}  # precision -> the training loop's autocast precision


@dataclass(frozen=True)
class Stack:
    """A stack of the course's recipes for one training step.

    ``precision`` is the dtype weights, gradients and optimizer states are kept in ("bf16": the
    pure-bf16 training torchtune does, 2 + 2 + 4 bytes per parameter under AdamW), or
    "bf16-mixed": fp32 weights, gradients and states under bf16 autocast, what transformers'
    ``Trainer`` does with ``bf16=True`` (ZeRO's 16 bytes per parameter, plus the bf16 copies of the
    weights autocast caches until the forward pass ends).
    """

    method: str = "full"
    precision: str = "bf16"
    checkpointing: bool = False
    optimizer: str = "adamw"
    grad_accum_steps: int = 1
    lora_rank: int = 16

    def __post_init__(self) -> None:
        for name, allowed in (("method", METHODS), ("precision", PRECISIONS),
                              ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        for name in ("grad_accum_steps", "lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")

    @property
    def label(self) -> str:
        parts = [self.method if self.method == "full" else f"LoRA r={self.lora_rank}",
                 self.precision, self.optimizer]
        if self.checkpointing:
            parts.append("checkpointing")
        if self.grad_accum_steps > 1:
            parts.append(f"accumulation x{self.grad_accum_steps}")
        return ", ".join(parts)


def model_config(model: Any):
    """A transformers config for a built-in preset name, a ``config.json`` (or its folder), or a
    config object.

    Raises:
        ValueError: naming ``model`` for an unknown name (listing the presets) or a config that
            is not a causal LM.
    """
    from transformers import AutoConfig, LlamaConfig, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if isinstance(model, PretrainedConfig):
        config = model
    elif isinstance(model, calc.ModelShape) or str(model).split("/")[-1].lower() in {
            k.lower() for k in calc.PRESETS}:
        shape = model if isinstance(model, calc.ModelShape) else next(
            v for k, v in calc.PRESETS.items() if k.lower() == str(model).split("/")[-1].lower())
        config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                             intermediate_size=shape.intermediate_size,
                             num_hidden_layers=shape.num_hidden_layers,
                             num_attention_heads=shape.num_attention_heads,
                             num_key_value_heads=shape.num_key_value_heads,
                             tie_word_embeddings=shape.tie_word_embeddings,
                             max_position_embeddings=131072)
    else:
        path = Path(str(model))
        if path.name == "config.json":
            path = path.parent
        if not (path / "config.json").is_file():
            raise ValueError(f"model={str(model)!r}: not a built-in preset "
                             f"({', '.join(calc.PRESETS)}) and no config.json there")
        config = AutoConfig.from_pretrained(path)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model={str(model)[:80]!r}: a {config.model_type!r} config is not a "
                         "causal language model")
    return config


def _check_seq_len(config, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        raise ValueError(f"seq_len={seq_len}: beyond the model's {limit} positions; RoPE "
                         "scaling (config.rope_scaling, e.g. YaRN) extends them")


def build_model(config, stack: Stack, device: torch.device | str, fake: bool = True,
                attn_implementation: str = "sdpa") -> tuple[torch.nn.Module, Any]:
    """Build ``config``'s model with ``stack`` applied, its weights fake (or real) on ``device``.

    Returns:
        ``(model, mode)``: ``mode`` is the ``FakeTensorMode`` to run the step in (None if real).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[stack.precision],
                                                 attn_implementation=attn_implementation)
    if stack.method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=stack.lora_rank, lora_alpha=2 * stack.lora_rank,
                                                 target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with mode or contextlib.nullcontext():
        model.to_empty(device=device)
        if not fake:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, 0.02)
        model.tie_weights()  # to_empty gives tied weights separate storages
        if not fake:  # fake tensors hold no values to restore
            _restore_buffers(model)
    if stack.checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    return model, mode


@contextlib.contextmanager
def _unpacked_rows():
    """Tell transformers the batch's rows are not packed documents.

    transformers checks the position ids for packed sequences and, when it cannot read them
    (fake tensors), assumes they may be packed and materialises a batch x s x s mask that the
    real run never builds. Our batches are one sequence per row, positions 0..s-1, so the check's
    answer is known: no packing.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _restore_buffers(model: torch.nn.Module) -> None:
    """Recompute the buffers ``to_empty`` left uninitialised (rotary inverse frequencies) by
    building each owning module afresh on the CPU and copying them in."""
    for module in model.modules():
        own = dict(module.named_buffers(recurse=False))
        if not own or not hasattr(module, "config"):
            continue
        fresh = type(module)(module.config)
        with torch.no_grad():
            for name, buf in own.items():
                buf.copy_(getattr(fresh, name))


def _optimizer(model: torch.nn.Module, stack: Stack):
    if stack.optimizer == "sgd":
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return make_optimizer(model, TrainConfig(lr=1e-4))  # the training loop's AdamW


def measure_step(model: Any, stack: Stack = Stack(), seq_len: int = 2048, batch_size: int = 1,
                 device: torch.device | str = "cpu", fake: bool = True) -> MemoryReport:
    """Peak memory of one training step (after a warm-up step, so optimizer states exist).

    Args:
        model: a preset name (``calc.PRESETS``), a ``config.json`` path or a config.
        stack: the recipes applied.
        seq_len, batch_size: tokens per sequence and sequences per optimizer step.
        device: the device the step would run on (fake tensors need no such device for
            matmuls, but run CUDA attention kernels only on a CUDA build).
        fake: measure on fake tensors (no memory used); False runs it for real.

    Returns:
        The step's ``MemoryReport`` on ``device``.

    Raises:
        ValueError: for bad sizes, a sequence beyond the model's positions, or a batch the
            accumulation steps do not divide.

    Example:
        >>> r = measure_step("Llama-3.1-8B", Stack(checkpointing=True), 2048)  # doctest: +SKIP
        >>> r.by_category["parameters"] / 2**30  # doctest: +SKIP
        14.96
    """
    for name, v, low in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{name}={v!r}: must be an integer >= {low}")
    if batch_size % stack.grad_accum_steps:
        raise ValueError(f"grad_accum_steps={stack.grad_accum_steps}: does not divide "
                         f"batch_size={batch_size}")
    config = model_config(model)
    _check_seq_len(config, seq_len)
    device = torch.device(device)
    before = (0, 0)
    if not fake and device.type == "cuda":  # what earlier work left allocated is not this step's
        gc.collect()
        torch.cuda.empty_cache()
        before = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    net, mode = build_model(config, stack, device, fake)
    opt = _optimizer(net, stack)
    targets = batch_size * (seq_len - 1)
    with mode or contextlib.nullcontext(), _unpacked_rows():
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
        batch = {"input_ids": ids, "labels": ids}

        def step() -> None:
            forward_backward(net, batch, stack.grad_accum_steps,
                             _AUTOCAST.get(stack.precision, "fp32"),
                             num_target_tokens=targets)
            optimizer_step(net, opt, max_grad_norm=None)

        step()  # optimizer states now exist, as in every step after the first
        allocated = reserved = None
        if not fake and device.type == "cuda":
            # the allocator read first, on a step with no tracker: the tracker's hooks form
            # reference cycles that keep a step's tensors alive until the garbage collector runs
            gc.collect()
            allocated, reserved = allocator_peak(step, device)
            allocated, reserved = allocated - before[0], reserved - before[1]
        report = measure_memory(step, net, opt, device)
    report.allocator_peak_bytes, report.allocator_reserved_bytes = allocated, reserved
    return report


def fake_vs_real(model: Any, stack: Stack, seq_len: int, batch_size: int = 1,
                 device: torch.device | str = "cpu") -> dict[str, Any]:
    """The same step measured on fake tensors and for real: per-category ratio fake / real.

    On CUDA the real run's allocator peaks (``max_memory_allocated`` and ``_reserved``, from one
    more step run without the tracker) are reported beside it.
    """
    fake = measure_step(model, stack, seq_len, batch_size, device, fake=True)
    real = measure_step(model, stack, seq_len, batch_size, device, fake=False)
    ratios = {k: (fake.by_category[k] / real.by_category[k]) if real.by_category[k] else
              (1.0 if fake.by_category[k] == 0 else float("inf")) for k in real.by_category}
    return {"fake": fake, "real": real, "peak_ratio": fake.peak_bytes / real.peak_bytes,
            "ratios": ratios}

