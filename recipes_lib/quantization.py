"""QLoRA: a 4-bit NF4 base (bitsandbytes, double quantization) with trainable LoRA adapters (peft).

NF4 stores each weight in 4 bits plus one scale (absmax) per block of 64 weights; double
quantization stores those scales in 8 bits with one fp32 scale per 256 of them. The frozen base
then costs ~0.52 bytes per parameter instead of 2 (bf16), and only the adapters train.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from recipes_lib.architectures import (
    PEFT_EXPERT_NAMES,
    architecture_name,
    frozen_experts,
    frozen_experts_text,
    lora_target_modules,
    unadapted_linears,
)
from recipes_lib.checkpointing import enable_activation_checkpointing
from recipes_lib.device import has_module
from recipes_lib.memory import tensor_bytes


def require_bitsandbytes() -> None:
    """Raise a clear error if 4-bit loading cannot work here.

    Raises:
        ImportError: bitsandbytes is not installed, or too old for CPU 4-bit (needs >= 0.48).
    """
    if not has_module("bitsandbytes"):
        raise ImportError("quantization='nf4' needs bitsandbytes: pip install 'bitsandbytes>=0.48'")
    from importlib.metadata import version

    from packaging.version import Version

    found = Version(version("bitsandbytes"))
    if not torch.cuda.is_available() and found < Version("0.48"):
        raise ImportError(f"bitsandbytes {found}: 4-bit on CPU needs >= 0.48")


def nf4_config(double_quant: bool = True, compute_dtype: torch.dtype = torch.bfloat16):
    """A ``BitsAndBytesConfig`` for NF4 weights (the QLoRA paper's setting by default).

    Args:
        double_quant: also quantize the per-block scales (saves ~0.37 bit per parameter).
        compute_dtype: dtype the 4-bit weights are dequantized to for each matmul.

    Raises:
        ImportError: if bitsandbytes is missing (see ``require_bitsandbytes``).
    """
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"compute_dtype={compute_dtype}: expected bf16, fp16 or fp32")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


def _quant_tensors(module) -> list[torch.Tensor]:
    """Every tensor a bnb Linear4bit holds: packed weight, scales, code tables, bias."""
    w = module.weight
    out = [w, module.bias]
    qs = getattr(w, "quant_state", None)
    while qs is not None:
        out += [qs.absmax, qs.code, getattr(qs, "offset", None)]
        qs = getattr(qs, "state2", None)
    return out


def _linear4bit_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, layer) for every bitsandbytes 4-bit linear layer.

    Raises:
        ValueError: if the model has none.
    """
    import bitsandbytes as bnb

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not layers:
        raise ValueError("model: has no bitsandbytes 4-bit linear layers")
    return layers


def quantized_linear_stats(model: torch.nn.Module) -> dict[str, object]:
    """Measured bytes of the model's 4-bit linear layers, and what they are.

    Args:
        model: a model with bitsandbytes 4-bit linear layers.

    Returns:
        {"bytes": total bytes of every tensor the 4-bit layers hold, "params": logical parameter
        count, "names": module names, "shapes": logical (out, in) weight shapes}.

    Raises:
        ValueError: if the model has no 4-bit linear layers.
    """
    names, shapes, tensors, params = [], [], [], 0
    for name, mod in _linear4bit_layers(model):
        names.append(name)
        shape = tuple(mod.weight.quant_state.shape)
        shapes.append(shape)
        params += shape[0] * shape[1]
        tensors += _quant_tensors(mod)
    return {"bytes": tensor_bytes(tensors), "params": params, "names": names, "shapes": shapes}


def linear_weight_bytes(model: torch.nn.Module, names: list[str]) -> int:
    """Measured bytes of the named linear layers' weights and biases (e.g. in a bf16 model).

    Args:
        model: the model.
        names: module names of its linear layers.

    Returns:
        Their bytes.

    Raises:
        ValueError: naming the modules ``model`` does not have.
    """
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(f"names: not in the model: {missing[:3]}")
    return tensor_bytes(t for n in names for t in (modules[n].weight, modules[n].bias))


def add_lora(
    model: torch.nn.Module,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    gradient_checkpointing: bool = False,
    target_parameters: list[str] | None = None,
):
    """Wrap ``model`` with LoRA adapters on every linear layer (QLoRA's setting).

    For a 4-bit model, ``prepare_model_for_kbit_training`` first casts norms to fp32 and enables
    input gradients, as the QLoRA recipe does. What peft leaves out of what the targets name is
    said in a warning:

    - linear layers without an adapter (a mixture of experts' dense layers and shared experts,
      whose names peft up to 0.21 maps onto the experts: ``architectures.unadapted_linears``);
    - routed experts left frozen (``architectures.frozen_experts``: Phi-3.5-MoE, GPT-OSS,
      Llama 4, Qwen2-MoE up to peft 0.21, ...), with the ``target_parameters`` that adapt them.

    Routers that are ``nn.Linear`` layers returning a tuple (Llama 4, Phi-3.5-MoE) are left out
    of "all-linear", said aloud (``architectures.lora_target_modules``).

    Args:
        model: a transformers causal LM, quantized or not.
        r: adapter rank (>= 1).
        alpha: LoRA scaling numerator (scale = alpha / r).
        dropout: dropout on the adapter input.
        target_modules: "all-linear" (every linear but the output head) or explicit names.
        gradient_checkpointing: also enable activation checkpointing (non-reentrant).
        target_parameters: peft's ``target_parameters``: parameters adapted as they are, a
            mixture of experts' 3-D experts (``["mlp.experts.gate_up_proj",
            "mlp.experts.down_proj"]``), one rank-``r`` adapter per expert.

    Raises:
        ValueError: for r < 1, dropout outside [0, 1), target names that match no module
            (naming the layers that could be adapted) or a router, or ``target_parameters``
            that is not a list of names.
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if not isinstance(r, int) or r < 1:
        raise ValueError(f"r={r!r}: LoRA rank must be an integer >= 1")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout={dropout}: must be in [0, 1)")
    if target_parameters is not None and not (
            isinstance(target_parameters, (list, tuple))
            and all(isinstance(t, str) and t for t in target_parameters)):
        raise ValueError(f"target_parameters={target_parameters!r}: a list of parameter names "
                         "(e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])")
    requested, target_modules = target_modules, lora_target_modules(model, target_modules)
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules, task_type="CAUSAL_LM",
                        target_parameters=list(target_parameters or []) or None)
    wrapped = get_peft_model(model, config)
    left = unadapted_linears(wrapped, target_modules)
    if left:
        warnings.warn(f"target_modules={target_modules!r}: peft left {len(left)} linear layers "
                      f"of {architecture_name(wrapped)} without adapters ({', '.join(left[:3])}"
                      f"{', ...' if len(left) > 3 else ''}): {PEFT_EXPERT_NAMES}", stacklevel=2)
    frozen = frozen_experts(wrapped, requested)  # "all-linear" asks for them, routers left out
    if frozen:
        warnings.warn(frozen_experts_text(architecture_name(wrapped), requested, frozen),
                      stacklevel=2)
    return wrapped


def trainable_fraction(model: torch.nn.Module) -> tuple[int, int]:
    """Trainable and total parameter counts; 4-bit packed weights counted at their logical size.

    Args:
        model: the model.

    Returns:
        ``(trainable, total)``.
    """
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            n = int(torch.Size(qs.shape).numel())
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


HELD_KINDS = ("4-bit layers", "unquantized base", "adapters")


def held_bytes_by_kind(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """What a QLoRA model's weights hold, by kind, and in which dtypes.

    Two QLoRA setups with the same 4-bit layers and the same adapters can still differ in what
    they keep beside them: peft's ``prepare_model_for_kbit_training`` (the course's ``add_lora``)
    casts the unquantized rest of the base (embeddings, norms, head) to fp32, while TRL's
    ``SFTTrainer`` (since trl #4577) leaves it in the dtype the model was loaded in and casts the
    adapters to bf16.

    Args:
        model: a model with bitsandbytes 4-bit linear layers (peft-wrapped or not).

    Returns:
        ``{kind: {"bytes": int, "dtypes": [dtype names]}}`` for the kinds in
        :data:`HELD_KINDS`: the 4-bit layers (packed weights, scales, code tables; what
        :func:`quantized_linear_stats` counts), the rest of the frozen base, and the trainable
        parameters.

    Raises:
        ValueError: if the model has no 4-bit linear layers.

    Example:
        >>> held = held_bytes_by_kind(add_lora(model_4bit))  # doctest: +SKIP
        >>> held["unquantized base"]["dtypes"]  # doctest: +SKIP
        ['float32']
    """
    quantized = [t for _, m in _linear4bit_layers(model) for t in _quant_tensors(m)
                 if t is not None]
    seen = {id(t) for t in quantized}
    kinds: dict[str, list[torch.Tensor]] = {"4-bit layers": quantized, "unquantized base": [],
                                            "adapters": []}
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))  # a tied head is the embedding: counted once
            kinds["adapters" if p.requires_grad else "unquantized base"].append(p)
    return {kind: {"bytes": tensor_bytes(ts),
                   "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in ts})}
            for kind, ts in kinds.items()}


def held_bytes_table(held: dict[str, dict[str, dict[str, object]]]):
    """:func:`held_bytes_by_kind` of several models as one table: a column per model, a row per
    kind's bytes and, beside the 4-bit layers (whose tensors mix dtypes), its dtypes.

    Args:
        held: model name -> its :func:`held_bytes_by_kind`.

    Returns:
        A pandas DataFrame.
    """
    import pandas as pd

    return pd.DataFrame({
        who: {**{f"{k} (bytes)": v["bytes"] for k, v in h.items()},
              **{f"{k} (dtype)": ", ".join(v["dtypes"]) for k, v in h.items()
                 if k != "4-bit layers"}}
        for who, h in held.items()})


def reload_adapter(base_path: str | Path, adapter_dir: str | Path, quantization_config=None,
                   dtype: torch.dtype = torch.bfloat16, merge: bool = False,
                   device: torch.device | str | None = None):
    """Load the base again, attach a saved adapter; optionally merge it into the weights.

    ``device`` is where the base is loaded (None: the CPU); use the trained model's device to
    compare their outputs. A 4-bit base gets the k-bit preparation ``add_lora`` gave it for
    training (fp32 norms, embeddings and head), so the reloaded adapter computes exactly what
    the trained model did.

    Merging into 4-bit weights would re-quantize them (lossy), so with ``merge=True`` a 4-bit
    base is first dequantized to ``dtype`` and the adapter merged into those dense weights: the
    result is a plain transformers model with no peft or bitsandbytes at inference.

    Args:
        base_path: the base model's folder or hub id.
        adapter_dir: the saved adapter's folder.
        quantization_config: the base's ``BitsAndBytesConfig`` (None: not quantized).
        dtype: the dtype the base loads (and a 4-bit base dequantizes) in.
        merge: merge the adapter into the weights.
        device: where the base is loaded.

    Returns:
        The peft model, or with ``merge`` the plain transformers model.
    """
    from peft import PeftModel

    from recipes_lib.model import load_model

    base = load_model(base_path, dtype=dtype, quantization_config=quantization_config,
                      device=device)
    if quantization_config is not None and not merge:
        # the base as ``add_lora`` trained it: peft's k-bit preparation keeps the norms, the
        # embeddings and the head in fp32, so the reloaded model computes what the trained one did
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    if merge and quantization_config is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = base.dequantize()
        base = base.to(dtype)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    model.eval()
    return model.merge_and_unload() if merge else model
