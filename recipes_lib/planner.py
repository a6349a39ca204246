"""Which recipes make a training run fit: the calculator's escalation, from the command line.

``python -m recipes_lib plan --model Llama-2-7B --gpu-mem 16GB --seq 2048 --batch 8`` lists, in
the order practitioners escalate, the predicted memory of each step (full fine-tune -> with 8-bit
AdamW states -> LoRA -> QLoRA -> activation checkpointing -> gradient accumulation -> optimizer
offload -> FSDP across the GPUs) and names the first that fits. Built-in shapes (``calc.PRESETS``) work offline; any
transformers ``config.json`` works too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from recipes_lib import calc

_UNITS = {"": 2**30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30, "t": 2**40}


def parse_bytes(text: str | float, name: str = "gpu_mem") -> float:
    """``"16GB"`` -> 16e9, ``"24GiB"`` / ``"24G"`` / ``24`` -> 24 * 2**30 (a bare number is GiB).

    Raises:
        ValueError: naming ``name`` for an unparsable, zero or negative size.

    Example:
        >>> parse_bytes("16GB"), parse_bytes("1.5 GiB")
        (16000000000.0, 1610612736.0)
    """
    m = re.fullmatch(r"\s*([-+]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={text!r}: not a size; write e.g. 16GB, 24GiB or 80")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{name}={text!r}: must be > 0")
    return value


def resolve_shape(model: str) -> tuple[str, calc.ModelShape]:
    """A built-in name (case-insensitive), a ``config.json`` or a folder holding one.

    Raises:
        ValueError: for an unknown name (listing the built-ins) or a file that is not a
            transformers decoder config.
    """
    by_lower = {k.lower(): k for k in calc.PRESETS}
    key = model.split("/")[-1].lower()  # "meta-llama/Llama-2-7B" -> "llama-2-7b"
    if key in by_lower:
        return by_lower[key], calc.PRESETS[by_lower[key]]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"model={model!r}: not a JSON config file ({err})") from err
        if not isinstance(config, dict):
            raise ValueError(f"model={model!r}: not a transformers config")
        return path.parent.name or model, calc.ModelShape.from_config(config)
    raise ValueError(f"model={model!r}: not a built-in model ({', '.join(calc.PRESETS)}) and "
                     "no config.json there; hub ids cannot be fetched offline, so pass a "
                     "local config.json")


def plan(model: str, gpu_mem: str | float, seq_len: int = 2048, batch_size: int = 8,
         gpus: int = 1, grad_accum_steps: int | None = None) -> dict[str, Any]:
    """Predicted per-GPU memory of each escalation step and the cheapest one that fits.

    Args:
        model: built-in name or path to a transformers config.json.
        gpu_mem: memory of one GPU, e.g. "16GB" (a T4), "80GiB".
        seq_len, batch_size: tokens per sequence and sequences per optimizer step.
        gpus: GPUs for the last step, a full fine-tune sharded with FSDP.
        grad_accum_steps: micro-batches per step in the accumulation row (default: the largest
            divisor of ``batch_size`` up to 4).

    Returns:
        ``{"model", "params_B", "gpu_bytes", "rows", "cheapest"}``; each row has step,
        state_GiB, activations_GiB, total_GiB, fits.

    Example:
        >>> plan("Llama-2-7B", "16GB", seq_len=512, batch_size=1, grad_accum_steps=1)["cheapest"]
        'QLoRA (NF4 base)'
    """
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("gpus", gpus)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an integer >= 1")
    if grad_accum_steps is None:
        grad_accum_steps = max(k for k in range(1, 5) if batch_size % k == 0)
    name, shape = resolve_shape(model)
    budget = parse_bytes(gpu_mem)
    rows = calc.escalation_table(shape, seq_len, batch_size, budget, grad_accum_steps)
    fs = calc.data_parallel_bytes(shape, gpus, "fsdp", seq_len, max(1, batch_size // gpus))
    rows.append({"step": f"full fine-tune, FSDP over {gpus} GPUs + checkpointing",
                 "state_GiB": (fs["state"] + fs["gathered"]) / 2**30,
                 "activations_GiB": fs["activations"] / 2**30,
                 "total_GiB": fs["gpu_total"] / 2**30, "fits": fs["gpu_total"] <= budget})
    cheapest = next((r["step"] for r in rows if r["fits"]), "nothing fits")
    return {"model": name, "params_B": calc.param_count(shape)["total"] / 1e9,
            "gpu_bytes": budget, "rows": rows, "cheapest": cheapest}


def format_plan(result: dict[str, Any]) -> str:
    """The plan as a plain-text table."""
    lines = [(f"{result['model']}: {result['params_B']:.2f} B parameters, "
              f"{result['gpu_bytes'] / 2**30:.1f} GiB per GPU"),
             f"{'step':<52} {'state':>8} {'activ.':>8} {'total':>8}  fits"]
    for r in result["rows"]:
        lines.append(f"{r['step']:<52} {r['state_GiB']:>7.1f}G {r['activations_GiB']:>7.1f}G "
                     f"{r['total_GiB']:>7.1f}G  {'yes' if r['fits'] else 'no'}")
    lines.append(f"cheapest that fits: {result['cheapest']}")
    return "\n".join(lines)
