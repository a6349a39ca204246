"""Command line: ``python -m recipes_lib {run,bench,readme,check-notebooks,data,plan,colab}``.

- ``run``: execute every notebook with papermill (``-p NAME VALUE`` as papermill takes it) into
  ``notebooks/executed/``, validate the calculator against measured tensors, then refresh the
  README's results table and write ``report.md`` and the self-contained ``report.html`` in the
  results directory (``$RECIPES_RESULTS_DIR``, else ``results/``). A notebook that fails is
  reported as failed and the others still run.
- ``bench``: ``run``, the fake-tensor checks
  (``real_scale.json``), then every speed claim recorded, with
  its figure, spread and verdict; exits non-zero if one is not met on the reference machine
  (``checks.REFERENCE``).
  Elsewhere the verdicts are printed, not asserted, and the output says why.
- ``archs``: every notebook on a tiny model of each architecture (Qwen2, Qwen3, Mistral, Phi-3,
  Gemma-2 and Llama; ``notebooks.architecture_matrix``), recorded as ``architectures.json`` and
  the README's architecture x notebook table; exits non-zero if a cell failed. ``make bench``
  runs it too.
- ``readme``: refresh the README's results table only.
- ``check-notebooks``: fail if a committed notebook carries outputs or execution counts
  (``--strip`` removes them).
- ``data``: regenerate the corpora in ``data/``.
- ``plan``: which recipes make a training run fit (``recipes_lib.planner``).
- ``colab``: stamp the "Open in Colab" badge and the Colab-only install cell into every notebook
  (``recipes_lib.colab``), given the repository's public GitHub ``owner/name``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# make bench's configs whose linear layers do not split into whole torchao NF4 blocks over 2 FSDP
# ranks (no FSDP + QLoRA row for them)
NF4_UNSPLIT = frozenset({"tiny"})


def search_processes() -> int:
    """How many processes ``plan --max-context`` searches in: one per core, or as many as
    ``OMP_NUM_THREADS`` gives this process where it is set (the test suite gives each of its
    workers one: two spawned searches there only added their imports, and a CLI test took
    7.4 s instead of 4.1).

    Returns:
        At least 1.
    """
    given = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, int(given) if given.isdigit() else os.cpu_count() or 1)


def claims_table(results_dir: Path | str | None = None) -> list[dict]:
    """Every speed claim recorded in the results directory, one row per claim.

    Args:
        results_dir: the results folder (default: the results setting's).

    Returns:
        One dict per claim: ``notebook`` and the claim's fields (recipe, claim, value, target,
        spread, met).
    """
    from recipes_lib import results

    return [{"notebook": stem, **claim}
            for stem, res in results.load_results(results_dir).items()
            for claim in res.get("claims", [])]


def format_claims(rows: list[dict]) -> str:
    """The claims as aligned text lines: verdict, notebook, recipe, claim, figure, spread.

    Args:
        rows: :func:`claims_table`'s rows.

    Returns:
        The lines, joined.
    """
    lines = []
    for c in rows:
        sign = ">=" if c["at_least"] else "<="
        spread = "" if c["spread"] is None else f"  spread {c['spread']:.0%}"
        where = c["notebook"][:2] if c["notebook"][:2].isdigit() else c["notebook"]
        lines.append(f"{'MET    ' if c['met'] else 'NOT MET'}  {where}  "
                     f"{c['recipe']}: {c['claim']}: {c['value']:.3g} {sign} {c['target']:.3g}"
                     f"{spread}")
    return "\n".join(lines)


def capped_results_dir(isa: str) -> Path:
    """Where ``run --cap-isa ISA`` puts its figures by default: beside the uncapped ones.

    Args:
        isa: the cap, e.g. "avx2".

    Returns:
        ``results/cpu-<isa>-capped``.
    """
    from recipes_lib.results import RESULTS_DIR

    return RESULTS_DIR / f"cpu-{isa}-capped"


def isa_claims_markdown(native_dir: Path | str, capped_dir: Path | str) -> str:
    """Every speed claim of an uncapped run beside the same claim with the CPU kernels capped
    (``run --cap-isa``), as a Markdown table: figure, spread and verdict on each side, for the
    notebooks the capped run recorded. A claim one side did not make (e.g. one that needs native
    bf16) reads "not claimed"; figures inside a claim's name are ignored when pairing them.

    Args:
        native_dir: the uncapped run's results folder.
        capped_dir: the capped run's.

    Returns:
        The Markdown table.
    """
    import re

    from recipes_lib import results

    def key(c: dict) -> tuple[str, str, str]:
        return c["notebook"], c["recipe"], re.sub(r" \([\d.]+x\)", "", c["claim"])

    def cell(c: dict | None) -> str:
        if c is None:
            return "not claimed"
        spread = "" if c["spread"] is None else f" (spread {c['spread']:.0%})"
        return f"{c['value']:.3g}{spread} {'met' if c['met'] else '**NOT MET**'}"

    stems = set(results.load_results(capped_dir))
    sides = [{key(c): c for c in claims_table(d) if c["notebook"] in stems}
             for d in (native_dir, capped_dir)]
    devices = [sorted({res["device"] for stem, res in results.load_results(d).items()
                       if stem in stems and res.get("claims")}) for d in (native_dir, capped_dir)]
    lines = [f"Uncapped: {'; '.join(devices[0])}. Capped: {'; '.join(devices[1])}.", "",
             "| notebook | claim | target | uncapped | capped |", "|---|---|---:|---:|---:|"]
    for k in sorted(dict.fromkeys([*sides[0], *sides[1]]), key=lambda k: k[0]):
        c = sides[0].get(k) or sides[1][k]
        lines.append(f"| {k[0][:2]} | {k[1]}: {k[2]} | "
                     f"{'>=' if c['at_least'] else '<='} {c['target']:.3g} | "
                     f"{cell(sides[0].get(k))} | {cell(sides[1].get(k))} |")
    return "\n".join(lines)


def bench_verdict(rows: list[dict], reference: bool, how: str) -> tuple[str, bool]:
    """The benchmark's last line, and whether it passes: every claim met on the reference
    machine; anywhere else the verdicts are reported, never a failure.

    Args:
        rows: :func:`claims_table`'s rows.
        reference: whether this is the reference machine.
        how: how this machine differs from it, if it does.

    Returns:
        ``(line, passes)``.
    """
    missed = [c for c in rows if not c["met"]]
    if not reference:
        return (f"not the reference machine ({how}): {len(missed)} of {len(rows)} speed claims "
                "not met here, reported, not asserted"), True
    if not rows:
        return "no speed claim was recorded: did the notebooks run?", False
    if missed:
        return f"{len(missed)} of {len(rows)} speed claims NOT MET on the reference machine", False
    return f"all {len(rows)} speed claims met on the reference machine", True


def real_scale_benchmark() -> None:
    """``make bench``'s fake-tensor checks, recorded as ``real_scale.json``: fake vs real peak
    per category on this CPU for a tiny and a ~110 M-parameter config under every recipe flag
    (value = fake / real; FSDP against both ranks of a real 2-rank job, FSDP + QLoRA at 110 M,
    FSDP's CPU offload with the GPU and the host apart), one Llama-3.1-8B
    training step measured on fake tensors, timed (the claim: at most 90 s on the reference
    machine), and the published GPU figures beside our predictions (``published``).

    Each measurement is kept as it is made (``results.Progress``): an interrupted run (it takes
    an hour or more on a 2-core CPU) resumes where it stopped when run again with the same code,
    packages and device."""
    import time
    from dataclasses import replace
    from functools import partial

    import torch
    from transformers import LlamaConfig

    from recipes_lib import (
        checks,
        device,
        fake_memory,
        published,
        results,
    )

    S = fake_memory.Stack
    # every flag at both sizes (bf16 is emulated on CPUs without AVX512-BF16 / AMX, such as the
    # AVX2 reference: there the 16-bit rows at 110 M parameters take minutes each)
    flags = [S(precision="fp32"), S(precision="fp32", checkpointing=True),
             S(method="lora", precision="fp32"), S(method="qlora", precision="fp32"),
             S(precision="fp32", grad_accum_steps=2), S(optimizer="sgd", precision="fp32"),
             S(optimizer="adamw-8bit", precision="fp32"), S(precision="fp32", chunked_loss=128),
             S(precision="fp32", loss="transformers-4.46"), S(precision="fp32", loss="litgpt"),
             S(method="lora", precision="fp32", lora_dropout=0.1, gpu_dropout=True),
             S(method="qlora", precision="fp32", nf4_keeps_input=True),
             S(precision="fp32", attention_mask=True)]
    sixteen = [S(), S(precision="fp16"), S(precision="bf16-mixed"),
               S(method="lora", checkpointing=True),
               S(method="qlora", checkpointing=True, autocast_adapter_dtype=False),
               S(method="qlora", precision="bf16-mixed", checkpointing=True),
               S(method="qlora", precision="bf16-mixed", checkpointing=True,
                 bf16_embeddings=True),
               S(method="qlora", precision="bf16-mixed", checkpointing=True,
                 bf16_embeddings=True, loss="transformers-4.46"),
               S(method="qlora", lora_rank=8, lora_targets=("q_proj", "v_proj"),
                 lora_dropout=0.05, autocast_adapter_dtype=False, gpu_dropout=True,
                 nf4_keeps_input=True, loss="litgpt")]
    sharded = [S(precision="fp32", fsdp_ranks=2), S(precision="bf16-mixed", fsdp_ranks=2),
               S(method="lora", precision="bf16-mixed", checkpointing=True, fsdp_ranks=2),
               # FSDP + QLoRA as notebook 02 runs it (torchao's NF4 dequantization)
               S(method="qlora", precision="bf16-mixed", checkpointing=True, fsdp_ranks=2)]
    configs = {"tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512),
               "110M": LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                   num_hidden_layers=12, num_attention_heads=12,
                                   num_key_value_heads=4, max_position_embeddings=512)}
    r = results.Results("real_scale", device.describe_device(torch.device("cpu")))
    kept = results.Progress("real_scale", r.device)
    if kept.reused:
        print(f"  resuming: {kept.reused} measurements kept by an interrupted run ({kept.path})")
    for name, cfg in configs.items():
        for stack in flags + sixteen:
            key = f"fake vs real: {name}: {stack!r}"
            out = kept.value(key, partial(_fake_vs_real_ratios, cfg, stack, 256, 2))
            worst = max(abs(v - 1) for v in out["ratios"].values() if v != float("inf"))
            print(f"  fake vs real, {name}, {stack.label}: peak {out['peak_ratio']:.4f}, "
                  f"worst category {worst:.2e}{kept.said(key)}")
            r.add("fake_vs_real", f"{name}: {stack.label}", out["peak_ratio"], baseline=1.0,
                  unit="fake / real peak, 2 x 256 tokens, CPU")
    # FSDP: rank 0 of a fake process group against both ranks of a real 2-rank gloo job (the fake
    # rank holds gloo's copy of each reduce-scatter input: comm_backend="gloo")
    jobs = _sharded_jobs(configs, sharded)
    reals = _real_ranks(kept, "fsdp: real gloo ranks' peaks", jobs)
    for (name, cfg, stack), ranks in zip(jobs, reals):
        keys = {backend: f"fsdp: fake rank ({backend}): {name}: {stack!r}"
                for backend in ("gloo", "nccl")}
        fake, nccl = (kept.value(key, partial(_fake_rank, cfg, stack, 256, 2, backend))["gpu"]
                      for backend, key in keys.items())
        ratio = max((fake / sum(rank.values()) for rank in ranks),
                    key=lambda x: abs(x - 1))  # the rank farthest from the fake one
        # the same rank counted as a GPU (NCCL) rank, without gloo's copy: the gap it explains
        nccl_ratio = min(nccl / sum(rank.values()) for rank in ranks)
        print(f"  fake vs real, {name}, {stack.label}: peak {ratio:.4f} (worst rank); "
              f"without gloo's copy {nccl_ratio:.4f}{kept.said(keys['nccl'])}")
        r.add("fake_vs_real", f"{name}: {stack.label}", ratio, baseline=1.0,
              unit="fake / real peak, worst of 2 gloo ranks, 2 x 256 tokens, CPU")
        r.add("fake_vs_real_nccl", f"{name}: {stack.label}", nccl_ratio, baseline=ratio,
              unit="fake NCCL rank (no gloo copy) / real gloo peak, lowest of 2 ranks "
                   "(baseline: with the copy)")
    _offloaded_fake_vs_real(r, kept, configs)
    # litgpt's own model (litgpt_memory), the code its published rows ran: fake vs real
    lit = S(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"), lora_dropout=0.05,
            loss="litgpt", autocast_adapter_dtype=False, gpu_dropout=True)
    for stack in (lit, replace(lit, precision="fp32", gpu_dropout=False),
                  replace(lit, method="qlora", nf4_keeps_input=True)):
        keys = {which: f"litgpt's tiny model ({which}): {stack!r}" for which in ("fake", "real")}
        fake, real = (kept.value(key, partial(_litgpt_peak, stack, 256, 2, which == "fake"))
                      for which, key in keys.items())
        ratio = fake / real
        print(f"  fake vs real, litgpt's tiny model, {stack.label}: peak {ratio:.4f}"
              f"{kept.said(keys['real'])}")
        r.add("fake_vs_real", f"litgpt's tiny model: {stack.label}", ratio, baseline=1.0,
              unit="fake / real peak, 2 x 256 tokens, CPU (litgpt_memory)")

    def big_step() -> dict:
        t0 = time.perf_counter()
        big = fake_memory.measure_step("Llama-3.1-8B", S(checkpointing=True), 2048, 1)
        return {"seconds": time.perf_counter() - t0, "by_category": big.by_category,
                "peak_bytes": big.peak_bytes}

    key = "Llama-3.1-8B step on fake tensors"
    big = kept.value(key, big_step)
    seconds = big["seconds"]
    for cat, value in big["by_category"].items():
        if value:
            r.add("llama_3_1_8b_step", f"{cat} GiB", value / 2**30,
                  unit="bf16 AdamW + checkpointing, 1 x 2048 tokens, fake tensors")
    print(f"  Llama-3.1-8B step on fake tensors: {seconds:.0f} s, peak "
          f"{big['peak_bytes'] / 2**30:.2f} GiB{kept.said(key)}")
    checks.check_speed(r, "fake_memory", "Llama-3.1-8B step on fake tensors (s)", seconds, 90.0,
                       at_least=False, unit="s")
    # published GPU figures beside our predictions (misses stay in the table, with the reason
    # in published.py and docs/planner.md)
    rows = published.predict(memo=kept.value)
    published.record(r, rows)
    print(published.format_table(rows))
    r.save()
    kept.done()
    published.update_readme(rows)


def _offloaded_fake_vs_real(r, kept, configs: dict) -> None:
    """FSDP's CPU offload, fake against real, into ``r`` (a ``results.Results``): rank 0 of a
    fake process group (counted as a gloo rank) against both ranks of a real 2-rank gloo job,
    2 x 256 tokens, the GPU's categories (recipe ``fake_vs_real``) and the host's
    (``fake_vs_real_host``) apart; on a CPU the two are one device, which
    ``memory.measure_memory`` splits by FSDP's labels. Each value is the rank farthest from 1.
    The stacks: bf16-mixed full, LoRA + checkpointing and FSDP + QLoRA as Answer.AI's
    offloaded rows run it (pure bf16, NF4 dequantized in chunks, bf16 adapters on every
    projection but o_proj, dropout; only where the config's layers split into NF4 blocks over
    the ranks).

    Args:
        r: the run's results.
        kept: the run's ``results.Progress`` (measurements kept as they are made).
        configs: name -> a transformers config.
    """
    from functools import partial

    from recipes_lib import fake_memory, published

    S = fake_memory.Stack
    stacks = [S(precision="bf16-mixed", fsdp_ranks=2, fsdp_cpu_offload=True),
              S(method="lora", precision="bf16-mixed", checkpointing=True, fsdp_ranks=2,
                fsdp_cpu_offload=True),
              # as Answer.AI's offloaded rows: pure bf16, adapters in bf16 on every projection
              # but o_proj, dropout
              S(method="qlora", precision="bf16", checkpointing=True, fsdp_ranks=2,
                chunked_dequant=True, fsdp_cpu_offload=True, autocast_adapter_dtype=False,
                lora_dropout=0.1, lora_targets=published.ANSWERAI_LORA_TARGETS)]
    jobs = _sharded_jobs(configs, stacks)
    reals = _real_ranks(kept, "fsdp offload: real gloo ranks' peaks", jobs)
    for (name, cfg, stack), ranks in zip(jobs, reals, strict=True):
        key = f"fsdp offload: fake rank (gloo): {name}: {stack!r}"
        fake = kept.value(key, partial(_fake_rank, cfg, stack, 256, 2, "gloo"))
        said = []
        for where, recipe in (("gpu", "fake_vs_real"), ("host", "fake_vs_real_host")):
            real = [sum(v for k, v in rank.items() if k.startswith("host ") == (where == "host"))
                    for rank in ranks]
            ratio = max((fake[where] / b for b in real), key=lambda x: abs(x - 1))
            said.append(f"{where} {ratio:.4f}")
            r.add(recipe, f"{name}: {stack.label}", ratio, baseline=1.0,
                  unit=f"fake / real {where} peak, worst of 2 gloo ranks, 2 x 256 tokens, CPU")
        print(f"  fake vs real, {name}, {stack.label}: {', '.join(said)} (worst rank)"
              f"{kept.said(key)}")


def _sharded_jobs(configs: dict, stacks: list) -> list[tuple]:
    """``(name, config's fields, stack)`` for each config and FSDP stack ``make bench`` compares
    with a real 2-rank job; FSDP + QLoRA only where the config's linear layers split into whole
    torchao NF4 blocks over 2 ranks (not the tiny config's: ``fake_memory`` says so with an
    ``UnmeasuredStackError``, and torchao cannot shard them)."""
    return [(name, cfg.to_dict(), stack) for name, cfg in configs.items() for stack in stacks
            if stack.method != "qlora" or name not in NF4_UNSPLIT]


def _real_ranks(kept, key: str, jobs: list[tuple]) -> list:
    """Each ``(name, config's fields, stack)`` job's step on both ranks of one real 2-rank gloo
    job (``fake_memory.real_rank_step``, 2 x 256 tokens), kept under ``key``."""
    from dataclasses import asdict

    from recipes_lib import distributed

    return kept.value(key, lambda: distributed.launch([(
        "recipes_lib.fake_memory:real_rank_step", {
            "model": cfg, "stack": asdict(stack), "seq_len": 256, "batch_size": 2})
        for _, cfg, stack in jobs], verbose=False))


def _fake_rank(config: dict, stack, seq_len: int, batch_size: int, backend: str) -> dict:
    """One FSDP rank's bytes on fake tensors, counted as a ``backend`` ("gloo" or "nccl") rank:
    ``{"gpu", "host"}`` (the host's: what FSDP's CPU offload keeps there, else 0)."""
    from recipes_lib import fake_memory

    report = fake_memory.measure_step(config, stack, seq_len, batch_size, comm_backend=backend)
    return {"gpu": sum(report.by_category.values()),
            "host": sum(report.host_by_category.values())}


def _fake_vs_real_ratios(config, stack, seq_len: int, batch_size: int) -> dict:
    """``fake_memory.fake_vs_real``'s ratios (peak and per category), the part a run keeps."""
    from recipes_lib import fake_memory

    out = fake_memory.fake_vs_real(config, stack, seq_len, batch_size)
    return {"peak_ratio": out["peak_ratio"], "ratios": out["ratios"]}


def _litgpt_peak(stack, seq_len: int, batch_size: int, fake: bool) -> int:
    """The peak of one training step of litgpt's tiny model, on fake or real tensors."""
    from recipes_lib import litgpt_memory

    return litgpt_memory.measure_step(litgpt_memory.TINY, stack, seq_len, batch_size,
                                      fake=fake).peak_bytes


def _measured_devices() -> list[str]:
    """The devices a run's ceilings are measured on: the CPU, and the GPU where one is."""
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _run(args, parser) -> int:
    """Execute the notebooks, validate the calculator, refresh the README table and the report;
    return the exit code (1 if a notebook failed)."""
    from recipes_lib import calc_validation, notebooks, results, sweep
    from recipes_lib.report import write_html_report

    paths = [Path(p) for p in args.notebooks] or notebooks.course_notebooks()
    params = {name: notebooks.parse_value(value) for name, value in args.parameters}
    try:
        results.check_writable(results.output_dir())
        # the reference size (recipes_lib.scale): what the README's figures are measured at
        status = notebooks.execute(paths, notebooks.EXECUTED, {"SCALE": "reference", **params})
    except ValueError as err:
        parser.error(str(err))
    for name, state in status.items():
        print(f"{name}: {results.run_status(name, state)}")
    print(f"calculator validation: {calc_validation.run()}")
    print(f"this machine's ceilings: {sweep.record_machine_peaks(_measured_devices())}")
    results.update_readme()
    report = results.write_report(status)
    page = write_html_report(status, notebooks.EXECUTED)
    print(results.markdown_table())
    print(f"report: {report} and {page}")
    return 0 if all(s == "ok" for s in status.values()) else 1


def matrix_from_figures(figures: list[dict]) -> dict[str, dict[str, str]]:
    """An ``architectures.json``'s figures back as architecture -> notebook -> status.

    Args:
        figures: the file's figures.

    Returns:
        architecture -> notebook -> "ok" or "failed: <error>".
    """
    out: dict[str, dict[str, str]] = {}
    for f in figures:
        out.setdefault(f["recipe"], {})[f["metric"]] = (
            "ok" if f["value"] == 1.0 else f["unit"].removeprefix("0: "))
    return out


def machines_by_architecture(line: str, architectures: list[str]) -> dict[str, str]:
    """Each architecture's machine, read from a recorded device line of ``architectures.json``:
    ``"a, b: <machine> | c: <machine>"`` (one group per machine, what :func:`record_matrix`
    writes), the nested ``"a: <machine>; b, c as recorded: <earlier line>"`` it wrote until
    2026-12-05, or a plain machine for every row.

    Args:
        line: the device line.
        architectures: the rows to place.

    Returns:
        architecture -> machine (the whole line where it names none for that row).
    """
    import re

    known = set(architectures)

    def names(text: str) -> list[str]:
        found = text.split(", ")
        return found if all(n in known for n in found) else []

    nested = re.match(r"((?:\w+, )*\w+): (.*?); ((?:\w+, )*\w+) as recorded: (.*)$", line)
    if nested and names(nested[1]) and names(nested[3]):
        return {**machines_by_architecture(nested[4], architectures),
                **{a: nested[2] for a in names(nested[1])}}
    found: dict[str, str] = {}
    for group in line.split(" | "):
        head, sep, machine = group.partition(": ")
        if not sep or not names(head):
            return {a: line for a in architectures}
        found.update({a: machine for a in names(head)})
    return {a: found.get(a, line) for a in architectures}


def record_matrix(matrix: dict[str, dict[str, str]], kept: list[str] = (),
                  kept_device: str = "", verbose: bool = True) -> str:
    """Write the matrix as ``architectures.json`` and the README's table.

    Args:
        matrix: architecture -> notebook -> status.
        kept: the architectures whose rows come from an earlier file ...
        kept_device: ... and that file's device line: the new line names each row's machine,
            grouped (one machine when every row ran on this one).
        verbose: print each row's statuses.

    Returns:
        The table, as Markdown.
    """
    import torch

    from recipes_lib import device, notebooks, results

    here = device.describe_device(torch.device("cpu"))
    earlier = machines_by_architecture(kept_device, list(matrix)) if kept else {}
    groups: dict[str, list[str]] = {}
    for arch in matrix:
        groups.setdefault(earlier[arch] if arch in kept else here, []).append(arch)
    where = (next(iter(groups)) if len(groups) == 1
             else " | ".join(f"{', '.join(archs)}: {machine}" for machine, archs in groups.items()))
    r = results.Results("architectures", where)
    for arch, row in matrix.items():
        for stem, state in row.items():
            if verbose:
                print(f"  {arch:<9} {stem}: {state}")
            r.add(arch, stem, float(state == "ok"),
                  unit="1: ran top to bottom" if state == "ok" else f"0: {state}")
    r.save()
    table = notebooks.matrix_table(matrix)
    results.write_readme_section("architectures", table)
    return table


# what `archs` sets beyond each notebook's CI size: notebook 03's compiled decode of the teacher
# (make run's size only, for the suite's budget) is where Gemma-2's recompile at every generated
# token shows, so the matrix runs it on every architecture
ARCHS_PARAMETERS = {"COMPILE_GENERATION": True}


def architectures_matrix(names: list[str] | None = None) -> bool:
    """``archs``: the architecture x notebook matrix, its results file and README table; return
    whether every notebook ran on every architecture run now. With ``names``, only those
    architectures run and the rest of the recorded matrix is kept (a rerun after a fix).

    Each architecture's row is recorded as soon as it has run, beside the recorded rows of the
    ones still to run, so that a stop (the matrix takes most of an hour) loses only the row that
    was running; a whole run's last record holds its own rows only.

    Args:
        names: the architectures to run (None: every decoder of ``model.ARCHITECTURES``).

    Returns:
        True if every notebook ran.
    """
    from recipes_lib import notebooks, results

    before = results.load_results().get("architectures", {})
    earlier = matrix_from_figures(before.get("figures", []))
    done: dict[str, dict[str, str]] = {}

    def record(last: bool = False) -> str:
        rows = {} if last and not names else dict(earlier)
        rows.update(done)
        return record_matrix(rows, [a for a in rows if a not in done],
                             before.get("device", "unknown"), verbose=last)

    def on_row(arch: str, row: dict[str, str]) -> None:
        done[arch] = row
        record()

    done.update(notebooks.architecture_matrix(tuple(names) if names else None,
                                              parameters=ARCHS_PARAMETERS, on_row=on_row))
    print(record(last=True))
    return all(s == "ok" for row in done.values() for s in row.values())


def main(argv: list[str] | None = None) -> int:
    """The command line, ``python -m recipes_lib <command>`` (``--help`` lists the commands).

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    from recipes_lib import data, device, results
    from recipes_lib.planner import GPU_CARDS

    parser = argparse.ArgumentParser(prog="python -m recipes_lib")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (("run", "execute the notebooks and refresh the results table"),
                       ("bench", "run, then assert every speed claim on the reference machine")):
        cmd = sub.add_parser(name, help=what)
        cmd.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
        cmd.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                         dest="parameters", metavar=("NAME", "VALUE"),
                         help="a notebook parameter, as papermill -p takes it")
        cmd.add_argument("--cap-isa", choices=sorted(device.ISA_CAPS),
                         help="run the CPU kernels an ISA-only CPU would run (device.cap_cpu_isa); "
                              "results go to results/cpu-ISA-capped/ unless "
                              f"${results.RESULTS_ENV} is set")
    ar = sub.add_parser("archs", help="every notebook on a tiny model of each architecture")
    ar.add_argument("names", nargs="*", help="default: every decoder of model.ARCHITECTURES")
    sub.add_parser("readme", help="refresh the README's results table")
    ck = sub.add_parser("check-notebooks", help="fail if a notebook carries outputs")
    ck.add_argument("--strip", action="store_true", help="remove outputs and execution counts")
    sub.add_parser("data", help="regenerate data/")
    pl = sub.add_parser("plan", help="which recipes make a training run fit in GPU memory")
    pl.add_argument("--model", required=True,
                    help="a built-in name or its hub id (e.g. Llama-3.1-8B, Qwen/Qwen3-8B, "
                    "google/gemma-2-9b-it) or a config.json path")
    # what a card is sold as is neither unit exactly (modal-labs/modal-client#2797: nvidia-smi
    # gives an H100 80GB 81559 MiB, an A100 80GB 81920 MiB, an A10 or L4 24GB ~23030 MiB)
    pl.add_argument("--gpu-mem", required=True,
                    help="memory per GPU, e.g. 16GB (10^9 bytes) or 80GiB; nvidia-smi's total "
                    "is the card's exact size (an H100 80GB: 81559MiB); or a card's name, "
                    "its total (and fp16 settings where it has no bf16): "
                    + ", ".join(c.name for c in GPU_CARDS.values()))
    pl.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    pl.add_argument("--batch", type=int, default=8,
                    help="sequences per optimizer step (default: 8)")
    pl.add_argument("--gpus", type=int, default=1, help="GPUs for the FSDP row (default: 1)")
    pl.add_argument("--measure", action="store_true",
                    help="also measure each row that can be on fake tensors")
    pl.add_argument("--replay-allocator", action="store_true",
                    help="with --measure or --max-context: judge each one-device row by its run "
                    "replayed through CUDA's caching allocator instead of a fixed 15%% reserve")
    pl.add_argument("--expandable-segments", action="store_true",
                    help="with --replay-allocator: replay the allocator as "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True runs it")
    pl.add_argument("--max-split-size-mb", type=int, metavar="N",
                    help="with --replay-allocator: replay the allocator as "
                    "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N runs it (N >= 20)")
    pl.add_argument("--alloc-conf", metavar="VALUE",
                    help="with --replay-allocator: replay the allocator as "
                    "PYTORCH_CUDA_ALLOC_CONF=VALUE runs it, e.g. 'expandable_segments:True' or "
                    "axolotl's 'expandable_segments:True,roundup_power2_divisions:16' "
                    "(settings that change nothing the replay sees are accepted, the ones it "
                    "does not model refused)")
    pl.add_argument("--max-context", action="store_true",
                    help="the longest sequence that fits under each step, by measurement")
    pl.add_argument("--attention-mask", action="store_true",
                    help="rows that need an attention mask: padded to a common length, or "
                    "packed documents kept apart (TRL's padding_free); default: full rows")
    cb = sub.add_parser("colab", help="stamp Colab badges and install cells into the notebooks")
    cb.add_argument("--repo", required=True, help="the public GitHub repository, owner/name")
    cb.add_argument("--ref", default="main", help="branch or tag the badges open")
    args = parser.parse_args(argv)

    if getattr(args, "cap_isa", None):
        capped = device.cap_cpu_isa(args.cap_isa)
        print(f"CPU kernels capped to {args.cap_isa}: "
              + ", ".join(f"{k}={v}" for k, v in capped.items()))
        if not os.environ.get(results.RESULTS_ENV):
            os.environ[results.RESULTS_ENV] = str(capped_results_dir(args.cap_isa))
    if args.command == "colab":
        from recipes_lib.colab import stamp_notebooks

        try:
            for path in stamp_notebooks(args.repo, args.ref):
                print(f"stamped {path.relative_to(ROOT)}")
        except ValueError as err:
            parser.error(str(err))
        return 0
    if args.command == "plan":
        from recipes_lib.allocator import parse_settings
        from recipes_lib.planner import (
            allocator_setting,
            check_allocator_setting,
            format_plan,
            max_context_per_step,
            plan,
        )

        if args.replay_allocator and not (args.measure or args.max_context):
            parser.error("--replay-allocator: replays the measured runs; add --measure or "
                         "--max-context")
        for flag in ("expandable_segments", "max_split_size_mb", "alloc_conf"):
            if getattr(args, flag) not in (False, None) and not args.replay_allocator:
                parser.error(f"--{flag.replace('_', '-')}: an allocator setting the replay "
                             "models; add --replay-allocator")
        args.roundup_power2_divisions = None  # --alloc-conf's alone
        if args.alloc_conf is not None:  # the launch's value, in place of the two flags
            if args.expandable_segments or args.max_split_size_mb is not None:
                parser.error("--alloc-conf: give the allocator settings there or as "
                             "--expandable-segments / --max-split-size-mb, not both")
            try:
                vars(args).update(parse_settings(args.alloc_conf))
            except ValueError as err:
                parser.error(f"--alloc-conf: {err}")
        try:
            check_allocator_setting(args.replay_allocator, args.expandable_segments,
                                    args.max_split_size_mb, args.roundup_power2_divisions)
            planned = plan(args.model, args.gpu_mem, args.seq, args.batch, args.gpus,
                           measure=args.measure, attention_mask=args.attention_mask,
                           replay=args.replay_allocator and args.measure,
                           expandable_segments=args.expandable_segments and args.measure,
                           max_split_size_mb=args.max_split_size_mb if args.measure else None,
                           roundup_power2_divisions=(args.roundup_power2_divisions
                                                     if args.measure else None),
                           progress=True)
            print(format_plan(planned))
            if args.max_context:  # the same rows: the plan's micro-batches
                rows = max_context_per_step(args.model, args.gpu_mem, args.batch,
                                            planned["grad_accum_steps"], gpus=args.gpus,
                                            workers=search_processes(),
                                            attention_mask=args.attention_mask, progress=True,
                                            replay=args.replay_allocator,
                                            expandable_segments=args.expandable_segments,
                                            max_split_size_mb=args.max_split_size_mb,
                                            roundup_power2_divisions=(
                                                args.roundup_power2_divisions))
                searched = {id(r["tries"]): len(r["tries"]) for r in rows if "tries" in r}
                words = allocator_setting(args.expandable_segments, args.max_split_size_mb,
                                          False, args.roundup_power2_divisions)
                setting = "" if words == "the default allocator settings" else f" with {words}"
                how = ("; one-device rows judged by their runs replayed through the caching "
                       f"allocator{setting}" if args.replay_allocator else "")
                print(f"\nlongest sequence that fits, by measurement (batch {args.batch}; "
                      f"{sum(searched.values())} fake steps{how}):")
                width = max((len(r["step"]) for r in rows), default=0)
                for r in rows:
                    shortest = min(r.get("tries") or [(0, 0.0)])
                    host = (f" + {r['host_GiB']:.1f} GiB of CPU RAM"
                            if r.get("host_GiB") and r.get("max_seq_len") else "")
                    if r.get("max_seq_len") and r["max_seq_len"] == r.get("limit"):
                        host += " (the longest length tried: the model's positions)"
                    found = (r["measured_stack"] if "tries" not in r else
                             f"{r['max_seq_len']:>7} tokens, {r['gpu_GiB']:5.1f} GiB on the GPU"
                             f"{host}" if r["max_seq_len"] else f"nothing fits: {shortest[0]} "
                             f"tokens need {shortest[1]:.1f} GiB on the GPU")
                    print(f"  {r['step']:<{width}} {found}")
        except ValueError as err:
            parser.error(str(err))
        return 0

    if args.command == "data":
        for name, path in data.generate_corpora().items():
            print(f"{name}: {path.relative_to(ROOT)}")
        return 0
    if args.command == "check-notebooks":
        from recipes_lib import notebooks

        if args.strip:
            for path in notebooks.strip(notebooks.course_notebooks()):
                print(f"stripped {path.relative_to(ROOT)}")
        problems = notebooks.unclean_cells(notebooks.course_notebooks())
        for line in problems:
            print(line)
        print("notebooks: " + ("stripped (no outputs, no execution counts)" if not problems else
                               "carry outputs; run python -m recipes_lib check-notebooks --strip"))
        return 1 if problems else 0
    if args.command == "run":
        return _run(args, parser)
    if args.command == "archs":
        try:
            return 0 if architectures_matrix(args.names) else 1
        except ValueError as err:
            parser.error(str(err))
    if args.command == "bench":
        from recipes_lib.checks import is_reference_machine

        reference, how = is_reference_machine()
        if not reference:
            print(f"not the reference machine ({how}): speed verdicts will be reported, "
                  "not asserted")
        code = _run(args, parser)
        real_scale_benchmark()
        print("every notebook on every architecture")
        archs_ok = architectures_matrix()
        results.update_readme()
        rows = claims_table()
        print(f"\nspeed claims ({len(rows)}):\n{format_claims(rows)}")
        verdict, ok = bench_verdict(rows, reference, how)
        print(verdict)
        return code if ok and archs_ok else 1
    results.update_readme()
    for isa in device.ISA_CAPS:  # a capped run's claims beside the uncapped ones, where recorded
        if any(capped_results_dir(isa).glob("*.json")):
            results.write_readme_section(f"claims-{isa}-capped", isa_claims_markdown(
                results.output_dir(), capped_results_dir(isa)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
