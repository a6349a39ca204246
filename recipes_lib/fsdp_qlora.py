"""QLoRA under FSDP2: frozen NF4 base weights sharded per parameter, LoRA adapters trained.

FSDP2 shards each parameter on its own (a DTensor per parameter, not one flat buffer), so a
tensor subclass can carry its own sharding rules. torchao's ``NF4Tensor`` does: it shards its
packed 4-bit data and quantized scales on dim 0 and all-gathers them *still quantized*
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), so both the stored base and the
communication cost ~0.52 bytes per weight instead of 2. This is the torchtune / Answer.AI
recipe; bitsandbytes' 4-bit ``Params4bit`` flattens weights into a ``[n, 1]`` uint8 buffer and is
reported fragile under FSDP2, so it is not used here.

Per rank, the base costs ``~0.516 * P / N`` bytes (NF4 with double-quantized scales, sharded
over N ranks) against ``2 * P`` for an unsharded bf16 base.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from recipes_lib.architectures import adapter_targets, architecture_name


def _nf4():
    from torchao.quantization import to_nf4
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4

    return to_nf4, NF4Tensor, linear_nf4


# packed bytes (two weights each) dequantized at a time by dequantize_chunked: 2**20 bytes keep
# its temporaries to about 30 MiB whatever the weight
DEQUANT_CHUNK = 2**20


@torch.library.custom_op("recipes_lib::nf4_dequantize", mutates_args=())
def _nf4_dequantize(packed: torch.Tensor, scalers: torch.Tensor, nf4: torch.Tensor,
                    block_size: int, dtype: torch.dtype, chunk_bytes: int) -> torch.Tensor:
    """NF4 weights, flat: ``packed`` (two 4-bit indices a byte), ``scalers`` (one per block of
    ``block_size`` weights) and the 16-value table ``nf4``, written into the output a chunk at a
    time."""
    half_block = block_size // 2
    out = torch.empty(2 * packed.numel(), dtype=dtype, device=packed.device)
    for start in range(0, packed.numel(), chunk_bytes):
        part = packed[start:start + chunk_bytes]
        # each byte's high then low 4 bits: the weights in order, as int64 indices
        index = torch.stack((part >> 4, part & 0b1111), dim=-1).flatten().to(torch.long)
        scale = scalers[start // half_block:(start + part.numel()) // half_block]
        scale = scale.unsqueeze(-1).expand(-1, block_size).flatten()
        # computed in the weight's dtype, as torchao does, then written in the output's
        out[2 * start:2 * (start + part.numel())] = nf4[index] * scale
    return out


@_nf4_dequantize.register_fake
def _(packed: torch.Tensor, scalers: torch.Tensor, nf4: torch.Tensor, block_size: int,
      dtype: torch.dtype, chunk_bytes: int) -> torch.Tensor:
    return packed.new_empty(2 * packed.numel(), dtype=dtype)  # what a fused kernel allocates


def dequantize_chunked(weight: Any, dtype: torch.dtype,
                       chunk_bytes: int = DEQUANT_CHUNK) -> torch.Tensor:
    """An ``NF4Tensor`` dequantized into its output a chunk at a time, in one operator: the
    values of torchao's ``weight.to(dtype)``, allocating the output and little else.

    torchao's dequantization (``NF4Tensor.get_original_weight``, what ``weight.to(dtype)`` and
    ``linear_nf4`` run) widens every 4-bit index to int64 and makes four more full-size tensors
    before the result: about 14 bytes per weight at once, in forward and again in backward, for
    a layer whose bf16 weight is 2 bytes per weight. A fused kernel (bitsandbytes'
    ``dequantize_4bit`` on a GPU) writes the output directly. This operator does it in Python,
    chunk by chunk, so its temporaries are one chunk's (about 30 MiB at ``DEQUANT_CHUNK``). As a
    kernel's, they stay inside the operator: a dispatch-level meter (fake tensors included) sees
    only the output, where a GPU's allocator would see those few MiB as well.

    Args:
        weight: an ``NF4Tensor`` (a sharded one as FSDP2 gathers it for compute; one that is
            not contiguous goes to torchao's dequantization).
        dtype: the output's dtype.
        chunk_bytes: packed bytes per chunk, a multiple of half the NF4 block size.

    Returns:
        The dequantized weight, ``weight.shape``, ``dtype``.

    Raises:
        ValueError: naming ``chunk_bytes`` if it does not hold whole NF4 blocks.

    Example:
        >>> to_nf4 = _nf4()[0]
        >>> w = to_nf4(torch.randn(64, 256, dtype=torch.bfloat16))
        >>> torch.equal(dequantize_chunked(w, torch.bfloat16), w.to(torch.bfloat16))
        True
    """
    half_block = weight.block_size // 2  # packed bytes per block: two 4-bit weights a byte
    if chunk_bytes < half_block or chunk_bytes % half_block:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be a positive multiple of "
                         f"{half_block} (half of the NF4 block of {weight.block_size})")
    if not weight.is_contiguous():  # a transposed view (no linear layer holds one): torchao's
        return weight.to(dtype)
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                        weight.scaler_block_size)  # one per block: small
    return _nf4_dequantize(weight.quantized_data, scalers, weight.nf4, weight.block_size, dtype,
                           chunk_bytes).view(weight.shape)


class _LinearNF4Chunked(torch.autograd.Function):
    """torchao's ``linear_nf4`` (the NF4 weight kept for backward, never its dequantized
    copy) with :func:`dequantize_chunked` in forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return nn.functional.linear(x, dequantize_chunked(weight, x.dtype))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad_output @ dequantize_chunked(weight, grad_output.dtype), None


class NF4BlockError(ValueError):
    """A weight that is not whole NF4 blocks (64 weights, their scales in groups of 256)."""


class NF4Linear(nn.Module):
    """``y = x W_nf4^T (+ b)``: a frozen NF4 linear layer, the base of :class:`NF4LoRALinear`,
    and on its own a layer that is quantized but not adapted (QLoRA quantizes every linear
    layer of the blocks, whichever of them its adapters target).

    Args:
        linear: the layer whose weight becomes the NF4 base.
        base_dtype: the dtype the base computes in.
        block_size: weights per NF4 absmax.
        scaler_block_size: absmax values per second-level scale (double quantization).
        chunked_dequant: dequantize with :func:`dequantize_chunked` (the output and one chunk)
            instead of torchao's ``linear_nf4`` (about 14 bytes per weight at once).

    Raises:
        NF4BlockError: naming ``linear`` for a weight that is not whole NF4 blocks.

    Example:
        >>> layer = NF4Linear(nn.Linear(256, 128))
        >>> layer(torch.randn(2, 256, dtype=torch.bfloat16)).shape
        torch.Size([2, 128])
    """

    def __init__(self, linear: nn.Linear, base_dtype: torch.dtype = torch.bfloat16,
                 block_size: int = 64, scaler_block_size: int = 256,
                 chunked_dequant: bool = False):
        super().__init__()
        w = linear.weight.detach()
        if w.numel() % block_size or (w.numel() // block_size) % scaler_block_size:
            raise NF4BlockError(f"linear: weight {tuple(w.shape)} is not a multiple of NF4 blocks "
                             f"({block_size} weights x {scaler_block_size} scales)")
        to_nf4, _, _ = _nf4()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(to_nf4(w.to(base_dtype).contiguous(), block_size,
                                          scaler_block_size), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)
        self.chunked_dequant = chunked_dequant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear_nf4 = _LinearNF4Chunked.apply if self.chunked_dequant else _nf4()[2]
        out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class NF4LoRALinear(NF4Linear):
    """``y = x W_nf4^T + (alpha / r) * B(A(dropout(x)))``: a frozen NF4 base and a LoRA adapter.

    ``A`` is Kaiming-uniform and ``B`` zero, as in peft, so the module starts equal to the base.

    Args:
        linear: the layer whose weight becomes the NF4 base.
        r: the adapter's rank.
        alpha: the adapter's scale numerator.
        dropout: dropout on the adapter's input.
        base_dtype: the dtype the base computes in.
        block_size: weights per NF4 absmax.
        scaler_block_size: absmax values per second-level scale (double quantization).
        chunked_dequant: dequantize with :func:`dequantize_chunked` (the output and one chunk)
            instead of torchao's ``linear_nf4`` (about 14 bytes per weight at once).
        adapter_dtype: the adapters' dtype: fp32 (peft's since 0.11), or the base's, as peft
            gave them before (and with ``autocast_adapter_dtype=False`` since).

    Raises:
        ValueError: naming ``r`` below 1.
        NF4BlockError: naming ``linear`` for a weight that is not whole NF4 blocks.
    """

    def __init__(self, linear: nn.Linear, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 base_dtype: torch.dtype = torch.bfloat16, block_size: int = 64,
                 scaler_block_size: int = 256, chunked_dequant: bool = False,
                 adapter_dtype: torch.dtype = torch.float32):
        if r < 1:
            raise ValueError(f"r={r}: LoRA rank must be >= 1")
        super().__init__(linear, base_dtype, block_size, scaler_block_size, chunked_dequant)
        kw = {"bias": False, "device": linear.weight.device, "dtype": adapter_dtype}
        self.lora_a = nn.Linear(self.in_features, r, **kw)
        self.lora_b = nn.Linear(r, self.out_features, **kw)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        adapter_dtype = self.lora_a.weight.dtype
        if x.dtype != adapter_dtype and not torch.is_autocast_enabled(x.device.type):
            # peft's LoRA layers do the same: fp32 adapters over a bf16 base without autocast
            # take an fp32 copy of their input, and their output comes back in the base's dtype
            adapted = self.lora_b(self.lora_a(self.dropout(x.to(adapter_dtype))))
            return out + (adapted * self.scaling).to(out.dtype)
        return out + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling


def apply_nf4_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                   target_modules: tuple[str, ...] | None = None,
                   base_dtype: torch.dtype = torch.bfloat16,
                   chunked_dequant: bool = False,
                   adapter_modules: tuple[str, ...] | None = None,
                   adapter_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Swap every targeted ``nn.Linear`` for an :class:`NF4LoRALinear` (or, outside
    ``adapter_modules``, a frozen :class:`NF4Linear`), freeze everything else.

    Args:
        model: a transformers causal LM (before sharding).
        r, alpha, dropout: LoRA rank, scale numerator and dropout, as in peft's ``LoraConfig``.
        target_modules: names of the linear layers to quantize; None: every linear
            layer of the decoder blocks, whatever the architecture calls them
            (``architectures.adapter_targets``: Phi-3's fused ``qkv_proj`` and ``gate_up_proj``).
        base_dtype: the dtype NF4 dequantizes to (bf16, as the weights were trained in).
        chunked_dequant: dequantize chunk by chunk (:class:`NF4Linear`).
        adapter_modules: which of the quantized layers get an adapter (peft's
            ``target_modules``; Answer.AI's train.py adapts six of Llama's seven, not
            ``o_proj``); None: all of them.
        adapter_dtype: the adapters' dtype (:class:`NF4LoRALinear`).

    Returns:
        The same model; only ``lora_a`` / ``lora_b`` weights require grad.

    Raises:
        ValueError: if no module matches ``target_modules``, or naming ``adapter_modules``
            where none of them is quantized.
        NF4BlockError: for a targeted layer whose weight is not whole NF4 blocks.
    """
    if target_modules is None:
        target_modules = adapter_targets(model)
    adapted = target_modules if adapter_modules is None else adapter_modules
    for p in model.parameters():
        p.requires_grad_(False)
    swapped = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in target_modules and isinstance(child, nn.Linear):
                layer = (NF4LoRALinear(child, r, alpha, dropout, base_dtype,
                                       chunked_dequant=chunked_dequant,
                                       adapter_dtype=adapter_dtype) if name in adapted
                         else NF4Linear(child, base_dtype, chunked_dequant=chunked_dequant))
                setattr(parent, name, layer)
                swapped[name] = isinstance(layer, NF4LoRALinear)
    if not swapped:
        have = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                       if isinstance(m, nn.Linear)})
        raise ValueError(f"target_modules={target_modules}: no nn.Linear with these names in "
                         f"{architecture_name(model)} (its linear layers: {have})")
    if not any(swapped.values()):
        raise ValueError(f"adapter_modules={adapter_modules}: none of the quantized layers "
                         f"({sorted(swapped)})")
    return model


def nf4_base_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of NF4 base weights (its shards' inner tensors) and the bytes the same
    weights take in bf16 unsharded (``2 * numel``).

    Args:
        model: the model with :class:`NF4Linear` layers (adapted or not).

    Returns:
        ``{"nf4_local", "bf16_full"}``.
    """
    from recipes_lib.memory import tensor_bytes

    local, full = [], 0
    for m in model.modules():
        if isinstance(m, NF4Linear):
            w = m.weight
            local.append(w.to_local() if hasattr(w, "to_local") else w.data)
            full += 2 * m.in_features * m.out_features
    return {"nf4_local": tensor_bytes(local), "bf16_full": full}


def train_fsdp_qlora(
    model_path: str,
    steps: int = 20,
    global_batch_size: int = 8,
    r: int = 16,
    lr: float = 2e-3,
    max_length: int = 128,
    seed: int = 0,
) -> dict[str, Any]:
    """QLoRA fine-tune on the topic task with the NF4 base sharded by FSDP2 (every rank runs it).

    Args:
        model_path: the base model's folder.
        steps: optimizer steps.
        global_batch_size: examples per step over all ranks.
        r: the adapters' rank.
        lr: the learning rate.
        max_length: the longest example kept.
        seed: for the adapters and the data order.

    Returns:
        JSON-ready dict: losses, this rank's NF4 base bytes (before and after sharding), the
        bf16 bytes of the same weights, trainable parameters.
    """
    from recipes_lib import data
    from recipes_lib import model as models
    from recipes_lib.distributed import check_global_batch, world
    from recipes_lib.fsdp import shard_model
    from recipes_lib.train import TrainConfig, train

    rank, world_size = world()
    micro = check_global_batch(global_batch_size, world_size)
    tok = models.load_tokenizer(model_path)
    sft = data.tokenize_examples(data.load_corpus("topic", "train"), tok, max_length, "sft")
    torch.manual_seed(seed)
    model = apply_nf4_lora(models.load_model(model_path), r=r, alpha=2 * r)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    before = nf4_base_bytes(model)
    model = shard_model(model) if world_size > 1 else model
    after = nf4_base_bytes(model)
    run = train(model, sft, tok.pad_token_id, TrainConfig(
        steps=steps, micro_batch_size=micro, lr=lr, warmup_steps=steps // 10,
        desc="FSDP QLoRA", seed=seed))
    return {"rank": rank, "world_size": world_size, "losses": run.losses,
            "nf4_bytes_unsharded": before["nf4_local"], "nf4_bytes_per_rank": after["nf4_local"],
            "bf16_base_bytes": after["bf16_full"], "trainable_params": trainable}
