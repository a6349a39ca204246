"""Which recipes make a training run fit: the calculator's escalation, from the command line.

``python -m recipes_lib plan --model Llama-2-7B --gpu-mem 16GB --seq 2048 --batch 8`` lists, in
the order practitioners escalate, the predicted memory of each step (full fine-tune -> with 8-bit
AdamW states -> LoRA -> QLoRA -> activation checkpointing -> gradient accumulation -> optimizer
offload -> FSDP across the GPUs) and names the first that fits. Built-in models
(``calc.preset_names()``: Llama, Mistral, Qwen2.5/3, Gemma-2/3, Phi-3/4, and the mixtures of
experts Qwen3-30B-A3B, Mixtral-8x7B and gpt-oss-20b, by name or hub id) work offline; any
transformers ``config.json`` works too.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recipes_lib import calc
from recipes_lib import model as models
from recipes_lib.architectures import (
    PEFT_EXPERT_NAMES,
    frozen_experts_text,
    layer_parameter_names,
)
from recipes_lib.max_context import check_positions

# What a fake trace cannot see, modelled as its own row (never folded into the measured figure):
# the CUDA context lives outside PyTorch's allocator (a few hundred MiB; it depends on the driver,
# the CUDA version and lazy module loading), and the caching allocator reserves more than it
# hands out (on the H100 runs in results/h100/, max_memory_reserved was 2-29 % above
# max_memory_allocated). Library workspaces (cuBLAS, attention kernels) come on top. Under FSDP1
# with bitsandbytes and a reserved peak counted since loading, Answer.AI's figures read 1.30-1.47x
# the fake trace, 1.35-1.69x with CPU offload (docs/planner.md, published.REASONS): 15 % is
# no ceiling.
# plan(replay=True) replaces it on one-device rows by the run replayed through the allocator's
# rules (recipes_lib.allocator: within 2.4 % of the H100's reserved peaks in bf16).
CUDA_CONTEXT_BYTES = 0.5 * 2**30
ALLOCATOR_RESERVE = 0.15


# the allocator settings the replay can assume (PyTorch reads them when CUDA first allocates)
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS_ENV = f"{ALLOC_CONF}=expandable_segments:True"


def allocator_setting(expandable_segments: bool = False, max_split_size_mb: int | None = None,
                      env: bool = True,
                      roundup_power2_divisions: int | tuple[int, ...] | None = None) -> str:
    """The allocator setting a replay assumed, as a launch sets it or in words.

    Args:
        expandable_segments: replayed with expandable segments.
        max_split_size_mb: replayed with that ``max_split_size_mb`` (None: unset).
        env: the environment variable and its value; False: the value in words
            ("expandable segments", "max_split_size_mb:N", each followed by
            ", roundup_power2_divisions:D" where set).
        roundup_power2_divisions: replayed with those divisions (None: unset).

    Returns:
        The setting, or "the default allocator settings".

    Example:
        >>> allocator_setting(max_split_size_mb=128)
        'PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128'
    """
    from recipes_lib.allocator import settings_conf

    conf = settings_conf(expandable_segments, max_split_size_mb, roundup_power2_divisions)
    if not conf:
        return "the default allocator settings"
    if env:
        return f"{ALLOC_CONF}={conf}"
    return ", ".join(filter(None, [
        "expandable segments" if expandable_segments else "",
        settings_conf(max_split_size_mb=max_split_size_mb),
        settings_conf(roundup_power2_divisions=roundup_power2_divisions)]))


def allocator_reserve(allocated_bytes: float) -> float:
    """The modelled bytes PyTorch's caching allocator reserves beyond what it hands out
    (``ALLOCATOR_RESERVE * allocated``): ``max_memory_reserved`` less ``max_memory_allocated``.

    Args:
        allocated_bytes: the fake trace's peak.

    Returns:
        The bytes to add to it.
    """
    return ALLOCATOR_RESERVE * allocated_bytes


def gpu_overhead(allocated_bytes: float) -> float:
    """The modelled bytes a GPU needs beyond a fake trace's peak: the CUDA context, which lives
    outside PyTorch's allocator, plus the allocator's reserve (``CUDA_CONTEXT_BYTES +``
    :func:`allocator_reserve`).

    Args:
        allocated_bytes: the fake trace's peak.

    Returns:
        The bytes to add to it.
    """
    return CUDA_CONTEXT_BYTES + allocator_reserve(allocated_bytes)


def _fsdp_step(gpus: int) -> str:
    """The escalation's last row: a full fine-tune sharded over ``gpus`` GPUs."""
    return f"full fine-tune, FSDP over {gpus} GPU{'' if gpus == 1 else 's'} + checkpointing"


def _fsdp_qlora_step(gpus: int) -> str:
    """The row after it where there are several GPUs: QLoRA with its NF4 base sharded too."""
    return f"QLoRA, FSDP over {gpus} GPUs + checkpointing"


def _fsdp_offload_step(gpus: int) -> str:
    """The row after that: FSDP's CPU offload of QLoRA's shards, gradients and optimizer states."""
    return f"QLoRA, FSDP over {gpus} GPUs + checkpointing + CPU offload"


def _sharded_steps(gpus: int) -> list[str]:
    """The rows that shard the model over ``gpus`` GPUs: the full fine-tune's FSDP row, and
    above one GPU the FSDP + QLoRA rows, measured only."""
    return [_fsdp_step(gpus)] + ([_fsdp_qlora_step(gpus), _fsdp_offload_step(gpus)]
                                 if gpus > 1 else [])


def _measured_stack(step: str, grad_accum_steps: int, gpus: int = 1,
                    attention_mask: bool = False) -> Any:
    """The stack measured on fake tensors for an escalation row (by its name;
    ``attention_mask``: ``fake_memory.Stack.attention_mask``), or why that row is not
    measured."""
    from recipes_lib.fake_memory import Stack

    qlora = Stack(method="qlora", precision="bf16-mixed")  # the course's QLoRA (k-bit prep.)
    stacks = {"full fine-tune (bf16 + AdamW)": Stack(precision="bf16-mixed"),
              "full fine-tune, 8-bit AdamW states": Stack(precision="bf16-mixed",
                                                          optimizer="adamw-8bit"),
              "LoRA on a bf16 base": Stack(method="lora"),
              "QLoRA (NF4 base)": qlora,
              "+ activation checkpointing": replace(qlora, checkpointing=True),
              f"+ gradient accumulation (k={grad_accum_steps})": replace(
                  qlora, checkpointing=True, grad_accum_steps=grad_accum_steps),
              "+ CPU offload of optimizer states": replace(
                  qlora, checkpointing=True, grad_accum_steps=grad_accum_steps,
                  offload_optimizer=True)}
    if gpus > 1:  # rank 0 of a fake process group
        stacks[_fsdp_step(gpus)] = Stack(precision="bf16-mixed", checkpointing=True,
                                         fsdp_ranks=gpus)
        # the course's FSDP + QLoRA (fsdp_qlora): torchao's NF4 base sharded, fp32 adapters;
        # its NF4 dequantized into the output alone, as bitsandbytes' kernel (the trainer
        # lines') does, not through torchao's temporaries (about 14 bytes a weight)
        stacks[_fsdp_qlora_step(gpus)] = replace(qlora, checkpointing=True, fsdp_ranks=gpus,
                                                 chunked_dequant=True)
        # FSDP2's CPUOffloadPolicy: the shards, their gradients and the optimizer step in CPU
        # RAM (Answer.AI's 70 B on two 24 GB cards)
        stacks[_fsdp_offload_step(gpus)] = replace(stacks[_fsdp_qlora_step(gpus)],
                                                   fsdp_cpu_offload=True)
    reasons = {"FSDP": "FSDP over one GPU is the full fine-tune"}
    if step in stacks:
        return replace(stacks[step], attention_mask=attention_mask)
    why = next((v for k, v in reasons.items() if k in step), "no fake-tensor stack for it")
    return f"not measured: {why}"

def _per_gpu_batch(batch_size: int, gpus: int) -> int:
    """Sequences on the busiest GPU when ``gpus`` share ``batch_size``: a batch the ranks do
    not divide leaves some rank one more, and that rank's peak decides whether the step fits."""
    return -(-batch_size // gpus)


def _whole_shares(stack: Any, batch_size: int) -> int:
    """The batch a row's stack is measured with: every FSDP rank takes the busiest rank's share
    (the calculator's per-GPU batch)."""
    return stack.fsdp_ranks * _per_gpu_batch(batch_size, stack.fsdp_ranks)


@dataclass(frozen=True)
class GpuCard:
    """A GPU the planner takes by name in place of a size (``--gpu-mem T4``).

    Attributes:
        name: as written on the command line.
        memory_MiB: the card's total as nvidia-smi reports it, all of it, before the CUDA context.
        compute_capability: (major, minor); bf16 runs natively from 8.0 (Ampere) on.
    """

    name: str
    memory_MiB: int
    compute_capability: tuple[int, int]

    @property
    def bf16(self) -> bool:
        return self.compute_capability >= (8, 0)


# nvidia-smi's totals on Modal's GPUs (modal-labs/modal-client#2797, January 2025); compute
# capabilities from NVIDIA's table (developer.nvidia.com/cuda-gpus). A T4 answers
# torch.cuda.is_bf16_supported() with True (emulation counts), which is why device.supports_bf16
# asks with including_emulation=False: a card's bf16 here is its hardware's.
GPU_CARDS = {card.name.lower(): card for card in (
    GpuCard("T4", 15360, (7, 5)), GpuCard("L4", 23034, (8, 9)), GpuCard("A10", 23028, (8, 6)),
    GpuCard("L40S", 46068, (8, 9)), GpuCard("A100-40GB", 40960, (8, 0)),
    GpuCard("A100-80GB", 81920, (8, 0)), GpuCard("H100", 81559, (9, 0)))}


def gpu_card(gpu_mem: Any) -> GpuCard | None:
    """The card ``gpu_mem`` names (any case), or None where it is a size.

    Args:
        gpu_mem: what the planner was given for the GPU's memory.

    Returns:
        The ``GpuCard`` of ``GPU_CARDS``, or None.

    Example:
        >>> gpu_card("t4").bf16, gpu_card("24GB")
        (False, None)
    """
    return GPU_CARDS.get(gpu_mem.strip().lower()) if isinstance(gpu_mem, str) else None


_UNITS = {"": 2**30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30, "t": 2**40}


def parse_bytes(text: str | float, name: str = "gpu_mem") -> float:
    """``"16GB"`` -> 16e9, ``"24GiB"`` / ``"24G"`` / ``24`` -> 24 * 2**30 (a bare number is GiB);
    a card's name (``GPU_CARDS``: ``"T4"``) -> its nvidia-smi total.

    Args:
        text: the size, or a card's name.
        name: the parameter named in the error.

    Returns:
        Bytes.

    Raises:
        ValueError: naming ``name`` for an unparsable, zero or negative size.

    Example:
        >>> parse_bytes("16GB"), parse_bytes("1.5 GiB"), parse_bytes("T4") / 2**20
        (16000000000.0, 1610612736.0, 15360.0)
    """
    card = gpu_card(text)
    if card is not None:
        return float(card.memory_MiB * 2**20)
    m = re.fullmatch(r"\s*([-+]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={text!r}: not a size; write e.g. 16GB, 24GiB or 80, or a card: "
                         + ", ".join(c.name for c in GPU_CARDS.values()))
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{name}={text!r}: must be > 0")
    return value


def resolve_shape(model: str) -> tuple[str, calc.ModelShape]:
    """A built-in name or its hub id (``calc.find_preset``), a ``config.json`` or a folder
    holding one, or any other hub id (its config.json from the hub or the Hugging Face cache,
    ``model.hub_config_file``).

    Args:
        model: the name, hub id or path.

    Returns:
        ``(name, shape)``.

    Raises:
        ValueError: for an unknown name (listing the built-ins), a hub id the hub cannot give
            (offline and not cached: with the reason), a file that is not a
            transformers decoder config; ``calc.NotDescribedError`` (a ValueError with
            ``model_name`` and ``built``, transformers' parameter count) for one the formulas
            do not describe (``calc.check_counted``, layers of two shapes, a mixture of
            experts).
    """
    preset = calc.find_preset(model)  # "meta-llama/Llama-2-7b-hf" -> "Llama-2-7B"
    if preset:
        return preset, calc.preset_shape(preset)
    path = _config_file(model)
    if path is not None:
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"model={model!r}: not a JSON config file ({err})") from err
        if not isinstance(config, dict):
            raise ValueError(f"model={model!r}: not a transformers config")
        if not Path(model).exists():  # a hub id, named by its name
            name = model.split("/")[-1]
        else:  # named by its folder (…/Qwen3-0.6B/config.json) or, saved under its own name, file
            name = (path.parent.name if path.name == "config.json" else path.stem) or model
        try:
            shape = calc.ModelShape.from_config(config, f"model={model!r}")
            calc.check_counted(config, f"model={model!r}")
        except calc.NotDescribedError as err:
            err.model_name = name
            raise
        return name, shape
    raise ValueError(f"model={model!r}: not a built-in model ({', '.join(calc.preset_names())}) "
                     "and no config.json there (a hub model: its namespace/name id, read from "
                     "the hub or, offline, the Hugging Face cache)")


def _config_file(model: str) -> Path | None:
    """The config.json that ``model`` names: a file, a folder's, or a hub id's (from the hub or
    its cache, ``model.hub_config_file``); None where it names none (a built-in model)."""
    if calc.find_preset(model):
        return None
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    return models.hub_config_file(model)


def _multimodal(model: str) -> bool:
    """Whether ``model`` is a config.json (its folder, its hub id) with a ``text_config``."""
    path = _config_file(model)
    try:
        return path is not None and "text_config" in json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


# plan's note where a row's stack would leave an MoE's experts in fp32
SUBSTITUTED = ("rows whose stack would keep a mixture-of-experts model's experts in fp32 are "
               "measured in pure bf16 instead (precision='bf16': weights, gradients and AdamW "
               "states in bf16; QLoRA without peft's k-bit preparation), the nearest stack "
               "transformers' grouped GEMM runs; their stack is named in the measured table")


def _note_once(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _measured(measure: Callable[[Any], Any], stack: Any, notes: list[str] | None = None
              ) -> tuple[Any, Any]:
    """``(stack, measure(stack))``; for a stack ``fake_memory`` cannot measure
    (``UnmeasuredStackError``: an MoE whose experts would be fp32), ``(substitute,
    measure(substitute))``, or ``("not measured: <why>", None)`` where it has none. ``notes``
    gets the reason and the substitution, once each."""
    from recipes_lib.fake_memory import UnmeasuredStackError

    try:
        return stack, measure(stack)
    except UnmeasuredStackError as err:
        if notes is not None:
            _note_once(notes, err.why)
        if err.substitute is None:
            return f"not measured: {err.short}", None
        if notes is not None:
            _note_once(notes, SUBSTITUTED)
        return err.substitute, measure(err.substitute)


def _check_counts(**counts: Any) -> None:
    for name, v in counts.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an integer >= 1")


def _default_grad_accum_steps(batch_size: int) -> int:
    """Micro-batches where nothing says how many fit: the largest divisor of the batch up to 4."""
    return max(k for k in range(1, 5) if batch_size % k == 0)


def _fewest_micro_batches(config: Any, shape: calc.ModelShape, seq_len: int, batch_size: int,
                          budget: float, attention_mask: bool = False) -> int:
    """The accumulation row's k: the fewest micro-batches (more than one where the batch
    allows: the row adds accumulation to checkpointing's k=1) whose row fits ``budget`` by the
    formulas plus ``gpu_overhead`` (:func:`_formula_rows`); where none does, one sequence per
    micro-batch (the least memory, the offload row's best chance). A fixed k=4 left 8 sequences
    of a 70 B QLoRA step at 4096 tokens 'nothing fits' on 80 GB, where k=8 fits."""
    divisors = [k for k in range(2, batch_size + 1) if batch_size % k == 0] or [1]
    for k in divisors:
        rows, _ = _formula_rows(config, shape, seq_len, batch_size, 1, k, budget,
                                attention_mask)
        if next(r for r in rows if r["step"] == f"+ gradient accumulation (k={k})")["fits"]:
            return k
    return divisors[-1]


def _on_gpu(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """``rows`` with what the GPU needs beyond the formulas' bytes, as a measured trace gets
    (``total_gpu_GiB``: plus ``gpu_overhead``), and whether that fits ``budget``."""
    for row in rows:
        if row["total_GiB"] is None:  # a row the formulas do not predict: measured only
            row.update(total_gpu_GiB=None, fits=None)
            continue
        total = row["total_GiB"] * 2**30
        row["total_gpu_GiB"] = (total + gpu_overhead(total)) / 2**30
        row["fits"] = total + gpu_overhead(total) <= budget
    return rows


def _counted_config(model: str) -> Any:
    """``model``'s transformers config for :func:`_count_layers`, or None where it cannot be
    read as one (the rows then keep the calculator's count)."""
    from recipes_lib import fake_memory

    try:
        return fake_memory.model_config(model)
    except ValueError:
        return None


def _sdpa_window_mask(shape: calc.ModelShape, seq_len: int) -> bool:
    """Whether transformers hands SDPA an explicit sliding-window mask at ``seq_len``: from the
    window's own length on (``kv_length >= window``, not beyond it); eager attention (Gemma-2)
    has its masks counted with its scores."""
    return bool(shape.sliding_layers and not shape.score_bytes
                and seq_len >= shape.sliding_window)


def _kept_mask_bytes(shape: calc.ModelShape, seq_len: int, micro_batch: int,
                     attention_mask: bool) -> int:
    """The 1-byte SDPA masks checkpointed layers keep as inputs: with an attention mask one
    ``micro_batch x s x s`` mask per kind of layer (full attention, sliding window); without,
    past the window one ``s x s`` mask for the batch (transformers broadcasts it over the
    rows); else none."""
    if attention_mask:
        layers, sliding = shape.num_hidden_layers, shape.sliding_layers
        return ((sliding < layers) + bool(sliding)) * micro_batch * seq_len**2
    return seq_len**2 if _sdpa_window_mask(shape, seq_len) else 0


def _count_layers(rows: list[dict[str, Any]], config: Any, shape: calc.ModelShape,
                  seq_len: int, batch_size: int, grad_accum_steps: int,
                  attention_mask: bool = False) -> bool:
    """Predict again, in place, each row whose stack ``calc.llama_layer_bytes`` counts op by op
    (``fake_memory.counted_layer_bytes``: the Llama family's, Phi-3's, Gemma-2's and Gemma-3's
    layers, which the fake-tensor meter matches to the byte; not FSDP): the layers as counted
    for that stack (one more uncheckpointed layer with checkpointing, alive while it is
    recomputed, after the loss has been freed: the larger of the two counts), the logits as the
    calculator has them (three fp32 copies), and what the stack keeps that the escalation's
    formulas leave out: QLoRA's k-bit preparation keeps the norms, embeddings and head in fp32,
    under bf16 autocast the head's matmul keeps a bf16 copy of its weight, and with
    checkpointing the layers keep their attention masks as inputs (Gemma-2's additive ones,
    SDPA's 1-byte masks: :func:`_kept_mask_bytes`). With ``attention_mask`` (padded or packed
    rows: ``fake_memory.Stack.attention_mask``) every layer's attention is masked. Without
    checkpointing the peak may instead be the forward's end, where the KV cache transformers
    builds in a training forward with ``use_cache`` on (the meter's loop; Trainer and TRL turn
    it off) still holds fp32 keys (and QLoRA's fp32 values) beside SDPA's casts, with the
    model's 16-bit logits: the larger of the two (a Llama-2-7B QLoRA step at 2 x 1024 tokens: 2
    GiB of cache against 0.7 of loss; predicted / measured 0.945 without it, 1.004 with it). A
    full fine-tune's fp32 gradients fill memory as backward frees the activations, so its total
    is the state without them plus the larger of the two. Korthikanti's ``34 s b h`` (a GPT
    layer) left a Llama-3.1-8B QLoRA step at 2048 tokens 17.9 GiB where it holds 30.3: 'fits 24
    GB' without checkpointing. True where a row was counted."""
    from recipes_lib import fake_memory

    counts = calc.param_count(shape)
    counted = False
    for row in rows:
        stack = _measured_stack(row["step"], grad_accum_steps, attention_mask=attention_mask)
        if isinstance(stack, str):
            continue
        layer = fake_memory.counted_layer_bytes(config, stack, seq_len, batch_size, shape)
        if layer is None:
            continue
        micro = batch_size // stack.grad_accum_steps
        # autocast's bf16 copy of the fp32 head's weight
        head = 2 * shape.vocab_size * shape.hidden_size if stack.precision == "bf16-mixed" else 0
        # the model's output logits; Gemma-2 soft-caps them, and tanh keeps its output too
        logits = (4 if stack.precision == "fp32" else 2) * micro * seq_len * shape.vocab_size
        tanh = logits if getattr(config, "final_logit_softcapping", None) else 0
        loss = calc.activation_bytes(shape, seq_len, micro)["logits"] + head + tanh
        act = shape.num_hidden_layers * layer + loss
        if stack.checkpointing:  # the loss is freed before the last layer is recomputed
            act += max(0.0, fake_memory.counted_layer_bytes(
                config, stack, seq_len, batch_size, shape, recomputed=True) - loss)
            if config.model_type == "gemma2":  # eager attention's additive masks, one per
                # kind of layer (full, sliding), in the residual stream's dtype: inputs the
                # checkpointed layers keep for their recomputation
                kinds = len(set(getattr(config, "layer_types", None) or ["full"]))
                act += kinds * micro * seq_len**2 * (2 if stack.precision in ("bf16", "fp16")
                                                     else 4)
            else:  # SDPA's 1-byte masks, inputs the checkpointed layers keep
                act += _kept_mask_bytes(shape, seq_len, micro, attention_mask)
        else:  # or the forward's end, the KV cache and the model's output logits still there
            cached = fake_memory.counted_layer_bytes(config, stack, seq_len, batch_size, shape,
                                                     with_cache=True)
            act = max(act, shape.num_hidden_layers * cached + logits + tanh + head)
        state = row["state_GiB"] * 2**30
        if stack.method == "qlora" and stack.precision == "bf16-mixed":
            state += 2 * (counts["total"] - counts["linear"])  # their fp32 copies, not bf16
        grads = 0.0
        if stack.method == "full":  # fp32 under autocast, else the weights' dtype
            grads = calc.gradient_bytes(counts["total"], "fp32" if stack.precision == "bf16-mixed"
                                        else stack.precision)
        row.update(state_GiB=state / 2**30, activations_GiB=act / 2**30,
                   total_GiB=(state - grads + max(act, grads)) / 2**30)
        counted = True
    return counted


def _formula_rows(config: Any, shape: calc.ModelShape, seq_len: int, batch_size: int,
                  gpus: int, grad_accum_steps: int, budget: float,
                  attention_mask: bool = False) -> tuple[list[dict[str, Any]], bool]:
    """The escalation's rows by the formulas (``calc.escalation_table``, the FSDP row from
    ``calc.data_parallel_bytes``), the Llama family's, Phi-3's, Gemma-2's and Gemma-3's counted
    op by op (:func:`_count_layers`; ``config`` None: none), each on the GPU (:func:`_on_gpu`); and
    whether any was counted."""
    rows = calc.escalation_table(shape, seq_len, batch_size, budget, grad_accum_steps)
    fs = calc.data_parallel_bytes(shape, gpus, "fsdp", seq_len, _per_gpu_batch(batch_size, gpus))
    rows.append({"step": _fsdp_step(gpus),
                 "state_GiB": (fs["state"] + fs["gathered"]) / 2**30,
                 "activations_GiB": fs["activations"] / 2**30,
                 "total_GiB": fs["gpu_total"] / 2**30})
    counted = config is not None and _count_layers(rows, config, shape, seq_len, batch_size,
                                                   grad_accum_steps, attention_mask)
    for step in _sharded_steps(gpus)[1:]:  # measured only: see FSDP_QLORA_NOTE
        rows.append(dict.fromkeys(("state_GiB", "activations_GiB", "total_GiB")) | {"step": step})
    return _on_gpu(rows, budget), counted


COUNTED_NOTE = (
    "activations: the layers counted op by op for each row's stack (calc.llama_layer_bytes: a "
    "Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma-2 or Gemma-3 layer, which the fake-tensor meter "
    "matches to the byte), the logits as three fp32 copies, or where that is more the forward's "
    "end, when the KV cache transformers builds in a training forward with use_cache on (not in "
    "Trainer or TRL, which turn it off) still holds the keys in fp32 under autocast; a full "
    "fine-tune's total is its state without the gradients plus the larger of its activations and "
    "its gradients, which fill memory as backward frees the activations; the FSDP row keeps "
    "Korthikanti's 34 sbh")
MASKED_NOTE = (
    "an attention mask in every layer: rows padded to a common length (DataCollatorWithPadding, "
    "TRL's default) or packed documents kept apart by their position_ids (TRL's padding_free) "
    "make transformers hand SDPA an explicit b x s x s mask instead of is_causal; SDPA keeps its "
    "copy of it in the matmuls' dtype (s x s a row, a layer) and, with grouped queries, the "
    "keys and values repeat_kv widens to every head (a mask rules out SDPA's enable_gqa); with "
    "checkpointing, the 1-byte masks the layers keep as inputs, b x s x s for each kind of "
    "layer: counted in the rows above. flash-attention-2 runs both without a mask (its "
    "variable-length calls), and full rows of concatenated text need none")
KORTHIKANTI_NOTE = (
    "activations: Korthikanti's 34 sbh bytes per layer (a GPT layer with a flash kernel), the "
    "logits as three fp32 copies; this architecture's layers are not counted op by op, and a "
    "gated MLP, norms that keep fp32 inputs and LoRA's fp32 adapters keep more (a "
    "Llama-3.2-1B layer, measured in notebook 01: 49-92 bytes per token per hidden unit, "
    "1.4-2.7x the 34): --measure measures")


# the FSDP + QLoRA row, above one GPU
FSDP_QLORA_NOTE = (
    "QLoRA sharded by FSDP (the last two rows: notebook 02's fsdp_qlora, torchao's NF4 base and "
    "fp32 adapters under FSDP2, rank 0 of a fake process group, each NF4 weight dequantized "
    "into its output alone as bitsandbytes' kernel does, where torchao's own dequantization "
    "holds about 14 bytes a weight of the largest layer at once; the last with FSDP's CPU "
    "offload, the shards, their gradients and the optimizer's states in CPU RAM) is measured "
    "only (--measure): the formulas leave it blank, because what a rank holds at its peak "
    "besides its shards (the blocks and the embeddings FSDP gathers, what NF4's matmuls keep "
    "for backward) is not modelled")


# the share of the checkpointed row's activations above which the plan says what the loss's logits
# take and what keeps only a chunk of them, and the tokens per chunk a measured plan measures
LOGITS_NOTE_SHARE = 0.5
LOGITS_CHUNK = 1024
LOGITS_NOTE_START = "the loss: its logits"


def note_logits(vocab_size: int, tokens: int, activations: float, notes: list[str],
                measured: bool = False) -> None:
    """Where the loss's logits (three fp32 copies of ``s x b x V``, as the rows count them) are at
    least half the checkpointed row's activations, a note of their size and of what keeps one
    chunk of them instead: after checkpointing, the vocabulary is what long context runs into
    (Gemma-2's 256k entries, Llama-3's 128k, a mixture of experts' few active parameters).

    Args:
        vocab_size: the model's vocabulary.
        tokens: the checkpointed row's tokens a step (its micro-batch: no accumulation).
        activations: that row's activation bytes, by the formulas or measured.
        notes: the plan's notes, appended to.
        measured: ``activations`` were measured on fake tensors (a model the formulas do not
            describe), as the note says.

    Example:
        >>> notes = []
        >>> note_logits(256_000, 4096, 15.8 * 2**30, notes)
        >>> notes[0][:59]
        'the loss: its logits, three fp32 copies of s x b x V (256,0'
    """
    logits = 3 * calc.logits_bytes(tokens, 1, vocab_size, 4)
    if logits < LOGITS_NOTE_SHARE * activations:
        return
    notes.append(
        f"{LOGITS_NOTE_START}, three fp32 copies of s x b x V ({vocab_size:,} entries), are "
        f"{logits / 2**30:.3g} GiB of the checkpointed row's {activations / 2**30:.3g} GiB of "
        f"{'measured ' if measured else ''}activations; a chunked loss keeps one chunk of them "
        "(notebook 04, recipes_lib.chunked_loss; in TrainingArguments or SFTConfig, "
        "use_liger_kernel=True on a CUDA GPU: Liger's fused linear cross-entropy). No row above "
        "has one; notebook 01's form measures a stack with it (fit_form.verdict)")


def measure_chunked_loss(model: Any, row: dict[str, Any], stack: Any, seq_len: int,
                         batch_size: int, budget: float, out: dict[str, Any]) -> Any:
    """Where :func:`note_logits` spoke, the checkpointed row's measured stack measured again with
    a chunked loss of ``LOGITS_CHUNK`` tokens, as ``out["chunked_loss"]`` and at the end of that
    note: what the row needs on the GPU without the full logits. Not where a step has no more
    tokens than one chunk (the chunked loss would be one chunk: not its regime).

    Args:
        model: a built-in name or its hub id, a ``config.json`` path or a config.
        row: the checkpointed row, measured.
        stack: the ``fake_memory.Stack`` it was measured with.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        budget: bytes of one GPU.
        out: the plan, whose notes and ``chunked_loss`` are written.

    Returns:
        The stack measured (``stack`` with the chunked loss), or None where none was.

    Example:
        >>> plan("Gemma-2-2B", "24GB", 4096, 1, measure=True)["chunked_loss"]  # doctest: +SKIP
        {'measured_stack': 'QLoRA r=16, bf16-mixed, adamw, checkpointing, chunked CE (1024)', ...}
    """
    at = next((i for i, n in enumerate(out["notes"]) if n.startswith(LOGITS_NOTE_START)), None)
    if at is None or seq_len * _whole_shares(stack, batch_size) <= LOGITS_CHUNK:
        return None  # no note, or one chunk would be the whole loss
    from recipes_lib import fake_memory

    chunked = replace(stack, chunked_loss=LOGITS_CHUNK)
    peak = fake_memory.measure_step(model, chunked, seq_len,
                                    _whole_shares(chunked, batch_size)).peak_bytes
    gpu = peak + gpu_overhead(peak)
    out["chunked_loss"] = {"measured_stack": chunked.label, "measured_GiB": peak / 2**30,
                           "gpu_GiB": gpu / 2**30, "measured_fits": gpu <= budget}
    out["notes"][at] += (f"; measured with {LOGITS_CHUNK}-token chunks, that row needs "
                         f"{gpu / 2**30:.3g} GiB on the GPU against {row['gpu_GiB']:.3g} without "
                         f"them: {'fits' if gpu <= budget else 'does not fit'}")
    return chunked


def _predicted(model: str, name: str, shape: calc.ModelShape, seq_len: int, batch_size: int,
               gpus: int, grad_accum_steps: int, budget: float, config: Any = None,
               attention_mask: bool = False) -> dict[str, Any]:
    """:func:`plan`'s result from the formulas alone (``config``, ``attention_mask``:
    :func:`_formula_rows`')."""
    rows, counted = _formula_rows(config, shape, seq_len, batch_size, gpus, grad_accum_steps,
                                  budget, attention_mask)
    cheapest = next((r["step"] for r in rows if r["fits"]), "nothing fits")
    out = {"model": name, "params_B": calc.param_count(shape)["total"] / 1e9,
           "gpu_bytes": budget, "rows": rows, "cheapest": cheapest, "layers_counted": counted,
           "notes": [COUNTED_NOTE if counted else KORTHIKANTI_NOTE]}
    if attention_mask:
        out["notes"].append(MASKED_NOTE if counted else
                            "an attention mask in every layer (padded or packed rows): this "
                            "architecture's layers are not counted op by op, so what the masks "
                            "add is not in the rows above: --measure measures it")
    if counted and _sdpa_window_mask(shape, seq_len) and not attention_mask:
        out["notes"].append(
            f"from its sliding window's length ({shape.sliding_window} tokens) on, transformers "
            "hands SDPA an explicit mask: its sliding-window layers are counted with SDPA's copy "
            "of it (s x s in the matmuls' dtype, a layer) and, with grouped queries, the keys "
            "and values repeat_kv widens to every head; with checkpointing, the 1-byte mask the "
            "checkpointed layers keep as an input too. A checkpointed step can keep more, not "
            "counted: where the backward of the layer recomputed last outweighs the loss (its "
            "MLP's fp32 gradients of the intermediate, through the adapters' casts, beside the "
            "recomputed tensors), its masked attention adds to that peak (a Mistral-7B at 8192 "
            "tokens: 0.23 GiB): --measure measures it")
    checkpointed = next(r for r in rows if r["step"] == "+ activation checkpointing")
    note_logits(shape.vocab_size, seq_len * batch_size, checkpointed["activations_GiB"] * 2**30,
                out["notes"])
    if _multimodal(model):
        out["notes"].append(
            f"{name} is a multimodal checkpoint: planned and measured is its language model "
            "(text_config); the vision encoder's weights, frozen or not, are not counted")
    if shape.score_bytes:
        out["notes"].append(
            f"attention: transformers has no SDPA for {name}'s architecture, so it runs eager "
            f"attention, which keeps {shape.score_bytes} bytes per score (batch x heads x s x s) "
            "for backward: counted in the rows above (a fused kernel, flash-attn's where the "
            "architecture supports it, keeps none); "
            + ("its four norms and soft-capped logits too, and with checkpointing the "
               "additive masks the layers keep" if counted else
               "what else its layers keep beyond the formulas' (more norms, soft-capped "
               "logits) is not: --measure measures it"))
    return out


def _unpredicted(err: calc.NotDescribedError, steps: list[str]) -> dict[str, Any]:
    """:func:`plan`'s result for an architecture the formulas do not describe: the rows
    without a formula figure (a wrong prediction is worse than none), to be measured."""
    blank = dict.fromkeys(("state_GiB", "activations_GiB", "total_GiB", "total_gpu_GiB", "fits"))
    return {"model": err.model_name, "params_B": err.built / 1e9 if err.built else None,
            "rows": [{"step": s, **blank} for s in steps], "layers_counted": False,
            "cheapest": "not predicted: the formulas do not describe this architecture",
            "notes": [f"not predicted, measured only: {err}"]}


def plan(model: str, gpu_mem: str | float, seq_len: int = 2048, batch_size: int = 8,
         gpus: int = 1, grad_accum_steps: int | None = None, measure: bool = False,
         attention_mask: bool = False, progress: bool = False,
         replay: bool = False, expandable_segments: bool = False,
         max_split_size_mb: int | None = None,
         roundup_power2_divisions: int | tuple[int, ...] | None = None) -> dict[str, Any]:
    """Predicted per-GPU memory of each escalation step and the cheapest one that fits.

    Args:
        model: built-in name or path to a transformers config.json.
        gpu_mem: memory of one GPU, e.g. "16GB", "80GiB", or a card's name (``GPU_CARDS``:
            "T4"), its nvidia-smi total; a card without bf16 gets fp16 trainer settings.
        seq_len, batch_size: tokens per sequence and sequences per optimizer step.
        gpus: GPUs for the last steps, a full fine-tune sharded with FSDP and, above one GPU,
            QLoRA with its NF4 base sharded too (the course's ``fsdp_qlora``, checkpointed;
            measured only, ``FSDP_QLORA_NOTE``), then that with FSDP's CPU offload; each GPU
            is planned with the busiest one's share of the batch, ``ceil(batch_size / gpus)``
            (at least one sequence: 1 sequence over 8 GPUs plans 1 per GPU).
        grad_accum_steps: micro-batches per step in the accumulation row (default: the fewest,
            more than one where the batch allows, whose row fits by the formulas, else one
            sequence per micro-batch; for an architecture the formulas do not describe, the
            largest divisor of ``batch_size`` up to 4).
        measure: also measure the rows on fake tensors (``fake_memory``): each gets
            ``measured_GiB`` (the trace's peak on the GPU), ``host_GiB`` (what offload keeps in
            CPU RAM), ``gpu_GiB`` (the peak plus ``gpu_overhead``), ``measured_stack`` and
            ``measured_fits``; a row that cannot be measured says why. The first row (the full
            fine-tune) also gets ``adamw_GiB``: its trace with AdamW stepped as measured (a
            CPU's for-loop), as ``foreach`` and as ``fused`` (``fake_memory.Stack.optimizer``).
            Where the loss's logits are most of the checkpointed row's activations, the result
            gets ``chunked_loss``: that row measured with a chunked loss
            (:func:`measure_chunked_loss`).
        attention_mask: the rows need an attention mask: padded to a common length, or packed
            documents kept apart (``fake_memory.Stack.attention_mask``); default: full rows, as
            the formulas have them.
        progress: with ``measure``, a progress bar over the rows, on stderr.
        replay: with ``measure``, each one-device row's run (the weights' materialisation and
            two steps) replayed through CUDA's caching allocator (``fake_memory.
            replay_allocator``) instead of the fixed reserve: ``reserved_GiB`` (its reserved
            peak on a card of ``gpu_mem`` less the CUDA context, or on an unlimited one where
            it runs out there), ``cache_released`` (times whole free segments were released
            to fit), and ``gpu_GiB`` / ``measured_fits`` from it, with ``other_allocator``:
            the other ``expandable_segments`` setting's replay (:func:`replayed_reserve`), and
            the result ``cheapest_measured_other_allocator``: ``{"expandable_segments",
            "step"}``, the cheapest step that fits under that setting. FSDP rows keep the fixed
            reserve (the replay models one stream), the same under both.
        expandable_segments: with ``replay``, replay as
            ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` runs.
        max_split_size_mb: with ``replay``, replay as ``PYTORCH_CUDA_ALLOC_CONF=
            max_split_size_mb:N`` runs (None: unset).
        roundup_power2_divisions: with ``replay``, replay as ``PYTORCH_CUDA_ALLOC_CONF=
            roundup_power2_divisions:D`` runs (one count or one per interval; None: unset).

    Returns:
        ``{"model", "params_B", "gpu_bytes", "gpu", "rows", "cheapest", "notes", "trainer",
        "grad_accum_steps", "layers_counted"}`` (``gpu``: the card named, or None;
        ``trainer``: the cheapest step as a trainer's
        settings, None where nothing fits, or where no measured row fits and ``chunked_loss``
        does, that stack's; ``grad_accum_steps``: the accumulation row's k;
        ``layers_counted``: the rows' layers were counted op by op (a Llama-family, Phi-3,
        Gemma-2 or Gemma-3 model), not with Korthikanti's ``34 s b h``, and ``notes`` begins
        by saying which);
        each row has step, state_GiB, activations_GiB, total_GiB (the formulas' bytes),
        total_gpu_GiB (plus the modelled ``gpu_overhead``, as a measured trace gets) and fits
        (on that), all None in the FSDP + QLoRA rows, which are measured only;
        ``notes``: what the formulas assume that this model does not do (eager attention's scores),
        and the loss's logits where they are most of the checkpointed row's activations
        (:func:`note_logits`). For an architecture the formulas do not describe
        (``calc.check_counted``: a hybrid such as Qwen3.5, Gemma-4's layers of two shapes, a mixture
        of experts), measured only (a row whose stack would keep an MoE's experts in fp32 is
        measured in pure bf16, its stack named; one with no stack to measure says why): the
        formulas' figures are None, ``cheapest`` says why, ``params_B`` is transformers' count and a
        note says why. An MoE under LoRA also gets ``expert_adapters`` and a note
        (:func:`note_expert_adapters`): with ``attention_only_GiB`` where LoRA adapts its experts
        whole (the first adapter row measured again with adapters on the attention only),
        ``experts_adapted_GiB`` where the targets leave them frozen (that row again with them in
        ``target_parameters``). A model measured with eager attention gets a note of what that keeps
        (:func:`note_eager_attention`).

    Raises:
        ValueError: naming the parameter, for an unknown model, a size that does not parse, a
            count below 1, a sequence beyond the model's positions (saying how RoPE scaling
            extends them; a config.json with them raised is planned as it says), or an
            architecture the formulas do not describe without ``measure``.
        TypeError: for an ``attention_mask`` that is not a bool.

    Example:
        >>> plan("Llama-2-7B", "16GB", seq_len=512, batch_size=1, grad_accum_steps=1)["cheapest"]
        'QLoRA (NF4 base)'
    """
    _check_counts(seq_len=seq_len, batch_size=batch_size, gpus=gpus)
    if replay and not measure:
        raise ValueError("replay=True: replays the measured rows' runs; set measure=True too "
                         "(--measure)")
    check_allocator_setting(replay, expandable_segments, max_split_size_mb,
                            roundup_power2_divisions)
    if not isinstance(attention_mask, bool):
        raise TypeError(f"attention_mask={attention_mask!r}: True (padded or packed rows, "
                         "which need a mask) or False (full rows)")
    try:
        name, shape = resolve_shape(model)
    except calc.NotDescribedError as err:
        if not measure:
            raise ValueError(f"{err}; --measure (plan(measure=True)) measures every row") from err
        if grad_accum_steps is None:
            grad_accum_steps = _default_grad_accum_steps(batch_size)
        out = _unpredicted(err, calc.escalation_steps(grad_accum_steps) + _sharded_steps(gpus))
        if attention_mask:
            out["notes"].append("an attention mask in every layer (padded or packed rows): "
                                "measured with it")
        out["gpu_bytes"] = budget = parse_bytes(gpu_mem)
    else:
        check_positions(shape, seq_len)
        budget = parse_bytes(gpu_mem)
        config = _counted_config(model)
        if grad_accum_steps is None:
            grad_accum_steps = _fewest_micro_batches(config, shape, seq_len, batch_size, budget,
                                                     attention_mask)
        out = _predicted(model, name, shape, seq_len, batch_size, gpus, grad_accum_steps, budget,
                         config, attention_mask)
    card = gpu_card(gpu_mem)
    out["gpu"] = card.name if card else None
    if card and not card.bf16:
        out["notes"].append(
            f"a {card.name} (compute capability {'.'.join(map(str, card.compute_capability))}) "
            "has no bf16: each row's 16-bit tensors are fp16 there, the same bytes, and the "
            "trainer settings train with fp16=True (autocast and Trainer's gradient scaler)")
    if gpus > 1 and not measure:
        out["notes"].append(FSDP_QLORA_NOTE)
    rows = out["rows"]
    chunked = None  # the checkpointed row's stack with a chunked loss, where measured
    if measure:
        from tqdm.auto import tqdm

        from recipes_lib import fake_memory

        # the first measured row with adapters, and its stack; the checkpointed row, and its
        adapted = checkpointed = None
        # a stack an earlier row measured (the accumulation row at k=1 is the checkpointed
        # row's step): its measurement and its replay, not taken again
        done: dict[Any, tuple[Any, Any, dict[str, Any] | None]] = {}
        for row in tqdm(rows, desc="fake-tensor steps, one a row", disable=not progress,
                        leave=False):
            stack = _measured_stack(row["step"], grad_accum_steps, gpus, attention_mask)
            if isinstance(stack, str):
                row["measured_stack"] = stack
                continue
            asked = stack
            if asked not in done:
                done[asked] = (*_measured(lambda s: fake_memory.measure_step(
                    model, s, seq_len, _whole_shares(s, batch_size)), stack, out["notes"]), None)
            stack, report, replayed = done[asked]
            if report is None:
                row["measured_stack"] = stack
                continue
            peak = report.peak_bytes
            if adapted is None and stack.method in ("lora", "qlora"):
                adapted = row, stack
            if row["step"] == "+ activation checkpointing":
                checkpointed = row, stack
                if row.get("activations_GiB") is None:  # no formulas: the measured activations
                    note_logits(fake_memory.model_config(model).vocab_size,
                                seq_len * _whole_shares(stack, batch_size),
                                report.by_category["activations"], out["notes"], measured=True)
            row.update(measured_stack=stack.label, measured_GiB=peak / 2**30,
                       host_GiB=report.host_bytes / 2**30,
                       gpu_GiB=(peak + gpu_overhead(peak)) / 2**30,
                       measured_fits=peak + gpu_overhead(peak) <= budget)
            if replay and stack.fsdp_ranks == 1:
                if replayed is None:
                    replayed = replayed_reserve(model, stack, seq_len,
                                                _whole_shares(stack, batch_size), budget,
                                                expandable_segments, max_split_size_mb,
                                                roundup_power2_divisions)
                    done[asked] = stack, report, replayed
                row.update(copy.deepcopy(replayed))
            if row is rows[0]:  # the full fine-tune: how a GPU runs AdamW moves its peak
                row["adamw_GiB"] = {"for-loop (as measured)": peak / 2**30} | {
                    impl: fake_memory.measure_step(
                        model, replace(stack, optimizer=f"adamw-{impl}"), seq_len,
                        _whole_shares(stack, batch_size)).peak_bytes / 2**30
                    for impl in ("foreach", "fused")}
        if calc.expert_count(fake_memory.model_config(model)):
            out["notes"].append(
                "a mixture-of-experts model: transformers 5 keeps its experts as 3-D parameters, "
                "not linear layers, so bitsandbytes' 4-bit conversion skips them (bitsandbytes "
                "#1849) and QLoRA quantizes its attention only")
            if adapted is not None:
                note_expert_adapters(model, *adapted, seq_len, batch_size, out)
        note_eager_attention(model, seq_len, out["notes"])
        if checkpointed is not None:
            chunked = measure_chunked_loss(model, *checkpointed, seq_len, batch_size, budget,
                                           out)
        if replay:  # where the other allocator setting lets a cheaper step fit, say which
            other = next((r["step"] for r in rows if r.get("other_allocator", r).get(
                "measured_fits")), "nothing measured fits")
            out["cheapest_measured_other_allocator"] = {
                "expandable_segments": not expandable_segments, "step": other,
                "roundup_power2_divisions": roundup_power2_divisions}
        out["cheapest_measured"] = next((r["step"] for r in rows if r.get("measured_fits")),
                                        "nothing measured fits")
    step = out.get("cheapest_measured", out["cheapest"])
    if step == "nothing measured fits" and chunked and out["chunked_loss"]["measured_fits"]:
        # what the note measured fits: its stack, the checkpointed row's with the chunked loss
        out["trainer"] = _trainer_settings(
            model, f"+ activation checkpointing, a chunked loss ({LOGITS_CHUNK}-token chunks)",
            batch_size, grad_accum_steps, gpus, attention_mask, stack=chunked,
            bf16=not card or card.bf16)
    else:
        out["trainer"] = _trainer_settings(model, step, batch_size, grad_accum_steps, gpus,
                                           attention_mask, bf16=not card or card.bf16)
    out["grad_accum_steps"] = grad_accum_steps
    return out


def replayed_reserve(model: Any, stack: Any, seq_len: int, batch_size: int,
                     budget: float, expandable_segments: bool = False,
                     max_split_size_mb: int | None = None,
                     roundup_power2_divisions: int | tuple[int, ...] | None = None
                     ) -> dict[str, Any]:
    """One row's run replayed through CUDA's caching allocator on a card of ``budget`` bytes
    (``fake_memory.allocation_trace``, ``allocator.replay``), the CUDA context set apart, with
    the allocator as set and with the other ``expandable_segments`` setting beside it (from
    ``max_split_size_mb``: expandable segments; the divisions kept).

    Args:
        model: the model planned.
        stack: the row's measured stack (one device).
        seq_len, batch_size: the row's sizes (sequences on the GPU).
        budget: the card's bytes.
        expandable_segments: replay as ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        max_split_size_mb: replay as ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` (None:
            unset).
        roundup_power2_divisions: replay as ``PYTORCH_CUDA_ALLOC_CONF=
            roundup_power2_divisions:D`` (None: unset).

    Returns:
        ``reserved_GiB``: the reserved peak the card reaches, or, where the run does not fit
        even with the cache released, the peak on an unlimited card; ``cache_released``: times
        cached memory was released to fit; ``gpu_GiB``: the reserved peak plus the CUDA
        context; ``measured_fits``; ``needs_GiB``: the smallest card the run fits, the
        context included (``allocator.min_capacity``: the cache released under pressure, as a
        full card does); ``expandable_segments``, ``max_split_size_mb`` and
        ``roundup_power2_divisions``;
        ``other_allocator``: the same keys (but ``gpu_GiB`` and ``needs_GiB``) for the other
        setting, from the same trace; ``needs_by_setting``: the smallest card under each
        setting the course compares (``allocator.SETTINGS``, by name; seconds for an 8 B
        model's trace), then under the setting as set where it is none of them; ``advice``:
        what the other setting changes in the verdict (:func:`allocator_advice`), or None.
    """
    from recipes_lib import allocator, fake_memory

    events = fake_memory.allocation_trace(model, stack, seq_len, batch_size)
    capacity = max(0, int(budget - CUDA_CONTEXT_BYTES))

    def on_card(expandable: bool, mss: int | None) -> dict[str, Any]:
        setting = {"max_split_size_mb": mss, "roundup_power2_divisions": roundup_power2_divisions}
        card = allocator.fits(events, capacity, expandable, **setting)
        fits = card is not None
        card = card or allocator.replay(events, None, expandable, **setting)
        return {"reserved_GiB": card.peak_reserved / 2**30, "cache_released": card.releases,
                "measured_fits": fits, "expandable_segments": expandable, **setting}

    out = on_card(expandable_segments, max_split_size_mb)
    out["gpu_GiB"] = out["reserved_GiB"] + CUDA_CONTEXT_BYTES / 2**30
    as_set = allocator.settings_conf(expandable_segments, max_split_size_mb,
                                     roundup_power2_divisions)
    named = dict(allocator.SETTINGS)
    if as_set not in named.values():  # a launch's own setting joins the ones compared
        named[allocator_setting(expandable_segments, max_split_size_mb, False,
                                roundup_power2_divisions)] = as_set
    cards = {name: (card + CUDA_CONTEXT_BYTES) / 2**30 for name, card in allocator.smallest_cards(
        events, {**named, "as set": as_set}).items()}
    out["needs_GiB"] = cards.pop("as set")
    out["other_allocator"] = on_card(not expandable_segments, None)
    out["needs_by_setting"] = cards
    out["advice"] = allocator_advice(out)
    return out


def check_allocator_setting(replay: bool, expandable_segments: bool,
                            max_split_size_mb: int | None = None,
                            roundup_power2_divisions: int | tuple[int, ...] | None = None) -> None:
    """Refuse an allocator setting without ``replay`` (only the replay models them), and one
    the replay does not model.

    Args:
        replay: the verdict replays the caching allocator.
        expandable_segments, max_split_size_mb, roundup_power2_divisions: the replay's
            allocator settings.

    Raises:
        ValueError: naming the parameters (and the command line's flag).
    """
    from recipes_lib import allocator

    for name, value in (("expandable_segments", expandable_segments),
                        ("max_split_size_mb", max_split_size_mb),
                        ("roundup_power2_divisions", roundup_power2_divisions)):
        if value not in (False, None) and not replay:
            raise ValueError(f"{name}={value!r}: an allocator setting the replay models; set "
                             "replay=True too (--replay-allocator)")
    allocator.CachingAllocator(expandable_segments=expandable_segments,
                               max_split_size_mb=max_split_size_mb,
                               roundup_power2_divisions=roundup_power2_divisions)  # or refuses


def allocator_advice(replayed: dict[str, Any]) -> str | None:
    """What the other ``expandable_segments`` setting changes in a replayed verdict.

    Args:
        replayed: :func:`replayed_reserve`'s result.

    Returns:
        A sentence where one setting fits and the other does not, else None.

    Example:
        >>> allocator_advice({"measured_fits": False, "expandable_segments": False,
        ...                   "other_allocator": {"measured_fits": True, "reserved_GiB": 22.5,
        ...                                       "expandable_segments": True}})
        'fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (22.5 GiB reserved, replayed)'
    """
    other = replayed["other_allocator"]
    if replayed["measured_fits"] == other["measured_fits"]:
        return None
    if other["measured_fits"]:
        setting = allocator_setting(other["expandable_segments"],
                                    roundup_power2_divisions=other.get("roundup_power2_divisions"))
        return f"fits with {setting} ({other['reserved_GiB']:.1f} GiB reserved, replayed)"
    unlimited = f"({other['reserved_GiB']:.1f} GiB reserved on an unlimited card)"
    divisions = replayed.get("roundup_power2_divisions")  # the other setting keeps them

    def named(expandable: bool, mss: int | None) -> str:
        words = allocator_setting(expandable, mss, False, divisions)
        if expandable or mss is not None:
            return words
        return "the default allocator" + (f" with {words}" if divisions is not None else "")

    ran_out = (f"{named(other['expandable_segments'], None)} "
               f"{'run' if other['expandable_segments'] else 'runs'} out")
    fitting = named(replayed["expandable_segments"], replayed.get("max_split_size_mb"))
    return f"fits only with {fitting}: {ran_out} {unlimited}"


def note_eager_attention(model: Any, seq_len: int, notes: list[str]) -> None:
    """Where the measured steps ran eager attention (transformers has no SDPA for the
    architecture: GPT-OSS's attention sinks) and no note on the formulas' side says so already,
    a note of what that keeps: each layer's attention probabilities for backward, at least
    heads x s x s in 16 bits a sequence and layer (tests/test_planner.py measures it), which a
    fused GPU kernel that supports the architecture keeps none of.

    Args:
        model: a built-in name or its hub id, a ``config.json`` path or a config.
        seq_len: tokens per sequence.
        notes: the plan's notes, appended to.

    Example:
        >>> notes = []
        >>> note_eager_attention("gpt-oss-20b", 2048, notes)  # doctest: +SKIP
        >>> notes[0][:43]  # doctest: +SKIP
        'attention: the steps were measured with eager'
    """
    from recipes_lib import fake_memory
    from recipes_lib.architectures import default_attention

    config = fake_memory.model_config(model)
    if default_attention(config) != "eager" or any(
            n.startswith("attention: transformers has no SDPA") for n in notes):
        return
    text = getattr(config, "get_text_config", lambda: config)()
    heads, layers = text.num_attention_heads, text.num_hidden_layers
    kept = 2 * heads * seq_len**2 * layers / 2**30
    notes.append(f"attention: the steps were measured with eager attention, transformers' only "
                 f"one for {config.model_type!r} (no SDPA), which keeps each layer's attention "
                 f"probabilities for backward: at least {heads} heads x {seq_len} x {seq_len} "
                 f"in 16 bits a sequence and layer, {kept:.1f} GiB a sequence over its {layers} "
                 "layers without checkpointing; a fused GPU kernel that supports the "
                 "architecture keeps none of it (for GPT-OSS's sinks, flash-attention 3 on a "
                 "Hopper GPU: attn_implementation='kernels-community/vllm-flash-attn3')")


def note_expert_adapters(model: Any, row: dict[str, Any], stack: Any, seq_len: int,
                         batch_size: int, out: dict[str, Any]) -> None:
    """For an MoE whose experts LoRA adapts whole (``fake_memory.expert_adapters``): a note of
    what that keeps and which linear layers peft left without adapters, and the measured step
    again with adapters on the attention only. For one whose experts the targets leave frozen
    (GPT-OSS, Phi-3.5-MoE, ...: ``architectures.frozen_experts``): a note saying so, and the step
    again with them adapted (``target_parameters``). Nothing for any other model or stack.

    Args:
        model: a built-in name or its hub id, a ``config.json`` path or a config.
        row: the measured step: ``step`` (its name) and ``measured_GiB`` (its peak).
        stack: its ``fake_memory.Stack``.
        seq_len, batch_size: its sizes.
        out: gets ``expert_adapters`` (``fake_memory.expert_adapters``' dict, with
            ``attention_only_GiB``, or ``experts_adapted_GiB`` where the targets left the experts
            frozen: the step again with them in ``target_parameters``) and the note appended to
            ``out["notes"]``.

    Example:
        >>> out, lora = {"notes": []}, Stack(method="lora", precision="bf16")  # doctest: +SKIP
        >>> row = {"step": "LoRA", "measured_GiB": 147.0}  # doctest: +SKIP
        >>> note_expert_adapters("Qwen3-30B-A3B", row, lora, 2048, 1, out)  # doctest: +SKIP
        >>> round(out["expert_adapters"]["attention_only_GiB"], 1)  # doctest: +SKIP
        75.6
    """
    from recipes_lib import fake_memory

    info = fake_memory.expert_adapters(model, stack)
    if info is None:
        return
    out["expert_adapters"] = info
    if info["frozen"]:  # peft maps no name onto this model type's experts: measured adapted
        text = frozen_experts_text(info["architecture"], stack.lora_targets, info["frozen"])
        experts = tuple(layer_parameter_names(info["frozen"]))
        adapted = replace(stack, lora_parameters=stack.lora_parameters + experts)
        peak = fake_memory.measure_step(model, adapted, seq_len,
                                        _whole_shares(adapted, batch_size)).peak_bytes / 2**30
        info["experts_adapted_GiB"] = peak
        out["notes"].append(f"{text}. The {row['step']!r} row measures them frozen, as peft "
                            f"trains them; with target_parameters={list(experts)} too: "
                            f"{peak:.1f} GiB measured, against {row['measured_GiB']:.1f} GiB")
        return
    layer = info["layer_bytes"] / 2**30
    text = (f"LoRA on {stack.lora_targets!r} adapts this model's experts whole, its router "
            "too: peft maps transformers 4's per-expert names onto the 3-D parameters "
            f"({', '.join(info['parameters'])}: target_parameters), a rank-{stack.lora_rank} "
            f"adapter per expert and projection, {info['adapter_params'] / 1e9:.2f} B adapter "
            "parameters. Each forward builds the adapted copy of a layer's experts, "
            f"W + scaling x B A, {layer:.2f} GiB a layer, which the grouped GEMM keeps for "
            f"backward: every layer's without checkpointing ({info['layers']} x {layer:.2f} = "
            f"{info['layers'] * layer:.1f} GiB), one at a time with it")
    if info["unadapted"]:
        left = info["unadapted"]
        text += (f"; {len(left)} linear layers get no adapter ({', '.join(left[:3])}"
                 f"{', ...' if len(left) > 3 else ''}): {PEFT_EXPERT_NAMES}")
    if info["attention_targets"]:
        alone = replace(stack, lora_targets=info["attention_targets"])
        peak = fake_memory.measure_step(model, alone, seq_len,
                                        _whole_shares(alone, batch_size)).peak_bytes / 2**30
        info["attention_only_GiB"] = peak
        text += (f". The {row['step']!r} row with adapters on the attention only "
                 f"(target_modules={list(info['attention_targets'])}): {peak:.1f} GiB measured, "
                 f"against {row['measured_GiB']:.1f} GiB")
    out["notes"].append(text)


def _trainer_settings(model: str, step: str, batch_size: int, grad_accum_steps: int,
                      gpus: int, attention_mask: bool = False, stack: Any = None,
                      bf16: bool = True) -> dict[str, Any] | None:
    """The cheapest step that fits as Trainer / peft / bitsandbytes settings
    (``trainers.stack_settings`` of the stack the row measures, or ``stack``; ``bf16=False``:
    fp16 in its place, a card without bf16), with the line that loads the model; None where
    nothing fits."""
    from recipes_lib import trainers

    if stack is None:
        stack = _measured_stack(step, grad_accum_steps, gpus, attention_mask)
    if isinstance(stack, str):  # nothing fits
        return None
    try:
        settings = trainers.stack_settings(stack, _whole_shares(stack, batch_size),
                                           settings_model(model, stack), bf16=bf16)
    except ValueError as err:  # micro-batches that do not divide the batch
        return {"step": step, "error": str(err)}
    return {"step": step, "settings": settings,
            "code": trainers.format_settings(settings, script_model_id(model))}


def settings_model(model: Any, stack: Any) -> Any:
    """``model`` built on the meta device for ``trainers.stack_settings``: FSDP wraps its own
    block class, and its activation may earn a note.

    Args:
        model: a built-in name, hub id, folder or config.
        stack: the stack the settings are for (``fake_memory.Stack``).

    Returns:
        The meta model; None where its config cannot be read, except under FSDP.

    Raises:
        ValueError: naming ``model``, where FSDP needs its block class and the config cannot
            be read (``fake_memory.model_config``).
    """
    from recipes_lib import architectures, fake_memory

    try:
        return architectures.meta_model(fake_memory.model_config(model), quiet=True)
    except ValueError:
        if stack.fsdp_ranks > 1:
            raise
        return None


def script_model_id(model: str) -> str:
    """What a training script's ``from_pretrained`` loads for ``model``: a hub id or a folder as
    given; a built-in name as the repository it was read from (``calc.HUB_IDS``); any other bare
    name as a placeholder naming it.

    Args:
        model: what the planner was given.

    Returns:
        The id or path, or ``<hub id of NAME>``.

    Example:
        >>> script_model_id("Llama-3.1-8B"), script_model_id("Qwen/Qwen3-8B")
        ('meta-llama/Llama-3.1-8B', 'Qwen/Qwen3-8B')
        >>> script_model_id("Llama-3.1-8B-Instruct")  # a variant: which repository is not known
        '<hub id of Llama-3.1-8B-Instruct>'
    """
    if "/" in model or Path(model).exists():
        return model
    hub_ids = {name.lower(): hub_id for name, hub_id in calc.HUB_IDS.items()}
    return hub_ids.get(model.lower(), f"<hub id of {model}>")


def max_context(model: str, gpu_mem: str | float | list, stack: Any = None, batch_size: int = 1,
                step: int = 256, limit: int | None = None,
                memo: Callable[[str, Callable[[], Any]], Any] | None = None,
                replay: bool = False, expandable_segments: bool = False,
                max_split_size_mb: int | None = None,
                roundup_power2_divisions: int | tuple[int, ...] | None = None,
                ) -> dict[str, Any] | list[dict[str, Any]]:
    """The longest sequence whose training step fits ``gpu_mem``, by measurement: a search over
    fake-tensor steps (``fake_memory.measure_step``, each peak plus ``gpu_overhead``), or with
    ``replay`` over their runs replayed through CUDA's caching allocator (each the smallest card
    the run fits, ``allocator.min_capacity``, plus the CUDA context).

    The search is ``max_context.max_seq_len`` (interpolating: a step's memory grows almost
    linearly with its length), in multiples of ``step``; several budgets share their
    measurements. Every reported length was measured to fit and ``step`` more was
    measured not to (or is the model's limit).

    Args:
        model: a preset name or a ``config.json``.
        gpu_mem: memory of one GPU, or a list of them (one result each).
        stack: the recipes (default: LoRA + checkpointing in bf16).
        batch_size: sequences per step.
        step: the search's granularity in tokens.
        limit: the longest length tried (default: the model's positions).
        memo: ``memo(key, measure)`` returns ``measure()`` or the value recorded under ``key``,
            for each length measured (``results.Progress.value``: a search stopped part-way
            keeps the lengths it measured); None measures every one.
        replay: judge each length by its run (the weights' materialisation and two steps,
            ``fake_memory.allocation_trace``) replayed through the caching allocator, not by
            the trace plus a fixed reserve; one-device stacks only.
        expandable_segments: with ``replay``, as ``PYTORCH_CUDA_ALLOC_CONF=
            expandable_segments:True`` runs.
        max_split_size_mb: with ``replay``, as ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N``
            runs (None: unset).
        roundup_power2_divisions: with ``replay``, as ``PYTORCH_CUDA_ALLOC_CONF=
            roundup_power2_divisions:D`` runs (None: unset).

    Returns:
        ``{"max_seq_len", "gpu_GiB" and "host_GiB" (at that length: the trace's GPU peak with
        ``gpu_overhead``, and what an offloading stack keeps in CPU RAM, else 0), "tries":
        [(seq_len, gpu_GiB)], "stack", "budget_GiB", "limit" (the longest length tried)}`` (a
        list of them for a list of budgets); ``max_seq_len`` is 0 when not even ``step`` tokens
        fit.

    Raises:
        ValueError: naming the parameter, for a ``step`` that is not a positive integer up to
            that longest length, a bad ``gpu_mem``, or what ``fake_memory`` refuses.

    Example:
        >>> max_context("Llama-3.1-8B", "24GB")["max_seq_len"]  # doctest: +SKIP
    """
    from recipes_lib import allocator, fake_memory
    from recipes_lib.max_context import max_seq_len

    stack = stack or fake_memory.Stack(method="lora", checkpointing=True)
    check_allocator_setting(replay, expandable_segments, max_split_size_mb,
                            roundup_power2_divisions)
    budgets = [parse_bytes(g) for g in (gpu_mem if isinstance(gpu_mem, (list, tuple))
                                        else [gpu_mem])]
    config = fake_memory.model_config(model)
    longest = limit or config.max_position_embeddings
    if not isinstance(step, int) or isinstance(step, bool) or not 0 < step <= longest:
        what = "limit" if limit else "model's positions"
        raise ValueError(f"step={step!r}: the search's granularity must be a positive integer "
                         f"up to the longest length tried, {longest} (the {what})")
    top = longest // step
    probes: dict[int, float] = {}  # length -> bytes on the GPU, shared by every budget
    host: dict[int, float] = {}  # length -> bytes in CPU RAM (offload)

    run = memo if memo is not None else (lambda key, measure: measure())
    out = []
    # one fake process group for the whole search: an FSDP stack's model is built once too
    with fake_memory.fake_process_group(stack.fsdp_ranks):
        meter = fake_memory.step_meter(config, stack, batch_size)  # built when first measured

        def need(n: int) -> float:
            if replay:  # the smallest card the run's replay fits, then the context
                def card() -> int:
                    events = fake_memory.allocation_trace(model, stack, n, batch_size)
                    return allocator.min_capacity(events, expandable_segments,
                                                  max_split_size_mb=max_split_size_mb,
                                                  roundup_power2_divisions=roundup_power2_divisions)

                host[n] = 0.0
                mss = (f", max_split_size_mb={max_split_size_mb}" if max_split_size_mb is not None
                       else "")  # unset: the key earlier searches recorded
                if roundup_power2_divisions is not None:
                    mss += f", roundup_power2_divisions={roundup_power2_divisions!r}"
                return CUDA_CONTEXT_BYTES + run(
                    f"replayed run: {model!r}, {stack!r}, {batch_size} x {n}, "
                    f"expandable_segments={expandable_segments}{mss}", card)

            def measure() -> tuple[float, float]:
                report = meter(n)
                return report.peak_bytes, report.host_bytes

            peak, host[n] = run(f"fake step: {model!r}, {stack!r}, {batch_size} x {n}", measure)
            return peak + gpu_overhead(peak)

        for budget in budgets:
            n = max_seq_len(need, budget, start=step, limit=top * step, multiple_of=step,
                            probes=probes)["seq_len"]
            out.append({"max_seq_len": n, "gpu_GiB": probes.get(n, 0.0) / 2**30,
                        "host_GiB": host.get(n, 0.0) / 2**30, "limit": top * step,
                        "budget_GiB": budget / 2**30, "stack": stack.label,
                        "replayed": replay, "expandable_segments": expandable_segments,
                        "max_split_size_mb": max_split_size_mb,
                        "roundup_power2_divisions": roundup_power2_divisions,
                        "tries": [(k, v / 2**30) for k, v in probes.items()]})
    return out if isinstance(gpu_mem, (list, tuple)) else out[0]


def max_context_per_step(model: str, gpu_mem: str | float, batch_size: int = 1,
                         grad_accum_steps: int | None = None, gpus: int = 1, step: int = 256,
                         workers: int = 1, attention_mask: bool = False,
                         progress: bool = False, replay: bool = False,
                         expandable_segments: bool = False,
                         max_split_size_mb: int | None = None,
                         roundup_power2_divisions: int | tuple[int, ...] | None = None
                         ) -> list[dict[str, Any]]:
    """The longest sequence that fits ``gpu_mem`` under each escalation step's measured stack
    (``max_context`` per stack; rows with the same stack share one search).

    A fake step's time is Python dispatching each operation (one core busy, whatever the
    length: 6-19 s per step of an 8 B model on the 2-core AVX2 reference, about 19 steps in
    all), so ``workers`` processes searching different stacks at once divide the wall time.

    Args:
        model: a built-in name or a config path.
        gpu_mem: memory of one GPU, e.g. "24GB".
        batch_size: sequences per optimizer step.
        grad_accum_steps: micro-batches in the accumulation row (default: the largest divisor
            of ``batch_size`` up to 4; the lengths searched decide what fits, not a k).
        gpus: GPUs for the FSDP row (above one, also the FSDP + QLoRA rows, with and
            without FSDP's CPU offload).
        step: the search's length granularity, in tokens.
        workers: processes searching at once (1: this one; more: spawned, one stack each at a
            time, the results the same).
        attention_mask: the rows need an attention mask (``fake_memory.Stack.attention_mask``).
        progress: a progress bar over the searches, on stderr (an 8 B model's take minutes).
        replay, expandable_segments, max_split_size_mb, roundup_power2_divisions: as
            :func:`max_context`, for the
            one-device rows; the FSDP rows keep the trace plus a fixed reserve (the replay
            models one stream).

    Returns:
        One dict per escalation row: ``step``, ``stack`` and ``max_seq_len`` / ``gpu_GiB`` /
        ``host_GiB`` / ``tries`` (or ``measured_stack``: why the row is not measured).

    Raises:
        ValueError: for counts below 1, naming the parameter.
    """
    _check_counts(batch_size=batch_size, gpus=gpus, workers=workers)
    check_allocator_setting(replay, expandable_segments, max_split_size_mb,
                            roundup_power2_divisions)
    if grad_accum_steps is None:
        grad_accum_steps = _default_grad_accum_steps(batch_size)
    steps = calc.escalation_steps(grad_accum_steps) + _sharded_steps(gpus)  # each measured
    stacks = {name: _measured_stack(name, grad_accum_steps, gpus, attention_mask)
              for name in steps}
    distinct = list(dict.fromkeys(s for s in stacks.values() if not isinstance(s, str)))
    search = functools.partial(_search_stack, model=model, gpu_mem=gpu_mem,
                               batch_size=batch_size, step=step, replay=replay,
                               expandable_segments=expandable_segments,
                               max_split_size_mb=max_split_size_mb,
                               roundup_power2_divisions=roundup_power2_divisions)
    from tqdm.auto import tqdm

    bar = {"desc": "longest-context searches", "disable": not progress, "leave": False}
    if workers > 1 and len(distinct) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawned, not forked: a fork of a process whose OpenMP threads started can hang
        with ProcessPoolExecutor(min(workers, len(distinct)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            searched = list(tqdm(pool.map(search, distinct), total=len(distinct), **bar))
    else:
        searched = [search(stack) for stack in tqdm(distinct, **bar)]
    found = dict(zip(distinct, searched, strict=True))
    return [{"step": name, "measured_stack": stack} if isinstance(stack, str)
            else {"step": name, **found[stack]} for name, stack in stacks.items()]


def _search_stack(stack: Any, model: str, gpu_mem: str | float, batch_size: int,
                  step: int, replay: bool = False, expandable_segments: bool = False,
                  max_split_size_mb: int | None = None,
                  roundup_power2_divisions: int | tuple[int, ...] | None = None) -> dict[str, Any]:
    """One stack's :func:`max_context` (an MoE's fp32 experts: the substitute, as :func:`plan`
    measures it), or why it is not measured; a function of the module, for worker processes.
    ``replay`` applies to one-device stacks."""
    one = replay and stack.fsdp_ranks == 1
    why, searched = _measured(lambda s: max_context(
        model, gpu_mem, s, _whole_shares(s, batch_size), step, replay=one,
        expandable_segments=expandable_segments and one,
        max_split_size_mb=max_split_size_mb if one else None,
        roundup_power2_divisions=roundup_power2_divisions if one else None), stack)
    return searched if searched is not None else {"measured_stack": why}


def format_plan(result: dict[str, Any]) -> str:
    """The plan as a plain-text table.

    Args:
        result: :func:`plan`'s result.

    Returns:
        The table.
    """
    count = "?" if result["params_B"] is None else f"{result['params_B']:.2f}"
    card = f" (a {result['gpu']}: nvidia-smi's total)" if result.get("gpu") else ""
    lines = [(f"{result['model']}: {count} B parameters, "
              f"{result['gpu_bytes'] / 2**30:.1f} GiB per GPU{card}"),
             f"{'step':<52} {'state':>8} {'activ.':>8} {'total':>8} {'on GPU':>8}  fits"]
    for r in result["rows"]:
        if r["total_GiB"] is None:  # an architecture the formulas miscount: measured only
            lines.append(f"{r['step']:<52} {'-':>8} {'-':>8} {'-':>8} {'-':>8}  -")
            continue
        lines.append(f"{r['step']:<52} {r['state_GiB']:>7.1f}G {r['activations_GiB']:>7.1f}G "
                     f"{r['total_GiB']:>7.1f}G {r['total_gpu_GiB']:>7.1f}G  "
                     f"{'yes' if r['fits'] else 'no'}")
    lines.append(f"on GPU: the total plus the modelled overhead, {CUDA_CONTEXT_BYTES / 2**30:.1f} "
                 f"GiB of CUDA context and a {ALLOCATOR_RESERVE:.0%} allocator reserve")
    lines.append(f"cheapest that fits: {result['cheapest']}")
    lines += result.get("notes", [])
    if "cheapest_measured" in result:
        replayed = any("reserved_GiB" in r for r in result["rows"])
        setting = next((f" with {assumed}" for r in result["rows"]
                        if (assumed := _assumed_setting(r, env=False))), "")
        reserve = (f"the caching allocator's replayed reserve{setting}; FSDP rows a fixed "
                   f"{ALLOCATOR_RESERVE:.0%}" if replayed else
                   f"{ALLOCATOR_RESERVE:.0%} allocator reserve")
        lines += ["", ("measured on fake tensors (peak + modelled GPU overhead: "
                       f"{CUDA_CONTEXT_BYTES / 2**30:.1f} GiB context + {reserve}):"),
                  f"{'step':<52} {'trace':>8} {'on GPU':>8}  fits  stack measured"]
        for r in result["rows"]:
            if "measured_GiB" in r:
                host = f" (+{r['host_GiB']:.1f}G in CPU RAM)" if r.get("host_GiB") else ""
                if r.get("cache_released") and r["measured_fits"]:
                    host += f" (fits with its cache released {r['cache_released']}x)"
                if r.get("needs_GiB"):
                    host += f" (needs a {r['needs_GiB']:.1f} GiB card, replayed)"
                if r.get("advice"):
                    host += f" ({r['advice']})"
                lines.append(f"{r['step']:<52} {r['measured_GiB']:>7.1f}G {r['gpu_GiB']:>7.1f}G"
                             f"  {'yes' if r['measured_fits'] else 'no ':<4} {r['measured_stack']}"
                             f"{host}")
            else:
                lines.append(f"{r['step']:<52} {'':>8} {'':>8}  {'':<4} {r['measured_stack']}")
        lines.append(f"cheapest measured that fits: {result['cheapest_measured']}")
        lines += _needs_by_setting(result["rows"])
        other = result.get("cheapest_measured_other_allocator")
        if other and other["step"] != result["cheapest_measured"]:
            setting = allocator_setting(other["expandable_segments"],
                                        roundup_power2_divisions=other.get(
                                            "roundup_power2_divisions"))
            lines.append(f"with {setting}: {other['step']}")
        impls = result["rows"][0].get("adamw_GiB")
        if impls:
            lines.append("AdamW is measured as a CPU steps it (one parameter at a time); on a GPU "
                         "the full fine-tune's trace is " + ", ".join(
                             f"{v:.1f}G {k}" for k, v in impls.items() if k != next(iter(impls)))
                         + " (foreach: a plain torch.optim.AdamW's default on CUDA; fused: "
                         "the course's loop and Trainer's default there)")
    trainer = result.get("trainer")
    if trainer:
        lines += ["", f"in your trainer ({trainer['step']}; TRL's SFTConfig takes the same args):"]
        lines += ["  " + line for line in trainer.get("code", trainer.get("error", "")).split("\n")]
        assumed = next((a for r in result["rows"] if (a := _assumed_setting(r))), None)
        if assumed:  # the verdict assumed it
            lines.append(f"  # launch with {assumed}: the replay assumed it")
    return "\n".join(lines)


def _needs_by_setting(rows: list[dict[str, Any]]) -> list[str]:
    """The replayed rows' smallest cards under each allocator setting, as a table's lines (none
    where no row was replayed)."""
    replayed = [r for r in rows if r.get("needs_by_setting")]
    if not replayed:
        return []
    names = list(replayed[0]["needs_by_setting"])
    width = max(len(n) for n in names)
    lines = [f"smallest card by allocator setting (GiB, replayed; {ALLOC_CONF}):",
             f"{'step':<52} " + " ".join(f"{n:>{width}}" for n in names)]
    lines += [f"{r['step']:<52} " + " ".join(f"{v:>{width}.1f}"
                                            for v in r["needs_by_setting"].values())
              for r in replayed]
    return lines


def _assumed_setting(row: dict[str, Any], env: bool = True) -> str | None:
    """The allocator setting a replayed row assumed, where not the default
    (:func:`allocator_setting`)."""
    if (row.get("expandable_segments") or row.get("max_split_size_mb") is not None
            or row.get("roundup_power2_divisions") is not None):
        return allocator_setting(row.get("expandable_segments", False),
                                 row.get("max_split_size_mb"), env,
                                 row.get("roundup_power2_divisions"))
    return None
