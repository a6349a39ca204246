"""litgpt's own model, measured on fake tensors as its LoRA fine-tuning script ran a step.

A published memory figure is a measurement of the code its authors ran. litgpt's resource tables
were measured with litgpt's ``GPT``, not transformers' model of the same config, and the two keep
different tensors for backward. litgpt computes q, k and v in one fused projection and takes v
as a view of its output, so scaled-dot-product attention, which keeps v for backward, keeps the
whole fused output alive (q and k too, though it keeps its own rotated copies of those); its
RMSNorm keeps its input in fp32; its LoRA on q and v runs one dropout on the fused projection's
input. transformers' model of the same config, measured with litgpt's precision, adapters and
loss, fell short of every row (by up to a fifth); litgpt's model (:func:`measure_step`) is what
the rows measured.

The model is ``lit_gpt`` as the ``litgpt`` package first shipped it on PyPI (0.1.0.dev1,
February 2024; ``requirements.txt`` pins it). It builds on the meta device, its linear layers
swapped for 4-bit ones by Lightning's ``BitsandbytesPrecision`` as litgpt's scripts ask for
``--quantize bnb.nf4-dq`` (every linear layer, the head's included), then materialises under
``FakeTensorMode`` with the course's meter (``memory.measure_memory``) and loop
(``grad_accumulation.forward_backward``): a GPU's dropout mask and bitsandbytes 0.41's 4-bit
matmul as ``fake_memory.Stack`` asks for them.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import fields
from typing import Any

import torch
import torch.nn.functional as F

from recipes_lib.data import IGNORE_INDEX
from recipes_lib.fake_memory import (
    DTYPES,
    Stack,
    check_sizes,
    create_optimizer_states,
    make_step_optimizer,
    materialize,
    packed_placeholders,
    step_context,
)
from recipes_lib.grad_accumulation import forward_backward
from recipes_lib.memory import MemoryReport, measure_memory
from recipes_lib.train import optimizer_step

PACKAGE = "litgpt==0.1.0.dev1"
# the course's names for the projections LoRA adapts -> litgpt's LoRA switches
TARGETS = {"q_proj": "to_query", "k_proj": "to_key", "v_proj": "to_value",
           "o_proj": "to_projection", "mlp": "to_mlp", "lm_head": "to_head"}
# what litgpt's finetune/lora.py can run: LoRA or QLoRA in one dtype ("-true" precisions), no
# checkpointing, its own loss; every other Stack field stays at its default
METHODS = ("lora", "qlora")
LITGPT_FIELDS = ("method", "precision", "lora_rank", "lora_targets", "lora_dropout", "loss",
                 "optimizer", "gpu_dropout", "nf4_keeps_input", "autocast_adapter_dtype")
CHUNK = 128  # finetune/lora.py: model(input_ids, lm_head_chunk_size=128)
# a tiny Llama-shaped litgpt config (RMSNorm, SwiGLU, grouped queries, fused qkv): the model the
# fake-against-real checks run for real on a CPU
TINY = {"name": "tiny-llama", "block_size": 512, "vocab_size": 512, "padding_multiple": 64,
        "n_layer": 2, "n_head": 4, "n_query_groups": 2, "n_embd": 64, "rotary_percentage": 1.0,
        "parallel_residual": False, "bias": False, "_norm_class": "RMSNorm",
        "_mlp_class": "LLaMAMLP", "intermediate_size": 176}


def _require_litgpt() -> None:
    try:
        import lit_gpt  # noqa: F401
    except ImportError as e:
        raise ImportError(f"litgpt's model needs the litgpt package: pip install '{PACKAGE}' "
                          f"(requirements.txt)") from e


def check_stack(stack: Stack) -> None:
    """Refuse what litgpt's LoRA script could not run, naming the field.

    Args:
        stack: the recipes asked for.

    Raises:
        ValueError: ``stack.<field>=...`` and what litgpt runs instead.
    """
    if stack.method not in METHODS:
        raise ValueError(f"stack.method={stack.method!r}: litgpt's finetune/lora.py trains "
                         f"LoRA adapters: one of {METHODS}")
    if stack.precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"stack.precision={stack.precision!r}: measured are litgpt's "
                         "bf16-true, 16-true and 32-true (bf16, fp16, fp32)")
    if stack.loss != "litgpt":
        raise ValueError(f"stack.loss={stack.loss!r}: litgpt's model computes its own loss "
                         "(the head over 128-token chunks): loss='litgpt'")
    if stack.autocast_adapter_dtype:
        raise ValueError("stack.autocast_adapter_dtype=True: litgpt's adapters are created in "
                         "the model's dtype (a peft setting): False")
    targets = (stack.lora_targets,) if isinstance(stack.lora_targets, str) else stack.lora_targets
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"stack.lora_targets={stack.lora_targets!r}: litgpt adapts "
                         f"{', '.join(TARGETS)}; not {', '.join(map(repr, unknown))}")
    default = Stack()
    for f in fields(Stack):
        if f.name not in LITGPT_FIELDS and getattr(stack, f.name) != getattr(default, f.name):
            raise ValueError(f"stack.{f.name}={getattr(stack, f.name)!r}: litgpt's "
                             "finetune/lora.py (October 2023) has no such setting; measured: "
                             f"{', '.join(LITGPT_FIELDS)}")


def litgpt_config(model: str | dict[str, Any], stack: Stack) -> Any:
    """litgpt's ``Config`` with ``stack``'s LoRA (alpha = 2 x rank, litgpt's 16 for rank 8).

    Args:
        model: a litgpt config name (``lit_gpt.config.name_to_config``, e.g. "phi-1_5") or a
            dict of ``Config`` fields (a tiny model for tests).
        stack: the recipes (:func:`check_stack`).

    Returns:
        A ``lit_gpt.lora.Config``.

    Raises:
        ValueError: naming ``model`` for an unknown name, or the stack's field.
    """
    _require_litgpt()
    from lit_gpt.config import name_to_config
    from lit_gpt.lora import Config

    check_stack(stack)
    targets = (stack.lora_targets,) if isinstance(stack.lora_targets, str) else stack.lora_targets
    lora = {"r": stack.lora_rank, "alpha": 2 * stack.lora_rank, "dropout": stack.lora_dropout,
            **{switch: name in targets for name, switch in TARGETS.items()}}
    if isinstance(model, dict):
        return Config(**{**model, **lora})
    if model not in name_to_config:
        lowered = {n.lower(): n for n in name_to_config}
        near = [lowered[n] for n in difflib.get_close_matches(str(model).lower(), lowered, 4)]
        raise ValueError(f"model={model!r}: not one of litgpt's {len(name_to_config)} config "
                         f"names (nearest: {', '.join(near or sorted(name_to_config)[:4])})")
    return Config.from_name(model, **lora)


def build_model(model: str | dict[str, Any], stack: Stack, seq_len: int,
                device: torch.device | str = "cpu", fake: bool = True
                ) -> tuple[torch.nn.Module, Any]:
    """litgpt's LoRA ``GPT`` with ``stack`` applied, its weights fake (or random) on ``device``.

    As litgpt's script: the model in the precision's dtype, every linear layer 4-bit for QLoRA
    (Lightning's ``BitsandbytesPrecision("nf4-dq")``: NF4 with double quantization), only the
    adapters trainable, the rotary cache built for ``seq_len`` (its ``max_seq_length``, the
    longest example).

    Args:
        model: a litgpt config name or ``Config`` fields (:func:`litgpt_config`).
        stack: the recipes (:func:`check_stack`).
        seq_len: the longest sequence the step sees.
        device: where the weights are.
        fake: fake weights (no memory); False draws real ones.

    Returns:
        ``(model, mode)``: ``mode`` is the ``FakeTensorMode`` to run the step in (None if real).

    Raises:
        ValueError: naming ``seq_len`` beyond the model's positions, ``model`` or the stack's
            field (:func:`litgpt_config`).
    """
    from lit_gpt.lora import GPT, mark_only_lora_as_trainable

    config = litgpt_config(model, stack)
    if not 2 <= seq_len <= config.block_size:
        raise ValueError(f"seq_len={seq_len}: litgpt's {config.name} takes 2 to "
                         f"{config.block_size} tokens (its block_size)")
    dtype = DTYPES[stack.precision]
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as Fabric's init_module under a "-true" precision
    try:
        with torch.device("meta"):
            net = GPT(config)
    finally:
        torch.set_default_dtype(default)
    if stack.method == "qlora":
        from lightning.fabric.plugins.precision.bitsandbytes import BitsandbytesPrecision

        net = BitsandbytesPrecision("nf4-dq", dtype).convert_module(net)
    mark_only_lora_as_trainable(net)
    device = torch.device(device)
    mode = materialize(net, packed_placeholders(net), dtype, device, fake)
    with mode or contextlib.nullcontext():
        net.max_seq_length = seq_len
        net.cos, net.sin = net.rope_cache(device=device)  # to_empty left them unset
    net.train()
    return net, mode


class LitGPTModelLoss:
    """``loss_fn`` for ``grad_accumulation.forward_backward``: finetune/lora.py's loss on
    litgpt's model. The model applies its head to 128-token chunks of the final hidden states
    (``lm_head_chunk_size=128``), the last chunk loses its last position, and each chunk's
    cross-entropy is taken apart (litgpt's ``chunked_cross_entropy``, summed here over the
    target tokens rather than averaged: ``forward_backward`` divides). The loop holds the list
    of logits (its ``logits`` variable) until after backward: so does this loss, until the next
    call or :meth:`release`.

    Example:
        >>> forward_backward(net, batch, loss_fn=LitGPTModelLoss())  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.held: list[torch.Tensor] = []

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["input_ids"], lm_head_chunk_size=CHUNK)
        logits[-1] = logits[-1][..., :-1, :]
        self.held = logits
        targets = batch["labels"][..., 1:]
        losses = [F.cross_entropy(chunk.reshape(-1, chunk.size(-1)), target.reshape(-1),
                                  ignore_index=IGNORE_INDEX, reduction="none")
                  for chunk, target in zip(logits, targets.split(CHUNK, dim=1))]
        return torch.cat(losses).sum()

    def release(self) -> None:
        """Drop the held logits (the step has ended)."""
        self.held = []


def measure_step(model: str | dict[str, Any], stack: Stack, seq_len: int, batch_size: int = 1,
                 device: torch.device | str = "cpu", fake: bool = True) -> MemoryReport:
    """Peak memory of one step of litgpt's LoRA fine-tuning, optimizer states already created
    (as after a first step).

    Args:
        model: a litgpt config name (e.g. "Llama-2-7b-hf", "phi-1_5") or ``Config`` fields.
        stack: the recipes (:func:`check_stack`: LoRA or QLoRA, litgpt's loss).
        seq_len: tokens per sequence.
        batch_size: sequences per step (litgpt's micro-batch).
        device: the device the step would run on.
        fake: on fake tensors (no memory used); False runs it for real.

    Returns:
        The step's ``MemoryReport`` on ``device``.

    Raises:
        ValueError: naming the bad size, ``model`` or the stack's field.

    Example:
        >>> s = Stack(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"),
        ...           loss="litgpt", autocast_adapter_dtype=False)
        >>> measure_step("phi-1_5", s, 1044, 4).peak_bytes / 1e9  # doctest: +SKIP
        9.70
    """
    check_stack(stack)
    check_sizes(seq_len, batch_size, stack)
    device = torch.device(device)
    net, mode = build_model(model, stack, seq_len, device, fake)
    opt = make_step_optimizer(net, stack)
    loss_fn = LitGPTModelLoss()
    with mode or contextlib.nullcontext():
        ids = torch.randint(0, net.config.vocab_size, (batch_size, seq_len), device=device)
        batch = {"input_ids": ids, "labels": ids}
        targets = batch_size * (seq_len - 1)  # every position but the last (a fake count)

        def step() -> None:
            with step_context(stack, "cpu"):
                forward_backward(net, batch, num_target_tokens=targets, loss_fn=loss_fn)
            optimizer_step(net, opt, max_grad_norm=None)
            loss_fn.release()

        create_optimizer_states(net, opt)
        return measure_memory(step, net, opt, device)
