"""The memory and compute calculator: what a recipe should save, before it is measured.

Sources: ZeRO (Rajbhandari et al., 2020) for the 16 bytes/param of mixed-precision Adam;
QLoRA (Dettmers et al., 2023) for NF4 and double quantization; Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models", for activation bytes;
Kaplan et al. (2020) for 6N training FLOPs per token (8N with full recomputation).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bytes per weight of each storage format. NF4: 4 bits + one fp32 absmax per 64-weight block;
# with double quantization the absmax is 8-bit, plus one fp32 scale per 256 absmax values.
BYTES_PER_PARAM = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "int8": 1.0 + 4 / 4096,  # LLM.int8 / dynamic int8: 1 byte + a per-row fp32 scale (4096-wide)
    "nf4": 0.5 + 4 / 64,
    "nf4_dq": 0.5 + 1 / 64 + 4 / (64 * 256),
}
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
ADAMW_8BIT_BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states


@dataclass(frozen=True)
class ModelShape:
    """The sizes that memory depends on (a Llama-style decoder).

    Args:
        vocab_size: tokens in the vocabulary (rows of the embedding and the LM head).
        hidden_size: width of the residual stream.
        intermediate_size: width of the MLP's hidden layer.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (fewer than the query heads with grouped-query
            attention).
        tie_word_embeddings: the LM head shares the embedding's weight.
        head_dim: width of one attention head (None: ``hidden_size // num_attention_heads``).
            Qwen3, Gemma and Mistral-Nemo set it wider than that, so their query projection
            is ``num_attention_heads * head_dim`` wide, not ``hidden_size``.
        sliding_window: tokens a sliding-window layer attends to (None: no such layers).
        sliding_layers: how many layers use the sliding window (Mistral v0.1: all of them;
            Gemma-2: every other one; the rest attend to everything).
        score_bytes: bytes autograd keeps per attention score (batch x heads x s x s) where
            transformers has no fused attention for the architecture (0: it has SDPA, whose flash
            kernel keeps none). Its eager attention keeps the fp32 softmax output and the 16-bit
            probabilities, 6 (:data:`EAGER_SCORE_BYTES`), and with Gemma-2's logit soft-capping
            the tanh's output too, 8: counted with saved-tensor hooks in
            ``tests/test_calc.py``. Set by :meth:`from_config`.
        mlp_matrices: weight matrices in a layer's MLP: 3 for a gated one (gate, up and down
            projections: Llama, Qwen, Mistral, Gemma, Phi-3's fused gate_up), 2 for a plain one
            (up and down: GPT-NeoX / Pythia, Phi-2, StarCoder2, Nemotron). Set by
            :meth:`from_config` from the model transformers builds.
        max_position_embeddings: the positions the model was trained on (None: not recorded).
            The planner and the fake-tensor meter refuse a longer sequence, saying how RoPE
            scaling extends it (``max_context.check_positions``); the formulas do not read it.

    Parameter counts leave out what is below 0.1 % of a real model: attention biases (Qwen2),
    query/key norms (Qwen3) and Gemma's extra norms.

    Example:
        >>> ModelShape(32000, 4096, 11008, 32, 32, 32).head_dim  # Llama-2-7B
        128
        >>> ModelShape(151936, 2560, 9728, 36, 32, 8, True, head_dim=128).q_size  # Qwen3-4B
        4096
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    sliding_window: int | None = None
    sliding_layers: int = 0
    score_bytes: int = 0
    mlp_matrices: int = 3
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.mlp_matrices not in MLP_MATRICES:
            raise ValueError(f"mlp_matrices={self.mlp_matrices}: expected one of {MLP_MATRICES}")
        if self.head_dim is None:  # frozen: set once, here
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window}: must be >= 1 or None")
        if not 0 <= self.sliding_layers <= self.num_hidden_layers or (
                self.sliding_layers and self.sliding_window is None):
            raise ValueError(f"sliding_layers={self.sliding_layers}: must be in [0, "
                             f"{self.num_hidden_layers}], and 0 without a sliding_window")

    @classmethod
    def from_config(cls, config: Any, name: str = "config") -> ModelShape:
        """From a transformers config (or any object / dict with the same fields; a dict with
        a ``model_type`` transformers knows is also read as that config class reads it, for
        its defaults and what it derives: Gemma-2's tied embeddings, which its config.json
        leaves out, its alternating ``layer_types``, whether the model has SDPA). The sizes
        come from the fields themselves: a config without them is refused, not defaulted;
        so is one whose layers differ in shape (:class:`NotDescribedError`). ``name``: what
        the errors call the config."""
        full = _transformers_config(config)
        text = language_model_config(full) if full is not None else None
        if text is not full:  # a multimodal checkpoint's config: its language model's
            config = full = text
        check_dense(config, name)
        _check_same_layers(full, name)
        get = _field_reader(config)
        derived = _field_reader(full if full is not None else config)
        # the window and which layers slide, as transformers decides: its default window where
        # the config leaves it out (Mistral's and Gemma-2's 4096), none where the config turns
        # it off (Qwen2's use_sliding_window), the config's layer_types, else every layer
        window = derived("sliding_window")
        types = derived("layer_types")
        if window is None:
            sliding = 0
        elif types:
            sliding = sum(t == "sliding_attention" for t in types)
        else:
            sliding = get("num_hidden_layers")
        try:
            return cls(vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
                       intermediate_size=int(get("intermediate_size")),
                       num_hidden_layers=int(get("num_hidden_layers")),
                       num_attention_heads=int(get("num_attention_heads")),
                       num_key_value_heads=int(get("num_key_value_heads")
                                               or get("num_attention_heads")),
                       tie_word_embeddings=bool(derived("tie_word_embeddings", False)),
                       head_dim=int(get("head_dim")) if get("head_dim") else None,
                       sliding_window=int(window) if window is not None and sliding else None,
                       sliding_layers=int(sliding), score_bytes=_score_bytes(full),
                       mlp_matrices=_mlp_matrices(full),
                       max_position_embeddings=(int(get("max_position_embeddings"))
                                                if get("max_position_embeddings") else None))
        except TypeError as err:
            raise ValueError(f"{name}: not a decoder config with hidden_size, intermediate_size, "
                             f"num_hidden_layers, ... ({err})") from err

    @property
    def q_size(self) -> int:
        """Width of the queries (and of the attention's output): heads x head_dim."""
        return self.num_attention_heads * self.head_dim


# what transformers' eager attention keeps per score for backward: softmax's fp32 output (4) and
# the 16-bit probabilities that multiply the values (2); logit soft-capping adds its tanh's output
EAGER_SCORE_BYTES = 6
SOFTCAP_SCORE_BYTES = 2


def _transformers_config(config: Any) -> Any:
    """``config`` as its transformers config class (a dict read as ``AutoConfig`` reads a
    config.json); None where transformers does not know its ``model_type``."""
    if not isinstance(config, dict):
        return config if hasattr(config, "model_type") else None
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(config.get("model_type"), **fields)
    except (ValueError, KeyError, TypeError):
        return None


def _check_same_layers(config: Any, name: str = "config") -> None:
    """Refuse a config whose layers differ in shape (transformers' ``per_layer_config``:
    Gemma-4's global layers have twice the head width), which the formulas, one layer shape
    for every layer, do not describe; transformers itself refuses to read such a field for the
    whole model (a RuntimeError, not a size)."""
    per_layer = config.to_dict().get("per_layer_config") if config is not None else None
    if per_layer:
        fields = sorted({k for v in per_layer.values() for k in v})
        raise NotDescribedError(
            f"{name}: a {config.model_type!r} config whose layers differ in {', '.join(fields)} "
            f"(per_layer_config, layers {', '.join(str(int(i)) for i in per_layer)}): the "
            "formulas take one layer shape for every layer; measure its step on fake tensors "
            "instead (fake_memory.measure_step)", built_param_count(config))


def language_model_config(config: Any) -> Any:
    """The language model's config of a multimodal checkpoint's (Gemma-3 4B and up, Mistral-3,
    Qwen2.5-VL: its ``text_config``, ``get_text_config``); any other config itself. What the
    course trains and measures is the decoder: the vision encoder's weights are not counted.

    Args:
        config: a transformers config.

    Returns:
        The decoder's config.
    """
    get_text = getattr(config, "get_text_config", None)
    return get_text(decoder=True) if get_text is not None else config


def _score_bytes(config: Any) -> int:
    """:attr:`ModelShape.score_bytes` for a transformers config (0 for None or an unknown one)."""
    from recipes_lib.architectures import supports_sdpa

    try:
        if config is None or supports_sdpa(config):
            return 0
    except ValueError:  # not a causal LM transformers maps
        return 0
    softcap = getattr(config, "attn_logit_softcapping", None)
    return EAGER_SCORE_BYTES + (SOFTCAP_SCORE_BYTES if softcap else 0)


MLP_MATRICES = (2, 3)  # plain, gated


def _mlp_matrices(config: Any) -> int:
    """:attr:`ModelShape.mlp_matrices` for a transformers config: counted on the architecture
    itself (:func:`_mlp_matrices_of`), 3 (gated) for None or one transformers cannot build."""
    model_type = getattr(config, "model_type", None)
    return _mlp_matrices_of(model_type) if model_type else 3


@functools.cache
def _mlp_matrices_of(model_type: str) -> int:
    """How many weight matrices a ``model_type``'s decoder layer has on the MLP's intermediate
    width: a two-layer copy of the architecture (intermediate width 832, which no other size
    shares) built on the meta device, its 2-D weights with 832 on one side counted (a fused
    gate_up, 1664 wide, counts twice), per layer. Once per model type and process (~0.1 s);
    3 where the copy cannot be built or counts neither 2 nor 3."""
    from transformers import AutoConfig

    width, layers = 832, 2
    model = _meta_model_or_none(lambda: AutoConfig.for_model(
        model_type, hidden_size=256, intermediate_size=width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64))
    if model is None:
        return 3
    count = sum((p.shape.count(width) + 2 * p.shape.count(2 * width))
                for p in model.parameters() if p.dim() == 2)
    return count // layers if count in (2 * layers, 3 * layers) else 3


def _field_reader(config: Any) -> Callable[..., Any]:
    """``get(field, default=None)`` on a config object or a dict of its fields."""
    return config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)


# how transformers' configs count routed experts (Mixtral, Llama-4 / Qwen-MoE / DeepSeek,
# Aria / ERNIE-4.5-MoE)
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config: Any) -> tuple[str, int] | None:
    """``(field, routed experts)`` of a mixture-of-experts config, under any of transformers'
    names for the count (:data:`EXPERT_COUNTS`); None for a dense one.

    Args:
        config: a transformers config, or a dict of its fields.

    Returns:
        The field and its count (more than one expert), or None.

    Example:
        >>> expert_count({"num_local_experts": 8})
        ('num_local_experts', 8)
    """
    get = _field_reader(config)
    nested = get("ffn_config")  # DBRX counts its experts in its MLP's sub-config
    for key in EXPERT_COUNTS:
        n = get(key)
        if n is None and nested is not None:
            n, key = _field_reader(nested)(key), f"ffn_config.{key}"
        if isinstance(n, int) and n > 1:
            return key, n
    return None


def check_dense(config: Any, name: str = "config") -> None:
    """Refuse a mixture-of-experts config, which the formulas do not describe: they count one
    MLP a layer. A fake-tensor step measures it (``fake_memory.measure_step`` runs transformers'
    grouped-GEMM experts, which take every token's top-k experts whatever the router chose).

    Args:
        config: a transformers config, or a dict of its fields.
        name: the parameter named in the error.

    Raises:
        NotDescribedError: a ValueError naming ``name`` and the expert count, for a config with
            more than one expert (``built``: transformers' parameter count, where it builds).

    Example:
        >>> check_dense({"num_local_experts": 8})
        Traceback (most recent call last):
        ...
        recipes_lib.calc.NotDescribedError: config: a mixture-of-experts model ...
    """
    experts = expert_count(config)
    if experts:
        full = _transformers_config(config)
        raise NotDescribedError(
            f"{name}: a mixture-of-experts model ({experts[0]}={experts[1]}): the formulas "
            "count one MLP a layer; measure its step on fake tensors instead "
            "(fake_memory.measure_step), which runs transformers' own experts",
            built_param_count(language_model_config(full)) if full is not None else None)


# how far the formulas' parameter count may fall from transformers' model of the same config
# before the calculator refuses the architecture: what the formulas leave out of a dense decoder
# (biases, Qwen3's and OLMo-2's q/k norms, Gemma-2's extra norms, Phi-2's and Persimmon's
# LayerNorm biases) stays under 0.2 % on the dense decoders tried (tests/test_calc.py); hybrid
# layers (Qwen3.5's linear attention, LFM2's convolutions, Falcon-H1's Mamba mixers) miss by 5-40 %
COUNT_TOLERANCE = 0.01


class NotDescribedError(ValueError):
    """The formulas do not describe this architecture (:func:`check_counted`; layers of
    different shapes, :meth:`ModelShape.from_config`), where a fake-tensor step measures it.
    ``built``: the parameters of transformers' model of it, or None where unknown;
    ``model_name``: what the caller calls the model, where it says."""

    def __init__(self, message: str, built: int | None = None, model_name: str | None = None):
        super().__init__(message)
        self.built, self.model_name = built, model_name


def check_counted(config: Any, name: str = "config") -> None:
    """Refuse a config whose layers the formulas do not describe: the formulas count every layer
    as q, k, v, o attention and one MLP, which a hybrid (linear-attention, convolution or
    Mamba layers beside attention), recurrent or latent-attention architecture does not have.
    The check is by count: transformers' model of the config, built on the meta device (no
    memory; once per config and process), against :func:`param_count`.

    A fake-tensor step (``fake_memory.measure_step``) runs transformers' own model, so it
    measures these architectures as exactly as a Llama (Qwen3.5, LFM2 and Falcon-H1 fake steps
    equal real ones on a CPU, tests/test_fake_memory.py).

    Args:
        config: a transformers config, or a dict of a config.json's fields; one whose
            ``model_type`` transformers does not know is not checked.
        name: the parameter named in the error.

    Raises:
        NotDescribedError: a ValueError naming ``name``, the model type and both counts,
            where they differ by more than :data:`COUNT_TOLERANCE`, or the fields in which its
            layers differ (transformers' ``per_layer_config``).
    """
    full = _transformers_config(config)
    if full is None:
        return
    text = language_model_config(full)
    counted = param_count(ModelShape.from_config(text, name))["total"]
    built = built_param_count(text)
    if built is None:
        return
    if abs(counted - built) > COUNT_TOLERANCE * built:
        raise NotDescribedError(
            f"{name}: the calculator counts {counted / 1e9:.3f} B parameters for this "
            f"{text.model_type!r} config, transformers' model has {built / 1e9:.3f} B "
            f"({counted / built:.2f}x): it is not only embeddings and decoder layers of "
            "attention (q, k, v, o) and an MLP (a hybrid's linear-attention, convolution or "
            "Mamba layers, a recurrent block, an encoder's extra tables, a vision or audio "
            "tower), so the formulas do not describe it; measure its step on fake tensors "
            "instead (fake_memory.measure_step, planner.max_context), which run transformers' "
            "own model", built)


_BUILT_COUNTS: dict[str, int | None] = {}  # config JSON -> parameters (check_counted)


def built_param_count(config: Any) -> int | None:
    """Parameters of transformers' causal LM for ``config``, built on the meta device (no
    memory), once per config and process: what :func:`param_count` counts by formula, for any
    architecture, experts and hybrid layers included (shared tensors, tied embeddings, once).

    Args:
        config: a transformers config (of a language model: ``language_model_config``).

    Returns:
        The count, or None where transformers cannot build the model.

    Example:
        >>> from transformers import LlamaConfig
        >>> built_param_count(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
        ...                               num_hidden_layers=2, num_attention_heads=4))
        115008
    """
    key = config.to_json_string()
    if key not in _BUILT_COUNTS:
        model = _meta_model_or_none(lambda: config)
        _BUILT_COUNTS[key] = (None if model is None
                              else sum(p.numel() for p in model.parameters()))
    return _BUILT_COUNTS[key]


def _meta_model_or_none(make_config: Callable[[], Any]) -> Any:
    """``architectures.meta_model`` of ``make_config()``, quiet; None where transformers cannot
    make the config or build the model (an architecture that needs extras, or cannot be built
    at a size a caller asks for)."""
    from recipes_lib.architectures import meta_model

    try:
        return meta_model(make_config(), quiet=True)
    except Exception:  # noqa: BLE001 - whatever transformers raises, the caller falls back
        return None


def bytes_per_param(fmt: str) -> float:
    """Bytes per weight for a storage format.

    Args:
        fmt: "fp32", "bf16", "fp16", "int8", "nf4" or "nf4_dq" (NF4 with double quantization).

    Returns:
        Bytes per weight, scales and absmax values included.

    Raises:
        ValueError: for an unknown ``fmt``.

    Example:
        >>> round(bytes_per_param("nf4_dq"), 4)
        0.5159
    """
    if fmt not in BYTES_PER_PARAM:
        raise ValueError(f"fmt={fmt!r}: expected one of {tuple(BYTES_PER_PARAM)}")
    return BYTES_PER_PARAM[fmt]


def nf4_tensor_bytes(out_features: int, in_features: int, double_quant: bool = True,
                     blocksize: int = 64, dq_blocksize: int = 256) -> int:
    """Exact bytes bitsandbytes stores for one NF4 weight, its scales and lookup tables.

    Packed 4-bit weights, one absmax per block (fp32, or uint8 + fp32 scale per ``dq_blocksize``
    blocks + a 256-entry fp32 code table + an fp32 offset with double quantization) and the
    16-entry fp32 NF4 code table.

    Args:
        out_features: rows of the weight.
        in_features: columns of the weight.
        double_quant: quantize the absmax values too (QLoRA's double quantization).
        blocksize: weights per absmax.
        dq_blocksize: absmax values per second-level scale with ``double_quant``.

    Returns:
        Bytes stored for the weight.

    Raises:
        ValueError: for a size below 1.

    Example:
        >>> round(nf4_tensor_bytes(4096, 4096) / (4096 * 4096), 4)  # bytes per weight
        0.5159
    """
    n = out_features * in_features
    if n <= 0:
        raise ValueError(f"out_features={out_features}, in_features={in_features}: must be > 0")
    blocks = math.ceil(n / blocksize)
    total = math.ceil(n / 2) + 16 * 4
    if double_quant:
        total += blocks + math.ceil(blocks / dq_blocksize) * 4 + 256 * 4 + 4
    else:
        total += blocks * 4
    return total


def param_count(shape: ModelShape) -> dict[str, int]:
    """Parameter count by part.

    Args:
        shape: the model's sizes.

    Returns:
        ``{"embeddings", "attention", "mlp", "norms", "lm_head", "total", "linear"}``: counts
        by part, their total, and the parameters in the decoder layers' linear layers.

    Example:
        >>> s = ModelShape(32000, 4096, 11008, 32, 32, 32)  # Llama-2-7B
        >>> round(param_count(s)["total"] / 1e9, 2)
        6.74
    """
    h, L = shape.hidden_size, shape.num_hidden_layers
    weights = [o * i for o, i in layer_linear_shapes(shape)]  # q, k, v, o, then the MLP's
    attn, mlp = L * sum(weights[:4]), L * sum(weights[4:])
    norms = L * 2 * h + h
    emb = shape.vocab_size * h
    head = 0 if shape.tie_word_embeddings else emb
    return {"embeddings": emb, "attention": attn, "mlp": mlp, "norms": norms, "lm_head": head,
            "linear": attn + mlp, "total": emb + attn + mlp + norms + head}


def gradient_bytes(n_trainable: int, dtype: str = "fp32") -> float:
    """Gradient bytes: gradients are stored in the trainable weights' dtype.

    Args:
        n_trainable: trainable parameters.
        dtype: their storage format (see :func:`bytes_per_param`).

    Returns:
        Bytes of the gradients.

    Example:
        >>> gradient_bytes(1000, "bf16")
        2000.0
    """
    return n_trainable * bytes_per_param(dtype)


def optimizer_bytes(n_trainable: int, optimizer: str = "adamw", master_weights: bool = False
                    ) -> float:
    """Optimizer state bytes: AdamW 8 B/param (two fp32 moments), 8-bit AdamW 2 + 2 * 4 / 256
    (two uint8 moments, an fp32 absmax per 256-value block each), SGD 0; plus a 4-byte fp32
    master copy per param when training in 16-bit (``master_weights``).

    A rule of thumb for large tensors; ``adamw_8bit_state_bytes`` counts exactly.

    Args:
        n_trainable: trainable parameters.
        optimizer: "adamw", "adamw_8bit" or "sgd".
        master_weights: add an fp32 master copy of each trainable parameter.

    Returns:
        Bytes of the optimizer states.

    Raises:
        ValueError: for an unknown ``optimizer``.

    Example:
        >>> optimizer_bytes(1000), optimizer_bytes(1000, master_weights=True)
        (8000.0, 12000.0)
    """
    per = {"adamw": 8.0, "adamw_8bit": 2.0 + 2 * 4 / ADAMW_8BIT_BLOCK, "sgd": 0.0}
    if optimizer not in per:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {OPTIMIZERS}")
    return n_trainable * (per[optimizer] + (4.0 if master_weights else 0.0))


def adamw_8bit_state_bytes(numels: list[int], min_8bit_size: int = 4096,
                           block_size: int = ADAMW_8BIT_BLOCK) -> int:
    """Exact state bytes of bitsandbytes' blockwise 8-bit AdamW for tensors of these sizes.

    A tensor of at least ``min_8bit_size`` values keeps two uint8 moments and an fp32 absmax per
    ``block_size`` values for each; a smaller one keeps two fp32 moments, as AdamW. The two
    256-entry fp32 quantization maps are shared by every tensor: 2 KiB once.

    Args:
        numels: the number of values of each trainable tensor.
        min_8bit_size: smallest tensor whose states are kept in 8 bits (bitsandbytes' default).
        block_size: values per absmax.

    Returns:
        Bytes of the optimizer states.

    Raises:
        ValueError: for a negative size or a block size < 1.

    Example:
        >>> adamw_8bit_state_bytes([300 * 1000, 300])  # a Linear's weight (8-bit) and bias (fp32)
        613824
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    if any(n < 0 for n in numels):
        raise ValueError(f"numels={numels!r}: sizes must be >= 0")
    total, quantized = 0, False
    for n in numels:
        if n >= min_8bit_size:
            total += 2 * n + 2 * 4 * math.ceil(n / block_size)
            quantized = True
        else:
            total += 8 * n
    return total + (2 * 256 * 4 if quantized else 0)


def layer_linear_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one decoder layer's linear weights, unfused: the
    query, key, value and output projections, then the MLP's (gate and up, or up alone, then
    down).

    Args:
        shape: the model's sizes.

    Returns:
        One pair per weight.

    Example:
        >>> layer_linear_shapes(ModelShape(32000, 4096, 11008, 32, 32, 8))[1:3]  # GQA: k, v
        [(1024, 4096), (1024, 4096)]
    """
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    mlp_in = [(shape.intermediate_size, h)] * (shape.mlp_matrices - 1)
    return ([(shape.q_size, h), (kv, h), (kv, h), (h, shape.q_size)] + mlp_in
            + [(h, shape.intermediate_size)])


def lora_param_count(shape: ModelShape, rank: int = 16) -> int:
    """Parameters of rank-``rank`` LoRA adapters on every linear layer of every decoder layer
    (peft's ``target_modules="all-linear"``, the LM head left out): ``rank * (in + out)`` per
    weight of :func:`layer_linear_shapes`. A fused projection (Phi-3's ``qkv_proj``) is one
    adapter, ``rank * (in + out)`` for the fused width: ``2 * rank * h`` fewer than counted
    here.

    Args:
        shape: the model's sizes.
        rank: the adapters' rank.

    Returns:
        The adapters' parameters.

    Raises:
        ValueError: for a ``rank`` below 1.

    Example:
        >>> lora_param_count(ModelShape(128256, 4096, 14336, 32, 32, 8))  # Llama-3.1-8B, r=16
        41943040
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r}: must be an integer >= 1")
    per_layer = sum(out + inp for out, inp in layer_linear_shapes(shape))
    return shape.num_hidden_layers * rank * per_layer


def training_state_bytes(n_params: int, weights: str = "bf16", optimizer: str = "adamw",
                         n_trainable: int | None = None) -> dict[str, float]:
    """Weights + gradients + optimizer (+ master weights when weights are 16-bit).

    Full mixed-precision AdamW gives ZeRO's 16 bytes/param (2 + 2 + 4 + 8).

    Args:
        n_params: parameters of the model.
        weights: the weights' storage format (see :func:`bytes_per_param`).
        optimizer: "adamw", "adamw_8bit" or "sgd".
        n_trainable: trainable parameters (default: all of them).

    Returns:
        ``{"weights", "gradients", "optimizer", "total"}`` in bytes.

    Example:
        >>> training_state_bytes(1, "bf16")["total"]
        16.0
    """
    n_trainable = n_params if n_trainable is None else n_trainable
    grad_dtype = "fp32" if weights == "fp32" else ("bf16" if weights.startswith("nf4")
                                                   or weights == "int8" else weights)
    w = n_params * bytes_per_param(weights)
    g = gradient_bytes(n_trainable, grad_dtype)
    o = optimizer_bytes(n_trainable, optimizer, master_weights=weights in ("bf16", "fp16"))
    return {"weights": w, "gradients": g, "optimizer": o, "total": w + g + o}


def activation_bytes_per_layer(seq_len: int, batch_size: int, hidden_size: int, num_heads: int,
                               recompute: str = "none", bytes_per_value: int = 2,
                               flash_attention: bool = False, score_bytes: float = 5) -> float:
    """Korthikanti et al.'s activation bytes for one transformer layer.

    ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations and no recomputation; the ``5*a*s/h``
    term (attention scores, softmax, dropout mask) is gone with selective recomputation or a
    flash kernel; full recomputation keeps only the layer input, ``2*s*b*h``. ``bytes_per_value``
    scales the count to fp32 (4).

    Args:
        seq_len: tokens per sequence (``s``).
        batch_size: sequences per step (``b``).
        hidden_size: the layer's width (``h``).
        num_heads: attention heads (``a``).
        recompute: "none", "selective" or "full".
        bytes_per_value: 2 for 16-bit activations, 4 for fp32.
        flash_attention: a fused attention kernel that keeps no score matrix.
        score_bytes: bytes kept per score without one (Korthikanti's 5: 16-bit scores and
            softmax, a 1-byte dropout mask; transformers' eager attention: ``ModelShape``'s
            ``score_bytes``), in 16-bit; scaled by ``bytes_per_value`` like the rest.

    Returns:
        Bytes one layer keeps for backward.

    Raises:
        ValueError: for an unknown ``recompute``.

    Example:
        >>> activation_bytes_per_layer(2048, 1, 4096, 32) / 2**20  # GPT-style layer, bf16 (MiB)
        912.0
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: expected one of {RECOMPUTE}")
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden_size", hidden_size),
                    ("num_heads", num_heads)):
        if v <= 0:
            raise ValueError(f"{name}={v}: must be > 0")
    sbh = seq_len * batch_size * hidden_size
    scale = bytes_per_value / 2
    if recompute == "full":
        return 2 * sbh * scale
    scores = 0 if (recompute == "selective" or flash_attention) else \
        score_bytes * num_heads * seq_len * seq_len * batch_size
    return (sbh * 34 + scores) * scale


def activation_bytes(shape: ModelShape, seq_len: int, batch_size: int, recompute: str = "none",
                     bytes_per_value: int = 2, flash_attention: bool = False,
                     loss_chunk: int | None = None) -> dict[str, float]:
    """Peak activation bytes of a training step for the whole model.

    Layers: ``L`` times the per-layer count; with full recomputation, plus one layer's full
    activations, alive while that layer is recomputed in backward. Logits: the output head's
    logits, their fp32 copy for the loss and the log-probabilities (3 tensors of ``s*b*V``);
    with a chunked loss (``loss_chunk`` tokens at a time) only one chunk's.

    Args:
        shape: the model's sizes.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        recompute: "none", "selective" or "full".
        bytes_per_value: 2 for 16-bit activations, 4 for fp32.
        flash_attention: a fused attention kernel that keeps no score matrix, where the
            architecture has one: a shape with ``score_bytes`` (transformers runs it with eager
            attention) keeps that many bytes per score whatever this says.
        loss_chunk: tokens per chunk of a chunked loss (None: the full loss).

    Returns:
        ``{"layers", "logits", "total"}`` in bytes.

    Raises:
        ValueError: for an unknown ``recompute``.

    Example:
        >>> s = ModelShape(32000, 4096, 11008, 32, 32, 32)
        >>> round(activation_bytes(s, 2048, 1, "full", flash_attention=True)["total"] / 2**30, 2)
        1.5
    """
    L = shape.num_hidden_layers
    args = (seq_len, batch_size, shape.hidden_size, shape.num_attention_heads)
    # an architecture transformers runs with eager attention keeps its scores whatever is asked
    kind = (flash_attention and not shape.score_bytes, shape.score_bytes or 5)
    layers = L * activation_bytes_per_layer(*args, recompute, bytes_per_value, *kind)
    if recompute == "full":
        layers += activation_bytes_per_layer(*args, "none", bytes_per_value, *kind)
    tokens = seq_len * batch_size if loss_chunk is None else min(loss_chunk, seq_len * batch_size)
    logits = 3 * tokens * shape.vocab_size * max(bytes_per_value, 4)
    return {"layers": layers, "logits": logits, "total": layers + logits}


LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's (and Phi-4's) linears: q, k and v in one projection, gate and up in another
PHI3_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LAYER_METHODS = ("full", "lora", "qlora")
LAYER_PRECISIONS = ("fp32", "bf16", "fp16", "bf16-mixed")


def llama_layer_bytes(shape: ModelShape, seq_len: int, batch_size: int, method: str = "full",
                      precision: str = "bf16", *, lora_rank: int = 16,
                      lora_targets: tuple[str, ...] | None = None, fp32_adapters: bool = True,
                      lora_dropout: float = 0.0, gpu_dropout: bool = False,
                      nf4_keeps_input: bool = False, checkpointing: bool = False,
                      qk_norm: bool = False, fused_projections: bool = False,
                      kv_cache: bool = True, gemma2: bool = False, gemma3: bool = False,
                      masked: bool = False) -> dict[str, float]:
    """What autograd keeps for one transformers Llama decoder layer in a training step, op by op.

    Counted as the layer runs (SDPA's flash kernel, every layer after the first), for a full
    fine-tune, LoRA on a frozen base (peft: ``lora_targets``, rank ``lora_rank``) or QLoRA (an
    NF4 base whose 4-bit matmul keeps nothing and returns its input's dtype). ``precision`` is
    the weights' dtype ("fp32", "bf16", "fp16") or "bf16-mixed": fp32 weights (for QLoRA, the
    fp32 norms and embeddings of peft's k-bit preparation) under bf16 autocast. Per token, with
    ``p`` the residual stream's bytes and ``c`` the matmuls':

    - each RMSNorm keeps its input upcast to fp32 (``4h``), one fp32 rsqrt (``4``) and, when its
      weight trains, the normalised input (``p h``);
    - a trained linear keeps its input: the very tensor where no cast intervenes (q, k and v
      share the norm's output, o_proj shares SDPA's output), a copy per module where autocast
      casts it;
    - SDPA keeps q, k, v and its output (``c (2h + 2 kv)``) and an fp32 log-sum-exp per head;
    - SwiGLU keeps gate, silu(gate) and up (``3 I``, in the dtype the gate comes out in);
    - a peft adapter keeps its own input cast to the adapter's dtype (``4 in`` with peft's fp32
      adapters over a 16-bit base: a copy per module, q, k and v included), the rank-``r``
      output of ``lora_A``, and with dropout its output and what the dropout keeps, per module:
      CPU's noise in the adapter's dtype, or with ``gpu_dropout`` the 1-byte mask of CUDA's
      fused kernel;
    - with ``nf4_keeps_input`` (QLoRA on bitsandbytes before 0.43.2), each 4-bit matmul keeps its
      input in the compute dtype: the shared tensor where it already is one, a cast per module
      where the layer casts it;
    - with ``qk_norm`` (Qwen3's RMSNorm over each query and key head), those norms keep their
      input upcast to fp32 (``4 (q + kv)``), an fp32 rsqrt per head (``4 (heads + kv_heads)``)
      and, when their weights train, the normalised heads (``c (q + kv)``);
    - with ``fused_projections`` (Phi-3 and Phi-4: ``qkv_proj`` and ``gate_up_proj``,
      :data:`PHI3_LINEARS`), one module reads each norm's output where three and two did, so
      one cast of it, one adapter and one ``lora_A`` output each; and the query, a slice of the
      fused output, comes out of RoPE head-major, SDPA's output with it, so the
      ``transpose(1, 2).contiguous()`` before ``o_proj`` copies it: ``o_proj``'s input is its
      own ``c q`` (on this CPU; kept when something keeps it). The value is a view of the fused
      output, so without ``kv_cache`` SDPA's saved value keeps all of it, ``c (q + kv)`` more,
      unless autocast casts it first (QLoRA's 4-bit matmul returns fp32 under bf16-mixed); with
      one (``config.use_cache``, transformers' default, off under checkpointing) the cache's
      ``torch.cat`` copies the keys and values and the fused output goes.

    With ``gemma2`` (transformers' Gemma-2 layer, which runs eager attention): four norms, each
    multiplying its weight in fp32 (the normalised input kept in fp32, ``4h``, when it trains,
    and ``1 + weight`` in fp32 per norm: ``16h`` bytes a layer); eager attention keeps the
    query and the (repeated) keys and values, ``3 c q``, no log-sum-exp, and 8 bytes per score
    (``heads x s`` a token: soft-capping's tanh output, softmax's fp32 output and its cast back;
    in fp32 the cast is the same tensor), and ``o_proj`` reads its own contiguous copy of the
    output. Its GeGLU keeps what SwiGLU does.

    With ``gemma3`` (transformers' Gemma-3 layer, SDPA): Gemma-2's four norms (above) and, over
    each query and key head, two more of the same kind: their input in fp32 (``4 (q + kv)``),
    an fp32 rsqrt per head, and when their weights train the normalised heads in fp32
    (``4 (q + kv)``), each ``1 + weight`` in fp32; its attention is SDPA's, as a Llama's.

    With ``masked`` (a sliding-window layer from its window's length on, where transformers hands
    SDPA an explicit mask instead of ``is_causal``): SDPA keeps its own copy of the mask in the
    matmuls' dtype (``c s`` a token, the ``s^2`` term), and, with grouped queries, the keys and
    values ``repeat_kv`` widened to every head instead of the grouped ones (``c (q - kv)`` more
    each, where ``repeat_kv`` copies, more than one key head, or autocast casts its view).

    ``kv_cache``: transformers builds a ``DynamicCache`` in a training forward too where
    ``config.use_cache`` is on (a plain loop; Trainer and TRL turn it off). Where SDPA keeps the
    very keys and values it holds, it costs nothing; under bf16 autocast RoPE leaves the keys in
    fp32 (``cos`` has the residual stream's dtype), and QLoRA's 4-bit matmul the values too, so
    the cache holds fp32 copies beside SDPA's bf16 casts, ``4 kv`` or ``8 kv`` a token, until
    the forward's output is dropped: after the layers, before the loss (a Llama-2-7B QLoRA step
    at 2 x 1024 tokens: 2 GiB, more than its loss's logits at that peak;
    ``config.use_cache = False`` frees them).

    Under autocast each matmul also keeps the bf16 copy of an fp32 weight (2 bytes per weight,
    frozen or not, NF4 excepted): a term of the layer, not of its tokens. A full fine-tune in
    16-bit keeps ``20h + 4 kv + 8I + 4 heads + 8`` bytes a token, peft's LoRA on all seven
    linears ``36h + 4 kv + 10I + 4 heads + 28r + 8``: more than the full fine-tune it replaces.
    With ``checkpointing`` a layer keeps only its input (``p h``). On this CPU the fake-tensor
    meter finds these bytes exactly for every stack above (``tests/test_fake_memory.py``).

    Args:
        shape: the model's sizes.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        method: "full", "lora" or "qlora".
        precision: "fp32", "bf16", "fp16" or "bf16-mixed".
        lora_rank: the adapters' rank.
        lora_targets: the linears adapted (None: all of the layer's).
        fp32_adapters: peft's default fp32 adapters (False: the base's dtype).
        lora_dropout: the adapters' dropout probability.
        gpu_dropout: count CUDA's 1-byte dropout mask (above).
        nf4_keeps_input: bitsandbytes before 0.43.2 (above).
        checkpointing: the layer is checkpointed.
        qk_norm: the layer normalises each query and key head (Qwen3).
        fused_projections: Phi-3's fused projections (above); ``lora_targets`` then names
            :data:`PHI3_LINEARS`.
        kv_cache: the forward builds a KV cache (``use_cache``, above).
        gemma2: Gemma-2's layer (above).
        gemma3: Gemma-3's layer (above).
        masked: SDPA gets an explicit mask (a sliding-window layer, above).

    Returns:
        ``{"per_token", "weight_copies", "total", "kv_cache"}``: bytes a token, bytes
        independent of the tokens, ``per_token * seq_len * batch_size + weight_copies``, and
        what the layer's KV cache holds beyond that until the forward's output is dropped
        (``kv_cache``; 0 with checkpointing, which turns the cache off).

    Raises:
        ValueError: for an unknown ``method``, ``precision`` or target, or a LoRA setting out of
            range.

    Example:
        >>> s = PRESETS["Llama-3.2-1B"]
        >>> full, lora = (llama_layer_bytes(s, 2048, 1, m)["per_token"] / 2048 for m in
        ...               ("full", "lora"))
        >>> round(full, 1), round(lora, 1)  # bytes per token per hidden unit
        (53.1, 77.3)
    """
    if method not in LAYER_METHODS:
        raise ValueError(f"method={method!r}: expected one of {LAYER_METHODS}")
    if precision not in LAYER_PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {LAYER_PRECISIONS}")
    linears = PHI3_LINEARS if fused_projections else LLAMA_LINEARS
    lora_targets = linears if lora_targets is None else lora_targets
    if set(lora_targets) - set(linears) or not lora_targets:
        raise ValueError(f"lora_targets={lora_targets!r}: expected some of {linears}")
    if not isinstance(lora_rank, int) or lora_rank < 1:
        raise ValueError(f"lora_rank={lora_rank!r}: must be an integer >= 1")
    if not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout={lora_dropout!r}: must be in [0, 1)")
    if gemma2 and (gemma3 or masked):
        raise ValueError("gemma2=True with gemma3 or masked: Gemma-2's eager attention counts "
                         "its own masks")
    if nf4_keeps_input and method != "qlora":
        raise ValueError(f"nf4_keeps_input=True with method={method!r}: only QLoRA has 4-bit "
                         "layers")
    h, inter, heads = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads
    kv = shape.num_key_value_heads * shape.head_dim
    autocast = precision == "bf16-mixed"
    p = 4 if precision in ("fp32", "bf16-mixed") else 2  # the residual stream (and the norms)
    c = 4 if precision == "fp32" else 2  # what the matmuls compute in
    trains_base = method == "full"
    adapted = set() if trains_base else set(lora_targets)
    a = 4 if (fp32_adapters or p == 4) else 2  # peft's adapters: fp32 unless told otherwise
    gate_bytes = p if method == "qlora" else c  # a 4-bit matmul returns its input's dtype
    q = shape.q_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    # the tensor each linear reads, its dtype, and whether something else keeps it already
    inputs = {"q_proj": ("attn_norm", p, False), "k_proj": ("attn_norm", p, False),
              "v_proj": ("attn_norm", p, False), "o_proj": ("sdpa_out", c, True),
              "gate_proj": ("mlp_norm", p, False), "up_proj": ("mlp_norm", p, False),
              "down_proj": ("swiglu", gate_bytes, False)}
    if gemma2:  # eager attention: o_proj reads a contiguous copy of its output
        inputs["o_proj"] = ("eager_out", c, False)
    if fused_projections:
        shapes = {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * inter),
                  "down_proj": (inter, h)}
        inputs = {"qkv_proj": inputs["q_proj"], "o_proj": ("sdpa_out_copy", c, False),
                  "gate_up_proj": inputs["gate_proj"], "down_proj": inputs["down_proj"]}
    if checkpointing:  # the layer's input; bitsandbytes' old 4-bit matmul kept its own too
        kept_inputs = {(x if x_bytes == c else name, c * shapes[name][0])
                       for name, (x, x_bytes, _) in inputs.items()} if nf4_keeps_input else set()
        per_token = p * h + sum(nbytes for _, nbytes in kept_inputs)
        return {"per_token": float(per_token), "weight_copies": 0.0,
                "total": float(per_token * seq_len * batch_size), "kv_cache": 0.0}
    per_token = 2 * (4 * h + 4 + (p * h if trains_base else 0))  # two RMSNorms
    per_token += c * (2 * q + 2 * kv) + 4 * heads + 3 * gate_bytes * inter  # SDPA, SwiGLU
    weight_copies, shared = 0, set()
    if gemma2:  # two more norms, each weight multiplied in fp32; eager, soft-capped scores
        per_token += 2 * (4 * h + 4) + (16 - 2 * p) * h * trains_base
        per_token += c * (q - 2 * kv) - 4 * heads + 8 * heads * seq_len
        weight_copies += 4 * 4 * h  # each norm's 1 + weight, in fp32
    for name, (d_in, d_out) in shapes.items():
        x, x_bytes, kept = inputs[name]
        if trains_base:
            if autocast and x_bytes != 2:
                per_token += 2 * d_in  # autocast's bf16 copy of the input, one per module
            elif not kept:
                shared.add((x, x_bytes * d_in))
        if nf4_keeps_input:  # bitsandbytes' 4-bit matmul before 0.43.2 kept its input
            if x_bytes != c:
                per_token += c * d_in  # the layer's cast to the compute dtype, one per module
            elif not kept:
                shared.add((x, x_bytes * d_in))
        if autocast and method != "qlora":
            weight_copies += 2 * d_in * d_out  # bf16 copy of the fp32 weight
        if name in adapted:
            saved = 2 if autocast else a
            if lora_dropout:  # CPU's noise in the adapter's dtype, or a GPU's 1-byte mask
                per_token += (1 if gpu_dropout else a) * d_in + saved * d_in
            elif a != x_bytes or saved != x_bytes:
                per_token += saved * d_in  # a cast of the input, one per module
            elif not kept:
                shared.add((x, x_bytes * d_in))
            per_token += saved * lora_rank  # lora_A's output, kept for lora_B
            if autocast:
                weight_copies += 2 * lora_rank * (d_in + d_out)
    per_token += sum(nbytes for _, nbytes in shared)
    if fused_projections and not kv_cache and gate_bytes == c:  # the value's view keeps q, k
        per_token += c * (q + kv)
    if qk_norm or gemma3:  # Gemma's norms keep the normalised heads in fp32
        per_token += (4 * (q + kv) + 4 * (heads + shape.num_key_value_heads)
                      + ((4 if gemma3 else c) * (q + kv) if trains_base else 0))
    if gemma3:  # Gemma-2's two more norms, each norm's 1 + weight in fp32
        per_token += 2 * (4 * h + 4) + (16 - 2 * p) * h * trains_base
        weight_copies += 4 * 4 * h + 2 * 4 * shape.head_dim
    # repeat_kv copies the grouped keys and values for every head (one key head: a view)
    copied = heads != shape.num_key_value_heads and (
        gemma2 or (masked and shape.num_key_value_heads > 1))
    if masked:  # SDPA's copy of the mask; the keys (RoPE'd, p) and values (gate) repeated
        per_token += c * seq_len
        if heads != shape.num_key_value_heads:
            per_token += sum(c * (q - kv) for nbytes in (p, gate_bytes)
                             if copied or nbytes != c)
    tokens = seq_len * batch_size
    # the cache's copies of the keys (RoPE'd in the residual stream's dtype) and values (the
    # projection's), where attention computes in another dtype and keeps casts of its own, or,
    # where attention keeps the heads repeat_kv copied (Gemma-2's eager attention, a masked
    # SDPA with grouped queries)
    cache = kv * sum(nbytes for nbytes in (p, gate_bytes) if nbytes != c or copied)
    return {"per_token": float(per_token), "weight_copies": float(weight_copies),
            "total": float(per_token * tokens + weight_copies),
            "kv_cache": float(cache * tokens) if kv_cache else 0.0}


def llama_activation_bytes(shape: ModelShape, seq_len: int, batch_size: int,
                           bytes_per_value: int = 4) -> dict[str, float]:
    """What autograd saves in a Llama full fine-tune (transformers, SDPA, no recomputation), in
    fp32 (``bytes_per_value=4``) or 16-bit weights (2).

    Every layer as ``llama_layer_bytes`` counts it, ``(8 + 4p) h + 2p (q + kv) + 4p I
    + 4 heads + 8`` bytes a token (``p = bytes_per_value``; the queries' width ``q = h`` in a
    Llama), plus the final norm (``3h``) and the loss's log-probabilities (``V``, fp32).
    Korthikanti's ``34 s b h`` (GPT, 16-bit) undercounts a Llama layer, whose SwiGLU and
    RMSNorms keep more.

    Args:
        shape: the model's sizes.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        bytes_per_value: 4 for fp32 weights, 2 for 16-bit ones.

    Returns:
        ``{"layers", "logits", "total"}`` in bytes.

    Raises:
        ValueError: for ``bytes_per_value`` other than 2 or 4.

    Example:
        >>> s = ModelShape(32000, 4096, 11008, 32, 32, 32)
        >>> round(llama_activation_bytes(s, 4096, 1, 2)["total"] / 2**30, 1)  # Llama-2-7B, bf16
        23.3
    """
    if bytes_per_value not in (2, 4):
        raise ValueError(f"bytes_per_value={bytes_per_value!r}: expected 2 (16-bit) or 4 (fp32)")
    precision = "fp32" if bytes_per_value == 4 else "bf16"
    tokens = seq_len * batch_size
    layers = shape.num_hidden_layers * llama_layer_bytes(shape, seq_len, batch_size, "full",
                                                         precision)["total"]
    final = 3 * shape.hidden_size * tokens * bytes_per_value + tokens * shape.vocab_size * 4
    return {"layers": float(layers), "logits": float(final), "total": float(layers + final)}


def max_seq_len(shape: ModelShape, budget_bytes: float, fixed_bytes: float = 0.0,
                batch_size: int = 1, recompute: str = "none", bytes_per_value: int = 4,
                flash_attention: bool = False, loss_chunk: int | None = None,
                limit: int = 1 << 20) -> int:
    """Longest sequence whose predicted activations plus ``fixed_bytes`` (weights, gradients,
    optimizer) fit ``budget_bytes``; 0 if none does.

    Args:
        shape: the model's sizes.
        budget_bytes: the memory available.
        fixed_bytes: bytes that do not grow with the sequence (weights, gradients, optimizer).
        batch_size: sequences per step.
        recompute: "none", "selective" or "full".
        bytes_per_value: 2 for 16-bit activations, 4 for fp32.
        flash_attention: a fused attention kernel that keeps no score matrix.
        loss_chunk: tokens per chunk of a chunked loss (None: the full loss).
        limit: the longest sequence tried.

    Returns:
        The longest sequence length that fits, in tokens.

    Raises:
        ValueError: for a ``budget_bytes`` <= 0.

    Example:
        >>> s = ModelShape(32000, 4096, 11008, 32, 32, 32)
        >>> max_seq_len(s, 80e9, flash_attention=True, recompute="full", bytes_per_value=2) > 8192
        True
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes}: must be > 0")

    def fits(n: int) -> bool:
        act = activation_bytes(shape, n, batch_size, recompute, bytes_per_value,
                               flash_attention, loss_chunk)["total"]
        return fixed_bytes + act <= budget_bytes
    lo, hi = 0, limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def kv_cache_bytes(shape: ModelShape, seq_len: int, batch_size: int, bytes_per_value: int = 2
                   ) -> float:
    """Keys and values of every layer: ``2 * L * kv_heads * head_dim * s * b * bytes``.

    A sliding-window layer keeps only the last ``sliding_window - 1`` tokens (transformers'
    cache: the next token attends to them and itself), so beyond the window only the other
    layers grow.

    Args:
        shape: the model's sizes.
        seq_len: tokens cached per sequence.
        batch_size: sequences.
        bytes_per_value: 2 for a 16-bit cache, 4 for fp32.

    Returns:
        Bytes of the cache.

    Example:
        >>> kv_cache_bytes(ModelShape(32000, 4096, 11008, 32, 32, 32), 4096, 1) / 2**30
        2.0
    """
    kept = shape.num_hidden_layers * seq_len
    if shape.sliding_layers:
        kept -= shape.sliding_layers * max(0, seq_len - (shape.sliding_window - 1))
    return 2 * shape.num_key_value_heads * shape.head_dim * kept * batch_size * bytes_per_value


def ring_attention_bytes(shape: ModelShape, seq_len: int, batch_size: int, world_size: int,
                         bytes_per_value: int = 4) -> dict[str, int]:
    """Bytes one rank sends around the ring per training step (context parallelism).

    Each rank holds ``s / N`` tokens; its keys and values (``kv_heads`` wide, not expanded) form
    a block of ``2 b (s/N) h_kv d`` values. Forward: the block makes ``N - 1`` hops. Backward:
    keys, values and their two gradient accumulators make ``N - 1`` hops, then the gradients one
    more, home. Per layer, ``(2 (N-1) + 4 (N-1) + 2) b (s/N) h_kv d`` values.

    Args:
        shape: the model's sizes.
        seq_len: tokens per sequence, over all ranks.
        batch_size: sequences per step.
        world_size: ranks in the ring (``N``).
        bytes_per_value: 2 for 16-bit keys and values, 4 for fp32.

    Returns:
        ``{"forward", "backward", "total"}``: bytes one rank sends.

    Raises:
        ValueError: for fewer than 2 ranks or a length the ``2N`` chunks do not divide.

    Example:
        >>> s = ModelShape(512, 64, 192, 2, 2, 1)
        >>> ring_attention_bytes(s, 1024, 1, 2)["total"]
        1048576
    """
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size={world_size!r}: context parallelism needs >= 2 ranks")
    if seq_len % (2 * world_size):
        raise ValueError(f"seq_len={seq_len}: must be a multiple of 2 x world_size")
    one = batch_size * (seq_len // world_size) * shape.num_key_value_heads * shape.head_dim \
        * bytes_per_value * shape.num_hidden_layers
    fwd = 2 * (world_size - 1) * one
    bwd = (4 * (world_size - 1) + 2) * one
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd}


def int8_linear_bytes(out_features: int, in_features: int) -> int:
    """Bytes of a Linear layer in int8 with a per-output-channel fp32 scale and int32 zero point.

    Args:
        out_features: rows of the weight.
        in_features: columns of the weight.

    Returns:
        Bytes of the weight, its scales and zero points.

    Raises:
        ValueError: for a size below 1.

    Example:
        >>> int8_linear_bytes(256, 256) / (4 * 256 * 256)  # vs fp32: 1/4 + 2/in_features
        0.2578125
    """
    if out_features < 1 or in_features < 1:
        raise ValueError(f"out_features={out_features}, in_features={in_features}: must be >= 1")
    return out_features * in_features + 8 * out_features


def amdahl_speedup(fraction: float, part_speedup: float) -> float:
    """Whole-program speed-up when a ``fraction`` of the time gets ``part_speedup`` x faster.

    Args:
        fraction: share of the time spent in the part that speeds up, in [0, 1].
        part_speedup: how many times faster that part gets (> 0).

    Returns:
        ``1 / ((1 - fraction) + fraction / part_speedup)``.

    Raises:
        ValueError: for a ``fraction`` outside [0, 1] or a ``part_speedup`` <= 0.

    Example:
        >>> round(amdahl_speedup(0.6, 1.5), 3)  # 60 % of the time in Linear layers, 1.5x int8
        1.25
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction}: must be in [0, 1]")
    if part_speedup <= 0:
        raise ValueError(f"part_speedup={part_speedup}: must be > 0")
    return 1.0 / ((1.0 - fraction) + fraction / part_speedup)


def kv_cache_bytes_per_token(shape: ModelShape, bytes_per_value: int = 2) -> float:
    """KV cache bytes one token adds: ``2 (k and v) * L * kv_heads * head_dim * bytes``, while
    the cache is shorter than any sliding window (beyond it, :func:`kv_cache_bytes`).

    Args:
        shape: the model's sizes.
        bytes_per_value: 2 for a 16-bit cache, 4 for fp32.

    Returns:
        Bytes per token of one sequence.

    Example:
        >>> kv_cache_bytes_per_token(ModelShape(128256, 4096, 14336, 32, 32, 8)) / 2**10  # 8B
        128.0
    """
    return kv_cache_bytes(shape, 1, 1, bytes_per_value)


def flops_per_token(n_params: int, training: bool = True, recompute: bool = False) -> float:
    """Matmul FLOPs per token: 2N forward, 6N training (forward + 2x backward), 8N with full
    recomputation (one more forward).

    Args:
        n_params: parameters in the matmuls (``N``).
        training: forward and backward (else forward only).
        recompute: training with full activation recomputation.

    Returns:
        FLOPs per token.

    Example:
        >>> flops_per_token(10**9), flops_per_token(10**9, recompute=True)
        (6000000000.0, 8000000000.0)
    """
    if not training:
        return 2.0 * n_params
    return (8.0 if recompute else 6.0) * n_params


def logits_bytes(seq_len: int, batch_size: int, vocab_size: int, bytes_per_value: int = 2
                 ) -> float:
    """One logits tensor: ``s * b * V * bytes``.

    Args:
        seq_len: tokens per sequence.
        batch_size: sequences.
        vocab_size: the vocabulary.
        bytes_per_value: 2 for 16-bit logits, 4 for fp32.

    Returns:
        Bytes of the tensor.

    Example:
        >>> round(logits_bytes(4096, 8, 256_000, 2) / 1e9, 1)  # bs 8, 4k tokens, 256k vocab, bf16
        16.8
    """
    return float(seq_len) * batch_size * vocab_size * bytes_per_value


def escalation_steps(grad_accum_steps: int = 4) -> list[str]:
    """The escalation table's steps, in order (:func:`escalation_table`'s ``step`` names).

    Args:
        grad_accum_steps: micro-batches per step in the gradient-accumulation row.

    Returns:
        The names.
    """
    return ["full fine-tune (bf16 + AdamW)", "full fine-tune, 8-bit AdamW states",
            "LoRA on a bf16 base", "QLoRA (NF4 base)", "+ activation checkpointing",
            f"+ gradient accumulation (k={grad_accum_steps})",
            "+ CPU offload of optimizer states"]


def escalation_table(shape: ModelShape, seq_len: int, batch_size: int, budget_bytes: float,
                     grad_accum_steps: int = 4, lora_fraction: float | None = None,
                     bytes_per_value: int = 2) -> list[dict[str, Any]]:
    """Predicted training memory as practitioners escalate when a run does not fit.

    Rows, cumulative: full fine-tune in mixed precision -> LoRA (bf16 base) -> QLoRA (the
    decoder layers' linear weights in NF4 with double quantization; embeddings, head and norms
    in bf16, as bitsandbytes through transformers leaves them) -> + activation checkpointing
    -> + gradient accumulation (micro-batch = batch / k) -> + CPU offload of optimizer states.
    A full fine-tune with 8-bit AdamW states sits after the first row: the step before giving
    up on full fine-tuning. Each row says whether it fits ``budget_bytes``.

    Args:
        shape: the model's sizes.
        seq_len: tokens per sequence.
        batch_size: sequences per optimizer step.
        budget_bytes: the memory available.
        grad_accum_steps: micro-batches per step in the gradient-accumulation row.
        lora_fraction: trainable share of the parameters with LoRA (None: rank-16 adapters
            on every linear layer of the decoder, :func:`lora_param_count`).
        bytes_per_value: 2 for 16-bit activations, 4 for fp32.

    Returns:
        One dict per row: ``step``, ``state_GiB`` (weights, gradients, optimizer),
        ``activations_GiB``, ``total_GiB`` and ``fits``.

    Raises:
        ValueError: for a ``budget_bytes`` <= 0 or a ``grad_accum_steps`` that does not divide
            ``batch_size``.

    Example:
        >>> rows = escalation_table(ModelShape(32000, 4096, 11008, 32, 32, 32), 2048, 4, 24 * 2**30)
        >>> next(r["step"] for r in rows if r["fits"])  # Llama-2-7B, 4 x 2048 tokens, 24 GiB
        '+ activation checkpointing'
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes}: must be > 0")
    if batch_size % grad_accum_steps:
        raise ValueError(f"grad_accum_steps={grad_accum_steps}: does not divide batch_size")
    counts = param_count(shape)
    n = counts["total"]
    n_lora = lora_param_count(shape) if lora_fraction is None else int(n * lora_fraction)
    # QLoRA quantizes the decoder layers' linear weights (each with its scales and code
    # tables); the embeddings, the LM head (which transformers leaves out of bitsandbytes'
    # conversion) and the norms stay 16-bit
    nf4_base = (shape.num_hidden_layers * sum(nf4_tensor_bytes(o, i)
                                              for o, i in layer_linear_shapes(shape))
                + (n - counts["linear"]) * bytes_per_param("bf16"))

    def act(recompute: str, b: int) -> float:
        return activation_bytes(shape, seq_len, b, recompute, bytes_per_value, True)["total"]

    micro = batch_size // grad_accum_steps
    lora_state = gradient_bytes(n_lora, "fp32") + optimizer_bytes(n_lora, "adamw")
    steps = [  # (state bytes, activation bytes) of each step in escalation_steps' order
        (training_state_bytes(n, "bf16")["total"], act("none", batch_size)),
        (training_state_bytes(n, "bf16", "adamw_8bit")["total"], act("none", batch_size)),
        (n * 2 + n_lora * 4 + lora_state, act("none", batch_size)),
        (nf4_base + n_lora * 4 + lora_state, act("none", batch_size)),
        (None, act("full", batch_size)),
        (None, act("full", micro)),
        (-optimizer_bytes(n_lora, "adamw"), None),
    ]
    rows, state, activ = [], 0.0, 0.0
    for name, (s, a) in zip(escalation_steps(grad_accum_steps), steps, strict=True):
        state = state + s if (s is not None and s < 0) else (s if s is not None else state)
        activ = a if a is not None else activ
        total = state + activ
        rows.append({"step": name, "state_GiB": state / 2**30, "activations_GiB": activ / 2**30,
                     "total_GiB": total / 2**30, "fits": total <= budget_bytes})
    return rows


# Shapes of real models (from their config.json), for tables at sizes people train.
# Their positions (max_position_embeddings) where every release a preset's name stands for
# (VARIANT_WORDS, PRESET_ALIASES) has the same; Qwen2.5-7B's are not recorded.
_LLAMA3 = {"max_position_embeddings": 131072}
_LLAMA2 = {"max_position_embeddings": 4096}
_32K = {"max_position_embeddings": 32768}
PRESETS = {
    "Llama-3.2-1B": ModelShape(128256, 2048, 8192, 16, 32, 8, tie_word_embeddings=True,
                               **_LLAMA3),
    "Llama-3.2-3B": ModelShape(128256, 3072, 8192, 28, 24, 8, tie_word_embeddings=True,
                               **_LLAMA3),
    "Llama-3.1-8B": ModelShape(128256, 4096, 14336, 32, 32, 8, **_LLAMA3),
    "Llama-3.1-70B": ModelShape(128256, 8192, 28672, 80, 64, 8, **_LLAMA3),
    "Llama-2-7B": ModelShape(32000, 4096, 11008, 32, 32, 32, **_LLAMA2),
    "Llama-2-13B": ModelShape(32000, 5120, 13824, 40, 40, 40, **_LLAMA2),
    "Llama-2-70B": ModelShape(32000, 8192, 28672, 80, 64, 8, **_LLAMA2),
    "Mistral-7B": ModelShape(32000, 4096, 14336, 32, 32, 8, **_32K),
    "Qwen2.5-0.5B": ModelShape(151936, 896, 4864, 24, 14, 2, tie_word_embeddings=True, **_32K),
    "Qwen2.5-7B": ModelShape(152064, 3584, 18944, 28, 28, 4),
}
# config.json fields of real models the Llama-shaped presets above cannot stand for (heads wider
# than hidden / heads, tied embeddings, sliding windows, Gemma-2's soft-capping and eager
# attention, Phi-3's fused projections), read as transformers reads a config.json: the planner,
# the fake-tensor meter and notebook 01's form take these names offline. Each entry is its hub
# repository's config.json as published (the fields that shape the model), tokenizer ids left out.
# What both Gemma-2 sizes' config.json files hold alike; tie_word_embeddings is left out there,
# and transformers' default ties them.
_GEMMA2 = {"model_type": "gemma2", "vocab_size": 256000, "head_dim": 256,
           "max_position_embeddings": 8192, "query_pre_attn_scalar": 256,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
           "sliding_window": 4096, "rope_theta": 10000.0}
# What the dense Qwen3 sizes' config.json files hold alike (Qwen/Qwen3-0.6B ... Qwen3-32B)
_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128,
          "max_position_embeddings": 40960, "rope_theta": 1000000, "use_sliding_window": False}
CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": {  # Qwen/Qwen3-0.6B
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1000000, "tie_word_embeddings": True, "use_sliding_window": False},
    "Qwen3-8B": {  # Qwen/Qwen3-8B
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1000000, "tie_word_embeddings": False, "use_sliding_window": False},
    # Qwen/Qwen3-4B, -14B, -32B, read from public copies of their config.json (no hub access here)
    "Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": True},
    "Qwen3-14B": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
    "Qwen3-32B": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600,
                  "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
    "Qwen2.5-72B": {  # Qwen/Qwen2.5-72B, read from public copies of its config.json (the
        # Instruct repository's says 32768 positions, YaRN to 131072; the base's 131072). A
        # config.json, not a Llama-shaped preset as Qwen2.5-7B is: its q, k and v biases counted
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 8192,
        "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
        "use_sliding_window": False, "tie_word_embeddings": False},
    "Gemma-2-2B": {  # google/gemma-2-2b
        **_GEMMA2, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4},
    "Gemma-2-9B": {  # google/gemma-2-9b
        **_GEMMA2, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8},
    "Gemma-2-27B": {  # google/gemma-2-27b, read from public copies of its config.json: heads of
        # 128 (not 256), their scores scaled by 1/sqrt(144) = hidden / heads
        **_GEMMA2, "hidden_size": 4608, "intermediate_size": 36864, "num_hidden_layers": 46,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
        "query_pre_attn_scalar": 144},
    "Gemma-3-1B": {  # google/gemma-3-1b-pt (text only; Gemma-3 4B and up are multimodal)
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "rope_theta": 1000000, "rope_local_base_freq": 10000},
    "Mistral-7B-v0.3": {  # mistralai/Mistral-7B-v0.3 (the Mistral-7B preset is v0.1's sizes)
        "model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False},
    "Phi-3-mini-4k-instruct": {  # microsoft/Phi-3-mini-4k-instruct
        "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096, "sliding_window": 2047,
        "rope_theta": 10000.0, "tie_word_embeddings": False},
    "Qwen3-30B-A3B": {  # Qwen/Qwen3-30B-A3B, read from public copies of its config.json (no hub
        # access here); a mixture of experts: measured only (plan --measure, fake_memory)
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False},
    "Mixtral-8x7B": {  # mistralai/Mixtral-8x7B-v0.1, read from public copies of its config.json;
        # a mixture of experts: measured only
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False},
    "gpt-oss-20b": {  # openai/gpt-oss-20b, read from public copies of its config.json (no hub
        # access here); a mixture of experts: measured only. The hub's experts are MXFP4; this is
        # the bf16 model fine-tuning loads (transformers' Mxfp4Config(dequantize=True))
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "experts_per_token": 4, "router_aux_loss_coef": 0.9,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "initial_context_length": 4096,
        "rope_theta": 150000, "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096},
        "attention_bias": True, "swiglu_limit": 7.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
        "tie_word_embeddings": False},
    "Phi-4": {  # microsoft/phi-4
        "model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120,
        "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40,
        "num_key_value_heads": 10, "max_position_embeddings": 16384,
        "original_max_position_embeddings": 16384, "sliding_window": None,
        "rope_theta": 250000, "tie_word_embeddings": False},
}
# Words in the hub names of a preset's fine-tuned or converted variants, the same shapes:
# meta-llama/Llama-3.1-8B-Instruct, google/gemma-2-9b-it, meta-llama/Llama-2-7b-chat-hf,
# mistralai/Mistral-7B-Instruct-v0.3, and Llama 3.1's first repository names (Meta-Llama-3.1-8B)
VARIANT_WORDS = ("instruct", "chat", "hf", "it", "pt", "base", "meta")
# The hub repository each built-in name's sizes were read from, which a training script's
# from_pretrained loads: the planner's "in your trainer" code names it.
HUB_IDS = {
    "Llama-3.2-1B": "meta-llama/Llama-3.2-1B", "Llama-3.2-3B": "meta-llama/Llama-3.2-3B",
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B", "Llama-3.1-70B": "meta-llama/Llama-3.1-70B",
    "Llama-2-7B": "meta-llama/Llama-2-7b-hf", "Llama-2-13B": "meta-llama/Llama-2-13b-hf",
    "Llama-2-70B": "meta-llama/Llama-2-70b-hf", "Mistral-7B": "mistralai/Mistral-7B-v0.1",
    "Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B", "Qwen2.5-7B": "Qwen/Qwen2.5-7B",
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B", "Qwen3-8B": "Qwen/Qwen3-8B",
    "Qwen3-4B": "Qwen/Qwen3-4B", "Qwen3-14B": "Qwen/Qwen3-14B", "Qwen3-32B": "Qwen/Qwen3-32B",
    "Qwen2.5-72B": "Qwen/Qwen2.5-72B",
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B", "Gemma-2-2B": "google/gemma-2-2b",
    "Gemma-2-9B": "google/gemma-2-9b", "Gemma-2-27B": "google/gemma-2-27b",
    "Gemma-3-1B": "google/gemma-3-1b-pt", "Mixtral-8x7B": "mistralai/Mixtral-8x7B-v0.1",
    "Mistral-7B-v0.3": "mistralai/Mistral-7B-v0.3",
    "Phi-3-mini-4k-instruct": "microsoft/Phi-3-mini-4k-instruct", "Phi-4": "microsoft/phi-4",
    "gpt-oss-20b": "openai/gpt-oss-20b"}
# Versions a preset stands for under another name: Mistral-7B v0.1 and v0.2 (Instruct-v0.2's
# config.json: the same sizes and 32000-token vocabulary; v0.3's 32768 tokens are their own entry);
# Mixtral-8x7B's repositories, base and Instruct, both end in v0.1; Llama-3.3-70B(-Instruct) has
# Llama-3.1-70B's config.json sizes and positions
PRESET_ALIASES = {"Mistral-7B-v0.1": "Mistral-7B", "Mistral-7B-v0.2": "Mistral-7B",
                  "Mixtral-8x7B-v0.1": "Mixtral-8x7B", "Llama-3.3-70B": "Llama-3.1-70B"}


def preset_names() -> list[str]:
    """Every built-in model name: the Llama-shaped :data:`PRESETS`, then :data:`CONFIGS`.

    Returns:
        The names, as the planner, the fake-tensor meter and their errors list them.

    Example:
        >>> "Qwen3-8B" in preset_names() and "Llama-3.1-8B" in preset_names()
        True
    """
    return [*PRESETS, *CONFIGS]


def find_preset(model: Any) -> str | None:
    """The built-in model a name or hub id stands for, or None.

    Case-insensitive, by the last part of a hub id; a fine-tuned variant's words
    (:data:`VARIANT_WORDS`, between dashes) are dropped when the name itself is not built in.
    A local file or folder of the name is the user's own config, never replaced by a preset's,
    unless the name is a preset's exactly (``Llama-3.1-8B``), as the planner has always read it.

    Args:
        model: a name, a hub id or a path.

    Returns:
        A key of :data:`PRESETS` or :data:`CONFIGS`, or None.

    Example:
        >>> find_preset("meta-llama/Llama-3.1-8B-Instruct"), find_preset("google/gemma-2-9b-it")
        ('Llama-3.1-8B', 'Gemma-2-9B')
        >>> find_preset("mistralai/Mistral-7B-Instruct-v0.3")  # 32768 tokens, not v0.1's 32000
        'Mistral-7B-v0.3'
        >>> find_preset("mistralai/Mistral-7B-v0.1")  # PRESET_ALIASES
        'Mistral-7B'
    """
    names = {k.lower(): k for k in preset_names()}
    names.update({k.lower(): v for k, v in PRESET_ALIASES.items()})
    key = str(model).rstrip("/").split("/")[-1].lower()
    if key in names:
        return names[key]
    if Path(str(model)).exists():
        return None
    return names.get("-".join(w for w in key.split("-") if w not in VARIANT_WORDS))


def preset_shape(name: str) -> ModelShape:
    """The sizes of a built-in model (:func:`find_preset`'s names).

    Args:
        name: a key of :data:`PRESETS` or :data:`CONFIGS`.

    Returns:
        Its :class:`ModelShape`; a :data:`CONFIGS` entry's read as transformers reads the
        config (Gemma-2's tied embeddings and eager attention's score bytes included).

    Raises:
        ValueError: naming ``name`` where it is not built in, listing the names that are.
        NotDescribedError: for a built-in model the formulas do not describe (a mixture of
            experts), its ``model_name`` the built-in name.

    Example:
        >>> preset_shape("Qwen3-8B").q_size  # 32 heads of 128 on a 4096-wide stream
        4096
    """
    if name in PRESETS:
        return PRESETS[name]
    if name in CONFIGS:
        try:
            return _config_shape(name)
        except NotDescribedError as err:  # measured only: named for the caller's table
            err.model_name = name
            raise
    raise ValueError(f"name={name!r}: not a built-in model ({', '.join(preset_names())})")


@functools.cache
def _config_shape(name: str) -> ModelShape:
    return ModelShape.from_config(CONFIGS[name], name)


# The decision table in notebook 02 plans for the current Llama generation.
LLAMA3 = {k: v for k, v in PRESETS.items() if k.startswith("Llama-3")}
DATA_PARALLEL = ("ddp", "zero2", "fsdp", "fsdp_offload")
# Gradient traffic per step relative to DDP's all-reduce (ZeRO paper, section 7): ZeRO-2 is a
# reduce-scatter + all-gather (the same volume), ZeRO-3 adds one more all-gather of parameters.
_COMM_VS_DDP = {"ddp": 1.0, "zero2": 1.0, "fsdp": 1.5, "fsdp_offload": 1.5}


def data_parallel_bytes(shape: ModelShape, world_size: int, strategy: str, seq_len: int,
                        micro_batch_size: int, recompute: str = "full") -> dict[str, float]:
    """Per-GPU bytes of a full fine-tune with mixed-precision AdamW under each data-parallel layout.

    ZeRO's ``2 + 2 + 12`` bytes per parameter (16-bit weights and gradients, fp32 master weights
    and two moments), with ``N = world_size``:

    - ``ddp``: everything replicated, ``16 P``.
    - ``zero2`` (FSDP ``reshard_after_forward=False`` / SHARD_GRAD_OP): weights replicated,
      gradients and optimizer sharded, ``2 P + 14 P / N``.
    - ``fsdp`` (full sharding, ZeRO-3): ``16 P / N`` plus two blocks' gathered 16-bit weights
      (the current one and the prefetched next one).
    - ``fsdp_offload``: sharded state in CPU RAM, only the gathered blocks on the GPU.

    Activations come from :func:`activation_bytes` with flash attention and ``recompute``.

    Args:
        shape: the model's sizes.
        world_size: data-parallel ranks (``N``).
        strategy: "ddp", "zero2", "fsdp" or "fsdp_offload".
        seq_len: tokens per sequence.
        micro_batch_size: sequences per rank per step.
        recompute: "none", "selective" or "full".

    Returns:
        ``{"state", "gathered", "activations", "gpu_total", "cpu_total"}`` in bytes.

    Raises:
        ValueError: for an unknown ``strategy`` or a ``world_size`` below 1.

    Example:
        >>> s = ModelShape(128256, 4096, 14336, 32, 32, 8)  # Llama-3.1-8B
        >>> round(data_parallel_bytes(s, 8, "fsdp", 4096, 1)["state"] / 2**30, 1)  # per rank
        15.0
    """
    if strategy not in DATA_PARALLEL:
        raise ValueError(f"strategy={strategy!r}: expected one of {DATA_PARALLEL}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an integer >= 1")
    counts = param_count(shape)
    p, n = counts["total"], world_size
    block = (counts["attention"] + counts["mlp"]) / shape.num_hidden_layers
    act = activation_bytes(shape, seq_len, micro_batch_size, recompute, 2, True)["total"]
    state = {"ddp": 16 * p, "zero2": 2 * p + 14 * p / n, "fsdp": 16 * p / n,
             "fsdp_offload": 0.0}[strategy]
    gathered = 2 * 2 * block if strategy in ("fsdp", "fsdp_offload") else 0.0
    cpu = 16 * p / n if strategy == "fsdp_offload" else 0.0
    return {"state": state, "gathered": gathered, "activations": act,
            "gpu_total": state + gathered + act, "cpu_total": cpu}


def parallelism_table(world_size: int, gpu_bytes: float, seq_len: int = 4096,
                      micro_batch_size: int = 1, models: dict[str, ModelShape] | None = None,
                      recompute: str = "full") -> list[dict[str, Any]]:
    """For each model: per-GPU GiB under each layout and the first that fits ``gpu_bytes``.

    Layouts are tried from least to most communication (DDP, ZeRO-2, FSDP, FSDP + CPU offload):
    shard only as much as memory forces. A 10 % margin is kept for the allocator and buffers.

    Args:
        world_size: GPUs (``N``).
        gpu_bytes: memory per GPU.
        seq_len: tokens per sequence.
        micro_batch_size: sequences per GPU per step.
        models: name -> sizes (default: the Llama 3 presets, 1B to 70B).
        recompute: "none", "selective" or "full".

    Returns:
        One dict per model: ``model``, the per-GPU GiB of each layout, and ``choose``: the first
        layout that fits (or "none").

    Raises:
        ValueError: for a ``gpu_bytes`` <= 0.

    Example:
        >>> rows = parallelism_table(8, 80 * 2**30)
        >>> [r["choose"] for r in rows]
        ['ddp', 'ddp', 'zero2', 'fsdp_offload']
    """
    if gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes={gpu_bytes}: must be > 0")
    rows = []
    for name, shape in (models or LLAMA3).items():
        row: dict[str, Any] = {"model": name,
                               "params_B": param_count(shape)["total"] / 1e9}
        choice = "does not fit"
        for strategy in DATA_PARALLEL:
            need = data_parallel_bytes(shape, world_size, strategy, seq_len, micro_batch_size,
                                       recompute)["gpu_total"]
            row[f"{strategy}_GiB"] = need / 2**30
            if choice == "does not fit" and need <= 0.9 * gpu_bytes:
                choice = strategy
        row["choose"] = choice
        row["comm_vs_ddp"] = _COMM_VS_DDP.get(choice)
        rows.append(row)
    return rows
