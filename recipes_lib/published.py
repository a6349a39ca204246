"""Our fake-tensor predictions beside GPU memory figures other people published.

Each row is a figure as its source states it (model, recipe stack, batch, GPU memory) and the
source's address. ``predict`` measures the same configuration on fake tensors
(``fake_memory.measure_step``, or ``planner.max_context`` for "longest context that fits"
figures) and adds ``planner.gpu_overhead``, the modelled CUDA context and allocator reserve,
to a whole card's figure, or ``planner.allocator_reserve`` alone to a ``max_memory_reserved``
one (the allocator's own count, which leaves the CUDA context out);
``record`` writes each pair to a results file (recipe ``published``: value = our prediction,
baseline = the published figure). A row is met when the prediction is within ``TOLERANCE`` of
the figure; a row that misses stays in the table with the reason found.

GPU sizes are read as the cards report them (an "80GB" A100 has 80 GiB), which is an assumption
where the source does not say how it capped memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from recipes_lib import fake_memory, litgpt_memory, planner, results
from recipes_lib.fake_memory import Stack

TOLERANCE = 0.15
KINDS = ("max_context", "peak")
READS = ("allocated", "reserved")  # a peak figure: max_memory_allocated or max_memory_reserved

UNSLOTH_README = ("https://github.com/unslothai/unsloth (README: Llama 3.1 (8B) max. context "
                  "length)")
UNSLOTH_LLAMA33 = "https://unsloth.ai/blog/llama3-3 (Llama 3.3 (70B) max. context length)"
LITGPT = ("https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md "
          "(Finetuning with LoRA on 1 GPU, A100 40GB)")
TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
              "llama3_h100_202412_torchtitan.md (Table 2)")
TORCHTITAN_FSDP = TORCHTITAN.replace("(Table 2)", "(Tables 1 and 3)")
TORCHTUNE = ("https://github.com/pytorch/torchtune (README: Optimization flags, Llama 3.2 3B, "
             "each technique added on top of the previous one)")
ANSWERAI = ("https://github.com/AnswerDotAI/fsdp_qlora/blob/main/benchmarks_03_2024.md "
            "(Llama-2 7B and 70B, Yi 34B, Mistral 7B v0.2, on two 3090s and two 4090s)")

# Unsloth: "4bit QLoRA on all linear layers (Q, K, V, O, gate, up and down) with rank = 32 with
# a batch size of 1 ... padded all sequences to a certain maximum sequence length"; its
# "Hugging Face + FA2" column is transformers + peft + bitsandbytes with gradient checkpointing.
# Both tables were published with Llama 3.3 (December 2024: the blog gives the 8B's 28,000 at
# 80 GB too), when transformers was at 4.46-4.47. The source does not say how its unquantized
# weights were kept, so several stacks are measured. The main one is what TRL's SFTTrainer ran
# with bf16=True on a 4-bit model then and until trl #4577 (November 2025): peft's k-bit
# preparation, get_peft_model, then its peft_module_casting_to_bf16 (embeddings and head back to
# bf16, norms fp32), with transformers' loss of that time (``.contiguous()`` on the shifted
# logits, removed by transformers #35646 in January 2025: a copy only with several sequences).
TRL_2024_QLORA = Stack(method="qlora", precision="bf16-mixed", checkpointing=True, lora_rank=32,
                       bf16_embeddings=True, loss="transformers-4.46")
# peft's k-bit preparation alone (embeddings and head in fp32): the course's add_lora.
HF_QLORA = Stack(method="qlora", precision="bf16-mixed", checkpointing=True, lora_rank=32)
# no k-bit preparation, the base in bf16: TRL's SFTTrainer since trl #4577.
BF16_QLORA = Stack(method="qlora", precision="bf16", checkpointing=True, lora_rank=32)
# the main stack with today's loss: what the late-2024 loss changes in the longest context;
# and with bitsandbytes' 8-bit AdamW, the optimizer Unsloth's benchmarks named when it compared
# itself with "the reference Huggingface implementation" ("optim = adamw_8bit", unslothai/unsloth
# #22, December 2023; the 2024 tables do not name theirs)
UNSLOTH_OTHER_STACKS = (("fp32 embeddings and head", HF_QLORA), ("bf16 base", BF16_QLORA),
                        ("today's loss", replace(TRL_2024_QLORA, loss="course")),
                        ("8-bit AdamW", replace(TRL_2024_QLORA, optimizer="adamw-8bit")))
# litgpt (commit 8641822, October 2023, A100 40GB): finetune/lora.py with --precision bf16-true,
# LoRA r=8 on the query and value projections (4,194,304 trainable parameters for Llama 2 7B),
# dropout 0.05, no activation checkpointing; "Max GPU RAM" is torch.cuda.max_memory_allocated()
# / 1e9 at the longest Alpaca example, 1304 tokens with the Llama 2 tokenizer (1044 with
# phi-1.5's, 1034 with StableLM's). Measured as the source ran: litgpt's own model
# (litgpt_memory: lit_gpt as litgpt 0.1.0.dev1 shipped it, February 2024, the earliest release),
# every parameter bf16, adapters included; on an A100 dropout keeps CUDA's 1-byte mask;
# --quantize bnb.nf4-dq makes every linear layer 4-bit, the head's included (Lightning's
# BitsandbytesPrecision, as litgpt's scripts call it), and the bitsandbytes of that time (0.41)
# kept each 4-bit layer's input for backward until #1270 (0.43.2, July 2024); the loss is
# finetune/lora.py's (the head over 128-token chunks, bf16 logits, no fp32 copy). Beside it:
# today's bitsandbytes, and transformers' model of the same config with the same precision,
# adapters, dropout and loss (what was measured for these rows before litgpt's model was). The
# table's "bnb.nf4" rows (4-bit without double quantization) are left out: the course's QLoRA
# always double-quantizes.
_LITGPT = {"precision": "bf16", "lora_rank": 8, "lora_targets": ("q_proj", "v_proj"),
           "lora_dropout": 0.05, "autocast_adapter_dtype": False, "gpu_dropout": True,
           "loss": "litgpt"}
# transformers' phi-1.5 and StableLM-Alpha-3B: microsoft/phi-1_5's and
# stabilityai/stablelm-base-alpha-3b's config.json (litgpt pads both vocabularies as these do).
# litgpt's Phi computes GELU's tanh approximation in one op (F.gelu(approximate="tanh"),
# transformers' "gelu_pytorch_tanh"); the hub config's "gelu_new" is the same function written
# as eight elementwise ops, which keep more for backward: measured beside as transformers' Phi.
# transformers' GPT-NeoX fuses q, k and v into query_key_value, so LoRA there adapts the fused
# projection: r=8 on it has litgpt's trainable count for q and v (2,097,152), which litgpt
# gets from the same fused layer.
PHI_1_5_HUB = {"model_type": "phi", "vocab_size": 51200, "hidden_size": 2048,
               "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
               "partial_rotary_factor": 0.5, "max_position_embeddings": 2048,
               "hidden_act": "gelu_new", "tie_word_embeddings": False}
PHI_1_5 = {**PHI_1_5_HUB, "hidden_act": "gelu_pytorch_tanh"}
STABLELM_ALPHA_3B = {"model_type": "gpt_neox", "vocab_size": 50688, "hidden_size": 4096,
                     "intermediate_size": 16384, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "rotary_pct": 0.25,
                     "max_position_embeddings": 4096, "use_parallel_residual": True,
                     "hidden_act": "gelu", "tie_word_embeddings": False}


@dataclass(frozen=True)
class LitGPTModel:
    """litgpt's own model of one of its config names: a row's ``model`` measured by
    ``litgpt_memory`` instead of as a transformers config.

    Args:
        name: litgpt's config name, e.g. "Llama-2-7b-hf".
    """

    name: str


# the source's model -> (litgpt's config name, transformers' model of the same config, the
# longest Alpaca example's tokens, the LoRA targets on transformers' model, the trainable
# parameters in the source's table)
LITGPT_MODELS: dict[str, tuple[str, Any, int, tuple[str, ...], int]] = {
    "Llama-2-7B": ("Llama-2-7b-hf", "Llama-2-7B", 1304, ("q_proj", "v_proj"), 4_194_304),
    "Llama-2-13B": ("Llama-2-13b-hf", "Llama-2-13B", 1304, ("q_proj", "v_proj"), 6_553_600),
    "phi-1.5": ("phi-1_5", PHI_1_5, 1044, ("q_proj", "v_proj"), 1_572_864),
    "StableLM-Alpha-3B": ("stablelm-base-alpha-3b", STABLELM_ALPHA_3B, 1034,
                          ("query_key_value",), 2_097_152),
}


def _litgpt_stack(quantized: bool, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Stack:
    return Stack(method="qlora" if quantized else "lora", nf4_keeps_input=quantized,
                 **{**_LITGPT, "lora_targets": targets})


def _litgpt_other_models(name: str, quantized: bool) -> tuple[tuple[str, Any, Stack], ...]:
    """transformers' model of the row's config (and, for phi-1.5, of the hub's gelu_new)."""
    _, model, _, targets, _ = LITGPT_MODELS[name]
    stack = _litgpt_stack(quantized, targets)
    others = [("transformers' model", model, stack)]
    if name == "phi-1.5":
        others.append(("transformers' Phi (gelu_new: eight ops)", PHI_1_5_HUB, stack))
    return tuple(others)


def _litgpt_config(name: str, quantize: str, micro_batch: int) -> str:
    """A litgpt row's configuration, in the source's words and what is measured for them."""
    _, _, tokens, _, trainable = LITGPT_MODELS[name]
    return ("litgpt's own model (litgpt 0.1.0.dev1's lit_gpt; the source ran commit 8641822), "
            f"bf16-true (adapters bf16 too), LoRA r=8 on q and v ({trainable:,} trainable), "
            f"dropout 0.05, micro-batch {micro_batch}, longest example {tokens} tokens"
            + (f", quantize {quantize} (every linear layer, the head's too; bitsandbytes 0.41, "
               "which kept each 4-bit layer's input)" if quantize else "")
            + "; litgpt's loss (the head over 128-token chunks, bf16 logits)")


# torchtune (2025 README): Llama 3.2 3B, batch 2, max sequence 4096, dtype bf16 (weights,
# gradients and optimizer states), A100; "Peak Memory Active" is torchtune's get_memory_stats,
# active_bytes.all.peak / 1024**3, reset at every logged step. From "+ Packed Dataset" on every
# batch is 2 x 4096 tokens. Measured here: the rows whose stack the fake trace models. Not
# measured: the baseline (unpacked Alpaca: its shapes depend on the data), "+ Compile" and
# "+ Chunked Cross Entropy" (compiled without checkpointing: the peak is the activations that
# Inductor chooses to save, which an eager trace does not see) and the rows from "+ Fuse
# optimizer step into backward" to "+ 8-bit AdamW" (optimizer_in_bwd, not modelled). The
# compiled rows that are measured run eager here. LoRA and QLoRA: the configs
# llama3_2/3B_lora_single_device and 3B_qlora_single_device, rank 64 on q, v, output and the
# MLP, adapters in bf16, torch.optim.AdamW, with the README's command's overrides (packed,
# compile, chunked CE, checkpointing, activation offloading, no optimizer_in_bwd).
_TORCHTUNE_LORA = {"precision": "bf16", "checkpointing": True, "offload_activations": True,
                   "chunked_loss": 1024, "lora_rank": 64, "autocast_adapter_dtype": False,
                   "lora_targets": ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                    "down_proj")}
_TORCHTUNE_CHUNKS = ("torchtune's CEWithChunkedOutputLoss (8 chunks, each chunk's bf16 logits "
                     "formed by the model) measured as the course's chunked loss (1,024-token "
                     "chunks, recomputed in backward)")


# Answer.AI (benchmarks of February and March 2024, on 2 GPUs): their train.py with --precision bf16
# (the model in bf16, no autocast), LoRA r=64 on its lora_target_modules "all", which train.py's
# main() expands to k, q, v, up, down and gate projections: not o_proj (every linear layer of the
# blocks is quantized for QLoRA, o_proj too), dropout 0.1, reentrant checkpointing of every decoder
# layer, torch.optim.AdamW, dummy rows truncated to the context length, transformers of that time
# (the logits upcast to fp32: measured as 4.46's loss). QLoRA is bitsandbytes' NF4 with double
# quantization stored in bf16 under FSDP1; measured as the course's torchao NF4 under FSDP2,
# dequantized into its output alone as bitsandbytes' kernel does (beside it, torchao's own
# dequantization). The "DDP" row is FSDP's NO_SHARD (the whole model on each GPU): one GPU's
# bitsandbytes QLoRA. "Peak Memory" is max reserved, GiB; the note under the LoRA table gives the
# peak allocated (8.28 and 9.16 GiB). The adapters are bf16: the peft of that time gave LoRA
# adapters the base weight's dtype (fp32 only from 0.11, May 2024: huggingface/peft#1706) and
# train.py casts nothing after get_peft_model (its Params4bit are stored in bf16, so QLoRA's
# adapters are bf16 too): autocast_adapter_dtype=False. "CPU Offload" is FSDP's
# CPUOffload(offload_params=True): measured as FSDP2's CPUOffloadPolicy (fsdp_cpu_offload), the
# GPU's peak. Its Mistral 7B v0.2 Base is v0.1's sizes with rope_theta 1e6 and no sliding window
# (the Mistral-7B-Instruct-v0.2 model card: "Mistral-7B-v0.2 has the following changes compared to
# Mistral-7B-v0.1": a 32k context, "Rope-theta = 1e6", "No Sliding-Window Attention"), whose
# config.json's fields follow.
MISTRAL_7B_V02 = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "max_position_embeddings": 32768,
                  "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False}
# Its Yi 34B is 01-ai/Yi-34B, a Llama architecture; its config.json's sizes as two public mirrors
# of it read here agree (the Hub itself cannot be reached from here).
YI_34B = {"model_type": "llama", "vocab_size": 64000, "hidden_size": 7168,
          "intermediate_size": 20480, "num_hidden_layers": 60, "num_attention_heads": 56,
          "num_key_value_heads": 8, "max_position_embeddings": 4096, "rope_theta": 5000000.0,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
ANSWERAI_LORA_TARGETS = ("k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj")
_ANSWERAI = {"precision": "bf16", "checkpointing": True, "lora_rank": 64, "lora_dropout": 0.1,
             "loss": "transformers-4.46", "autocast_adapter_dtype": False,
             "lora_targets": ANSWERAI_LORA_TARGETS}
_ANSWERAI_FSDP_QLORA = Stack(method="qlora", fsdp_ranks=2, chunked_dequant=True, **_ANSWERAI)
_ANSWERAI_CONFIG = ("Answer.AI's train.py, 2 GPUs, {how}, batch {b} a GPU, precision bf16 (no "
                    "autocast), LoRA r=64 on the blocks' linear layers but o_proj (its 'all'), "
                    "adapters in bf16 (peft before 0.11), dropout 0.1, reentrant checkpointing "
                    "(measured non-reentrant), AdamW, transformers' fp32 logits{qlora}; {reads}")
_ANSWERAI_QLORA = (", bitsandbytes NF4 stored in bf16 (measured as torchao's NF4 dequantized "
                   "into its output, as bitsandbytes' kernel does)")
_ANSWERAI_OFFLOADED = replace(_ANSWERAI_FSDP_QLORA, fsdp_cpu_offload=True)
_OFFLOAD_HOW = "FSDP full shard with CPU offload (the GPU's peak)"


@dataclass(frozen=True)
class Figure:
    """One published figure and the configuration its source states.

    ``kind="max_context"``: the longest sequence that fits ``gpu_mem`` (tokens; 0 where the
    source says out of memory, which is met when nothing fits here either).
    ``kind="peak"``: a training step's peak memory at ``seq_len`` x ``batch_size``, in units of
    ``unit_bytes`` (1e9 for "GB" as ``max_memory_allocated() / 1e9``; 2**30 for GiB);
    ``reads="allocated"`` compares it with the trace's peak, ``"reserved"`` (a
    ``max_memory_reserved``, the caching allocator's count: no CUDA context) with the trace plus
    ``planner.allocator_reserve``.

    Attributes:
        source: the source's address.
        row: the row as the source labels it.
        model: a preset name, a config.json's fields (``fake_memory.model_config``), or
            ``LitGPTModel``: litgpt's own model (``litgpt_memory``).
        stack: the recipes the source's words describe.
        kind: "max_context" or "peak".
        published: the source's figure (tokens, or memory in ``unit_bytes``).
        config: the source's configuration, in its words.
        gpu_mem: the card's memory ("max_context").
        seq_len: tokens per sequence ("peak").
        batch_size: sequences per step.
        reads: "allocated" or "reserved" (above).
        unit_bytes: bytes per published unit.
        alternatives: other stacks the source's words fit, ``(name, stack)``.
        model_alternatives: other models, ``(name, model, stack)``: where the source ran its
            own model, transformers' model of the same config.
    """

    source: str
    row: str
    model: Any
    stack: Stack
    kind: str
    published: float
    config: str
    gpu_mem: str | None = None
    seq_len: int = 0
    batch_size: int = 1
    reads: str = "reserved"
    unit_bytes: float = 2**30
    # (name, stack) the source's words also fit, or the library default the source's setting
    # replaces (torchtune's bf16 adapters: peft's fp32 ones), measured beside the row's own stack
    alternatives: tuple[tuple[str, Stack], ...] = ()
    model_alternatives: tuple[tuple[str, Any, Stack], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {KINDS}")
        if self.reads not in READS:
            raise ValueError(f"reads={self.reads!r}: expected one of {READS}")
        if self.kind == "max_context" and not self.gpu_mem:
            raise ValueError(f"gpu_mem: a max_context figure ({self.row}) needs the card's memory")
        if self.kind == "peak" and self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len}: a peak figure ({self.row}) needs it")
        if self.published < 0 or (self.published == 0 and self.kind != "max_context"):
            raise ValueError(f"published={self.published!r}: a {self.kind} figure ({self.row}) "
                             "is > 0 (0 only for a longest context that ran out of memory)")


FIGURES = [
    *(Figure(UNSLOTH_README, f"Llama-3.1-8B QLoRA r=32, HF + FA2, longest context on {gb} GB",
             "Llama-3.1-8B", TRL_2024_QLORA, "max_context", tokens, gpu_mem=f"{gb}GiB",
             config="4-bit QLoRA on all linear layers, rank 32, batch 1, padded sequences; "
                    "GB read as the card's GiB; measured as TRL's SFTTrainer ran it in "
                    "December 2024",
             alternatives=UNSLOTH_OTHER_STACKS)
      for gb, tokens in ((8, 0), (12, 932), (16, 2551), (24, 5789), (40, 12264), (48, 15502),
                         (80, 28454))),
    *(Figure(UNSLOTH_LLAMA33, f"Llama-3.3-70B QLoRA r=32, HF + FA2, longest context on {gb} GB",
             "Llama-3.1-70B", TRL_2024_QLORA, "max_context", tokens, gpu_mem=f"{gb}GiB",
             config="4-bit QLoRA on all linear layers, rank 32, batch 1, A100 80GB (Llama 3.3 "
                    "70B has Llama 3.1 70B's shape); measured as TRL's SFTTrainer ran it in "
                    "December 2024",
             alternatives=UNSLOTH_OTHER_STACKS)
      for gb, tokens in ((48, 0), (80, 6916))),
    *(Figure(LITGPT, f"{name} LoRA{' ' + q if q else ''}, micro-batch {b}",
             LitGPTModel(LITGPT_MODELS[name][0]), _litgpt_stack(bool(q)), "peak", gb,
             config=_litgpt_config(name, q, b),
             seq_len=LITGPT_MODELS[name][2], batch_size=b, reads="allocated", unit_bytes=1e9,
             alternatives=((("today's bitsandbytes",
                             replace(_litgpt_stack(True), nf4_keeps_input=False)),) if q else ()),
             model_alternatives=_litgpt_other_models(name, bool(q)))
      for name, q, b, gb in (("Llama-2-7B", "", 1, 21.30), ("Llama-2-7B", "", 2, 29.07),
                             ("Llama-2-7B", "bnb.nf4-dq", 1, 13.84),
                             ("Llama-2-13B", "", 1, 38.12),
                             ("Llama-2-13B", "bnb.nf4-dq", 1, 22.55),
                             ("phi-1.5", "", 1, 4.82), ("phi-1.5", "bnb.nf4-dq", 1, 3.72),
                             ("phi-1.5", "", 2, 6.76), ("phi-1.5", "", 4, 10.68),
                             ("StableLM-Alpha-3B", "", 1, 9.69),
                             ("StableLM-Alpha-3B", "bnb.nf4-dq", 1, 6.19),
                             ("StableLM-Alpha-3B", "", 2, 12.10),
                             ("StableLM-Alpha-3B", "", 4, 16.92))),
    Figure(TORCHTITAN, "Llama-3.1-8B FSDP 8, 32768 tokens, full AC", "Llama-3.1-8B",
           Stack(precision="bf16-mixed", checkpointing=True, fsdp_ranks=8), "peak", 83.9,
           config="FSDP over 8 H100s, local batch 1, sequence 32768, full activation "
                  "checkpointing, fp32 master weights; torch.compile + Float8 (not modelled "
                  "here: bf16 eager); memory is torchtitan's max reserved, GiB",
           seq_len=32768, batch_size=8, reads="reserved"),
    # Tables 1 and 3, the rows without torch.compile and Float8: selective activation
    # checkpointing with selective_ac_option="op" (llama3_8b.toml), the policy
    # checkpointing.selective_context writes out. The tables give the local batch (2) but not
    # the sequence length: the config's, 8192.
    *(Figure(TORCHTITAN_FSDP, f"Llama-3.1-8B FSDP {gpus}, selective AC (Table {table})",
             "Llama-3.1-8B", Stack(precision="bf16-mixed", checkpointing=True,
                                   selective_checkpointing=True, fsdp_ranks=gpus), "peak", gib,
             config=f"FSDP over {gpus} H100s (96 GB), local batch 2, selective activation "
                    "checkpointing (per-op policy: every other matmul and attention kept), fp32 "
                    "master weights, bf16 compute, no torch.compile, no Float8; sequence 8192, "
                    "the llama3_8b.toml default (the table does not state it); memory is "
                    "torchtitan's max reserved, GiB",
             seq_len=8192, batch_size=2 * gpus, reads="reserved")
      for table, gpus, gib in ((1, 8, 82.4), (3, 128, 67.0))),
    Figure(TORCHTUNE, "Llama-3.2-3B full, + packed dataset (torchtune)", "Llama-3.2-3B",
           Stack(precision="bf16"), "peak", 60.0,
           config="full_finetune_single_device, bf16, AdamW, batch 2 packed to 4096 tokens, "
                  "no compile, no checkpointing, A100; an unchunked cross-entropy the table "
                  "does not name (the recipe passes it the bf16 logits; the course's loss "
                  "upcasts them to fp32, as transformers does); peak memory active, GiB",
           seq_len=4096, batch_size=2, reads="allocated"),
    Figure(TORCHTUNE, "Llama-3.2-3B full, + compile, chunked CE, checkpointing (torchtune)",
           "Llama-3.2-3B", Stack(precision="bf16", checkpointing=True, chunked_loss=1024),
           "peak", 24.9,
           config="as the row above, with torch.compile (measured eager), chunked "
                  f"cross-entropy and activation checkpointing; {_TORCHTUNE_CHUNKS}",
           seq_len=4096, batch_size=2, reads="allocated"),
    *(Figure(TORCHTUNE, f"Llama-3.2-3B {name} (torchtune)", "Llama-3.2-3B",
             Stack(method=method, **_TORCHTUNE_LORA), "peak", gib,
             config=f"lora_finetune_single_device, {name} r=64 on q, v, output and MLP, "
                    "adapters in bf16, AdamW, batch 2 packed to 4096 tokens, compile (measured "
                    "eager), chunked CE, activation checkpointing and offloading; "
                    f"{_TORCHTUNE_CHUNKS}",
             seq_len=4096, batch_size=2, reads="allocated",
             alternatives=(("peft's default: fp32 adapters",
                            Stack(method=method, **{**_TORCHTUNE_LORA,
                                                    "autocast_adapter_dtype": True})),))
      for name, method, gib in (("LoRA", "lora", 8.5), ("QLoRA", "qlora", 4.6))),
    *(Figure(ANSWERAI, f"Llama-2-7B QLoRA, FSDP over 2 GPUs, batch {b} x {seq} (Answer.AI)",
             "Llama-2-7B", _ANSWERAI_FSDP_QLORA, "peak", gib,
             config=_ANSWERAI_CONFIG.format(how="FSDP full shard", b=b, qlora=_ANSWERAI_QLORA,
                                            reads="peak memory: max reserved, GiB"),
             seq_len=seq, batch_size=2 * b, reads="reserved",
             alternatives=(("torchao's dequantization",
                            replace(_ANSWERAI_FSDP_QLORA, chunked_dequant=False)),))
      for seq, b, gib in ((512, 1, 4.98), (2048, 1, 5.21), (2048, 4, 11.22), (2048, 10, 20.97))),
    # Yi 34B (both case studies' tables: the same figures on the 3090s and the 4090s)
    Figure(ANSWERAI, "Yi-34B QLoRA, FSDP over 2 GPUs, batch 2 x 2048 (Answer.AI)", YI_34B,
           _ANSWERAI_FSDP_QLORA, "peak", 23.05,
           config=_ANSWERAI_CONFIG.format(how="FSDP full shard", b=2, qlora=_ANSWERAI_QLORA,
                                          reads="peak memory: max reserved, GiB"),
           seq_len=2048, batch_size=4, reads="reserved",
           alternatives=(("torchao's dequantization",
                          replace(_ANSWERAI_FSDP_QLORA, chunked_dequant=False)),)),
    Figure(ANSWERAI, "Llama-2-7B QLoRA, DDP over 2 GPUs, batch 8 x 2048 (Answer.AI)",
           "Llama-2-7B", Stack(method="qlora", gpu_dropout=True, **_ANSWERAI), "peak", 20.94,
           config=_ANSWERAI_CONFIG.format(how="FSDP's NO_SHARD (one GPU's step)", b=8,
                                          qlora=", bitsandbytes NF4 stored in bf16",
                                          reads="peak memory: max reserved, GiB"),
           seq_len=2048, batch_size=8, reads="reserved"),
    # the same table's LoRA row under NO_SHARD: the whole bf16 base on each GPU
    Figure(ANSWERAI, "Llama-2-7B LoRA, DDP over 2 GPUs, batch 4 x 2048 (Answer.AI)",
           "Llama-2-7B", Stack(method="lora", gpu_dropout=True, **_ANSWERAI), "peak", 22.04,
           config=_ANSWERAI_CONFIG.format(how="FSDP's NO_SHARD (one GPU's step)", b=4, qlora="",
                                          reads="peak memory: max reserved, GiB"),
           seq_len=2048, batch_size=4, reads="reserved"),
    *(Figure(ANSWERAI, f"Llama-2-7B LoRA, FSDP over 2 GPUs, batch {b} x {seq} (Answer.AI)",
             "Llama-2-7B", Stack(method="lora", fsdp_ranks=2, gpu_dropout=True, **_ANSWERAI),
             "peak", gib,
             config=_ANSWERAI_CONFIG.format(how="FSDP full shard", b=b, qlora="",
                                            reads="peak memory: " + (
                                                "max allocated (the note under the LoRA "
                                                "table), GiB" if reads == "allocated" else
                                                "max reserved, GiB")),
             seq_len=seq, batch_size=2 * b, reads=reads)
      for seq, b, gib, reads in ((512, 1, 8.28, "allocated"), (2048, 1, 9.16, "allocated"),
                                 (2048, 4, 16.14, "reserved"), (2048, 6, 21.35, "reserved"))),
    # with FSDP's CPU offload: the dual 4090 tables (Llama-2 70B's row is the 3090s' too)
    *(Figure(ANSWERAI, f"{name} QLoRA, FSDP + CPU offload over 2 GPUs, batch {b} x {seq} "
             "(Answer.AI)", model, _ANSWERAI_OFFLOADED, "peak", gib,
             config=_ANSWERAI_CONFIG.format(how=_OFFLOAD_HOW, b=b, qlora=_ANSWERAI_QLORA,
                                            reads="peak memory: max reserved, GiB"),
             seq_len=seq, batch_size=2 * b, reads="reserved",
             alternatives=(("torchao's dequantization",
                            replace(_ANSWERAI_OFFLOADED, chunked_dequant=False)),))
      for name, model, seq, b, gib in (("Llama-2-7B", "Llama-2-7B", 2048, 12, 22.38),
                                       ("Yi-34B", YI_34B, 2048, 4, 22.98),
                                       ("Llama-2-70B", "Llama-2-70B", 2048, 2, 14.92),
                                       ("Mistral-7B-v0.2", MISTRAL_7B_V02, 2048, 12, 22.54),
                                       ("Mistral-7B-v0.2", MISTRAL_7B_V02, 24576, 1, 22.54))),
    Figure(ANSWERAI, "Llama-2-7B LoRA, FSDP + CPU offload over 2 GPUs, batch 10 x 2048 "
           "(Answer.AI)", "Llama-2-7B",
           Stack(method="lora", fsdp_ranks=2, gpu_dropout=True, fsdp_cpu_offload=True,
                 **_ANSWERAI), "peak", 22.69,
           config=_ANSWERAI_CONFIG.format(how=_OFFLOAD_HOW, b=10, qlora="",
                                          reads="peak memory: max reserved, GiB"),
           seq_len=2048, batch_size=20, reads="reserved"),
]


# Why rows miss, as found; keyed by source (every miss so far is one cause per source). Our figures
# in a reason come from the run (``lines``), never typed here.
REASONS = {
    UNSLOTH_README: (
        "The source's words fit several stacks and do not say which ('other stacks' column); "
        "measured as TRL's SFTTrainer ran it when the tables were made, December 2024 (peft's "
        "k-bit preparation, then embeddings and head back to bf16; transformers 4.46-4.47's "
        "loss, which copied the shifted logits, though not for one sequence: the 'today's "
        "loss' column is the same stack with today's loss). Its six rows with a length are not "
        "six measurements: they lie on one straight line (1,619 tokens more per 4 GB at every "
        "step; the 'Unsloth' column, 18,876), so they test two numbers, the memory each token "
        "adds and the memory before the first token. "
        "A difference in the fixed part weighs most on the smallest card, where the line is "
        "closest to its zero; the line table below the figures has both numbers. The optimizer "
        "is not where the gap lies: with the 8-bit AdamW of Unsloth's 2023 benchmarks "
        "(unslothai/unsloth#22) the memory before the first token drops further below the "
        "source's. Which stack, and which GB (10^9 bytes or the card's GiB), the source measured "
        "with stays open; neither is tuned here."),
    ANSWERAI: (
        "Measured as the source's train.py ran (its 'all': adapters on six of Llama's seven "
        "projections, not o_proj; bf16 adapters, as the peft of early 2024 gave them), every "
        "row that reads the reserved peak is under the source, and the two that read the peak "
        "allocated (LoRA at one sequence a GPU, the note under the source's LoRA table) are "
        "met. Until 2026-12-07 the rows were measured with fp32 adapters on all seven "
        "projections, a stack the source did not run: those adapters (fp32 weights, gradients "
        "and states, and the fp32 copy of each adapted layer's input peft takes in pure bf16) "
        "filled most of the gap, and fourteen rows were met. The "
        "caching allocator's reserve beyond the trace, modelled as planner.allocator_reserve "
        "(15 % of the trace), is larger on the source's GPUs, and larger with FSDP's CPU "
        "offload than without: the source's own pair at one sequence a GPU reads 10.22 GiB "
        "reserved for 9.16 allocated at 2,048 tokens and 10.24 for 8.28 at 512, and a reserved "
        "peak is the allocator's high-water mark since the process started, loading included "
        "(the source reads 3.72 GiB reserved once the model is wrapped, before the first "
        "step): FSDP1's flat parameters, bitsandbytes' buffers and loading leave blocks "
        "reserved that a step's trace does not hold. The misses are the rows where that gap "
        "passes 15 %. Its LoRA rows also grow faster with the batch than its QLoRA rows (2.6 "
        "GiB for each further 2,048-token sequence from 4 to 6 a GPU, against 1.63 from 4 to "
        "10), though the two steps differ only in the base's weights and their matmul; why a "
        "LoRA sequence costs more there is not found. Its Yi 34B rows read the same reserved "
        "peak with FSDP's CPU offload at twice the batch (23.05 GiB at 2 sequences a GPU "
        "without it, 22.98 at 4 with it): on its GPUs offloading freed about what two further "
        "sequences take, where here it frees the sharded NF4 base and the adapters' shards, "
        "gradients and optimizer states, more than those sequences add."),
}
MIN_LINE_ROWS = 3  # longest-context rows of one source and model that make a line worth fitting


def fit_line(gpu_bytes: list[float], tokens: list[float]) -> dict[str, float]:
    """The least-squares line through (memory, longest context) points, as the two numbers a
    memory model of a training step is made of.

    Args:
        gpu_bytes: each point's memory.
        tokens: each point's longest context.

    Returns:
        ``bytes_per_token`` (memory each token adds), ``fixed_bytes`` (memory at zero tokens:
        weights, optimizer, buffers, whatever does not grow with the sequence) and
        ``worst_residual`` (tokens, the point furthest from the line).

    Raises:
        ValueError: naming ``gpu_bytes`` for fewer than ``MIN_LINE_ROWS`` points, unequal
            lengths or a line that does not rise.

    Example:
        >>> line = fit_line([12e9, 16e9, 24e9], [1000, 3000, 7000])
        >>> round(line["bytes_per_token"]), round(line["fixed_bytes"])
        (2000000, 10000000000)
    """
    if len(gpu_bytes) != len(tokens) or len(gpu_bytes) < MIN_LINE_ROWS:
        raise ValueError(f"gpu_bytes: {len(gpu_bytes)} sizes for {len(tokens)} lengths; a line "
                         f"needs at least {MIN_LINE_ROWS} of each")
    slope, intercept = np.polyfit(np.asarray(gpu_bytes, float), np.asarray(tokens, float), 1)
    if slope <= 0:
        raise ValueError(f"gpu_bytes: the longest context does not grow with memory ({tokens})")
    residual = np.asarray(tokens) - (slope * np.asarray(gpu_bytes) + intercept)
    return {"bytes_per_token": float(1 / slope), "fixed_bytes": float(-intercept / slope),
            "worst_residual": float(np.abs(residual).max())}


def lines(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each source and model with at least ``MIN_LINE_ROWS`` longest-context rows: the line
    through the published figures (GB read as the card's GiB, as the rows read them, and as
    10^9 bytes) and the line through our predictions for each stack measured.

    Args:
        rows: :func:`predict`'s rows.

    Returns:
        One dict per source and model: ``source``, ``model``, ``rows`` (how many), ``published``
        and ``published_1e9`` (``fit_line`` results), ``ours`` (stack name -> ``fit_line``;
        ``"main"`` is the row's own stack).
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:  # an out-of-memory row says only that the line's zero lies above its card
        if r["kind"] == "max_context" and r.get("gpu_mem") and r["published"]:
            groups.setdefault((r["source"], r["model"]), []).append(r)
    out = []
    for (source, model), group in groups.items():
        if len(group) < MIN_LINE_ROWS:
            continue
        mem = [planner.parse_bytes(r["gpu_mem"]) for r in group]
        names = ["main", *group[0]["alternatives"]]
        ours = {name: fit_line(mem, [r["predicted"] if name == "main" else r["alternatives"][name]
                                     for r in group]) for name in names}
        out.append({"source": source, "model": model, "rows": len(group),
                    "published": fit_line(mem, [r["published"] for r in group]),
                    "published_1e9": fit_line([m / 2**30 * 1e9 for m in mem],
                                              [r["published"] for r in group]),
                    "ours": ours, "stack": group[0]["stack"]})
    return out


def line_summary(line: dict[str, Any]) -> str:
    """The source's line beside ours (``lines``), in words: per token and before the first
    token, under both readings of the source's GB.

    Args:
        line: one of :func:`lines`' results.

    Returns:
        The sentence.
    """
    def both(f: dict[str, float]) -> str:
        return (f"{f['bytes_per_token'] / 2**20:.2f} MiB a token from "
                f"{f['fixed_bytes'] / 2**30:.2f} GiB")

    ours, src, src9 = line["ours"]["main"], line["published"], line["published_1e9"]
    others = "; ".join(f"{name}: {both(f)}" for name, f in line["ours"].items() if name != "main")
    return (f"{line['model']}: the source's {line['rows']} rows lie on one line (the furthest "
            f"{src['worst_residual']:.0f} tokens off it), {both(src)} with GB read as GiB, "
            f"{both(src9)} as 10^9 bytes; ours {both(ours)}: per token "
            f"{ours['bytes_per_token'] / src['bytes_per_token'] - 1:+.0%} / "
            f"{ours['bytes_per_token'] / src9['bytes_per_token'] - 1:+.0%} of the source's, "
            f"before the first token {(ours['fixed_bytes'] - src['fixed_bytes']) / 2**30:+.2f} / "
            f"{(ours['fixed_bytes'] - src9['fixed_bytes']) / 2**30:+.2f} GiB"
            + (f" (other stacks: {others})." if others else "."))


def figure_for(model: str, stack: Stack, gpu_mem: str) -> Figure | None:
    """The published longest-context figure for this model and card whose source's words fit
    ``stack`` (its main stack or one of its other stacks), if the table has one.

    Args:
        model: a preset name, e.g. "Llama-3.1-8B".
        stack: the recipes measured.
        gpu_mem: the card's memory, e.g. "24GB".

    Returns:
        The ``Figure``, or None.
    """
    return next((f for f in FIGURES if f.kind == "max_context" and f.model == model
                 and stack in (f.stack, *(s for _, s in f.alternatives))
                 and planner.parse_bytes(f.gpu_mem) == planner.parse_bytes(gpu_mem)), None)


def _peak_bytes(model: Any, stack: Stack, seq_len: int, batch_size: int) -> int:
    """One training step's peak on fake tensors, on litgpt's own model where the row ran it."""
    return (litgpt_memory.measure_step(model.name, stack, seq_len, batch_size)
            if isinstance(model, LitGPTModel) else
            fake_memory.measure_step(model, stack, seq_len, batch_size)).peak_bytes


def predict(figures: list[Figure] = FIGURES, step: int = 64,
            memo: Callable[[str, Callable[[], Any]], Any] | None = None) -> list[dict[str, Any]]:
    """Our prediction for each figure (and for the other stacks its source's words fit),
    measured on fake tensors: rows that ask for the longest context of the same model and stack
    share one search (``planner.max_context``).

    Args:
        figures: the figures to predict.
        step: the longest-context search's granularity, in tokens.
        memo: ``memo(key, measure)`` returns ``measure()`` or the value recorded under ``key``
            (``results.Progress.value``: an interrupted run resumes where it stopped); None
            measures everything.

    Returns:
        One dict per figure: its fields, ``predicted``, ``error`` (predicted / published - 1;
        None for an out-of-memory figure), ``met`` (within ``TOLERANCE``; for out of memory,
        nothing fits here either), ``alternatives`` (name -> prediction, for the other stacks
        and the other models; empty where the source allows one stack) and, for a miss,
        ``reason`` (with what each further sequence adds, :func:`batch_slopes`).

    Raises:
        ValueError: naming ``model`` for a longest-context figure given a config's fields
            (its searches are grouped by preset name).
    """
    jobs = [(i, f, f.model, f.stack, "main") for i, f in enumerate(figures)] + [
        (i, f, f.model, stack, name) for i, f in enumerate(figures)
        for name, stack in f.alternatives] + [
        (i, f, model, stack, name) for i, f in enumerate(figures)
        for name, model, stack in f.model_alternatives]
    run = memo if memo is not None else (lambda key, measure: measure())
    values: dict[tuple[int, str], float] = {}
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for i, f, model, stack, which in jobs:
        if f.kind == "max_context":
            if not isinstance(model, str):
                raise ValueError(f"model: a longest-context figure ({f.row}) names a preset")
            groups.setdefault((model, stack, f.batch_size), []).append((i, which))
            continue
        peak = run(f"peak: {model!r}, {stack!r}, {f.batch_size} x {f.seq_len}",
                   partial(_peak_bytes, model, stack, f.seq_len, f.batch_size))
        if f.reads == "reserved":  # the allocator's count: the CUDA context is outside it
            peak += planner.allocator_reserve(peak)
        values[i, which] = peak / f.unit_bytes
    for (model, stack, batch), keys in groups.items():
        gpu_mems = [figures[i].gpu_mem for i, _ in keys]
        found = run(f"max context: {model!r}, {stack!r}, batch {batch}, {gpu_mems}, step {step}",
                    partial(planner.max_context, model, gpu_mems, stack, batch, step=step,
                            memo=run))
        for key, r in zip(keys, found):
            values[key] = float(r["max_seq_len"])
    out = []
    for i, f in enumerate(figures):
        error = values[i, "main"] / f.published - 1 if f.published else None
        unit = ("tokens" if f.kind == "max_context" else
                "GB" if f.unit_bytes == 1e9 else "GiB") + (
                    f" ({f.reads})" if f.kind == "peak" else "")
        row = {"source": f.source, "row": f.row, "kind": f.kind, "config": f.config,
               "model": f.model, "gpu_mem": f.gpu_mem, "batch_size": f.batch_size,
               "seq_len": f.seq_len,
               # a config's fields are named by the row, which starts with the model's name
               "model_name": f.model if isinstance(f.model, str) else f.row.split()[0],
               "unit": unit, "published": f.published, "predicted": values[i, "main"],
               "error": error, "stack": f.stack.label,
               "met": values[i, "main"] == 0 if error is None else abs(error) <= TOLERANCE,
               "alternatives": {name: values[i, name]
                                for name, *_ in (*f.alternatives, *f.model_alternatives)}}
        if not row["met"]:
            row["reason"] = REASONS.get(f.source, "not investigated yet")
        out.append(row)
    for line in lines(out):
        for row in out:
            if not row["met"] and (row["source"], row["model"]) == (line["source"],
                                                                   line["model"]):
                row["reason"] += " " + line_summary(line)
    for source in {r["source"] for r in out if not r["met"]}:
        slopes = [s for s in batch_slopes(out) if s["source"] == source]
        if slopes:
            said = " ".join(slope_summary(s) for s in slopes)
            for row in out:
                if not row["met"] and row["source"] == source:
                    row["reason"] += " What each further sequence adds: " + said
    return out


def batch_slopes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each source, model, stack and sequence length with peak rows at two or more
    micro-batches: what each further sequence adds, the source's and ours (least squares over
    the micro-batches).

    Args:
        rows: :func:`predict`'s rows.

    Returns:
        One dict per group: ``source``, ``model`` (its name), ``stack``, ``unit``,
        ``published`` and ``predicted`` (per sequence, in the rows' unit), ``batch_sizes``.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] == "peak":
            groups.setdefault((r["source"], r["model_name"], r["stack"], r["unit"],
                               r.get("seq_len")), []).append(r)
    out = []
    for (source, model, stack, unit, _), group in groups.items():
        sizes = [r["batch_size"] for r in group]
        if len(set(sizes)) < 2:
            continue
        out.append({"source": source, "model": model, "stack": stack, "unit": unit,
                    "batch_sizes": sorted(set(sizes)),
                    **{key: float(np.polyfit(sizes, [r[key] for r in group], 1)[0])
                       for key in ("published", "predicted")}})
    return out


def slope_summary(slope: dict[str, Any]) -> str:
    """One :func:`batch_slopes` result in words.

    Args:
        slope: one of :func:`batch_slopes`' results.

    Returns:
        The sentence.
    """
    unit = slope["unit"].split()[0]
    return (f"{slope['model']} (micro-batches {', '.join(map(str, slope['batch_sizes']))}), "
            f"{slope['published']:.2f} {unit} a sequence at the source, "
            f"{slope['predicted']:.2f} here ({slope['predicted'] / slope['published'] - 1:+.0%}).")


def record(results: Any, rows: list[dict[str, Any]]) -> None:
    """Write each row to ``results`` as recipe ``published`` (value = our prediction, baseline =
    the published figure; the unit names the source's address), and each source's line
    (``lines``) as recipe ``published_line``: ours on the rows' stack beside the source's.

    Args:
        results: a ``results.Results``.
        rows: :func:`predict`'s rows.
    """
    for r in rows:
        oom = " (0: out of memory)" if r["kind"] == "max_context" else ""
        results.add("published", r["row"], r["predicted"], baseline=r["published"],
                    unit=f"{r['unit']}{oom}; {r['source']}; measured stack: {r['stack']}")
    for line in lines(rows):
        ours, src = line["ours"]["main"], line["published"]
        where = f"{line['source']}; measured stack: {line['stack']}; GB read as GiB"
        results.add("published_line", f"{line['model']}: MiB each token adds",
                    ours["bytes_per_token"] / 2**20, baseline=src["bytes_per_token"] / 2**20,
                    unit=f"MiB; {where}")
        results.add("published_line", f"{line['model']}: GiB before the first token",
                    ours["fixed_bytes"] / 2**30, baseline=src["fixed_bytes"] / 2**30,
                    unit=f"GiB; {where}")


def _value(r: dict[str, Any], v: float) -> str:
    """A figure as the tables print it: tokens whole ("OOM" for none), memory to 0.01."""
    if r["kind"] == "max_context":
        return f"{v:,.0f}" if v else "OOM"
    return f"{v:,.2f}"


def _error(r: dict[str, Any]) -> str:
    return "" if r["error"] is None else f"{r['error']:+.1%}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as the README's table: source, its configuration, the published figure, ours
    (and the other stacks', where the source's words allow several), the error and, for a miss,
    why.

    Args:
        rows: :func:`predict`'s rows.

    Returns:
        The Markdown table.
    """
    out = ["| figure (source) | published | ours | other stacks | error | |",
           "|---|---:|---:|---:|---:|---|"]
    explained = set()
    for r in rows:
        alt = "; ".join(f"{_value(r, v)} ({name})" for name, v in r["alternatives"].items())
        site = r["source"].split()[0]
        verdict = "met"
        if not r["met"]:
            verdict = "MISSED: " + ("as above" if r["source"] in explained else r["reason"])
            explained.add(r["source"])
        out.append(f"| {r['row']} ([source]({site}); {r['config']}) | "
                   f"{_value(r, r['published'])}{' ' + r['unit'] if r['published'] else ''} | "
                   f"{_value(r, r['predicted'])} | "
                   f"{alt} | {_error(r)} | {verdict} |")
    found = lines(rows)
    if found:
        out += ["", ("Where a source's longest-context rows make a line, the line: memory each "
                     "token adds, and memory before the first token (where the line meets zero "
                     "tokens)."), "",
                "| source, model | stack | MiB a token | GiB before the first token |",
                "|---|---|---:|---:|"]
        for line in found:
            site = line["source"].split()[0]
            head = f"[{line['model']}]({site})"
            for name, f in [("published, GB read as GiB", line["published"]),
                            ("published, GB read as 10^9 bytes", line["published_1e9"]),
                            *((f"ours, {line['stack'] if n == 'main' else n}", f)
                              for n, f in line["ours"].items())]:
                out.append(f"| {head} | {name} | {f['bytes_per_token'] / 2**20:.2f} | "
                           f"{f['fixed_bytes'] / 2**30:.2f} |")
    return "\n".join(out)


def update_readme(rows: list[dict[str, Any]]) -> bool:
    """Write :func:`markdown_table` between the published-table markers of the planner's page,
    ``docs/planner.md`` (only when results go to the repository's ``results/``, as
    ``results.update_readme``).

    Args:
        rows: :func:`predict`'s rows.

    Returns:
        True if the page changed.
    """
    return results.write_readme_section("published-table", markdown_table(rows),
                                        results.PLANNER_DOC)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table, misses marked, then each source's line (``lines``).

    Args:
        rows: :func:`predict`'s rows.

    Returns:
        The text.
    """
    head = (f"{'published figure':<66} {'published':>10} {'ours':>10} {'others':>17} "
            f"{'error':>7}")
    out = [head]
    for r in rows:
        alt = " / ".join(_value(r, v) for v in r["alternatives"].values())
        out.append(f"{r['row']:<66} {_value(r, r['published']):>10} "
                   f"{_value(r, r['predicted']):>10} {alt:>17} {_error(r):>7}"
                   f"{'' if r['met'] else '  MISSED'}")
    out.extend(line_summary(line) for line in lines(rows))
    return "\n".join(out)
