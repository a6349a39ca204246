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
the measured figure. Where a CPU and a GPU kernel keep different tensors for backward, the stack
says which runs: dropout keeps CPU's noise unless ``Stack(gpu_dropout=True)`` runs CUDA's fused
kernel (a 1-byte mask); SDPA runs CPU's flash kernel, whose backward keeps what CUDA's flash
kernel's keeps (q, k, v, the output and a log-sum-exp per head: PyTorch's derivatives.yaml; CUDA's
adds a few bytes of RNG state).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from recipes_lib import calc
from recipes_lib.allocator import AllocationLog, CachingAllocator, Event, replay
from recipes_lib.architectures import (
    adapter_targets,
    architecture_name,
    decoder_layers,
    default_attention,
    frozen_experts,
    lora_target_modules,
    meta_model,
    unadapted_linears,
)
from recipes_lib.checkpointing import enable_activation_checkpointing
from recipes_lib.chunked_loss import ChunkedCausalLMLoss
from recipes_lib.data import IGNORE_INDEX
from recipes_lib.fsdp import shard_model
from recipes_lib.grad_accumulation import forward_backward
from recipes_lib.max_context import check_positions
from recipes_lib.memory import MemoryReport, allocator_peak, measure_memory
from recipes_lib.model import hub_config_file
from recipes_lib.offload import CPUOffloadOptimizer
from recipes_lib.optim8bit import make_adamw_8bit
from recipes_lib.quantization import nf4_config, require_bitsandbytes
from recipes_lib.train import TrainConfig, make_optimizer, optimizer_step

METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-mixed")
OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused", "adamw-8bit", "sgd")
_FP_ADAMW = OPTIMIZERS[:3]  # AdamW with moments in the weights' dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "bf16-mixed": torch.float32}
_AUTOCAST = {"bf16-mixed": "bf16"}  # precision -> the training loop's autocast precision
# Stack's switches that must be bools, and what each value means (for the error)
_SWITCHES = {"autocast_adapter_dtype": "True (adapters in fp32, peft's default) or False (the "
                                       "base's dtype)",
             "gpu_dropout": "True (a GPU's 1-byte mask) or False (CPU's noise)",
             "nf4_keeps_input": "True (bitsandbytes before 0.43.2) or False",
             "attention_mask": "True (rows that need a mask: padded or packed) or False (full "
                               "rows)",
             "chunked_dequant": "True (FSDP + QLoRA's NF4 dequantized into its output, as a "
                                "fused kernel does) or False (torchao's dequantization)",
             "fsdp_cpu_offload": "True (FSDP's shards, gradients and optimizer states in host "
                                 "memory) or False"}
# How the full causal-LM loss holds the logits: "course", the course's loop and today's
# transformers; "transformers-4.46", transformers' loss from 4.46 until #35646
# (``TransformersLoss``: with several sequences, one more fp32 copy of the logits in forward);
# "litgpt", litgpt's fine-tuning scripts (``LitGPTLoss``: the head over 128-token chunks, no
# fp32 copy, every chunk's logits held by the loop through backward) on a transformers model
# (litgpt's own model is ``litgpt_memory``'s).
LOSSES = ("course", "transformers-4.46", "litgpt")


def _compute_dtype(stack: Stack) -> torch.dtype:
    """The dtype matmuls run in (a QLoRA base's compute dtype; bf16 under bf16-mixed)."""
    return torch.bfloat16 if stack.precision == "bf16-mixed" else DTYPES[stack.precision]


@dataclass(frozen=True)
class Stack:
    """A stack of the course's recipes for one training step.

    ``precision`` is the dtype weights, gradients and optimizer states are kept in ("bf16": the
    pure-bf16 training torchtune does, 2 + 2 + 4 bytes per parameter under AdamW), or
    "bf16-mixed": fp32 weights, gradients and states under bf16 autocast, what transformers'
    ``Trainer`` does with ``bf16=True`` (ZeRO's 16 bytes per parameter, plus the bf16 copies of the
    weights autocast caches until the forward pass ends).

    ``selective_checkpointing=True`` (with ``checkpointing``) keeps, inside each checkpointed
    layer, every other matmul's output and attention's (``checkpointing.selective_context``, the
    policy torchtitan applies with ``selective_ac_option="op"``) and recomputes the rest.

    ``method="qlora"`` is QLoRA as the course and the QLoRA paper run it: every linear layer but
    the head in NF4 with double quantization (bitsandbytes' own quantize and 4-bit matmul ops),
    LoRA adapters on all of them; with "bf16-mixed" peft's ``prepare_model_for_kbit_training``
    first casts the remaining weights (norms, embeddings, head) to fp32, as the course's
    ``quantization.add_lora`` does. ``bf16_embeddings=True`` then casts the embeddings and the
    head back to bf16 (norms stay fp32, adapters fp32): what TRL's ``SFTTrainer`` ran with
    ``bf16=True`` on a 4-bit model until trl #4577 (November 2025; its
    ``peft_module_casting_to_bf16`` after ``get_peft_model``). Since then it runs no k-bit
    preparation and keeps them in the load dtype, which ``precision="bf16"`` measures.
    With ``fsdp_ranks > 1`` it is the course's FSDP + QLoRA instead (``fsdp_qlora``, notebook 02):
    torchao's ``NF4Tensor`` base on every linear layer of the blocks, which FSDP2 shards and gathers
    still quantized, and LoRA adapters on those ``lora_targets`` names (all of them by default;
    bitsandbytes' packed weights do not shard under FSDP2); the weights left unquantized are in the
    precision's dtype (in pure bf16 fp32 adapters take an fp32 copy of their input, as peft's do;
    ``autocast_adapter_dtype=False`` gives them the base's dtype, as peft before 0.11 did). torchao
    dequantizes a weight for each matmul (forward, and again in backward) through about 14 bytes per
    weight at once (int64 indices and four more full-size tensors); ``chunked_dequant=True`` holds
    only the output (``fsdp_qlora.dequantize_chunked``: the same values), which is what a fused
    kernel holds, bitsandbytes' ``dequantize_4bit`` on a GPU among them.
    ``fsdp_cpu_offload=True`` (with ``fsdp_ranks > 1``) is FSDP2's ``CPUOffloadPolicy``
    (``fsdp.shard_model(cpu_offload=True)``; accelerate's ``fsdp_offload_params``, Answer.AI's
    ``--use_cpu_offload``): the shards, their gradients and the optimizer's states live in host
    memory and the optimizer steps there, each group's shards copied to the GPU for its
    all-gather. The report's peak is the GPU's, ``host_by_category`` the host's
    (``memory.measure_memory`` tells them apart on a CPU trace, leaving out the GPU's copy of
    one group's shards on the way in and of its gradients on the way out).
    ``optimizer="adamw-8bit"`` is bitsandbytes' blockwise 8-bit AdamW. ``"adamw"`` is the
    course loop's ``torch.optim.AdamW`` as torch runs it on the device measured: on a CPU the
    for-loop implementation, whose temporaries are a few copies of one parameter (its
    ``sqrt(v)`` and the ratio, freed before the next). The other two are how a GPU runs it:
    ``"adamw-foreach"`` (``foreach=True``, torch's default for CUDA tensors: a plain
    ``torch.optim.AdamW`` on a GPU) updates every parameter of a dtype at once and holds one
    temporary the size of all their second moments; ``"adamw-fused"`` (``fused=True``: the
    course's loop on a GPU, transformers' ``Trainer`` default, ``optim="adamw_torch_fused"``,
    and torchtitan's) holds none. ``chunked_loss`` is the
    chunk size of the chunked cross-entropy (0: the full logits). ``loss`` is how the full
    loss holds the logits: ``"course"`` (the course's loop, and transformers since #35646), or
    ``"transformers-4.46"`` (``TransformersLoss``: 4.46 until #35646, late 2024), for measuring
    a stack as it ran then, or ``"litgpt"`` (``LitGPTLoss``), litgpt's loop's loss on a
    transformers model (litgpt's own model: ``litgpt_memory``).
    ``autocast_adapter_dtype`` is peft's ``get_peft_model`` argument:
    True (peft's default) keeps LoRA adapters in fp32 over a 16-bit base; False keeps them in
    the base's dtype, as torchtune does with ``dtype: bf16``. ``gpu_dropout=True`` (with
    ``lora_dropout``) runs dropout as a GPU does: CUDA's fused kernel (``aten.native_dropout``)
    keeps a 1-byte mask for backward, where CPU's keeps its noise in the input's dtype; the
    trace and a real run on this CPU both call that kernel (``gpu_dropout_context``).
    ``nf4_keeps_input=True`` (QLoRA) runs bitsandbytes' 4-bit matmul as it was until 0.43.2
    (bitsandbytes #1270, July 2024), keeping each 4-bit layer's input for backward, which only a
    trainable 4-bit weight would need (``nf4_keeps_input_context``): what a QLoRA step measured
    before then held.
    ``attention_mask=True`` measures rows that need an attention mask: rows padded to a common
    length, as a collator that pads hands them (``DataCollatorWithPadding``, TRL's default), or
    packed documents kept apart by restarting ``position_ids`` (TRL's ``padding_free``, the
    course's ``packing.collate_padding_free``). Either way transformers gives SDPA (and eager
    attention) an explicit ``b x 1 x s x s`` mask in every layer instead of ``is_causal``, which
    SDPA copies into the matmuls' dtype and keeps for backward, and with grouped queries
    ``repeat_kv`` widens the keys and values to every head (a mask rules out SDPA's
    ``enable_gqa``). The step pads one token (``padding_context``); packed documents keep the
    same bytes (to one ``s x s`` 1-byte tensor: ``tests/test_fake_memory.py``).
    flash-attention-2 runs both without a mask (variable-length calls): not measured here.
    The default, full rows with no mask, is what pretraining on concatenated text runs.

    Attributes:
        method: "full", "lora" or "qlora".
        precision: "fp32", "bf16", "fp16" or "bf16-mixed" (above).
        checkpointing: activation checkpointing of every decoder layer.
        selective_checkpointing: keep some outputs inside each checkpointed layer (above).
        optimizer: "adamw", "adamw-foreach", "adamw-fused", "adamw-8bit" or "sgd" (above).
        grad_accum_steps: micro-batches per step (the batch is split into them).
        lora_rank: the adapters' rank.
        chunked_loss: tokens per chunk of the chunked cross-entropy (0: the full logits).
        fsdp_ranks: ranks the model is sharded over with FSDP2 (1: none).
        lora_targets: peft's ``target_modules`` ("all-linear" or module names).
        lora_parameters: peft's ``target_parameters``: parameters adapted as they are, a mixture
            of experts' 3-D experts (``("mlp.experts.gate_up_proj", "mlp.experts.down_proj")``)
            where "all-linear" leaves them frozen (``architectures.frozen_experts``).
        lora_dropout: the adapters' dropout probability.
        offload_optimizer: optimizer states in host memory (``offload.CPUOffloadOptimizer``).
        offload_activations: saved activations in host memory
            (``torch.autograd.graph.save_on_cpu``).
        bf16_embeddings: QLoRA's embeddings and head cast back to bf16 (above).
        loss: "course", "transformers-4.46" or "litgpt" (above).
        autocast_adapter_dtype: peft's fp32 adapters over a 16-bit base (above).
        gpu_dropout: dropout as CUDA's fused kernel keeps it (above).
        nf4_keeps_input: bitsandbytes' 4-bit matmul before 0.43.2 (above).
        attention_mask: the rows need an attention mask (above).
        chunked_dequant: FSDP + QLoRA's NF4 dequantized chunk by chunk (above).
        fsdp_cpu_offload: FSDP's shards, gradients and optimizer states in host memory (above).

    Raises:
        ValueError: naming the field, for a value out of range or a combination that does not
            exist (QLoRA with a full fine-tune).

    Example:
        >>> Stack(method="qlora", precision="bf16-mixed", checkpointing=True).method
        'qlora'
    """

    method: str = "full"
    precision: str = "bf16"
    checkpointing: bool = False
    selective_checkpointing: bool = False
    optimizer: str = "adamw"
    grad_accum_steps: int = 1
    lora_rank: int = 16
    chunked_loss: int = 0
    fsdp_ranks: int = 1
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_parameters: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    offload_optimizer: bool = False
    offload_activations: bool = False
    bf16_embeddings: bool = False
    loss: str = "course"
    autocast_adapter_dtype: bool = True
    gpu_dropout: bool = False
    nf4_keeps_input: bool = False
    attention_mask: bool = False
    chunked_dequant: bool = False
    fsdp_cpu_offload: bool = False

    def __post_init__(self) -> None:
        if "qlora" in str(self.method) and "full" in str(self.method):
            raise ValueError(f"method={self.method!r}: QLoRA trains adapters on a frozen 4-bit "
                             "base; a full fine-tune of NF4 weights does not exist (use "
                             "'qlora' or 'full')")
        for name, allowed in (("method", METHODS), ("precision", PRECISIONS),
                              ("optimizer", OPTIMIZERS), ("loss", LOSSES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        for name, low in (("grad_accum_steps", 1), ("lora_rank", 1), ("chunked_loss", 0),
                          ("fsdp_ranks", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name}={v!r}: must be an integer >= {low}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout!r}: must be in [0, 1)")
        if not isinstance(self.lora_targets, str) and not (
                isinstance(self.lora_targets, tuple) and self.lora_targets
                and all(isinstance(t, str) for t in self.lora_targets)):
            raise ValueError(f"lora_targets={self.lora_targets!r}: 'all-linear' or a tuple of "
                             "module names, e.g. ('q_proj', 'v_proj')")
        if not (isinstance(self.lora_parameters, tuple)
                and all(isinstance(t, str) and t for t in self.lora_parameters)):
            raise ValueError(f"lora_parameters={self.lora_parameters!r}: a tuple of parameter "
                             "names, e.g. ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj')")
        if self.lora_parameters and self.method == "full":
            raise ValueError("lora_parameters with method='full': they name what LoRA adapts, "
                             "and a full fine-tune trains every parameter")
        if self.offload_optimizer and (self.fsdp_ranks > 1
                                       or self.optimizer not in ("adamw", "sgd")):
            raise ValueError("offload_optimizer=True: the course offloads AdamW or SGD states of "
                             "one device (offload.CPUOffloadOptimizer, which steps them on the "
                             "host as torch picks there); with FSDP use its CPUOffloadPolicy, "
                             "and 8-bit states are not offloaded")
        if self.offload_activations and self.fsdp_ranks > 1:
            raise ValueError("offload_activations=True with fsdp_ranks > 1: not measured here "
                             "(one device's saved tensors go to its host)")
        if self.bf16_embeddings and (self.method, self.precision) != ("qlora", "bf16-mixed"):
            raise ValueError(f"bf16_embeddings=True with method={self.method!r}, precision="
                             f"{self.precision!r}: it undoes part of peft's k-bit preparation, "
                             "which only method='qlora' with precision='bf16-mixed' runs")
        if self.selective_checkpointing and not self.checkpointing:
            raise ValueError("selective_checkpointing=True with checkpointing=False: selective "
                             "checkpointing chooses what a checkpointed layer keeps; set both")
        for name, meaning in _SWITCHES.items():
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}: {meaning}")
        if not self.autocast_adapter_dtype and self.method == "full":
            raise ValueError("autocast_adapter_dtype=False with method='full': it sets the "
                             "LoRA adapters' dtype, and a full fine-tune has none")
        if self.gpu_dropout and not self.lora_dropout:
            raise ValueError("gpu_dropout=True with lora_dropout=0: it chooses how the adapters' "
                             "dropout keeps its mask, and there is no dropout")
        if self.nf4_keeps_input and self.method != "qlora":
            raise ValueError(f"nf4_keeps_input=True with method={self.method!r}: it is how a "
                             "4-bit layer's matmul kept its input, and only QLoRA has 4-bit layers")
        if self.chunked_loss and self.loss != "course":
            raise ValueError(f"loss={self.loss!r} with chunked_loss={self.chunked_loss}: the "
                             "chunked loss never forms the logits that loss holds; choose one")
        if self.chunked_dequant and (self.method, self.fsdp_ranks > 1) != ("qlora", True):
            raise ValueError(f"chunked_dequant=True with method={self.method!r}, fsdp_ranks="
                             f"{self.fsdp_ranks}: it is how FSDP + QLoRA's torchao NF4 weights "
                             "are dequantized (method='qlora', fsdp_ranks > 1); QLoRA on one "
                             "device runs bitsandbytes' kernels, which hold only their output")
        if self.fsdp_cpu_offload and self.fsdp_ranks == 1:
            raise ValueError("fsdp_cpu_offload=True with fsdp_ranks=1: it is FSDP's offload of "
                             "the shards; on one device offload the optimizer's states "
                             "(offload_optimizer=True)")
        if self.fsdp_ranks > 1 and self.method == "qlora":  # the course's FSDP + QLoRA
            unlike = {"lora_parameters": bool(self.lora_parameters),
                      "gpu_dropout": self.gpu_dropout, "precision": self.precision == "fp16"}
            field = next((k for k, v in unlike.items() if v), None)
            if field:
                raise ValueError(
                    f"{field}={getattr(self, field)!r} with method='qlora' and fsdp_ranks > 1: "
                    "FSDP + QLoRA is the course's fsdp_qlora (bitsandbytes' packed weights do "
                    "not shard under FSDP2): torchao's NF4 base on every linear layer of the "
                    "blocks and adapters on those lora_targets names, in fp32, bf16 or "
                    "bf16-mixed")

    @property
    def label(self) -> str:
        method = {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}[self.method]
        if self.method == "qlora" and self.fsdp_ranks > 1:  # the course's fsdp_qlora
            method = "QLoRA (torchao NF4)"
        modules = (self.lora_targets if isinstance(self.lora_targets, str)
                   else "+".join(self.lora_targets))
        targets = "" if modules == "all-linear" else f" on {modules}"
        if self.lora_parameters:  # "LoRA r=16 on all-linear and mlp.experts.down_proj"
            targets = f" on {modules} and {'+'.join(self.lora_parameters)}"
        parts = [method if self.method == "full" else f"{method} r={self.lora_rank}{targets}",
                 self.precision, self.optimizer]
        if self.checkpointing:
            parts.append("selective checkpointing" if self.selective_checkpointing
                         else "checkpointing")
        if self.grad_accum_steps > 1:
            parts.append(f"accumulation x{self.grad_accum_steps}")
        if self.chunked_loss:
            parts.append(f"chunked CE ({self.chunked_loss})")
        if self.fsdp_ranks > 1:
            parts.append(f"FSDP over {self.fsdp_ranks} ranks")
        if self.offload_optimizer:
            parts.append("optimizer offloaded")
        if self.offload_activations:
            parts.append("activations offloaded")
        if self.bf16_embeddings:
            parts.append("bf16 embeddings and head")
        if self.loss != "course":
            parts.append(f"{self.loss}'s loss")
        if not self.autocast_adapter_dtype:
            parts.append("adapters in the base's dtype")
        if self.lora_dropout:
            parts.append(f"dropout {self.lora_dropout:g}"
                         + (" (a GPU's 1-byte mask)" if self.gpu_dropout else ""))
        if self.nf4_keeps_input:
            parts.append("4-bit layers keep their input (bitsandbytes < 0.43.2)")
        if self.attention_mask:
            parts.append("attention mask (padded or packed rows)")
        if self.chunked_dequant:
            parts.append("NF4 dequantized in chunks")
        if self.fsdp_cpu_offload:
            parts.append("FSDP's CPU offload")
        return ", ".join(parts)


class TransformersLoss:
    """``loss_fn`` for ``grad_accumulation.forward_backward``: next-token cross-entropy from the
    model's logits, holding what transformers' causal-LM loss held from 4.46 (October 2024)
    until #35646 (January 2025). Summed over the target tokens, equal to
    ``grad_accumulation.causal_lm_loss_sum``; only the memory differs.

    ``ForCausalLMLoss`` upcast the logits to fp32 while the model's forward still held them in
    its own dtype, then flattened a contiguous copy of the shifted logits
    (``logits[..., :-1, :].contiguous()``), where today's loss, and the course's, pads the
    labels instead. With several sequences that copy is one more tokens x vocab fp32 tensor while
    the cross-entropy's forward runs; with one, the shifted slice is already contiguous and
    nothing is copied, so a batch-1 step holds what the course's loss holds (to one position's
    log-probabilities).

    Example:
        >>> forward_backward(model, batch, loss_fn=TransformersLoss())  # doctest: +SKIP
    """

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch.get("attention_mask")).logits
        upcast = logits.float()  # beside the logits the model's forward still holds
        shifted = upcast[..., :-1, :].contiguous()
        return F.cross_entropy(shifted.view(-1, shifted.shape[-1]),
                               batch["labels"][..., 1:].contiguous().view(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")


class LitGPTLoss:
    """``loss_fn`` for ``grad_accumulation.forward_backward``: next-token cross-entropy as
    litgpt's fine-tuning scripts compute it (``model(input_ids, lm_head_chunk_size=128)`` then
    ``chunked_cross_entropy``, since 2023): the head applied to 128-token chunks of the final
    hidden states, each chunk's logits kept in the model's dtype (no fp32 copy), their
    cross-entropy taken chunk by chunk. The loop holds the list of logits (its ``logits``
    variable) until after backward: so does this loss, until the next call or :meth:`release`.
    Summed over the target tokens, equal to ``grad_accumulation.causal_lm_loss_sum`` in fp32;
    only the memory differs (and, in 16-bit, the log-softmax's rounding).

    Args:
        chunk_size: tokens per chunk of the head (litgpt's 128).

    Example:
        >>> forward_backward(model, batch, loss_fn=LitGPTLoss())  # doctest: +SKIP
    """

    # it calls the decoder and reads the head itself, not the model's forward: a loop runs it
    # as that forward where a wrapper needs its own to run (architectures.through_wrappers)
    bypasses_forward = True

    def __init__(self, chunk_size: int = 128):
        self.chunk_size = chunk_size
        self.held: list[torch.Tensor] = []

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from recipes_lib.architectures import final_hidden_states

        head = model.get_output_embeddings()
        hidden = final_hidden_states(model, batch)
        logits = [F.linear(h, head.weight, head.bias)  # litgpt's head is one nn.Linear
                  for h in hidden.split(self.chunk_size, dim=1)]
        self.held = logits  # the previous call's are freed only now, as the loop's variable
        labels = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        return sum(F.cross_entropy(chunk.flatten(0, 1), target.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
                   for chunk, target in zip(logits, labels.split(self.chunk_size, dim=1)))

    def release(self) -> None:
        """Drop the held logits (the step has ended)."""
        self.held = []


@contextlib.contextmanager
def padding_context(model: torch.nn.Module):
    """Hand the decoder of ``model`` (transformers or peft) an attention mask whose first row
    ends in a pad token wherever its forward gets none: the batch a collator that pads to the
    longest row makes. transformers then builds the explicit ``b x 1 x s x s`` mask padding
    needs for every layer (a real mask for its zero; on fake tensors for any mask, whose values
    it cannot read: ``masking_utils.is_tracing``), so a fake and a real step build the same.
    The mask is the decoder's input alone: the loss still takes every label.

    Args:
        model: the model whose ``get_decoder()`` builds the masks.

    Example:
        >>> with padding_context(model):  # doctest: +SKIP
        ...     forward_backward(model, batch)
    """
    def pad_last_token(module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            ids = kwargs.get("input_ids")
            rows = ids if ids is not None else kwargs["inputs_embeds"][..., 0]
            mask = torch.ones(rows.shape, dtype=torch.long, device=rows.device)
            mask[0, -1] = 0
            kwargs["attention_mask"] = mask
        return args, kwargs

    handle = model.get_decoder().register_forward_pre_hook(pad_last_token, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def gpu_dropout_context():
    """Run ``torch.nn.functional.dropout`` (what ``nn.Dropout`` and peft's adapters call) as CUDA
    does, with the fused ``aten.native_dropout``, on any device.

    ATen's dropout takes the fused kernel only for CUDA tensors; elsewhere it multiplies by a
    noise tensor in the input's dtype and keeps it for backward. The fused kernel returns a bool
    mask and keeps that: 1 byte an element where the noise kept 2 or 4. It exists on CPU too, with
    the same outputs' distribution, so a fake trace and a real CPU run under this context both
    keep what a GPU keeps.

    Example:
        >>> with gpu_dropout_context():  # doctest: +SKIP
        ...     loss = model(**batch).loss
    """
    original = F.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                inplace: bool = False) -> torch.Tensor:
        if not training or p in (0, 1) or inplace:  # ATen's own answer for these
            return original(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


class _KeptInput(torch.autograd.Function):
    """The identity on a 4-bit matmul's output, whose graph node holds the matmul's input as a
    plain attribute until the graph is freed: what bitsandbytes' ``MatMul4Bit`` did until #1270
    (``ctx.tensors = (A, B)``; out of reach of checkpointing's saved-tensor hooks, as there)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        ctx.kept = kept
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@contextlib.contextmanager
def nf4_keeps_input_context():
    """Run bitsandbytes' 4-bit matmul (``bnb.matmul_4bit``, what ``Linear4bit`` calls) as it ran
    until bitsandbytes 0.43.2: each call keeps its input ``A`` (in the compute dtype) for
    backward, which only a trainable 4-bit weight would need. bitsandbytes #1270 (July 2024)
    stopped it; "the bug that caused a lot of memory issues with QLoRA", in its author's words.
    Outputs and gradients are unchanged. The input is held as bitsandbytes held it, a plain
    attribute of the graph node, so non-reentrant checkpointing (the course's) cannot free it
    either; reentrant checkpointing's forward runs without a graph and kept nothing.
    """
    import bitsandbytes as bnb

    original = bnb.matmul_4bit

    def matmul_4bit(A: torch.Tensor, B: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = original(A, B, *args, **kwargs)
        return _KeptInput.apply(out, A) if torch.is_grad_enabled() and A.requires_grad else out

    bnb.matmul_4bit = matmul_4bit
    try:
        yield
    finally:
        bnb.matmul_4bit = original


def model_config(model: Any):
    """A transformers config for a built-in preset name, a ``config.json`` (or its folder), or a
    config object.

    Args:
        model: a built-in name or its hub id (``calc.find_preset``), a folder with a
            config.json or a config file (of any name), or a config object.

    Returns:
        The config (a ``PretrainedConfig``); for a multimodal checkpoint's, its language
        model's (``calc.language_model_config``).

    Raises:
        ValueError: naming ``model`` for an unknown name (listing the presets), or a config
            that is not a causal LM.
    """
    from transformers import AutoConfig, LlamaConfig, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if isinstance(model, PretrainedConfig):  # a copy: a model built from it may change it
        config = copy.deepcopy(model)
    elif isinstance(model, dict):  # a config's to_dict(), e.g. sent to the ranks of a real run
        config = AutoConfig.for_model(**model)
    elif (preset := calc.find_preset(model)) in calc.CONFIGS:  # Qwen3, Gemma, Phi: their class
        config = AutoConfig.for_model(**calc.CONFIGS[preset])
    elif isinstance(model, calc.ModelShape) or preset:
        shape = model if isinstance(model, calc.ModelShape) else calc.PRESETS[preset]
        config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                             intermediate_size=shape.intermediate_size,
                             num_hidden_layers=shape.num_hidden_layers,
                             num_attention_heads=shape.num_attention_heads,
                             num_key_value_heads=shape.num_key_value_heads,
                             tie_word_embeddings=shape.tie_word_embeddings,
                             head_dim=shape.head_dim,
                             max_position_embeddings=shape.max_position_embeddings or 131072)
    else:
        path = Path(str(model))  # a folder with a config.json, or a config file of any name
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            path = hub_config_file(str(model)) or path  # a hub id: from the hub or its cache
        if not path.is_file():
            raise ValueError(f"model={str(model)!r}: not a built-in preset "
                             f"({', '.join(calc.preset_names())}) and no config.json there")
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as err:  # not JSON, or no model_type transformers knows
            raise ValueError(f"model={str(model)!r}: not a transformers config ({err})") from err
    config = calc.language_model_config(config)  # a multimodal checkpoint: its decoder
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        # a config object's str() is its whole JSON: name it by its class
        given = type(model).__name__ if isinstance(model, PretrainedConfig) else str(model)[:80]
        raise ValueError(f"model={given!r}: a {config.model_type!r} config is not a causal "
                         "language model (transformers maps no AutoModelForCausalLM to it)")
    return config


COMM_BACKENDS = ("nccl", "gloo")


def _gloo_reduce_scatter():
    """FSDP2's reduce-scatter as gloo runs it on CPU ranks: on a full-size copy of its input.

    Seen on 2 gloo ranks: after ``c10d._reduce_scatter_base_`` the trace shows ``aten.split`` of
    a storage the input's size that is not the input. NCCL reduces in place, so a fake rank
    counts this copy only when it stands in for a gloo rank (``comm_backend="gloo"``); at
    110 M parameters it is the root group's 187.5 MiB, the whole gap between a fake rank's
    peak and a real gloo rank's before it was modelled.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class GlooReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            # the collective first, as the trace shows it: the meter labels its input as the
            # reduce-scatter buffer there; then gloo's working copy, alive beside that input
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            input_tensor.clone()
            return work

    return GlooReduceScatter()


def build_model(config, stack: Stack, device: torch.device | str, fake: bool = True,
                attn_implementation: str | None = None,
                comm_backend: str = "nccl", log: Any = None) -> tuple[torch.nn.Module, Any]:
    """Build ``config``'s model with ``stack`` applied, its weights fake (or real) on ``device``.

    ``attn_implementation`` None: SDPA where transformers has it for the architecture, else
    eager (Gemma-2), whose s x s scores the measurement then counts, as a GPU would hold them.
    ``comm_backend`` (FSDP on fake tensors): the collective library the ranks would use,
    ``"nccl"`` (GPUs) or ``"gloo"`` (CPU ranks, whose reduce-scatter copies its input).

    Args:
        config: a transformers causal-LM config.
        stack: the recipes applied.
        device: where the weights are (fake or real).
        fake: fake weights (no memory); False builds real ones.
        attn_implementation: transformers' attention implementation (None: as above).
        comm_backend: "nccl" or "gloo" (above).
        log: an ``allocator.AllocationLog`` that records the weights' allocations (and the
            storages tying the embeddings frees), one device only (FSDP stacks: not logged).

    Returns:
        ``(model, mode)``: ``mode`` is the ``FakeTensorMode`` to run the step in (None if real).
    """
    device = torch.device(device)
    logged = log or contextlib.nullcontext()
    if stack.method == "qlora" and stack.fsdp_ranks > 1:  # the course's fsdp_qlora
        model, mode = _sharded_nf4_model(config, stack, device, fake, attn_implementation)
    else:
        model = _meta_model(config, stack, attn_implementation)
        _check_experts(model, config, stack)
        nf4_shapes = packed_placeholders(model)
        if stack.fsdp_ranks > 1:  # sharded on meta; to_empty then gives each rank its shards
            shard_model(model, "bf16" if stack.precision == "bf16-mixed" else "fp32",
                        device_type=device.type, cpu_offload=stack.fsdp_cpu_offload)
        mode = materialize(model, nf4_shapes, _compute_dtype(stack), device, fake, log)
        with mode or contextlib.nullcontext(), logged:
            if stack.fsdp_ranks == 1:  # FSDP keeps one sharded parameter for tied weights
                model.tie_weights()  # to_empty gives tied weights separate storages
            if not fake:  # fake tensors hold no values to restore
                _restore_buffers(model)
    if fake and stack.fsdp_ranks > 1 and comm_backend == "gloo":
        from torch.distributed.fsdp import FSDPModule

        comm = _gloo_reduce_scatter()  # stateless: one for every sharded module
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)
    if stack.checkpointing:
        enable_activation_checkpointing(model, selective=stack.selective_checkpointing)
    model.train()
    return model, mode


def _sharded_nf4_model(config: Any, stack: Stack, device: torch.device, fake: bool,
                       attn_implementation: str | None) -> tuple[torch.nn.Module, Any]:
    """:func:`build_model`'s model for FSDP + QLoRA, the course's ``fsdp_qlora``: torchao's NF4 base
    on every linear layer of the blocks and LoRA adapters on ``stack.lora_targets``, sharded by
    FSDP2, NF4 shards and all. NF4 quantizes the weights it is given, so the model is materialised
    (fake or random) first and sharded after, not on the meta device; the device mesh is made before
    fake mode, whose tensors cannot give the mesh its ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from recipes_lib.fsdp_qlora import NF4BlockError, apply_nf4_lora

    model = meta_model(config, dtype=DTYPES[stack.precision],
                       attn_implementation=attn_implementation or default_attention(config))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mode = materialize(model, {}, _compute_dtype(stack), device, fake)
    with mode or contextlib.nullcontext():
        model.tie_weights()  # before sharding: FSDP keeps one sharded parameter for both
        if not fake:
            _restore_buffers(model)
        why = (f"its linear layers' weights do not split into whole torchao NF4 blocks (64 "
               f"weights, their scales in groups of 256) over {stack.fsdp_ranks} FSDP ranks")
        try:
            apply_nf4_lora(model, r=stack.lora_rank, alpha=2 * stack.lora_rank,
                           dropout=stack.lora_dropout, base_dtype=_compute_dtype(stack),
                           chunked_dequant=stack.chunked_dequant,
                           adapter_modules=None if stack.lora_targets == "all-linear"
                           else stack.lora_targets,
                           adapter_dtype=torch.float32 if stack.autocast_adapter_dtype
                           else DTYPES[stack.precision])
        except NF4BlockError as err:
            raise UnmeasuredStackError("model", f"{why}: {err}", "NF4 blocks do not split "
                                       "over the ranks") from err
        except ValueError as err:  # the only names it is given: stack.lora_targets
            raise ValueError(f"lora_targets={stack.lora_targets!r}: {err}") from err
        try:
            shard_model(model, "bf16" if stack.precision == "bf16-mixed" else "fp32",
                        mesh=mesh, cpu_offload=stack.fsdp_cpu_offload)
        except AssertionError as err:  # torchao's NF4 split asserts its blocks divide
            raise UnmeasuredStackError("model", f"{why}: {err}", "NF4 blocks do not split "
                                       "over the ranks") from err
    return model, mode


def _meta_model(config: Any, stack: Stack, attn_implementation: str | None = None
                ) -> torch.nn.Module:
    """``config``'s model on the meta device with ``stack``'s NF4 layers and adapters."""
    # a QLoRA base loads in its compute dtype (peft's k-bit preparation then casts what stays
    # unquantized to fp32 under bf16-mixed); other stacks load in their weights' dtype
    dtype = _compute_dtype(stack) if stack.method == "qlora" else DTYPES[stack.precision]
    attn_implementation = attn_implementation or default_attention(config)
    model = meta_model(config, dtype=dtype, attn_implementation=attn_implementation)
    if stack.method == "qlora":
        _to_nf4(model, stack)
    if stack.method in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        targets = lora_target_modules(model, stack.lora_targets if isinstance(
            stack.lora_targets, str) else list(stack.lora_targets), "lora_targets")
        model = get_peft_model(model, LoraConfig(r=stack.lora_rank, lora_alpha=2 * stack.lora_rank,
                                                 target_modules=targets,
                                                 target_parameters=list(stack.lora_parameters)
                                                 or None,
                                                 lora_dropout=stack.lora_dropout,
                                                 task_type="CAUSAL_LM"),
                               autocast_adapter_dtype=stack.autocast_adapter_dtype)
    if stack.bf16_embeddings:  # TRL's peft_module_casting_to_bf16, after get_peft_model
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            module.to(torch.bfloat16)
    return model


def materialize(model: torch.nn.Module, nf4_shapes: dict[torch.nn.Module, torch.Size],
                dtype: torch.dtype, device: torch.device, fake: bool, log: Any = None) -> Any:
    """Give a model built on the meta device fake (or random) storage on ``device``, its 4-bit
    layers quantized (:func:`quantize_nf4`).

    Args:
        model: the model, on meta.
        nf4_shapes: its 4-bit layers' weight shapes (:func:`packed_placeholders`).
        dtype: the dtype 4-bit weights are quantized from.
        device: where the weights go.
        fake: fake storage (no memory); False draws random weights.
        log: an ``allocator.AllocationLog`` to record the allocations in (None: none).

    Returns:
        The ``FakeTensorMode`` a step must run in (None if real).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with mode or contextlib.nullcontext(), log or contextlib.nullcontext():
        model.to_empty(device=device)
        if not fake:
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.normal_(0.0, 0.02)
        for layer, shape in nf4_shapes.items():
            quantize_nf4(layer, shape, dtype, device, fake)
    return mode


class UnmeasuredStackError(ValueError):
    """A stack this module cannot measure for the model (:func:`_check_experts`): a ValueError
    ``"<param>: <why>"`` naming ``stack`` (or ``model``); ``why`` alone, the same for every
    stack it refuses for one reason, and ``short``, that reason in a few words, are what the
    planner shows (a note, and the row instead of a figure); ``substitute``: the nearest stack
    that can be measured, where there is one (the planner measures it instead, and says so)."""

    def __init__(self, param: str, why: str, short: str, substitute: Stack | None = None):
        super().__init__(f"{param}: {why}")
        self.why, self.short, self.substitute = why, short, substitute


def _check_experts(model: torch.nn.Module, config: Any, stack: Stack) -> None:
    """Refuse what a fake step of a mixture-of-experts model cannot measure.

    transformers 5 runs experts through one interface (``@use_experts_implementation``) whose
    default, ``grouped_mm``, sorts the tokens by expert and multiplies every token's top-k
    experts in one grouped GEMM: its shapes do not depend on the router's choice, so a fake
    step, which has no values, counts what a real one allocates (tiny Mixtral, Qwen3-MoE,
    GPT-OSS and DeepSeek-V3 fake steps equal real ones on a CPU, tests/test_fake_memory.py).
    An architecture with its own routing code, or another implementation (``"eager"`` loops
    over the experts the router chose), takes its shapes from that choice, which fake tensors
    cannot make. torch's grouped GEMM multiplies bf16 only (its checks are the CUDA kernel's;
    CPU autocast leaves it in fp32), so the experts' weights must be bf16, or gathered as bf16
    copies by FSDP's mixed-precision policy (bf16-mixed over several ranks: fake and real gloo
    ranks of Qwen3-MoE and DeepSeek-V3 equal). And bitsandbytes' 4-bit conversion skips the
    experts, 3-D parameters in transformers 5, not linear layers (bitsandbytes #1849): QLoRA
    quantizes the attention only.
    """
    experts = calc.expert_count(config)
    if experts is None:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = f"{config.model_type!r} ({experts[0]}={experts[1]})"
    impl = getattr(base.config, "_experts_implementation", None)
    interface = type(base)._can_set_experts_implementation()
    if not interface or impl != "grouped_mm":
        how = ("routes tokens in its own code" if not interface
               else f"runs its experts with experts_implementation={impl!r}")
        raise UnmeasuredStackError(
            "model", f"the mixture-of-experts {kind} {how}: a fake step has no values for "
            "its router to choose experts by, and only transformers' grouped_mm experts take "
            "shapes that do not depend on that choice (every token's top-k); measure a real "
            "step (memory.measure_memory)", "its experts' shapes depend on the router")
    if stack.fsdp_ranks > 1 and stack.precision == "bf16-mixed":
        return  # FSDP's mixed-precision policy gathers bf16 copies of the fp32 weights to compute
    dtypes = {p.dtype for p in base.parameters() if p.ndim == 3 and p.is_floating_point()}
    if dtypes - {torch.bfloat16}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        why = ("peft's k-bit preparation casts what bitsandbytes left unquantized to fp32, and "
               "its 4-bit conversion skips the experts, 3-D parameters (bitsandbytes #1849)"
               if stack.method == "qlora" else f"precision {stack.precision}")
        raise UnmeasuredStackError(
            f"stack={stack.label!r}", f"the {kind} experts' weights would be {names} ({why}), "
            "and transformers' grouped_mm experts, its default, multiply bf16 only (torch's "
            "grouped GEMM, whose checks are its CUDA kernel's): measure precision='bf16' "
            "(weights, gradients and AdamW states in bf16, as torchtitan trains its MoE models)",
            f"{names} experts; grouped_mm multiplies bf16 only",
            replace(stack, precision="bf16", bf16_embeddings=False))


def expert_adapters(model: Any, stack: Stack = Stack(method="lora", precision="bf16")
                    ) -> dict[str, Any] | None:
    """What peft's LoRA does to a mixture-of-experts model's experts: it adapts them whole.

    transformers 5 keeps an MoE's experts as 3-D parameters (every expert's projections stacked),
    not linear layers. peft maps the names transformers 4 gave them (``gate_proj``, ``up_proj``,
    ``down_proj``, which "all-linear" takes, and the router's ``gate``) onto those parameters
    (``target_parameters``) and adapts each through its ``ParamWrapper``, one rank-r adapter per
    expert. Each forward then builds the adapted parameter, ``W + scaling * B A`` (one ``baddbmm``
    since peft #3577), the size of the layer's experts, and the grouped GEMM keeps it for
    backward: without checkpointing every layer's copy stays alive until its backward runs, with
    it one layer's at a time. Adapters on the attention alone leave the experts as they are.

    For some model types (Phi-3.5-MoE, GPT-OSS, Llama 4, Qwen2-MoE up to peft 0.21, ...) peft
    maps no name onto the experts: "all-linear" leaves them frozen
    (``architectures.frozen_experts``), and the result says so instead.

    Args:
        model: a built-in name or its hub id, a ``config.json`` path or a config (as
            :func:`measure_step`).
        stack: a LoRA or QLoRA stack; its ``lora_targets`` decide what is adapted.

    Returns:
        None for a dense model, a full fine-tune, or targets that leave the experts alone on
        purpose (the attention's); else ``architecture`` (the model's class name), ``frozen``
        (the experts' parameters the targets name that peft left frozen, every layer's:
        ``architectures.frozen_experts``, empty where it adapts them), ``parameters`` (the
        adapted parameters of one decoder layer, named from it),
        ``unadapted`` (linear layers the targets name that peft's mapping left without adapters,
        ``architectures.unadapted_linears``: a dense layer's or a shared expert's),
        ``adapter_params`` (the adapters' parameters on them, over every layer),
        ``layer_bytes`` (one layer's adapted copies, each its parameter's size and dtype),
        ``layers`` (the decoder layers with adapted experts) and ``attention_targets`` (the
        attention's linear layers, as ``lora_targets`` that leave the experts out; None for a
        model whose layers have no ``self_attn``).

    Example:
        >>> info = expert_adapters("qwen3-30b-a3b/config.json")  # doctest: +SKIP
        >>> info["layers"], round(info["layer_bytes"] / 2**30, 3)  # doctest: +SKIP
        (48, 1.125)
    """
    from peft.tuners.lora.layer import ParamWrapper

    config = model_config(model)
    if calc.expert_count(config) is None or stack.method not in ("lora", "qlora"):
        return None
    built = _meta_model(config, stack)
    layers = decoder_layers(built)
    wrapped: dict[int, dict[str, torch.Tensor]] = {}
    adapter_params = 0
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, ParamWrapper):
                param = module.get_param()
                owner = name.split(".base_layer")[0]  # nested wrappers: one a parameter
                wrapped.setdefault(i, {})[f"{owner}.{module.parameter_name}"] = param
                adapter_params += sum(p.numel() for adapters in (module.lora_A, module.lora_B)
                                      for p in adapters.parameters())
    frozen = frozen_experts(built, stack.lora_targets)
    if not wrapped and not frozen:
        return None
    first = wrapped[min(wrapped)] if wrapped else {}
    attention = getattr(layers[0], "self_attn", None)
    inside = {n.rsplit(".", 1)[-1] for n, _ in attention.named_modules()} if attention else set()
    return {"architecture": architecture_name(built), "frozen": frozen,
            "parameters": sorted(first),
            "unadapted": unadapted_linears(built, stack.lora_targets),
            "adapter_params": adapter_params,
            "layer_bytes": sum(p.numel() * p.element_size() for p in first.values()),
            "layers": len(wrapped),
            "attention_targets": tuple(t for t in adapter_targets(built) if t in inside) or None}


def _to_nf4(model: torch.nn.Module, stack: Stack) -> None:
    """Swap every linear layer but the head for bitsandbytes' ``Linear4bit`` (on meta, NF4 with
    double quantization, as ``quantization.nf4_config``)."""
    require_bitsandbytes()
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"],
                            quantization_config=nf4_config(compute_dtype=_compute_dtype(stack)))
    if stack.precision == "bf16-mixed":  # peft's k-bit preparation, as add_lora runs it
        from peft import prepare_model_for_kbit_training

        model.is_loaded_in_4bit = True
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def packed_placeholders(model: torch.nn.Module) -> dict[torch.nn.Module, torch.Size]:
    """Give each 4-bit layer (once peft has wrapped it) a plain uint8 weight of the packed shape
    for ``to_empty``: bitsandbytes' ``Params4bit`` cannot wrap a fake tensor.

    Args:
        model: a model on the meta device whose linear layers may be bitsandbytes' 4-bit ones.

    Returns:
        Each 4-bit layer's full weight shape, to quantize once materialised (:func:`quantize_nf4`).
    """
    from recipes_lib.device import has_module

    if not has_module("bitsandbytes"):
        return {}
    import bitsandbytes as bnb

    shapes = {}
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            shapes[layer] = layer.weight.shape
            packed = torch.empty(layer.weight.numel() // 2, 1, dtype=torch.uint8, device="meta")
            layer.weight = torch.nn.Parameter(packed, requires_grad=False)
    if shapes:
        bnb.functional.quantize_blockwise(torch.ones(256))  # its code table, outside fake mode
    return shapes


def quantize_nf4(layer: torch.nn.Module, shape: torch.Size, dtype: torch.dtype,
                 device: torch.device, fake: bool) -> None:
    """Quantize a (fake or random) weight of ``shape`` into ``layer`` with bitsandbytes' own op,
    whose fake implementation allocates what the kernel does. The quantization statistics are
    registered as buffers so the meter counts them; the packed weight stays a frozen parameter.

    Args:
        layer: a 4-bit layer given a placeholder by :func:`packed_placeholders`.
        shape: its full weight shape.
        dtype: the dtype the weight is quantized from.
        device: where the weight is.
        fake: a fake weight (inside ``FakeTensorMode``); False draws a random one.
    """
    import bitsandbytes as bnb

    weight = torch.empty(shape, dtype=dtype, device=device)
    if not fake:
        weight.normal_(0.0, 0.02)
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True,
                                                 quant_type="nf4", quant_storage=torch.uint8)
    layer.weight.data = packed
    layer.weight.quant_state = state
    for name, t in nf4_statistics(state).items():
        layer.register_buffer(f"nf4_{name}", t, persistent=False)


def nf4_statistics(state: Any) -> dict[str, torch.Tensor]:
    """The tensors a bitsandbytes NF4 ``QuantState`` (double quantization) keeps beside the
    packed weight: what ``calc.nf4_tensor_bytes`` counts.

    Args:
        state: the weight's ``QuantState``.

    Returns:
        ``{"absmax", "code", "offset", "absmax2", "code2"}``.
    """
    return {"absmax": state.absmax, "code": state.code, "offset": state.offset,
            "absmax2": state.state2.absmax, "code2": state.state2.code}


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


@contextlib.contextmanager
def _process_group(world_size: int, fake: bool):
    """Rank 0 of a fake process group of ``world_size`` ranks (torchtitan's estimator does the
    same), or the real one a real FSDP run is launched in."""
    import torch.distributed as dist

    if world_size == 1:
        yield
        return
    if dist.is_initialized() or not fake:
        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise ValueError(f"fsdp_ranks={world_size}: a real run needs a process group of "
                             f"{world_size} ranks (distributed.launch); "
                             f"{dist.get_world_size() if dist.is_initialized() else 'none'} here")
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """Rank 0 of a fake process group of ``world_size`` ranks, held open for several
    measurements: a :func:`step_meter` of an FSDP stack made inside it builds its sharded model
    once for every length (outside one, each length builds afresh, its group living for one
    measurement). A group already open with ``world_size`` ranks is kept as it is.

    Args:
        world_size: the ranks (1: no group).

    Raises:
        ValueError: a process group of another size is already open.

    Example:
        >>> with fake_process_group(2):  # doctest: +SKIP
        ...     at = step_meter("Llama-2-70B", Stack(method="qlora", fsdp_ranks=2), 2)
        ...     peaks = [at(n).peak_bytes for n in (1024, 2048)]
    """
    import torch.distributed as dist

    if world_size > 1 and dist.is_initialized() and not _group_held(world_size):
        raise ValueError(f"world_size={world_size}: a process group of "
                         f"{dist.get_world_size()} ranks is already open")
    with _process_group(world_size, fake=True):
        yield


def _group_held(world_size: int) -> bool:
    """Whether a process group of ``world_size`` ranks is open (:func:`fake_process_group`)."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() == world_size


def _restore_buffers(model: torch.nn.Module) -> None:
    """Recompute the buffers ``to_empty`` left uninitialised (rotary inverse frequencies,
    Gemma-4's per-layer scalars) by building each owning module afresh on the CPU (with its
    ``layer_idx`` where its constructor takes one) and copying them in."""
    import inspect

    for module in model.modules():
        own = dict(module.named_buffers(recurse=False))
        if not own or not hasattr(module, "config"):
            continue
        takes_index = "layer_idx" in inspect.signature(type(module)).parameters
        fresh = type(module)(module.config, **(
            {"layer_idx": module.layer_idx} if takes_index and hasattr(module, "layer_idx")
            else {}))
        with torch.no_grad():
            for name, buf in own.items():
                buf.copy_(getattr(fresh, name))


def make_step_optimizer(model: torch.nn.Module, stack: Stack, host: torch.device | str = "cpu"):
    """The optimizer ``stack`` names, over ``model``'s trainable parameters.

    Args:
        model: the model.
        stack: its ``optimizer`` and ``offload_optimizer``.
        host: where offloaded states go.

    Returns:
        The optimizer.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if stack.offload_optimizer:  # fp32 master copies and states on ``host``
        opt_class = torch.optim.SGD if stack.optimizer == "sgd" else torch.optim.AdamW
        return CPUOffloadOptimizer(trainable, opt_class, host=host, lr=1e-4)
    if stack.optimizer == "sgd":
        return torch.optim.SGD(trainable, lr=1e-4)
    if stack.optimizer == "adamw-8bit":  # its code tables are built here, outside fake mode
        return make_adamw_8bit(trainable, lr=1e-4)
    config = TrainConfig(lr=1e-4)
    if stack.optimizer in ("adamw-foreach", "adamw-fused"):  # as a GPU runs it, on any device
        implementation = stack.optimizer.split("-")[1]
        return torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay,
                                 **{implementation: True})
    return make_optimizer(model, config)  # the training loop's AdamW


def _saved_on(host: str):
    """``torch.autograd.graph.save_on_cpu`` (the course's ``checkpointing.offload_activations``)
    with the host named: each tensor saved for backward is copied there in the forward pass and
    back in the backward pass; on fake tensors the host is the meta device, counted apart."""
    def pack(t: torch.Tensor):
        return t.device, t.to(host, copy=True)

    def unpack(packed) -> torch.Tensor:
        device, t = packed
        return t.to(device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def step_context(stack: Stack, host: str, model: torch.nn.Module | None = None):
    """What a step of ``stack`` runs under: its activations saved on ``host``, a GPU's dropout,
    bitsandbytes' 4-bit matmul of before 0.43.2, a padded row's mask, as the stack asks.

    Args:
        stack: the recipes.
        host: where offloaded activations go.
        model: the model stepped (with ``stack.attention_mask``: its decoder gets the mask).

    Raises:
        ValueError: ``stack.attention_mask`` without ``model``.
    """
    if stack.attention_mask and model is None:
        raise ValueError("stack.attention_mask=True: step_context needs the model, whose "
                         "decoder gets the attention mask")
    with contextlib.ExitStack() as contexts:
        if stack.attention_mask:
            contexts.enter_context(padding_context(model))
        if stack.offload_activations:
            contexts.enter_context(_saved_on(host))
        if stack.gpu_dropout:
            contexts.enter_context(gpu_dropout_context())
        if stack.nf4_keeps_input:
            contexts.enter_context(nf4_keeps_input_context())
        yield


def create_optimizer_states(model: torch.nn.Module, optimizer: Any) -> None:
    """One optimizer step on zero gradients, then the gradients freed: the states a first
    training step leaves behind, at half the cost of running that step (on fake tensors the
    step's time is dispatch overhead, the same for both).

    Args:
        model: the model whose trainable parameters ``optimizer`` updates.
        optimizer: the optimizer.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in trainable:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check_sizes(seq_len: int, batch_size: int, stack: Stack) -> int:
    """The batch each rank takes.

    Args:
        seq_len, batch_size: the step's sizes.
        stack: its ranks and accumulation steps.

    Returns:
        Sequences per rank.

    Raises:
        ValueError: naming the bad size.
    """
    for name, v, low in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{name}={v!r}: must be an integer >= {low}")
    if batch_size % stack.fsdp_ranks:
        raise ValueError(f"fsdp_ranks={stack.fsdp_ranks}: does not divide "
                         f"batch_size={batch_size} (each rank takes a whole share)")
    per_rank = batch_size // stack.fsdp_ranks
    if per_rank % stack.grad_accum_steps:
        raise ValueError(f"grad_accum_steps={stack.grad_accum_steps}: does not divide "
                         f"{'batch_size' if stack.fsdp_ranks == 1 else 'the per-rank batch'}"
                         f"={per_rank}")
    return per_rank


def measure_step(model: Any, stack: Stack = Stack(), seq_len: int = 2048, batch_size: int = 1,
                 device: torch.device | str = "cpu", fake: bool = True,
                 comm_backend: str = "nccl") -> MemoryReport:
    """Peak memory of one training step, optimizer states already created (as after a first
    step).

    Args:
        model: a built-in name or its hub id (``calc.find_preset``), a ``config.json`` path
            or a config.
        stack: the recipes applied.
        seq_len, batch_size: tokens per sequence and sequences per optimizer step (over all
            ranks with FSDP: each rank takes ``batch_size / stack.fsdp_ranks``).
        device: the device the step would run on (fake tensors need no such device for
            matmuls, but run CUDA attention kernels only on a CUDA build).
        fake: measure on fake tensors (no memory used); False runs it for real (with FSDP,
            on every rank of a process group of ``stack.fsdp_ranks`` ranks).
        comm_backend: with FSDP on fake tensors, the collectives' library: ``"nccl"`` (GPU
            ranks) or ``"gloo"`` (CPU ranks, whose reduce-scatter holds a full-size copy of its
            input: what a fake rank needs to equal a real gloo rank). A real run uses its own.

    Returns:
        The step's ``MemoryReport`` on ``device`` (one rank's, with FSDP: on fake tensors the
        process is rank 0 of a fake process group of ``stack.fsdp_ranks`` ranks, whose
        collectives return at once and allocate what the real ones do).

    Raises:
        ValueError: for bad sizes, a sequence beyond the model's positions, a batch the
            ranks and accumulation steps do not divide, or a real (``fake=False``) step of
            ``stack.fsdp_cpu_offload`` on a GPU.

    Example:
        >>> r = measure_step("Llama-3.1-8B", Stack(checkpointing=True), 2048)  # doctest: +SKIP
        >>> r.by_category["parameters"] / 2**30  # doctest: +SKIP
        14.96
    """
    per_rank = check_sizes(seq_len, batch_size, stack)
    if stack.fsdp_cpu_offload and not fake and torch.device(device).type != "cpu":
        raise ValueError(f"stack.fsdp_cpu_offload=True with fake=False on {device}: a real "
                         "offloaded step is measured on CPU ranks here (its model is built on "
                         "the device, where FSDP's CPUOffloadPolicy refuses it); measure it on "
                         "fake tensors (fake=True)")
    if comm_backend not in COMM_BACKENDS:
        raise ValueError(f"comm_backend={comm_backend!r}: one of {', '.join(COMM_BACKENDS)}")
    config = model_config(model)
    check_positions(config, seq_len)
    device = torch.device(device)
    before = (0, 0)
    if not fake and device.type == "cuda":  # what earlier work left allocated is not this step's
        gc.collect()
        torch.cuda.empty_cache()
        before = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    with _process_group(stack.fsdp_ranks, fake):
        return _Prepared(config, stack, device, fake, comm_backend).measure(seq_len, per_rank,
                                                                              before)


def replay_allocator(model: Any, stack: Stack = Stack(), seq_len: int = 2048,
                     batch_size: int = 1, device: torch.device | str = "cpu", steps: int = 2,
                     capacity_bytes: int | None = None, fake: bool = True,
                     fsdp_one_stream: bool = False, expandable_segments: bool = False,
                     max_split_size_mb: int | None = None,
                     roundup_power2_divisions: int | tuple[int, ...] | None = None
                     ) -> CachingAllocator:
    """What CUDA's caching allocator would hold for a training run: its allocations and frees
    (:func:`allocation_trace`) replayed through the allocator's rules
    (:func:`recipes_lib.allocator.replay`).

    ``peak_allocated`` is :func:`measure_step`'s trace; ``peak_reserved`` adds what the cache
    holds beyond it (segments rounded up, blocks split, freed space too small or in the wrong
    place for later requests), in place of a fixed reserve. Checked against an H100's
    ``max_memory_reserved`` for a 1.2 B model (``tests/test_allocator.py``).

    Args:
        model, stack, seq_len, batch_size, device, steps, fake, fsdp_one_stream: as
            :func:`allocation_trace`.
        capacity_bytes: the card's bytes for PyTorch (None: unlimited, as on a large card):
            whole free segments are released when a new one would pass it.
        expandable_segments: replay as ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        max_split_size_mb: replay as ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` (None:
            unset).
        roundup_power2_divisions: replay as ``PYTORCH_CUDA_ALLOC_CONF=
            roundup_power2_divisions:D`` (``allocator.roundup_divisions``; None: unset).

    Returns:
        The allocator after the run: ``peak_allocated``, ``peak_reserved``, ``segments``.

    Raises:
        ValueError: as :func:`allocation_trace`.
        SimulatedOutOfMemory: when ``capacity_bytes`` cannot hold the run.

    Example:
        >>> a = replay_allocator("Llama-3.2-1B", Stack(), 2048, 2)  # doctest: +SKIP
        >>> a.peak_reserved / a.peak_allocated  # doctest: +SKIP
        1.02
    """
    return replay(allocation_trace(model, stack, seq_len, batch_size, device, steps, fake,
                                   fsdp_one_stream), capacity_bytes, expandable_segments,
                  max_split_size_mb=max_split_size_mb,
                  roundup_power2_divisions=roundup_power2_divisions)


def allocation_trace(model: Any, stack: Stack = Stack(), seq_len: int | Sequence[int] = 2048,
                     batch_size: int = 1, device: torch.device | str = "cpu", steps: int = 2,
                     fake: bool = True, fsdp_one_stream: bool = False) -> list[Event]:
    """A training run's allocations and frees on ``device``, in order, from the weights'
    materialisation to the end of step ``steps`` (``allocator.AllocationLog``), or of one step
    at each of several lengths (an unpacked dataset's batches, padded to their longest row).

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        stack: the recipes applied. On a GPU, torch's AdamW defaults to its foreach kernels:
            ``optimizer="adamw-foreach"`` traces them.
        seq_len, batch_size: tokens per sequence and sequences per optimizer step; a list of
            lengths runs one step at each, in order (``steps`` then unused).
        device: the device the trace is for ("cpu": CPU kernels' allocations; "cuda" on a
            CUDA build, where CUDA attention kernels run on fake tensors).
        steps: training steps run (the first creates the optimizer states).
        fake: fake tensors (no memory); False runs the steps for real on ``device`` (the check
            of the fake trace on a CPU).
        fsdp_one_stream: trace an FSDP stack (rank 0 of a fake process group) as if its
            collectives allocated on the step's own stream: on a GPU they allocate on streams
            of their own, whose cached blocks serve only them, so its replay is an estimate
            below what those pools take. False refuses FSDP stacks.

    Returns:
        ``("alloc", id, nbytes)`` and ``("free", id, 0)`` events, for ``allocator.replay``.

    Raises:
        ValueError: for an FSDP stack without ``fsdp_one_stream``, FSDP's CPU offload (its
            host's shards share the trace's CPU device), ``steps`` < 1, or
            :func:`measure_step`'s bad sizes.
    """
    lengths = list(seq_len) if isinstance(seq_len, (list, tuple)) else None
    if lengths is not None and not lengths:
        raise ValueError("seq_len=[]: one length or a list of at least one")
    for n in lengths or [seq_len]:
        per_rank = check_sizes(n, batch_size, stack)
    if stack.fsdp_ranks > 1 and not fsdp_one_stream:
        raise ValueError(f"stack.fsdp_ranks={stack.fsdp_ranks}: FSDP's collectives allocate on "
                         "streams of their own, whose cached blocks the replay does not model; "
                         "replay a one-device stack, or set fsdp_one_stream=True for an "
                         "estimate below what those streams' pools take")
    if stack.fsdp_cpu_offload:
        raise ValueError("stack.fsdp_cpu_offload=True: on fake tensors the shards FSDP keeps "
                         "on the host share the CPU device with what the GPU would hold, which "
                         "an allocation log cannot tell apart")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r}: an integer >= 1")
    config = model_config(model)
    check_positions(config, max(lengths or [seq_len]))
    device = torch.device(device)
    log = AllocationLog(device.type, fake_only=fake)
    with _process_group(stack.fsdp_ranks, fake):
        prepared = _Prepared(config, stack, device, fake, log=log)
        with prepared.mode or contextlib.nullcontext(), _unpacked_rows(), log:
            # one batch made before the first step for every step, or each length's own, made
            # with its step and freed after the next one's
            run = ([prepared.step_fn(seq_len, per_rank)] * steps if lengths is None
                   else (prepared.step_fn(n, per_rank) for n in lengths))
            for step in run:
                step()
                gc.collect()  # what reference cycles hold is freed by the collector, as in a run
    return list(log.events)  # a copy: frees after the run would go on appending to the log


class _Prepared:
    """A stack's model and optimizer, built once, in the state every step after the first starts
    from (weights and optimizer states, no gradients): each :meth:`measure` is one step at a
    length. A step ends with its gradients freed, so measuring again starts from the same state,
    and searches over lengths reuse one build (about a third of a fresh measurement's time)."""

    def __init__(self, config, stack: Stack, device: torch.device, fake: bool,
                 comm_backend: str = "nccl", log: Any = None):
        self.config, self.stack, self.device, self.fake = config, stack, device, fake
        self.net, self.mode = build_model(config, stack, device, fake, comm_backend=comm_backend,
                                          log=log)
        # offloaded states go to the host: on fake tensors a CPU device's host is "meta", so its
        # bytes are counted apart (``MemoryReport.host_by_category``); the copies need fake mode
        self.host = "meta" if fake and device.type == "cpu" else "cpu"
        with (self.mode if stack.offload_optimizer and self.mode else contextlib.nullcontext()):
            self.opt = make_step_optimizer(self.net, stack, self.host)
        self.loss_fn = (ChunkedCausalLMLoss(stack.chunked_loss) if stack.chunked_loss else
                        TransformersLoss() if stack.loss == "transformers-4.46" else
                        LitGPTLoss() if stack.loss == "litgpt" else None)
        self.stepped = False

    def step_fn(self, seq_len: int, per_rank: int) -> Callable[[], None]:
        """One training step at ``seq_len`` (its batch made now: call it in ``self.mode``)."""
        stack, net, opt = self.stack, self.net, self.opt
        targets = per_rank * (seq_len - 1)  # the global count / the ranks, as forward_backward asks
        # FSDP's mixed-precision policy casts the weights; elsewhere bf16-mixed is autocast's
        autocast = "fp32" if stack.fsdp_ranks > 1 else _AUTOCAST.get(stack.precision, "fp32")
        ids = torch.randint(0, self.config.vocab_size, (per_rank, seq_len), device=self.device)
        batch = {"input_ids": ids, "labels": ids}

        def step() -> None:
            with step_context(stack, self.host, net):
                forward_backward(net, batch, stack.grad_accum_steps, autocast,
                                 num_target_tokens=targets, loss_fn=self.loss_fn)
            optimizer_step(net, opt, max_grad_norm=None)
            if isinstance(self.loss_fn, LitGPTLoss):  # litgpt's loop holds its logits
                self.loss_fn.release()  # until the next step: a new length's step here

        return step

    def measure(self, seq_len: int, per_rank: int,
                before: tuple[int, int] = (0, 0)) -> MemoryReport:
        stack, device, net, opt = self.stack, self.device, self.net, self.opt
        with self.mode or contextlib.nullcontext(), _unpacked_rows():
            step = self.step_fn(seq_len, per_rank)
            if not self.stepped:
                # FSDP2's first iteration records its prefetch order; on a GPU the allocator's
                # reserved bytes are a high-water mark since the build, and a real first step
                # leaves the cache a training run's second step starts from
                if stack.fsdp_ranks > 1 or not self.fake and device.type == "cuda":
                    step()
                else:  # the optimizer states, as they exist in every step after the first
                    create_optimizer_states(net, opt)
                self.stepped = True
            allocated = reserved = None
            if not self.fake and device.type == "cuda":
                # the allocator read first, on a step with no tracker: the tracker's hooks form
                # reference cycles that keep a step's tensors alive until the garbage collector
                gc.collect()
                allocated, reserved = allocator_peak(step, device)
                allocated, reserved = allocated - before[0], reserved - before[1]
            report = measure_memory(step, net, opt, device)
        report.allocator_peak_bytes, report.allocator_reserved_bytes = allocated, reserved
        return report


def step_meter(model: Any, stack: Stack = Stack(), batch_size: int = 1,
               device: torch.device | str = "cpu") -> Callable[[int], MemoryReport]:
    """``seq_len -> measure_step(model, stack, seq_len, batch_size, device)`` on fake tensors,
    with one model built for every length asked (a search over lengths: the planner's
    ``max_context``). FSDP stacks do so inside :func:`fake_process_group`; outside one they
    build afresh for each length (their fake process group lives for one measurement).

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        stack: the recipes applied.
        batch_size: sequences per step.
        device: the device the trace is for.

    Returns:
        ``at(seq_len) -> MemoryReport``.

    Raises:
        ValueError: as :func:`measure_step`, for the batch now and for each length when asked.
    """
    if stack.fsdp_ranks > 1 and not _group_held(stack.fsdp_ranks):
        return lambda seq_len: measure_step(model, stack, seq_len, batch_size, device)
    config = model_config(model)
    prepared: list[_Prepared] = []

    def at(seq_len: int) -> MemoryReport:
        per_rank = check_sizes(seq_len, batch_size, stack)
        check_positions(config, seq_len)
        if not prepared:
            prepared.append(_Prepared(config, stack, torch.device(device), True))
        return prepared[0].measure(seq_len, per_rank)

    check_sizes(2, batch_size, stack)
    return at


def real_rank_step(model: dict, stack: dict, seq_len: int, batch_size: int) -> dict[str, int]:
    """This rank's categories of a real FSDP step (``measure_step(..., fake=False)``), with the
    config and the stack as plain dicts: a target for ``distributed.launch``, whose ranks are
    compared with the same step on a fake process group.

    Args:
        model: a config's fields.
        stack: a :class:`Stack`'s fields.
        seq_len: tokens per sequence.
        batch_size: sequences per step.

    Returns:
        category -> bytes at this rank's peak; with ``fsdp_cpu_offload`` also "host <category>"
        -> bytes at the host's peak.
    """
    tuples = {k: tuple(v) for k, v in stack.items() if isinstance(v, list)}  # JSON's lists
    report = measure_step(model, Stack(**stack | tuples), seq_len, batch_size, fake=False)
    return report.by_category | {f"host {k}": v for k, v in report.host_by_category.items()}


def fake_vs_real(model: Any, stack: Stack, seq_len: int, batch_size: int = 1,
                 device: torch.device | str = "cpu") -> dict[str, Any]:
    """The same step measured on fake tensors and for real: per-category ratio fake / real.

    On CUDA the real run's allocator peaks (``max_memory_allocated`` and ``_reserved``, from one
    more step run without the tracker) are reported beside it.

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        stack: the recipes applied.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        device: where the real step runs.

    Returns:
        ``{"fake", "real", "peak_ratio", "ratios"}``: both reports, fake peak / real peak, and
        category -> fake / real.
    """
    fake = measure_step(model, stack, seq_len, batch_size, device, fake=True)
    real = measure_step(model, stack, seq_len, batch_size, device, fake=False)
    ratios = {k: (fake.by_category[k] / real.by_category[k]) if real.by_category[k] else
              (1.0 if fake.by_category[k] == 0 else float("inf")) for k in real.by_category}
    return {"fake": fake, "real": real, "peak_ratio": fake.peak_bytes / real.peak_bytes,
            "ratios": ratios}


def fsdp_per_rank(model: Any, ranks: int, seq_len: int = 4096, micro_batch_size: int = 1,
                  stack: Stack | None = None) -> dict[str, Any]:
    """One rank's memory for a fine-tune sharded with FSDP over ``ranks`` GPUs, measured on fake
    tensors (rank 0 of a fake process group), beside the calculator's prediction.

    The calculator (``calc.data_parallel_bytes``: ZeRO-3's 16 bytes per parameter over
    ``ranks``, two blocks' gathered weights, Korthikanti's activations) describes a full
    fine-tune in bf16 mixed precision with AdamW, checkpointed or not, of a model of one
    attention and one MLP per layer; for another stack, or a mixture of experts or a hybrid
    (``calc.check_counted``), ``calc_GiB`` is None. A mixture of experts runs the default stack
    too: FSDP's mixed-precision policy gathers bf16 copies of its fp32 experts, which
    transformers' grouped GEMM takes.

    Args:
        model: a preset name, a ``config.json`` or a config.
        ranks: the FSDP world size (>= 2).
        seq_len, micro_batch_size: each rank's sequences.
        stack: the recipes (default: bf16 mixed precision + checkpointing, AdamW: ZeRO-3's
            16 bytes per parameter over ``ranks``).

    Returns:
        ``{"model", "ranks", "stack", "params_B"`` (transformers' model of the config, built
        on the meta device), ``"<category>_GiB"..., "peak_GiB", "calc_GiB"`` (or None, above),
        ``"optimizer_expected_GiB"}``: AdamW's two moments of this rank's shards of a full
        fine-tune, in the weights' dtype (fp32 under bf16-mixed); 0 for SGD; None where the
        trainable parameters are adapters or the states 8-bit.

    Raises:
        ValueError: for ``ranks`` < 2 (naming it) and what ``measure_step`` refuses
            (``UnmeasuredStackError`` for a stack a fake step cannot run).

    Example:
        >>> row = fsdp_per_rank("Llama-3.1-8B", 8, 4096)  # doctest: +SKIP
        >>> round(row["optimizer_expected_GiB"], 2)  # doctest: +SKIP
        7.48
    """
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 2:
        raise ValueError(f"ranks={ranks!r}: FSDP needs at least 2 ranks")
    config = model_config(model)
    stack = replace(stack or Stack(precision="bf16-mixed", checkpointing=True), fsdp_ranks=ranks)
    report = measure_step(config, stack, seq_len, ranks * micro_batch_size)
    n = calc.built_param_count(config)
    name = Path(str(model)).name if isinstance(model, (str, Path)) else config.model_type
    row = {"model": name, "ranks": ranks, "stack": stack.label, "params_B": n / 1e9}
    row.update({f"{k}_GiB": v / 2**30 for k, v in report.by_category.items() if v})
    row.update(peak_GiB=report.peak_bytes / 2**30, calc_GiB=_fsdp_calculator_GiB(
        config, stack, ranks, seq_len, micro_batch_size), optimizer_expected_GiB=None)
    if stack.method == "full" and stack.optimizer in _FP_ADAMW:
        state_bytes = 4 if stack.precision in ("fp32", "bf16-mixed") else 2
        row["optimizer_expected_GiB"] = 2 * state_bytes * n / ranks / 2**30
    elif stack.method == "full" and stack.optimizer == "sgd":  # no momentum: no state
        row["optimizer_expected_GiB"] = 0.0
    return row


def _described_shape(config: Any) -> calc.ModelShape | None:
    """The calculator's shape of ``config``, or None for a model its formulas do not describe
    (a mixture of experts, a hybrid: ``calc.check_counted``)."""
    try:
        calc.check_counted(config, "model")
        return calc.ModelShape.from_config(config.to_dict(), "model")
    except calc.NotDescribedError:
        return None


def _fsdp_calculator_GiB(config: Any, stack: Stack, ranks: int, seq_len: int,
                         micro_batch_size: int) -> float | None:
    """``calc.data_parallel_bytes``' per-rank total for a stack and model it describes, or None."""
    if (stack.selective_checkpointing or stack.optimizer not in _FP_ADAMW
            or replace(stack, checkpointing=False, optimizer="adamw")
            != Stack(precision="bf16-mixed", fsdp_ranks=ranks)):
        return None
    shape = _described_shape(config)
    if shape is None:
        return None
    recompute = "full" if stack.checkpointing else "none"
    return calc.data_parallel_bytes(shape, ranks, "fsdp", seq_len, micro_batch_size,
                                    recompute)["gpu_total"] / 2**30


_PEAK_ELSEWHERE = ("the step's peak does not fall where the activations are (at short lengths "
                   "it falls at the end of backward, when the gradients exist), so differences "
                   "of peaks do not split them; measure at a longer seq_len")


def activation_anatomy(model: Any, stack: Stack = Stack(), seq_len: int = 2048,
                       batch_size: int = 1, small_vocab: int | None = None
                       ) -> dict[str, float]:
    """Where a step's activation bytes go, measured by difference: per decoder layer, per
    logit, and the rest.

    Three fake steps of the same stack: the model as given, with half its layers, and with a
    ``small_vocab``-entry vocabulary. Their activation peaks differ by what the removed layers and
    vocabulary entries held, so the per-layer bytes can be set beside Korthikanti et al.'s
    ``34 s b h`` (a GPT layer in 16-bit; ``calc.activation_bytes_per_layer``) and the op-by-op
    Llama count (``calc.llama_layer_bytes``), and the loss's bytes per logit beside the
    calculator's three fp32 copies (12). Differences of peaks are valid where each peak falls at
    the same point of the step, as it does for the stacks of notebook 01; ``rest_bytes`` (the
    embeddings' output, the final norm, the loss's per-token terms) must then be positive.

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        stack: the recipes applied.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        small_vocab: the vocabulary of the third step (default: 1024, or half a vocabulary
            smaller than 2048).

    Returns:
        ``{"activation_bytes", "per_layer_bytes", "layer_coefficient"`` (per-layer bytes per
        token per hidden unit, Korthikanti's 34 in 16-bit), ``"per_logit_bytes"`` (per token per
        vocabulary entry), ``"rest_bytes"}``.

    Raises:
        ValueError: for a model with fewer than 2 layers, a ``small_vocab`` not below its
            vocabulary, or what ``measure_step`` refuses.

    Example:
        >>> a = activation_anatomy("Llama-3.2-1B", Stack(), 2048)  # doctest: +SKIP
        >>> round(a["layer_coefficient"])  # doctest: +SKIP
        53
    """
    config = model_config(model)
    layers, vocab = config.num_hidden_layers, config.vocab_size
    if small_vocab is None:
        small_vocab = min(1024, vocab // 2)
    _check_halvable(config)
    if not isinstance(small_vocab, int) or not 0 < small_vocab < vocab:
        raise ValueError(f"small_vocab={small_vocab!r}: must be an integer in 1..{vocab - 1} "
                         "(below the model's vocabulary)")
    small = copy.deepcopy(config)
    small.vocab_size = small_vocab
    if (getattr(small, "pad_token_id", None) or 0) >= small_vocab:  # Phi-3's 32000: the
        small.pad_token_id = None  # embedding's padding row, which changes no byte
    ((full, per_layer),) = _by_layer_difference(config, stack, (seq_len,), batch_size).values()
    tokens = batch_size * seq_len // stack.fsdp_ranks
    per_logit = (full - measure_step(small, stack, seq_len, batch_size).by_category[
        "activations"]) / (tokens * (vocab - small_vocab))
    rest = full - layers * per_layer - tokens * vocab * per_logit
    if per_logit <= 0 or rest < 0:
        raise ValueError(f"seq_len={seq_len}: {_PEAK_ELSEWHERE}")
    return {"activation_bytes": full, "per_layer_bytes": per_layer,
            "layer_coefficient": per_layer / (tokens * config.hidden_size),
            "per_logit_bytes": per_logit, "rest_bytes": rest}


def _half_the_layers(config: Any) -> Any:
    """A copy of ``config`` with the first half of its decoder layers."""
    half = copy.deepcopy(config)
    half.num_hidden_layers = config.num_hidden_layers // 2
    if getattr(half, "layer_types", None):  # Gemma-2, Qwen3: one entry per layer
        half.layer_types = half.layer_types[:half.num_hidden_layers]
    return half


def per_layer_activation_bytes(model: Any, stack: Stack = Stack(),
                               seq_lens: tuple[int, ...] = (2048,),
                               batch_size: int = 1) -> dict[int, float]:
    """:func:`activation_anatomy`'s ``per_layer_bytes`` at each of ``seq_lens``, from its two
    steps that differ by layers alone (the model as given and with half its layers), each model
    built once for every length (:func:`step_meter`): what the op-by-op count is checked
    against, in two builds instead of three per length.

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        stack: the recipes applied.
        seq_lens: tokens per sequence, one measurement each.
        batch_size: sequences per step.

    Returns:
        ``{seq_len: bytes a decoder layer holds at the step's peak}`` (the mean over layers).

    Raises:
        ValueError: for a model with fewer than 2 layers, a length whose peak falls where the
            difference does not split the activations (as :func:`activation_anatomy`), or what
            ``measure_step`` refuses.

    Example:
        >>> per_layer_activation_bytes("Llama-3.2-1B", Stack(), (2048,))  # doctest: +SKIP
        {2048: 222576640.0}
        >>> counted_layer_bytes("Llama-3.2-1B", Stack(), 2048)  # doctest: +SKIP
        222576640.0
    """
    config = model_config(model)
    _check_halvable(config)
    return {s: per_layer for s, (_, per_layer)
            in _by_layer_difference(config, stack, seq_lens, batch_size).items()}


def _check_halvable(config: Any) -> None:
    if config.num_hidden_layers < 2:
        raise ValueError(f"model: num_hidden_layers={config.num_hidden_layers}; halving the "
                         "layers needs >= 2")


def _by_layer_difference(config: Any, stack: Stack, seq_lens: tuple[int, ...],
                         batch_size: int) -> dict[int, tuple[float, float]]:
    """``{seq_len: (the step's activation bytes, a layer's)}``: the model as given and with half
    its layers, each built once for every length (:func:`step_meter`), a layer's bytes their
    difference over the layers removed; a length refused where the difference cannot be a
    layer's (not positive, or more than the whole step's over the layers)."""
    layers = config.num_hidden_layers
    full, half = (step_meter(c, stack, batch_size) for c in (config, _half_the_layers(config)))
    out = {}
    for s in seq_lens:
        act = full(s).by_category["activations"]
        per_layer = (act - half(s).by_category["activations"]) / (layers - layers // 2)
        if per_layer <= 0 or act < layers * per_layer:
            raise ValueError(f"seq_len={s}: {_PEAK_ELSEWHERE}")
        out[s] = (act, per_layer)
    return out


# Decoders whose layers are a transformers Llama layer as ``calc.llama_layer_bytes`` counts it
# (Qwen2's q, k and v biases keep nothing more; Qwen3's norms over each query and key head are
# its ``qk_norm``; Phi-3's fused projections its ``fused_projections``, where its residual
# dropout is off and RoPE turns every dimension of a head: Phi-4-mini's partial rotary is not;
# Gemma-2's norms and eager, soft-capped attention its ``gemma2``; Gemma-3's norms its ``gemma3``;
# a sliding-window layer from its window's length on, its ``masked``).
_COUNTED_LAYERS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


def _partial_rotary(config: Any) -> float:
    """The share of each head's dimensions RoPE turns (Phi-4-mini: 0.75), where a config names
    it, as a field or in its ``rope_parameters``; else 1."""
    rope = getattr(config, "rope_parameters", None)
    return (getattr(config, "partial_rotary_factor", None)
            or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or 1.0)


def counted_layer_bytes(model: Any, stack: Stack, seq_len: int = 2048, batch_size: int = 1,
                        shape: calc.ModelShape | None = None, recomputed: bool = False,
                        with_cache: bool = False) -> float | None:
    """The bytes one decoder layer keeps in this stack's step, by ``calc.llama_layer_bytes``'
    op-by-op count (a micro-batch's tokens), or None where the count does not model the stack:
    another architecture, selective checkpointing, offloaded activations, FSDP, LoRA targets
    that are not its linears, dropout in the layer. Where sliding-window layers get SDPA's
    explicit mask (``seq_len`` from the window's length on), the mean over the layers; with
    ``stack.attention_mask`` every layer gets one.

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        stack: the recipes applied.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        shape: the model's ``calc.ModelShape`` where the caller has it (None: read from the
            config, a tenth of a second).
        recomputed: with checkpointing, the layer while backward recomputes it (all it keeps,
            without a KV cache, which checkpointing turns off) instead of its input alone.
        with_cache: add what the layer's KV cache holds beyond that while the forward runs
            (``calc.llama_layer_bytes``' ``kv_cache``: where ``config.use_cache`` is on).

    Returns:
        Bytes, or None.

    Example:
        >>> counted_layer_bytes("Llama-3.2-1B", Stack(method="lora"), 2048) / 2048**2
        77.28515625
    """
    config = model_config(model)
    fused = config.model_type == "phi3"
    linears = calc.PHI3_LINEARS if fused else calc.LLAMA_LINEARS
    targets = linears if stack.lora_targets == "all-linear" else stack.lora_targets
    if (config.model_type not in _COUNTED_LAYERS or stack.selective_checkpointing
            or stack.offload_activations or stack.fsdp_ranks > 1
            or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
            or getattr(config, "resid_pdrop", 0.0) or getattr(config, "attention_dropout", 0.0)
            or _partial_rotary(config) != 1.0
            or (config.model_type == "gemma2" and not config.attn_logit_softcapping)
            or getattr(config, "attn_logit_softcapping", None) and config.model_type != "gemma2"
            or not set(targets) <= set(linears)):
        return None
    shape = shape or calc.ModelShape.from_config(config.to_dict())
    gemma2 = config.model_type == "gemma2"

    def layer(masked: bool) -> float:
        count = calc.llama_layer_bytes(
            shape, seq_len, batch_size // stack.grad_accum_steps, stack.method,
            stack.precision, lora_rank=stack.lora_rank, lora_targets=tuple(targets),
            fp32_adapters=stack.autocast_adapter_dtype, lora_dropout=stack.lora_dropout,
            gpu_dropout=stack.gpu_dropout, nf4_keeps_input=stack.nf4_keeps_input,
            checkpointing=stack.checkpointing and not recomputed,
            qk_norm=config.model_type == "qwen3", fused_projections=fused, gemma2=gemma2,
            gemma3=config.model_type == "gemma3_text", masked=masked,
            kv_cache=getattr(config, "use_cache", True) and not stack.checkpointing)
        return count["total"] + (count["kv_cache"] if with_cache else 0.0)

    # SDPA's sliding-window layers get an explicit mask from the window's length on, and every
    # layer one with padding (Gemma-2's eager attention counts its own)
    if gemma2:
        masked_layers = 0
    elif stack.attention_mask:
        masked_layers = shape.num_hidden_layers
    elif shape.sliding_window is not None and seq_len >= shape.sliding_window:
        masked_layers = shape.sliding_layers
    else:
        masked_layers = 0
    if masked_layers and recomputed:  # the layer recomputed last: the larger kind, a masked one
        counted = layer(True)
    elif masked_layers:  # the mean over the layers, which the caller multiplies by their number
        layers = shape.num_hidden_layers
        counted = (masked_layers * layer(True) + (layers - masked_layers) * layer(False)) / layers
    else:
        counted = layer(False)
    if config.model_type == "qwen2" and stack.method == "qlora":
        # a 16-bit copy of q, k and v's biases per layer, checkpointed or not (measured): what
        # bitsandbytes' 4-bit layer casts for its matmul
        counted += 2 * (shape.hidden_size + 2 * shape.num_key_value_heads * shape.head_dim)
    return counted


def anatomy_table(model: Any, stacks: dict[str, Stack], seq_len: int = 2048,
                  batch_size: int = 1) -> list[dict[str, Any]]:
    """:func:`activation_anatomy` for each named stack, beside what the calculator's escalation
    assumes: Korthikanti's bytes per token per hidden unit per layer (34 in 16-bit with a flash
    kernel; 2, the layer input, with checkpointing), the same stack's op-by-op count
    (:func:`counted_layer_bytes`, ``calc.llama_layer_bytes``; None where it does not model the
    stack) and three fp32 copies of the logits (12 bytes per logit). For a model the formulas
    do not describe (a mixture of experts, a hybrid: ``calc.check_counted``) the calculator's
    columns are None and the measured ones stand alone.

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        stacks: row name -> the stack measured.
        seq_len: tokens per sequence.
        batch_size: sequences per step.

    Returns:
        One row per stack: ``stack``, ``layer_coefficient``, ``calculator_coefficient``,
        ``llama_count_coefficient``, ``per_logit_bytes``, ``calculator_per_logit_bytes``,
        ``per_layer_GiB``, ``rest_GiB``, ``activation_GiB``.
    """
    config = model_config(model)
    shape = _described_shape(config)  # None: the calculator's columns are None
    tokens_h = batch_size * seq_len * config.hidden_size
    per_logit = None if shape is None else calc.activation_bytes(
        shape, seq_len, batch_size)["logits"] / (batch_size * seq_len * shape.vocab_size)
    rows = []
    for name, stack in stacks.items():
        a = activation_anatomy(model, stack, seq_len, batch_size)
        counted = counted_layer_bytes(model, stack, seq_len, batch_size)
        recompute = "full" if stack.checkpointing else "none"
        korthikanti = None if shape is None else calc.activation_bytes_per_layer(
            seq_len, batch_size, shape.hidden_size, shape.num_attention_heads, recompute,
            flash_attention=True) / tokens_h
        rows.append({"stack": name, "layer_coefficient": a["layer_coefficient"],
                     "calculator_coefficient": korthikanti,
                     "llama_count_coefficient": None if counted is None else counted / tokens_h,
                     "per_logit_bytes": a["per_logit_bytes"],
                     "calculator_per_logit_bytes": per_logit,
                     "per_layer_GiB": a["per_layer_bytes"] / 2**30,
                     "rest_GiB": a["rest_bytes"] / 2**30,
                     "activation_GiB": a["activation_bytes"] / 2**30})
    return rows
