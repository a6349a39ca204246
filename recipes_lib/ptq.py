"""INT8 post-training quantization of Linear layers, and which layers it hurts.

Weights are stored as int8 with one fp32 scale and int32 zero point per output channel: 1 byte
per weight plus ``8 / in_features``, about 0.25x fp32 (``calc.int8_linear_bytes``). *Dynamic*
quantization also quantizes each activation on the fly (per tensor) and runs the matmul in int8
with int32 accumulation, so it saves compute as well as bytes where the CPU has fast int8
instructions.

- CPU: PyTorch's dynamic quantization (``torch.ao.quantization.quantize_dynamic``, fbgemm / x86
  kernels). PyTorch deprecates it in favour of torchao's ``quantize_`` with
  ``Int8DynamicActivationInt8WeightConfig`` (``quantize_int8_torchao``). Which is faster depends
  on the CPU's int8 instructions (``compare_int8_backends``: the same prefill timed in
  alternation; notebook 03 runs it at ``make run`` and claims this module's path is at least as
  fast). Prefill of 16 prompts of up to 128 tokens on the tiny default model, torch 2.13,
  torchao 0.18, one run each: on the 2-core AVX2 reference, fp32 126 ms, ``torch.ao`` 106 ms
  (1.18x fp32), torchao eager 2377 ms (0.05x), torchao compiled 2303 ms (0.05x, after ~40 s of
  compilation); on a 2-core Intel Xeon with AVX512-VNNI and AMX, fp32 96 ms, ``torch.ao`` 79 ms
  (1.21x), torchao eager 147 ms (0.65x), torchao compiled 36 ms (2.64x). So the recipe keeps the
  deprecated path, the fast one on the reference; ``make bench`` fails there when torchao
  catches up (time to move), the notebook says NOT MET where it already has, and
  ``tests/test_ptq.py`` fails when the old API disappears.
- CUDA: bitsandbytes' LLM.int8 (Dettmers et al., 2022), which keeps outlier feature columns in
  fp16 (``load_int8``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from recipes_lib.compiling import first_call


def linear_names(model: torch.nn.Module) -> list[str]:
    """Names of every ``torch.nn.Linear`` in ``model`` (the LM head included).

    Args:
        model: any module.

    Returns:
        The names, in module order.

    Example:
        >>> linear_names(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        ['0']
    """
    return [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]


def quantize_int8_dynamic(model: torch.nn.Module, skip: Iterable[str] = ()) -> torch.nn.Module:
    """A copy of ``model`` with every Linear (except ``skip``) dynamically quantized to int8.

    Args:
        model: an fp32 model on the CPU.
        skip: names of Linear layers left in fp32 (e.g. the most sensitive ones).

    Returns:
        The quantized copy; ``model`` itself is unchanged.

    Raises:
        ValueError: if ``model`` has no Linear layer left to quantize, ``skip`` names a layer that
            is not a Linear, or the model is not an fp32 CPU model.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64))
        >>> type(quantize_int8_dynamic(m)[0]).__name__
        'Linear'
    """
    names = linear_names(model)
    skip = set(skip)
    unknown = skip - set(names)
    if unknown:
        raise ValueError(f"skip={sorted(unknown)}: not Linear layers of the model")
    targets = [n for n in names if n not in skip]
    if not targets:
        raise ValueError("model: has no torch.nn.Linear layers to quantize"
                         + (" (all were skipped)" if names else ""))
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"model: dynamic int8 quantization runs on fp32 CPU models, got "
                         f"{p.dtype} on {p.device.type}; on CUDA use load_int8 (LLM.int8)")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # torch.ao's deprecation notice, see the module docstring
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated",
                                category=DeprecationWarning)
        return quantize_dynamic(copy.deepcopy(model).eval(),
                                {n: per_channel_dynamic_qconfig for n in targets},
                                dtype=torch.qint8)


def load_int8(model_path: str | Path, device: torch.device, skip: Iterable[str] = ()
              ) -> torch.nn.Module:
    """Load a model with int8 Linear layers: LLM.int8 on CUDA, dynamic int8 on the CPU.

    Args:
        model_path: a folder or hub id.
        device: where it runs.
        skip: Linear layers left in full precision.

    Returns:
        The int8 model.
    """
    from recipes_lib.model import load_model

    if device.type == "cuda":
        from transformers import BitsAndBytesConfig

        from recipes_lib.quantization import require_bitsandbytes

        require_bitsandbytes()
        cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(skip) or None)
        return load_model(model_path, dtype=torch.float16, quantization_config=cfg,
                          device=device)
    return quantize_int8_dynamic(load_model(model_path), skip)


def int8_linear_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the int8 Linear layers' weights and scales, and how many weights they hold.

    Counts torch's dynamic quantized Linear (packed int8 weight + scales + zero points) and
    bitsandbytes' ``Linear8bitLt`` (int8 weight + one fp32 scale per row).

    Args:
        model: a model quantized to int8.

    Returns:
        ``{"bytes", "params"}``: bytes held by the int8 layers, and the weights they hold.

    Raises:
        ValueError: if the model has no int8 Linear layer.
    """
    total = params = 0
    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            w = module.weight()
            scales = (w.q_per_channel_scales().numel()
                      if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric)
                      else 1)
            total += w.numel() + scales * (4 + 4)  # fp32 scale + int32 zero point
            params += w.numel()
        elif type(module).__name__ == "Linear8bitLt":
            w = module.weight
            total += w.numel() * w.element_size()
            scb = getattr(w, "SCB", None)
            total += 0 if scb is None else scb.numel() * scb.element_size()
            params += w.numel()
    if params == 0:
        raise ValueError("model: has no int8 Linear layers (quantize it first)")
    return {"bytes": total, "params": params}


def quantize_int8_torchao(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with torchao's ``Int8DynamicActivationInt8WeightConfig`` applied: the
    kept API that succeeds ``torch.ao.quantization.quantize_dynamic`` (see the module docstring
    for why the notebooks still time the older path on a CPU).

    Args:
        model: the fp32 model (left unchanged).

    Returns:
        The quantized copy.
    """
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    q = copy.deepcopy(model).eval()
    quantize_(q, Int8DynamicActivationInt8WeightConfig())
    return q


def compare_int8_backends(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                          repeats: int = 5, compile_torchao: bool = True) -> dict[str, Any]:
    """Prefill time of fp32, ``torch.ao``'s dynamic int8 and torchao's int8 (eager, and
    ``torch.compile``d), timed in alternation in one run, with each int8 path's largest logit
    difference from fp32.

    Args:
        model: the fp32 model.
        batch: the prefill batch.
        repeats: timed passes of each, in alternation.
        compile_torchao: time torchao's int8 compiled too.

    Returns:
        ``{name: {"seconds", "spread", "speedup_vs_fp32", "max_abs_logit_diff"}}``; the
        compiled variant also has ``"compile_s"`` (its first call).
    """
    from recipes_lib.timing import time_interleaved

    model = model.eval()
    ids = {"input_ids": batch["input_ids"]}
    variants = {"fp32": model, "torch.ao dynamic int8": quantize_int8_dynamic(model),
                "torchao int8 (eager)": quantize_int8_torchao(model)}
    compile_s = None
    with torch.inference_mode():
        ref = model(**ids).logits
        if compile_torchao:
            compiled = torch.compile(quantize_int8_torchao(model))
            _, compile_s = first_call(lambda: compiled(**ids))  # as a first run compiles it
            variants["torchao int8 (compiled)"] = compiled
        diffs = {name: float((m(**ids).logits - ref).abs().max()) for name, m in variants.items()}
        times = time_interleaved({name: (lambda m=m: m(**ids)) for name, m in variants.items()},
                                 warmup=1, repeats=repeats)
    out = {name: {"seconds": t.median_s, "spread": t.spread,
                  "speedup_vs_fp32": times["fp32"].median_s / t.median_s,
                  "max_abs_logit_diff": diffs[name]} for name, t in times.items()}
    if compile_s is not None:
        out["torchao int8 (compiled)"]["compile_s"] = compile_s
    return out


def check_int8_backends(results: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                        repeats: int = 5, compile_torchao: bool = True,
                        strict: bool | None = None) -> dict[str, Any]:
    """:func:`compare_int8_backends`, recorded: each int8 path's prefill speed-up over fp32 and
    largest logit difference from fp32 (``int8/prefill_speedup, <path>``,
    ``int8/max_logit_diff, <path>``), and the claim that keeps this module's deprecated path:
    ``torch.ao``'s dynamic int8 at least as fast as torchao's fastest (``checks.check_speed``;
    NOT MET tells that torchao is the faster path on this CPU).

    Args:
        results: the notebook's ``results.Results``.
        model: the fp32 model.
        batch: the prefill batch.
        repeats: timed passes of each path, in alternation.
        compile_torchao: time torchao's paths compiled too.
        strict: assert the speed claim (None: report it; ``make bench`` asserts).

    Returns:
        :func:`compare_int8_backends`'s rows.
    """
    from recipes_lib.checks import check_speed, spread_of

    out = compare_int8_backends(model, batch, repeats, compile_torchao)
    for name, row in out.items():
        results.add("int8", f"prefill_speedup, {name}", row["speedup_vs_fp32"], baseline=1.0,
                    unit="x fp32")
        if name != "fp32":
            results.add("int8", f"max_logit_diff, {name}", row["max_abs_logit_diff"],
                        baseline=0.0, unit="abs, vs fp32")
    ours = out["torch.ao dynamic int8"]
    best = min((row for name, row in out.items() if name.startswith("torchao")),
               key=lambda row: row["seconds"])
    check_speed(results, "int8", "torch.ao dynamic int8 (this recipe's path) over torchao's "
                "fastest, prefill", best["seconds"] / ours["seconds"], 1.0,
                spread=spread_of(ours["spread"], best["spread"]), strict=strict)
    return out


def linear_kernel_speedup(model: torch.nn.Module, tokens: int = 2048, repeats: int = 5
                          ) -> float:
    """fp32 time / int8 time of the model's Linear layers alone, at their shapes, on random input.

    The kernel-level ceiling of the recipe; with the share of prefill time spent in Linear layers
    it predicts the whole-model speed-up (``calc.amdahl_speedup``).

    Args:
        model: the fp32 model.
        tokens: rows of the random input.
        repeats: timed passes of each, in alternation.

    Returns:
        The speed-up of the Linear layers alone.

    Raises:
        ValueError: if the model has no ``torch.nn.Linear`` layers.
    """
    from recipes_lib.timing import time_interleaved

    shapes: dict[tuple[int, int], int] = {}
    for name in linear_names(model):
        m = model.get_submodule(name)
        shapes[(m.in_features, m.out_features)] = shapes.get((m.in_features, m.out_features), 0) + 1
    if not shapes:
        raise ValueError("model: has no torch.nn.Linear layers")
    t32 = t8 = 0.0
    for (i, o), count in shapes.items():
        fp32 = torch.nn.Sequential(torch.nn.Linear(i, o, bias=False))
        int8 = quantize_int8_dynamic(fp32)
        x = torch.randn(tokens, i)
        with torch.inference_mode():
            t = time_interleaved({"fp32": lambda m=fp32, x=x: m(x),
                                  "int8": lambda m=int8, x=x: m(x)}, repeats=repeats)
        t32 += count * t["fp32"].median_s
        t8 += count * t["int8"].median_s
    return t32 / t8


def layer_sensitivity(
    model: torch.nn.Module,
    eval_fn: Callable[[torch.nn.Module], float],
    names: list[str] | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """How much each Linear alone hurts when quantized: ``eval_fn(one layer int8) - eval_fn(fp32)``.

    Args:
        model: the fp32 CPU model.
        eval_fn: e.g. eval loss on a held-out subset (lower is better).
        names: the layers to try (default every Linear).
        progress: show a progress bar.

    Returns:
        layer name -> increase of ``eval_fn``, largest first.
    """
    from tqdm.auto import tqdm

    names = names if names is not None else linear_names(model)
    base = eval_fn(model)
    out = {}
    everything = set(linear_names(model))
    for name in tqdm(names, desc="int8 sensitivity", disable=not progress, leave=False):
        out[name] = eval_fn(quantize_int8_dynamic(model, skip=everything - {name})) - base
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@torch.no_grad()
def activation_outliers(model: torch.nn.Module, batch: dict[str, torch.Tensor]
                        ) -> dict[str, float]:
    """Per Linear: max |input| / mean |input| over a batch, the outlier ratio LLM.int8 is about.

    A large ratio means one per-tensor int8 scale must cover a few huge values, so the many small
    ones get few levels: the layer quantizes badly.

    Args:
        model: the fp32 model.
        batch: a calibration batch.

    Returns:
        Linear layer name -> its ratio.
    """
    ratios: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            def hook(mod, args, out, name=name):
                x = args[0].abs().float()
                ratios[name] = float(x.max() / x.mean().clamp_min(1e-12))
            hooks.append(module.register_forward_hook(hook))
    try:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in hooks:
            h.remove()
    return ratios


def _mlp(hidden: int) -> torch.nn.Module:
    """A Llama-shaped MLP without the gate (hidden -> 4 hidden -> hidden, no bias), eval mode."""
    torch.manual_seed(hidden)
    return torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden, bias=False),
                               torch.nn.Linear(4 * hidden, hidden, bias=False)).eval()


def quantize_int8_weight_only(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with torchao's ``Int8WeightOnlyConfig``: int8 weights (one scale per
    output channel) dequantized into the activations' dtype inside the matmul. Nothing is
    quantized on the fly, so it is the decode recipe: at batch 1 a matmul reads each weight once,
    and 1 byte instead of 4 is the saving, when a kernel fuses the dequantization (compiled).

    Args:
        model: the model (left unchanged).

    Returns:
        The quantized copy.
    """
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    q = copy.deepcopy(model).eval()
    quantize_(q, Int8WeightOnlyConfig())
    return q


def decode_sweep(hidden_sizes: list[int], repeats: int = 5, compile_weight_only: bool = True,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Batch-1 decode (one token through a ``hidden -> 4 hidden -> hidden`` MLP), the
    unquantized MLP against torchao's weight-only int8 over the hidden size, both with
    activations in ``dtype``, timed in alternation (``sweep.run_sweep``).

    The recipe is weight-only int8 compiled with ``torch.compile``; the eager weight-only, and
    ``torch.ao``'s dynamic int8 (the prefill recipe; fp32 only) or, for 16-bit activations, the
    fp32 MLP are timed beside it. Compilation happens before timing; its seconds are not in
    the figures. Work per call: the baseline's ``2 * 8 h^2`` FLOPs and ``8 h^2`` weights'
    bytes (memory-bound once the weights leave the caches).

    What the compiled recipe runs depends on ``dtype`` (torch 2.13, torchao 0.18, on a CPU):
    with bf16 activations Inductor lowers the dequantize-then-matmul to PyTorch's CPU
    weight-only kernel (``aten._weight_int8pack_mm``), which reads the int8 weight once; with
    fp32 (or fp16) activations it does not, and writes the dequantized weight before an ordinary
    matmul (more bytes than the unquantized layer alone). Eager torchao dequantizes the whole
    weight first in any dtype.

    Args:
        hidden_sizes: at least three, growing.
        compile_weight_only: compile the recipe (needs a C++ compiler on CPU, Triton on CUDA;
            ``compiling.compile_available``); False times eager weight-only as the recipe.
        dtype: the activations' (and the baseline's weights') dtype: float32, bfloat16 or
            float16.

    Returns:
        A ``sweep.Sweep`` (recipe "int8_weight_only", or "int8_weight_only_bf16" /
        "int8_weight_only_fp16"; dimension "hidden").

    Raises:
        ValueError: for sizes a sweep cannot use, a dtype other than those three, or
            compilation asked where it cannot run.
    """
    from recipes_lib.compiling import require_compile
    from recipes_lib.sweep import run_sweep

    names = {torch.float32: "", torch.bfloat16: "_bf16", torch.float16: "_fp16"}
    if dtype not in names:
        raise ValueError(f"dtype={dtype}: decode_sweep takes torch.float32, torch.bfloat16 or "
                         "torch.float16 activations")
    device = torch.device(device)
    if compile_weight_only:
        require_compile(device)

    def make(h: int):
        fp32 = _mlp(h).to(device)
        base = fp32 if dtype == torch.float32 else copy.deepcopy(fp32).to(dtype)
        wo = quantize_int8_weight_only(base)
        x = torch.randn(1, h, device=device).to(dtype)
        if compile_weight_only:  # a fresh dynamo per size: a recompile would go dynamic-shaped
            torch._dynamo.reset()
        recipe = torch.compile(wo) if compile_weight_only else wo
        with torch.inference_mode():
            recipe(x)  # compile (or warm) outside the timing

        def run(m, inp=x):
            with torch.inference_mode():
                return m(inp)
        fns = {"baseline": lambda: run(base), "recipe": lambda: run(recipe)}
        if compile_weight_only:
            fns["weight-only int8 (eager)"] = lambda: run(wo)
        if dtype != torch.float32:
            fns["fp32"] = lambda: run(fp32, x.float())
        elif device.type == "cpu":
            dyn = quantize_int8_dynamic(fp32)
            fns["dynamic int8"] = lambda: run(dyn)
        return fns

    def work(h: int) -> tuple[float, float]:
        return 2 * 8 * h * h, torch.empty((), dtype=dtype).element_size() * 8 * h * h
    return run_sweep(f"int8_weight_only{names[dtype]}", "hidden", hidden_sizes, make, work,
                     device, repeats=repeats, progress=False, dtype=dtype)


def prefill_sweep(rows: list[int], hidden: int = 1024, repeats: int = 5):
    """Prefill through the same MLP, fp32 against ``torch.ao``'s dynamic int8 (this module's
    prefill recipe), over the rows (batch x tokens) of the activation, on the CPU: where int8
    matmuls start to pay. Work per call: ``2 * 8 h^2 * rows`` FLOPs, the fp32 weights and
    activations in bytes.

    Args:
        rows: the activation's rows, at least three, growing.
        hidden: the MLP's width.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "int8", dimension "rows").
    """
    from recipes_lib.sweep import run_sweep

    fp32 = _mlp(hidden)
    dyn = quantize_int8_dynamic(fp32)

    def make(n: int):
        x = torch.randn(n, hidden)

        def run(m):
            with torch.inference_mode():
                return m(x)
        return {"baseline": lambda: run(fp32), "recipe": lambda: run(dyn)}

    def work(n: int) -> tuple[float, float]:
        return 2 * 8 * hidden * hidden * n, 4 * (8 * hidden * hidden + 6 * hidden * n)
    return run_sweep("int8", "rows", rows, make, work, "cpu", repeats=repeats, progress=False)
