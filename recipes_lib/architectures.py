"""What the recipes need to know about a decoder architecture, read from the model, not its name.

Recipes touch a model in four places: its repeated blocks (checkpointing wraps them, FSDP shards
them), the linear layers inside those blocks (LoRA and NF4 adapt them), the output head (chunked
cross-entropy and distillation multiply by its weight) and its attention function (plug-ins
replace it). Llama names are not universal: Phi-3 fuses ``qkv_proj`` and ``gate_up_proj``,
Qwen2/3 and Gemma-2 tie the head to the embeddings, Gemma-2 soft-caps its attention scores and
final logits (``cap * tanh(x / cap)``) and has no SDPA path in transformers. Everything here is
found through transformers' own hooks (``_no_split_modules``, ``get_output_embeddings``, the
config), so a new architecture works if transformers describes it.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _class_names(module: nn.Module) -> list[str]:
    # FSDP2's fully_shard swaps a module's class for a subclass named FSDP<Class>
    return [c.__name__ for c in type(module).__mro__]


def architecture_name(model: nn.Module) -> str:
    """The class name users know the model by (``Phi3ForCausalLM``), through a peft wrapper or
    FSDP2's renamed class.

    Args:
        model: a module, wrapped or not.

    Returns:
        The class name.
    """
    return next(n for n in _class_names(_base(model)) if not n.startswith("FSDP"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the classes transformers lists in ``_no_split_modules``).

    Args:
        model: a transformers model, wrapped or not.

    Returns:
        The blocks, in order.

    Raises:
        ValueError: naming the architecture, if it declares no such classes or none are found.

    Example:
        >>> len(decoder_layers(model)) == model.config.num_hidden_layers  # doctest: +SKIP
        True
    """
    base = _base(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if names.intersection(_class_names(m))]
    if not layers:
        wanted = sorted(names) or "_no_split_modules (none declared)"
        raise ValueError(f"model: {architecture_name(base)} has no decoder blocks the recipes can "
                         f"wrap or shard (looked for {wanted})")
    return layers


def adapter_targets(model: nn.Module) -> tuple[str, ...]:
    """Names of the linear layers inside the decoder blocks, in order of first appearance: what
    LoRA and NF4 adapt (Llama: q/k/v/o and gate/up/down projections; Phi-3: ``qkv_proj``,
    ``o_proj``, ``gate_up_proj``, ``down_proj``). The head and embeddings are left out, as peft's
    ``"all-linear"`` does. A layer adapted already (peft's LoRA wrapper, the course's NF4 layer)
    counts as the linear it wraps.

    Args:
        model: a transformers model, wrapped or not.

    Returns:
        The layers' names (the last part of each module name), in order.

    Raises:
        ValueError: naming the architecture, if its blocks hold no ``nn.Linear``.

    Example:
        >>> adapter_targets(phi3_model)  # doctest: +SKIP
        ('qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj')
    """
    names: dict[str, None] = {}
    for block in decoder_layers(model):
        taken: list[str] = []  # a linear layer already adapted (peft, NF4) holds its own linears
        for name, module in block.named_modules():
            if not name or any(name.startswith(t + ".") for t in taken):
                continue
            if isinstance(getattr(module, "in_features", None), int) and \
                    isinstance(getattr(module, "out_features", None), int):
                taken.append(name)
                names.setdefault(name.rsplit(".", 1)[-1], None)
    if not names:
        raise ValueError(f"model: {architecture_name(model)}'s decoder blocks hold no nn.Linear "
                         "layers to adapt (LoRA and NF4 need them)")
    return tuple(names)


def check_adapter_targets(model: nn.Module, targets: str | list[str] | tuple[str, ...],
                          name: str = "target_modules") -> None:
    """Refuse LoRA target names that match no module of ``model`` before peft does, naming the
    parameter and the layers that could be adapted (peft's own error names neither).

    A list matches as peft matches it: a module whose name is an entry or ends in ``.`` + entry.
    ``"all-linear"`` needs linear layers in the decoder blocks (:func:`adapter_targets`); any
    other string is peft's regular expression and is left to peft.

    Args:
        model: the model the adapters go on.
        targets: peft's ``target_modules``.
        name: the caller's parameter, for the error.

    Raises:
        ValueError: naming ``name``, the architecture and its adaptable layers, for entries that
            match nothing or a model without linear layers to adapt.

    Example:
        >>> check_adapter_targets(llama_model, ["q_proj", "qkv_proj"])  # doctest: +SKIP
        ValueError: target_modules: 'qkv_proj' matches no module of LlamaForCausalLM; ...
    """
    if isinstance(targets, str):
        if targets == "all-linear":
            adapter_targets(model)
        return
    modules = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in modules)]
    if missing:
        raise ValueError(f"{name}: {', '.join(map(repr, missing))} "
                         f"match{'es' if len(missing) == 1 else ''} no module of "
                         f"{architecture_name(model)}; its decoder blocks' linear layers are "
                         f"{', '.join(adapter_targets(model))} ('all-linear' takes them all)")


# why unadapted_linears finds layers (said by quantization.add_lora's warning and the planner)
PEFT_EXPERT_NAMES = ("on transformers 5 peft (up to 0.21) maps the names transformers 4 gave the "
                     "experts (gate_proj, up_proj, down_proj) onto their 3-D parameters, and "
                     "takes the dense layers' and shared experts' layers of those names with "
                     "them (peft 0.22 adapts them)")


def unadapted_linears(model: nn.Module, targets: str | list[str] | tuple[str, ...]
                      ) -> list[str]:
    """The decoder blocks' linear layers ``targets`` names that peft left without an adapter.

    On transformers 5, peft up to 0.21 maps the names transformers 4 gave a mixture of experts'
    experts (``gate_proj``, ``up_proj``, ``down_proj``) onto their 3-D parameters for every model
    type transformers converts (DeepSeek-V2/V3, GLM-4-MoE, Qwen3-Next, ...), by name alone: the
    dense layers' and shared experts' linear layers of those names go with them, and get no
    adapter whatever ``target_modules`` says ("all-linear" included). peft 0.22 adapts them
    (seen with 0.22.0 on DeepSeek-V3 and GLM-4-MoE): nothing to return there. Routers that
    "all-linear" leaves out on purpose (:func:`not_linear_maps`, :func:`lora_target_modules`) are
    not listed.

    Args:
        model: a peft-wrapped model.
        targets: the ``target_modules`` it was wrapped with: "all-linear" names every linear
            layer of the decoder blocks, a list those whose name is an entry or ends in ``.`` +
            entry (as peft matches); a regular expression is left to peft (nothing returned).

    Returns:
        The layers' names in the base model (``model.layers.0.mlp.gate_proj``), in order.

    Example:
        >>> unadapted_linears(add_lora(deepseek_v3), "all-linear")[:1]  # doctest: +SKIP
        ['model.layers.0.mlp.gate_proj']
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(targets, str) and targets != "all-linear":
        return []
    base = _base(model)
    blocks = {id(b) for b in decoder_layers(base)}
    inside = [n for n, m in base.named_modules() if id(m) in blocks]
    adapted = [n for n, m in base.named_modules() if isinstance(m, BaseTunerLayer)]
    routers = not_linear_maps(base) if targets == "all-linear" else {}  # left out on purpose
    left = []
    for name, module in base.named_modules():
        if not any(name.startswith(b + ".") for b in inside) or \
                any(name == a or name.startswith(a + ".") for a in adapted) or \
                name.rsplit(".", 1)[-1] in routers:
            continue
        named = targets == "all-linear" or any(name == t or name.endswith("." + t)
                                               for t in targets)
        if named and isinstance(getattr(module, "in_features", None), int) and \
                isinstance(getattr(module, "out_features", None), int):
            left.append(name)
    return left


# the names a mixture of experts' MLP projections go by, in transformers 4 (per expert: gate_proj,
# up_proj, down_proj; Mixtral's w1, w3, w2) and 5 (3-D: gate_up_proj, down_proj)
EXPERT_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate_up_proj")
PEFT_FROZEN_EXPERTS = ("target_modules takes linear layers only, and peft maps the MLP's names "
                       "onto the experts' 3-D parameters only for Mixtral and the model types "
                       "transformers converts as it does Qwen2-MoE (Qwen3-MoE, DeepSeek-V3, "
                       "OLMoE, ...; Qwen2-MoE itself from peft 0.22): not for Phi-3.5-MoE or "
                       "Jamba, whose experts transformers 4 kept as linear layers, which LoRA "
                       "adapted, nor for GPT-OSS, Llama 4 or Granite-MoE, whose experts were 3-D "
                       "already")


def frozen_experts(model: nn.Module, targets: str | list[str] | tuple[str, ...]) -> list[str]:
    """The routed experts' 3-D parameters peft left without an adapter although ``targets`` name
    the MLP's layers: they stay frozen, and LoRA trains none of the experts.

    transformers 5 stacks every expert's projections into 3-D parameters of a module it names
    ``experts`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), which peft's
    ``target_modules`` ("all-linear" included) never takes; its ``target_parameters`` does. peft
    converts the MLP names into ``target_parameters`` for some model types only
    (``PEFT_FROZEN_EXPERTS``).

    Args:
        model: a peft-wrapped model.
        targets: the ``target_modules`` it was wrapped with. "all-linear" or a list naming an MLP
            projection (``EXPERT_MLP_NAMES``, or ending in ``.`` + one) asks for the experts;
            other targets (the attention's alone) leave them frozen on purpose: nothing returned.

    Returns:
        The parameters' names in the base model (``model.layers.0.mlp.experts.gate_up_proj``),
        every layer's, in order; empty for a dense model or experts that have adapters.

    Example:
        >>> frozen_experts(add_lora(gpt_oss), "all-linear")[:2]  # doctest: +SKIP
        ['model.layers.0.mlp.experts.gate_up_proj', 'model.layers.0.mlp.experts.down_proj']
    """
    from peft.tuners.lora.layer import ParamWrapper

    if isinstance(targets, str):
        if targets != "all-linear":
            return []
    elif not any(t.rsplit(".", 1)[-1] in EXPERT_MLP_NAMES for t in targets):
        return []
    base = _base(model)

    def unwrapped(name: str) -> str:  # peft nests a ParamWrapper per adapted parameter
        return ".".join(part for part in name.split(".") if part != "base_layer")

    adapted = {f"{unwrapped(n)}.{m.parameter_name}" for n, m in base.named_modules()
               if isinstance(m, ParamWrapper)}
    blocks = {id(b) for b in decoder_layers(base)}
    frozen = []
    for layer_name, layer in base.named_modules():
        if id(layer) not in blocks:
            continue
        for name, module in layer.named_modules():
            # transformers 5 names the module that stacks them "experts" (mlp.experts,
            # feed_forward.experts, block_sparse_moe.experts); other 3-D parameters (a Mamba
            # mixer's conv1d) are not experts
            if unwrapped(name).rsplit(".", 1)[-1] != "experts":
                continue
            for pname, param in module.named_parameters(recurse=False):
                full = unwrapped(f"{layer_name}.{name}.{pname}")
                if param.dim() == 3 and full not in adapted:
                    frozen.append(full)
    return frozen


_LAYER_PREFIX = re.compile(r"(.*?\.\d+)\.(.*)")  # model.layers.3 . mlp.experts.down_proj


def layer_parameter_names(names: list[str]) -> list[str]:
    """Parameter names without their layer's prefix, once each, in order: what peft's
    ``target_parameters`` takes (it matches the end of a name).

    Args:
        names: full names (``model.layers.0.mlp.experts.gate_up_proj``).

    Returns:
        The names inside a layer (``mlp.experts.gate_up_proj``).

    Example:
        >>> layer_parameter_names(["model.layers.0.mlp.experts.down_proj",
        ...                        "model.layers.1.mlp.experts.down_proj"])
        ['mlp.experts.down_proj']
    """
    return list(dict.fromkeys(m.group(2) if m else n
                              for m, n in zip(map(_LAYER_PREFIX.match, names), names)))


def frozen_experts_text(architecture: str, targets: str | list[str] | tuple[str, ...],
                        frozen: list[str]) -> str:
    """What :func:`frozen_experts` found, said for a user: which parameters, in how many layers,
    why, and the ``target_parameters`` that adapt them (``quantization.add_lora``'s warning, the
    planner's note).

    Args:
        architecture: the model's class name (:func:`architecture_name`).
        targets: the ``target_modules`` it was wrapped with.
        frozen: :func:`frozen_experts`' names.

    Returns:
        The sentence.
    """
    short = layer_parameter_names(frozen)
    layers = len({m.group(1) for m in map(_LAYER_PREFIX.match, frozen) if m})
    return (f"target_modules={targets!r}: peft adapted none of {architecture}'s "
            f"routed experts ({', '.join(short)}, in {layers} layer{'s' * (layers != 1)}), "
            f"3-D parameters: {PEFT_FROZEN_EXPERTS}. They stay frozen and LoRA trains no "
            f"expert; target_parameters={short!r} adapts them (one adapter per expert)")


# peft (0.21) refuses LoRA on a Mamba mixer's out_proj and conv1d for these model types
# (peft.tuners.tuners_utils._check_lora_target_modules_mamba), yet its "all-linear" picks out_proj
PEFT_MAMBA_MODEL_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")
PEFT_MAMBA_REFUSED = ("out_proj", "conv1d")


def not_linear_maps(model: nn.Module) -> dict[str, str]:
    """The decoder blocks' ``nn.Linear`` layers whose forward is not their linear map:
    transformers' own subclasses that override ``forward``, each called once on one row of zeros
    (on its weight's device: meta works), that return anything but one ``out_features``-wide row
    or refuse that input. Llama 4's and Phi-3.5-MoE's routers return their routing weights and
    chosen experts; DeepSeek-V4's grouped output projection wants its heads split into groups.
    peft's "all-linear" takes them, and its LoRA layer, which adds ``B A x`` to the output, fails
    at the first forward ("'tuple' object has no attribute 'dtype'", or shapes that differ).

    Args:
        model: a transformers model, not yet wrapped by peft.

    Returns:
        Each such layer's name (the last part of its module name) -> its class name.

    Example:
        >>> not_linear_maps(llama4_model)  # doctest: +SKIP
        {'router': 'Llama4Router'}
    """
    found: dict[str, str] = {}
    for block in decoder_layers(model):
        for name, module in block.named_modules():
            cls = type(module)
            short = name.rsplit(".", 1)[-1]
            if short in found or not isinstance(module, nn.Linear) or \
                    cls.forward is nn.Linear.forward or \
                    not cls.__module__.startswith("transformers."):
                continue
            x = torch.zeros(1, module.in_features, dtype=module.weight.dtype,
                            device=module.weight.device)
            try:
                with torch.no_grad():
                    out = module(x)
            except Exception:  # noqa: BLE001 (DeepSeek-V4's grouped linear wants its groups)
                out = None
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, module.out_features):
                found[short] = cls.__name__
    return found


def lora_target_modules(model: nn.Module, targets: str | list[str] | tuple[str, ...],
                        name: str = "target_modules") -> str | list[str] | tuple[str, ...]:
    """What to hand peft as ``target_modules``: ``targets`` checked
    (:func:`check_adapter_targets`) and returned, except ``"all-linear"`` where peft's own
    expansion would fail, which becomes the decoder blocks' other linear layers, said aloud:

    - on an architecture with Mamba layers (Falcon-H1), peft's "all-linear" takes their
      ``out_proj``, which its own check then refuses ("incompatible with Mamba-based models");
    - on Llama 4 and Phi-3.5-MoE it takes their routers, ``nn.Linear`` subclasses that return a
      tuple (and DeepSeek-V4's grouped projection), on which its LoRA layer fails at the first
      forward (:func:`not_linear_maps`).

    Args:
        model: the model the adapters go on.
        targets: peft's ``target_modules``.
        name: the caller's parameter, for errors and the warning.

    Returns:
        ``targets``, or the names that replace ``"all-linear"``.

    Raises:
        ValueError: as :func:`check_adapter_targets`, and for a list naming a layer
            :func:`not_linear_maps` finds (naming it and its class).
    """
    check_adapter_targets(model, targets, name)
    config = getattr(_base(model), "config", None)
    model_type = getattr(config, "model_type", None)
    routers = not_linear_maps(model) if targets == "all-linear" or \
        not isinstance(targets, str) else {}
    if not isinstance(targets, str):
        named = {t.rsplit(".", 1)[-1] for t in targets} & set(routers)
        if named:
            raise ValueError(f"{name}: {', '.join(map(repr, sorted(named)))} "
                             f"name{'s' if len(named) == 1 else ''} "
                             f"{', '.join(sorted({routers[n] for n in named}))}, an nn.Linear "
                             "whose forward is not its linear map, to which LoRA cannot add its "
                             "update (peft's layer fails at the first forward)")
        return targets
    if targets != "all-linear" or (model_type not in PEFT_MAMBA_MODEL_TYPES and not routers):
        return targets
    names = [t for t in adapter_targets(model) if t not in routers and not (
        model_type in PEFT_MAMBA_MODEL_TYPES and t in PEFT_MAMBA_REFUSED)]
    why = []
    if model_type in PEFT_MAMBA_MODEL_TYPES:
        why.append(f"peft refuses LoRA on {model_type}'s Mamba "
                   f"{' and '.join(PEFT_MAMBA_REFUSED)} (its 'all-linear' picks out_proj, then "
                   "its own check refuses it)")
    if routers:
        layers = ", ".join(f"{n} ({c})" for n, c in routers.items())
        one = len(routers) == 1
        why.append(f"{architecture_name(model)}'s {layers} "
                   f"{'is an nn.Linear' if one else 'are nn.Linear layers'} whose forward is not "
                   f"{'its' if one else 'their'} linear map (a router returns its weights and "
                   "chosen experts), and peft's LoRA layer, which 'all-linear' would put on "
                   f"{'it' if one else 'them'}, fails at the first forward")
    warnings.warn(f"{name}='all-linear': {'; '.join(why)}; adapting {', '.join(names)}",
                  stacklevel=2)
    return names


# config fields by which a transformers causal LM scales its logits (or the hidden states
# entering its head) outside the head's matmul, and where (transformers 5.x modeling files)
HEAD_SCALINGS = {
    "logits_scaling": "(Granite: logits / logits_scaling)",
    "logit_scale": "(Cohere: logits * logit_scale)",
    "output_multiplier": "(logits * output_multiplier)",
    "dim_model_base": "(MiniCPM3: hidden states / (hidden_size / dim_model_base) before the head)",
}


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The output projection's weight (vocab x hidden), tied to the embeddings or not.

    Args:
        model: a causal LM, wrapped or not.

    Returns:
        The weight (the parameter itself, not a copy).

    Raises:
        ValueError: naming the architecture, if it is not a transformers model (no config),
            if there is no bias-free linear head, if the head carries unmerged LoRA adapters
            (its weight alone would leave them out), or if the model scales its logits or the
            hidden states after the decoder in a way the chunked losses do not
            (:data:`HEAD_SCALINGS`; Gemma-2's soft-capping they do).
    """
    config = getattr(_base(model), "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"model: {architecture_name(model)} is not a transformers model (no "
                         "config or get_output_embeddings); the chunked losses read the LM "
                         "head of a transformers causal LM")
    for attr, who in HEAD_SCALINGS.items():
        value = getattr(getattr(config, "text_config", None) or config, attr, None)
        if value is not None and value != 1:
            raise ValueError(f"model: {architecture_name(model)} applies config.{attr}={value} "
                             f"{who}, which a loss that multiplies by the head's weight does not; "
                             "use the full loss (the model's own logits)")
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"model: {architecture_name(model)} exposes no output head "
                         "(get_output_embeddings() is None)")
    # peft's LoRA layer answers .weight with its base layer's: the product with the hidden
    # states would silently drop the adapters' low-rank term (a loss 145.6 for 149.0)
    if getattr(head, "base_layer", None) is not None and getattr(head, "lora_A", None) and \
            not getattr(head, "merged", False):
        raise ValueError(f"model: {architecture_name(model)}'s output head carries LoRA adapters "
                         "('lm_head' in target_modules), which a loss that multiplies by the "
                         "head's weight would leave out; adapt the layers without it, train "
                         "the head itself (modules_to_save=['lm_head']) or use the full loss")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"model: {architecture_name(model)}'s output head has a bias; the "
                         "chunked losses expect a bias-free LM head")
    return head.weight


@contextlib.contextmanager
def as_forward(module: nn.Module, fn: Callable[[], Any]) -> Iterator[None]:
    """``module``'s forward replaced by ``fn`` for the calls made inside the block, then put back
    (an instance attribute it had, such as accelerate's autocast wrapper, as well as the class's):
    how a loss that reads the decoder and the head itself (chunked cross-entropy, distillation)
    runs inside the wrappers' own forward.

    Args:
        module: the module whose forward ``fn`` stands in for.
        fn: called with no arguments, whatever the module is called with.

    Returns:
        A context manager; inside it, calling ``module`` (or a wrapper around it) calls ``fn``.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> with as_forward(net, lambda: "replaced"):
        ...     net(), "forward" in vars(net)
        ('replaced', True)
        >>> "forward" in vars(net)
        False
    """
    own = module.__dict__.get("forward")
    module.forward = lambda *args, **kwargs: fn()
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def through_wrappers(model: nn.Module, fn: Callable[[nn.Module], Any]) -> Any:
    """``fn(inner)`` for the model inside ``model``'s wrappers, called as that model's forward
    through ``model``'s own call where a wrapper or FSDP needs its forward to run: DDP's prepares
    the gradients' all-reduce, an FSDP2 root's pre-forward hook gathers the parameters it holds
    (the embeddings and the head); a loss calling the decoder and the head directly would skip
    both (on an FSDP2 root the embedding then meets its sharded weight: "mixed torch.Tensor and
    DTensor"). A bare model's ``fn`` is called directly.

    Args:
        model: a causal LM, bare, DDP- or DataParallel-wrapped, or sharded by ``fully_shard``.
        fn: ``fn(inner) -> result``, e.g. a course loss on a micro-batch.

    Returns:
        What ``fn`` returns.

    Example:
        >>> through_wrappers(nn.DataParallel(nn.Linear(2, 2)), lambda m: type(m).__name__)
        'Linear'
    """
    inner = model
    while isinstance(inner, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        inner = inner.module
    if inner is model and not _fsdp_sharded(model):
        return fn(model)
    with as_forward(inner, lambda: fn(inner)):
        return model()


def _fsdp_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def final_hidden_states(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder's last hidden states for ``batch``, as the model's own forward makes them
    before its head: what a loss computed from the head's weight (chunked cross-entropy,
    distillation) multiplies. Packed rows (``position_ids`` restarting at each document, no
    attention mask) are passed on as the training loop passes them, without a KV cache, so each
    document attends only to itself.

    Args:
        model: a causal LM, wrapped or not.
        batch: ``input_ids``, and ``attention_mask`` or ``position_ids`` where present.

    Returns:
        (batch, seq, hidden) hidden states.
    """
    return model.get_decoder()(**model_inputs(batch)).last_hidden_state


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A batch's keyword arguments for a model's forward: ``input_ids`` and ``attention_mask``,
    or, for packed rows, ``position_ids`` without a KV cache (transformers reads restarting
    positions as packed documents only without one, which ``config.use_cache`` would create:
    Trainer sets it False too). The labels stay out: the course computes its losses itself.

    Args:
        batch: ``input_ids``, and ``attention_mask`` or ``position_ids`` where present.

    Returns:
        The keyword arguments.

    Example:
        >>> ids = torch.zeros(1, 4, dtype=torch.long)
        >>> sorted(model_inputs({"input_ids": ids, "position_ids": ids}))
        ['attention_mask', 'input_ids', 'position_ids', 'use_cache']
    """
    packed = {} if "position_ids" not in batch else {
        "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"),
            **packed}


def padding_mask_only(*args: Any, attention_mask: torch.Tensor | None = None,
                      **kwargs: Any) -> torch.Tensor | None:
    """A mask function for ``transformers.masking_utils.AttentionMaskInterface``, to register
    beside an attention a recipe registers (``AttentionInterface``) under the same name: the
    2-D padding mask as given (bool, batch x keys), or None. transformers hands a registered
    attention no mask at all without one, so padding would pass unseen; with this one the
    attention sees the padding and keeps its own causal structure (nothing s x s is built).

    Args:
        *args: transformers' mask arguments (unused).
        attention_mask: the padding mask transformers prepared.
        **kwargs: transformers' mask arguments (unused).

    Returns:
        ``attention_mask``.
    """
    return attention_mask


def final_logit_softcap(model: nn.Module) -> float | None:
    """Gemma-2's ``final_logit_softcapping`` (logits become ``cap * tanh(logits / cap)``), or
    None for architectures whose head is a plain matmul.

    Args:
        model: a causal LM, wrapped or not.

    Returns:
        The cap, or None.
    """
    return getattr(_base(model).config, "final_logit_softcapping", None) or None


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` as Gemma-2 applies it to its final logits; unchanged for
    None. Apply it wherever logits are made from the head's weight outside the model's forward.

    Args:
        logits: any tensor of logits.
        cap: the model's :func:`final_logit_softcap`.

    Returns:
        The capped logits (``logits`` itself for None).

    Example:
        >>> softcap(torch.tensor([0.0, 100.0]), 30.0).round()
        tensor([ 0., 30.])
    """
    return logits if cap is None else torch.tanh(logits / cap) * cap


def supports_sdpa(config: Any) -> bool:
    """Whether transformers has an SDPA attention path for ``config``'s causal LM (Gemma-2, for
    one, has not: its attention soft-capping needs the scores written out).

    Args:
        config: a transformers model config.

    Returns:
        True where ``attn_implementation="sdpa"`` loads.

    Raises:
        ValueError: if ``config`` is not a causal LM's config.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return bool(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa)
    except KeyError as err:
        raise ValueError(f"config: {type(config).__name__} is not a causal LM's config") from err


def default_attention(config: Any) -> str:
    """``"sdpa"`` where the architecture has it, else ``"eager"``: what ``load_model``'s "auto"
    ends up with, for models built from a config.

    Args:
        config: a causal LM's transformers config.

    Returns:
        The attention implementation's name.
    """
    return "sdpa" if supports_sdpa(config) else "eager"


def describe(model: nn.Module) -> dict[str, Any]:
    """What the recipes will use in ``model``: its block class, adapter targets, head, attention.

    Args:
        model: a causal LM, wrapped or not.

    Returns:
        ``architecture``, ``blocks``, ``adapter_targets``, ``tied_embeddings``, ``attention``
        and the soft-capping values.

    Example:
        >>> describe(model)["adapter_targets"]  # doctest: +SKIP
        ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
    """
    base = _base(model)
    cfg = base.config
    blocks = decoder_layers(model)
    head = base.get_output_embeddings()
    return {
        "architecture": architecture_name(model),
        "blocks": f"{len(blocks)} x {architecture_name(blocks[0])}",
        "adapter_targets": adapter_targets(model),
        "tied_embeddings": head is not None
        and head.weight is base.get_input_embeddings().weight,
        "attention": cfg._attn_implementation,
        "final_logit_softcap": final_logit_softcap(model),
        "attn_logit_softcap": getattr(cfg, "attn_logit_softcapping", None),
        "sliding_window": getattr(cfg, "sliding_window", None),
    }


def meta_model(config: Any, quiet: bool = False, **kwargs: Any) -> nn.Module:
    """transformers' causal LM for ``config`` built on the meta device: shapes and dtypes, no
    memory (an 8 B model in about a second).

    Args:
        config: a transformers config.
        quiet: transformers' warnings silenced while it builds (:func:`quiet_transformers`).
        **kwargs: passed to ``AutoModelForCausalLM.from_config`` (``dtype``,
            ``attn_implementation``).

    Returns:
        The model, its parameters on the meta device.
    """
    from transformers import AutoModelForCausalLM

    with quiet_transformers(quiet), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


# transformers' own "Loading weights" (per tensor) and "Writing model shards" (per file) bars are
# shown for checkpoints of this size and up, where loading or saving takes seconds; a smaller one
# (the course's models: ~20 MB, loaded dozens of times a notebook) is done before its bar is drawn
PROGRESS_BAR_BYTES = 2**30


@contextlib.contextmanager
def transformers_progress_bars(weights_bytes: int | None) -> Iterator[None]:
    """transformers' progress bars off while the block runs for a checkpoint under
    :data:`PROGRESS_BAR_BYTES`; left as they are for a larger one or an unknown size (a hub id:
    its download bars stay). Other progress bars (the course's own, Trainer's) are not touched.

    Args:
        weights_bytes: the checkpoint's size in bytes, or None where it is not known.

    Returns:
        A context manager; the setting in force before it is restored on exit.
    """
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    if shown and weights_bytes is not None and weights_bytes < PROGRESS_BAR_BYTES:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_transformers(quiet: bool = True) -> Iterator[None]:
    """transformers' logging at error level while the block runs, when ``quiet``: for builds
    whose warnings are about what the course does on purpose (a multimodal checkpoint's vision
    weights left out, a two-layer copy of an architecture counted on the meta device).

    Args:
        quiet: False leaves the logging as it is.

    Returns:
        A context manager; the level in force before it is restored on exit.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
