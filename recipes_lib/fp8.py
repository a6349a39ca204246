"""FP8 training: the linear layers' matmuls in float8, with torchao's
``convert_to_float8_training``.

Where mixed precision went after bf16. Each ``nn.Linear`` becomes a ``Float8Linear``: before each
of its three matmuls (output, grad-input, grad-weight) the operands are scaled into float8's
range (e4m3 forward, e5m2 for gradients under "tensorwise"; e4m3 with one scale per row under
"rowwise") and multiplied on the float8 tensor cores, at twice bf16's peak rate on an H100. The
weights, their gradients and the optimizer stay in high precision: FP8 saves time, not memory.

It pays only where the matmuls dominate and are large: the casts are extra memory-bound passes,
so small layers get slower (torchao skips them by default, ``_auto_filter_for_recipe``). It needs
compute capability >= 8.9 (H100, L4, RTX 4090), not a T4 or an A100. Elsewhere torchao's
*emulation* runs the same casts and scales with a high-precision matmul: it checks the numerics,
never the speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
EXCLUDE = ("lm_head",)  # the output head stays in high precision, as torchtitan does


def hardware_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` has float8 tensor cores, and why not.

    Args:
        device: the device to ask about.

    Returns:
        ``(supported, reason)``: compute capability 8.9 or later (Ada, Hopper, Blackwell).

    Example:
        >>> hardware_support("cpu")[0]
        False
    """
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type}: no float8 matmul; torchao's emulation checks numerics only"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return False, (f"compute capability {cap[0]}.{cap[1]} < 8.9 ({name}): no float8 tensor "
                       "cores; skipped")
    return True, f"compute capability {cap[0]}.{cap[1]}: float8 tensor cores"


@dataclass
class Conversion:
    """Which linear layers became float8, and why the others did not.

    Attributes:
        recipe: torchao's float8 scaling, "tensorwise" or "rowwise".
        converted: the converted layers' names.
        skipped: layer name -> why it stayed in high precision.
    """

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for r in self.skipped.values():
            reasons[r] = reasons.get(r, 0) + 1
        why = "; ".join(f"{n} {r}" for r, n in reasons.items())
        return f"{self.recipe}: {len(self.converted)} linear layers in float8" + (
            f", skipped: {why}" if why else "")


def _size_filter(recipe: str):
    from torchao.float8 import _auto_filter_for_recipe

    return _auto_filter_for_recipe(recipe, filter_fqns=[])


def convert(model: torch.nn.Module, recipe: str = "tensorwise", emulate: bool | None = None,
            skip_small: bool = True, exclude: tuple[str, ...] = EXCLUDE) -> Conversion:
    """Swap ``model``'s linear layers for torchao's ``Float8Linear`` in place.

    Args:
        model: any module (a transformers or peft model).
        recipe: "tensorwise" (one scale per tensor) or "rowwise" (one per row, more accurate).
        emulate: high-precision matmuls in place of float8 ones; default: where the model's
            device has no float8 tensor cores.
        skip_small: keep the layers torchao's size heuristic (measured on H100) predicts to be
            slower in float8; every layer needs dimensions divisible by 16 regardless.
        exclude: name fragments of layers kept in high precision.

    Returns:
        A ``Conversion`` naming the converted and the skipped layers with the reason.

    Raises:
        ValueError: for an unknown recipe; ImportError without torchao.

    Example:
        >>> c = convert(model, "tensorwise", skip_small=False)  # doctest: +SKIP
        >>> c.summary()  # doctest: +SKIP
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: expected one of {RECIPES}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    device = next(model.parameters()).device
    if emulate is None:
        emulate = not hardware_support(device)[0]
    result = Conversion(recipe)
    size_ok = _size_filter(recipe)

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(mod, torch.nn.Linear):
            return False  # a container: torchao asks about it too; recurse into it
        out_f, in_f = mod.weight.shape
        if any(x in fqn for x in exclude):
            result.skipped[fqn] = "excluded by name"
        elif out_f % 16 or in_f % 16:
            result.skipped[fqn] = "dimension not divisible by 16"
        elif skip_small and not size_ok(mod, fqn):
            result.skipped[fqn] = f"too small to gain ({recipe} heuristic)"
        else:
            result.converted.append(fqn)
            return True
        return False

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        from dataclasses import replace

        config = replace(config, emulate=True)
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return result


def linear_sweep(sizes: list[int], tokens: int = 8192, recipe: str = "tensorwise",
                 device: torch.device | str = "cuda", compile: bool = True, repeats: int = 10):
    """FP8 vs bf16 for one linear layer's training step (forward + backward) over its width.

    Shape: ``tokens x d`` input, ``d x d`` weight, at each ``d`` in ``sizes``; both variants
    compiled when ``compile`` (torchao's float8 relies on ``torch.compile`` to fuse its casts).

    Args:
        sizes: the widths ``d``, at least three, growing.
        tokens: rows of the input.
        recipe: torchao's float8 scaling, "tensorwise" or "rowwise".
        device: a GPU with float8 tensor cores.
        compile: compile both variants.
        repeats: timed steps of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "fp8", dimension "hidden").

    Raises:
        ValueError: on a device without float8 tensor cores (emulation is no speed test), or
            sizes a sweep cannot use.
    """
    from recipes_lib.sweep import run_sweep

    ok, why = hardware_support(device)
    if not ok:
        raise ValueError(f"device={str(device)!r}: {why}")
    device = torch.device(device)

    def make(d: int):
        torch._dynamo.reset()  # a fresh cache per size: past its recompile limit dynamo runs eager
        x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
        base = torch.nn.Linear(d, d, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = torch.nn.Sequential(torch.nn.Linear(d, d, bias=False, device=device,
                                                  dtype=torch.bfloat16))
        convert(fp8, recipe, skip_small=False)
        fns = {}
        for name, mod in (("baseline", base), ("recipe", fp8)):
            run = torch.compile(mod) if compile else mod

            def step(run=run):
                run(x).backward(grad)
            fns[name] = step
        return fns

    def work(d: int) -> tuple[float, float]:
        return 6.0 * tokens * d * d, 2.0 * 3 * (2 * tokens * d + d * d)

    return run_sweep("fp8", "hidden", sizes, make, work, device, warmup=3, repeats=repeats,
                     progress=False, dtype=torch.bfloat16)


def compare_with_high_precision(load_model, examples: list[dict[str, list[int]]],
                                pad_token_id: int, config, recipe: str = "tensorwise"
                                ) -> dict[str, object]:
    """The same steps from the same weights and batches, plain and with every linear layer of the
    decoder in float8 (the one training loop, ``train.train``, for both).

    Small layers are converted too (``skip_small=False``): on a tiny model the point is the
    numerics. Where the device has no float8 tensor cores this is torchao's emulation.

    Args:
        load_model: returns a fresh copy of the same model (called twice).
        examples: tokenised training examples.
        pad_token_id: the id padded positions get.
        config: the ``train.TrainConfig`` of both runs.
        recipe: torchao's float8 scaling, "tensorwise" or "rowwise".

    Returns:
        ``{"plain": TrainResult, "fp8": TrainResult, "conversion": Conversion,
        "emulated": bool, "loss_rel_diff": float}`` (the last step's loss, relative).
    """
    from recipes_lib import train

    out: dict[str, object] = {}
    for name in ("plain", "fp8"):
        model = load_model()
        if name == "fp8":
            device = next(model.parameters()).device
            out["emulated"] = not hardware_support(device)[0]
            out["conversion"] = convert(model, recipe, skip_small=False)
        out[name] = train.train(model, examples, pad_token_id, config)
    plain, low = out["plain"].losses[-1], out["fp8"].losses[-1]
    out["loss_rel_diff"] = abs(low - plain) / plain
    return out


def plan_conversion(model, recipe: str = "tensorwise") -> Conversion:
    """Which linear layers of a real-size model torchao would convert: the model is built on the
    meta device (no memory), from a preset name, a ``config.json`` or a config.

    Args:
        model: a preset name, a ``config.json`` (or its folder) or a config.
        recipe: torchao's float8 scaling, "tensorwise" or "rowwise".

    Returns:
        A ``Conversion``: the layers converted, and each skipped one with its reason.

    Example:
        >>> plan_conversion("Llama-3.1-8B").summary()  # doctest: +SKIP
        'tensorwise: 160 linear layers in float8, skipped: 64 too small to gain ...'
    """
    from transformers import AutoModelForCausalLM

    from recipes_lib.fake_memory import model_config

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(model_config(model))
    return convert(net, recipe, emulate=False)
