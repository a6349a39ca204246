"""Will it fit? A small form for notebook 01: a model, a GPU, a length and the recipes in, one
training step measured on fake tensors out, as a chart of its anatomy and a verdict.

The HF Ultra-Scale Playbook's memory widget computes from formulas; this one measures
(``fake_memory.measure_step``), then adds the GPU's overhead as its own bar: the CUDA context
and the caching allocator's cache, the run replayed through its rules
(``planner.replayed_reserve``), or a fixed 15 % (``planner.gpu_overhead``). In JupyterLab and
Colab the form is interactive; headless runs (papermill, nbval) call :func:`verdict` with the
parameters cell's values instead.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from recipes_lib import allocator, calc, planner, trainers
from recipes_lib.fake_memory import METHODS, PRECISIONS, Stack, UnmeasuredStackError, measure_step
from recipes_lib.memory import MemoryReport

# the form's allocator menu: the settings the course compares, and axolotl's launch (its command
# line sets expandable segments and rounds requests to 16 steps a power of two)
LAUNCHES = {**allocator.SETTINGS, "expandable segments, roundup_power2_divisions:16 (axolotl)":
            "expandable_segments:True,roundup_power2_divisions:16"}


def make_stack(method: str = "qlora", checkpointing: bool = True, adamw_8bit: bool = False,
               chunked_loss: int = 0, precision: str = "bf16-mixed",
               attention_mask: bool = False) -> Stack:
    """The form's toggles as a ``fake_memory.Stack``.

    Args:
        method: "full", "lora" or "qlora".
        checkpointing: activation checkpointing.
        adamw_8bit: bitsandbytes' 8-bit AdamW instead of AdamW.
        chunked_loss: tokens per chunk of the chunked cross-entropy (0: the full logits).
        precision: "fp32", "bf16", "fp16" or "bf16-mixed".
        attention_mask: padded or packed rows, whose mask every layer gets
            (``fake_memory.Stack.attention_mask``).

    Returns:
        The stack.

    Raises:
        ValueError: naming the field, as ``fake_memory.Stack`` refuses it.
        TypeError: naming the field, for a toggle that is not a bool.
    """
    return Stack(method=method, precision=precision, checkpointing=checkpointing,
                 optimizer="adamw-8bit" if adamw_8bit else "adamw", chunked_loss=chunked_loss,
                 attention_mask=attention_mask)


def verdict(model: str, gpu_mem: str | float, seq_len: int, batch_size: int,
            stack: Stack, replay: bool = False, expandable_segments: bool = False,
            max_split_size_mb: int | None = None,
            roundup_power2_divisions: int | tuple[int, ...] | None = None) -> dict[str, Any]:
    """Measure one step and say whether it fits one GPU of ``gpu_mem``.

    Args:
        model: a preset name or a config path.
        gpu_mem: memory of one GPU, e.g. "24GB", or bytes, or a card's name
            (``planner.GPU_CARDS``: "T4"), whose settings are fp16 where it has no bf16.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        stack: the recipes applied.
        replay: the overhead is the CUDA context plus the run replayed through CUDA's caching
            allocator on the card (``planner.replayed_reserve``: two more fake steps), instead
            of the fixed reserve (``planner.gpu_overhead``); the text says where the other
            ``expandable_segments`` setting changes the verdict.
        expandable_segments: with ``replay``, replay as
            ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` runs.
        max_split_size_mb: with ``replay``, replay as
            ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N`` runs (None: unset).
        roundup_power2_divisions: with ``replay``, replay as
            ``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:D`` runs (None: unset).

    Returns:
        ``{"report", "overhead_bytes", "need_bytes", "budget_bytes", "fits", "text",
        "trainer_code"}``: the text says, for a mixture of experts under LoRA, what the
        adapters on its experts keep (``planner.note_expert_adapters``), and ends with the
        stack in a trainer's settings where it fits (``trainers.format_settings``). A mixture
        of experts whose experts the stack would keep in fp32 (the form's default, bf16-mixed),
        which transformers' grouped GEMM cannot multiply, is measured in pure bf16 instead, as
        ``plan --measure`` does, and the text says so.

    Raises:
        ValueError: naming the parameter, for what ``fake_memory`` or ``planner.parse_bytes``
            refuse (``UnmeasuredStackError`` where no stack near it can be measured).
    """
    setting = {"max_split_size_mb": max_split_size_mb,
               "roundup_power2_divisions": roundup_power2_divisions}
    planner.check_allocator_setting(replay, expandable_segments, **setting)
    as_set = planner.allocator_setting(expandable_segments, env=False, **setting)
    assumed = as_set != "the default allocator settings"
    budget = planner.parse_bytes(gpu_mem)
    said = []
    try:
        report = measure_step(model, stack, seq_len, batch_size)
    except UnmeasuredStackError as err:  # an MoE's experts in fp32: its nearest stack, said
        if err.substitute is None:
            raise
        said.append(f"{err.why}; measured {err.substitute.label!r} instead of "
                    f"{stack.label!r}, the nearest stack transformers' grouped GEMM runs")
        stack = err.substitute
        report = measure_step(model, stack, seq_len, batch_size)
    if replay:
        replayed = planner.replayed_reserve(model, stack, seq_len, batch_size, budget,
                                            expandable_segments, **setting)
        need, fits = replayed["gpu_GiB"] * 2**30, replayed["measured_fits"]
        overhead, how = need - report.peak_bytes, "CUDA context and allocator cache, replayed"
        if assumed:
            how += " with " + as_set
        if replayed["cache_released"] and fits:
            said.append(f"fits once the allocator releases its cache "
                        f"({replayed['cache_released']}x), as a full card does")
        said.append(f"the smallest card it fits: {replayed['needs_GiB']:.1f} GiB, the context "
                    "included (the cache released as a full card does); by allocator setting: "
                    + ", ".join(f"{name} {gib:.1f}"
                                for name, gib in replayed["needs_by_setting"].items()))
        if replayed["advice"]:
            said.append(replayed["advice"])
    else:
        overhead = planner.gpu_overhead(report.peak_bytes)
        need, how = report.peak_bytes + overhead, "modelled overhead"
        fits = need <= budget
    text = (f"{model}, {seq_len} x {batch_size} tokens, {stack.label}: "
            f"{need / 2**30:.1f} GiB on the GPU ({report.peak_bytes / 2**30:.1f} measured + "
            f"{overhead / 2**30:.1f} {how}) of {budget / 2**30:.1f} GiB: "
            f"{'fits' if fits else 'does NOT fit'}")
    notes: dict[str, Any] = {"notes": said}  # then an MoE's adapters, as the planner says
    planner.note_expert_adapters(model, {"step": stack.label,
                                         "measured_GiB": report.peak_bytes / 2**30},
                                 stack, seq_len, batch_size, notes)
    text += "".join(f"\nnote: {n}" for n in notes["notes"])
    card = planner.gpu_card(gpu_mem)  # a card without bf16: fp16 settings (planner.plan)
    try:
        code = trainers.format_settings(
            trainers.stack_settings(stack, batch_size, planner.settings_model(model, stack),
                                    bf16=not card or card.bf16),
            planner.script_model_id(str(model)))
    except ValueError as err:  # 16-bit trainable weights on a card without bf16
        code = f"# {err}"
    if fits:
        text += "\nin your trainer (TRL's SFTConfig takes the same args):\n" + code
        if replay and assumed:  # it assumed it
            launch = planner.allocator_setting(expandable_segments, **setting)
            text += f"\n# launch with {launch}: the replay assumed it"
    return {"report": report, "overhead_bytes": overhead, "need_bytes": need,
            "budget_bytes": budget, "fits": fits, "text": text, "trainer_code": code}


def plot_verdict(result: dict[str, Any], title: str = "One training step, fake tensors"):
    """The step's anatomy (GiB) with the modelled overhead on top and the GPU's size as a
    line.

    Args:
        result: :func:`verdict`'s result.
        title: the plot's title.

    Returns:
        The matplotlib figure.
    """
    from recipes_lib.compare import plot_memory_breakdown

    report = result["report"]
    shown = MemoryReport(report.peak_bytes, {**report.by_category,
                                             "other": report.by_category.get("other", 0)
                                             + int(result["overhead_bytes"])})
    fig = plot_memory_breakdown({"this step\n(+ overhead as other)": shown}, title, unit=2**30)
    ax = fig.axes[0]
    ax.axhline(result["budget_bytes"] / 2**30, color="black", linestyle="--", label="GPU")
    ax.legend(fontsize=8)
    return fig


def form(model: str = "Llama-3.1-8B", gpu_mem: str = "24GB", seq_len: int = 2048,
         batch_size: int = 1):
    """The interactive form (ipywidgets): fields, toggles, a Measure button and an output area
    that shows the verdict and the chart, or the error for a bad field.

    Args:
        model: the model field's first value (a preset name or a config path).
        gpu_mem: the GPU memory field's first value, e.g. "24GB" or "T4".
        seq_len: the sequence length field's first value.
        batch_size: the batch field's first value.

    Returns:
        The form (an ipywidgets box); its ``run()`` does what a click does and returns the text
        shown (for headless runs and tests).
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    fields = {
        "model": w.Combobox(value=model, options=calc.preset_names(),
                            description="model",
                            placeholder="built-in name, hub id or config.json"),
        "gpu_mem": w.Combobox(value=str(gpu_mem), description="GPU memory",
                              options=[card.name for card in planner.GPU_CARDS.values()],
                              placeholder="e.g. 24GB, 80GiB, or a card: T4"),
        "seq_len": w.IntText(value=seq_len, description="sequence"),
        "batch_size": w.IntText(value=batch_size, description="batch"),
        "method": w.Dropdown(options=list(METHODS), value="qlora", description="method"),
        # bf16-mixed: what Trainer runs with bf16=True; bf16: torchtitan's pure bf16, the only
        # precision a mixture of experts' grouped GEMM takes
        "precision": w.Dropdown(options=list(PRECISIONS), value="bf16-mixed",
                                description="precision"),
        "checkpointing": w.Checkbox(value=True, description="activation checkpointing"),
        "adamw_8bit": w.Checkbox(value=False, description="8-bit AdamW"),
        "chunked": w.Checkbox(value=False, description="chunked cross-entropy"),
        # a padding collator's rows, or packed documents kept apart: SDPA gets a mask a layer
        "attention_mask": w.Checkbox(value=False, description="padded or packed rows"),
        # the allocator's cache replayed (two more fake steps) instead of a fixed 15 %
        "replay": w.Checkbox(value=True, description="replay the caching allocator"),
        # the PYTORCH_CUDA_ALLOC_CONF the replay assumes (expandable segments: torchtitan's)
        "allocator": w.Dropdown(options=list(LAUNCHES), value="default",
                                description="allocator"),
    }
    button = w.Button(description="Measure", button_style="primary")
    out = w.Output()

    def run(_=None) -> str:
        out.clear_output()
        # a fake step of an 8 B model takes seconds to a minute on a CPU: say so meanwhile, and
        # take no second click until it is done
        button.disabled, button.description = True, "Measuring..."
        with out:
            print(f"measuring one training step of {fields['model'].value} on fake tensors...")
            try:
                stack = make_stack(fields["method"].value, fields["checkpointing"].value,
                                   fields["adamw_8bit"].value,
                                   1024 if fields["chunked"].value else 0,
                                   fields["precision"].value, fields["attention_mask"].value)
                result = verdict(fields["model"].value, fields["gpu_mem"].value,
                                 fields["seq_len"].value, fields["batch_size"].value, stack,
                                 fields["replay"].value,
                                 **allocator.parse_settings(LAUNCHES[fields["allocator"].value]))
            except ValueError as err:
                out.clear_output(wait=True)
                print(f"error: {err}")
                return f"error: {err}"
            except Exception as err:  # noqa: BLE001 - a callback's error reaches no cell
                # an error raised in a click's callback goes to the front end's log, not to
                # the notebook: show it here, whole
                out.clear_output(wait=True)
                traceback.print_exc(file=sys.stdout)
                return f"error: {type(err).__name__}: {err}"
            finally:
                button.disabled, button.description = False, "Measure"
            out.clear_output(wait=True)  # the line above goes when the verdict comes
            print(result["text"])
            fig = plot_verdict(result)
            display(fig)
            plt.close(fig)
            return result["text"]

    button.on_click(run)
    box = w.VBox([*fields.values(), button, out])
    box.run = run  # what a click does, returning the text shown (headless use and tests)
    return box
