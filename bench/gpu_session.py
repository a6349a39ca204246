"""Everything this course measures on a GPU, in one call (a lent GPU is held by the minute).

    python bench/gpu_session.py OUT_DIR [--smoke] [--memory-only]
    python bench/gpu_session.py --record [DEVICE]  # results/DEVICE/raw/*.json (default h100)
                                                   # -> results/DEVICE/gpu_session.json

Writes ``OUT_DIR/gpu_session.json``: what the GPU holds outside PyTorch's allocator (the CUDA
context and the libraries' kernels), the fake-tensor memory prediction against the real run of
a >= 1 B-parameter model (five recipe stacks, three again with expandable segments, three
with ``max_split_size_mb:128``, three with axolotl's ``expandable_segments:True,
roundup_power2_divisions:16`` and three with expandable segments and ``max_split_size_mb:128``
together) and of Unsloth's Llama-3.1-8B QLoRA rows at four lengths (two
stacks; ``published``), whether that row fits a 24 GB share of the GPU at four lengths under
each allocator setting beside the replay's verdict (``card_share``), the FP8 vs bf16 linear
sweep (tensorwise and rowwise), an FP8 training step at a scale where it should pay, and the
crossover sweeps of SDPA, chunked cross-entropy and activation checkpointing. ``--smoke``
runs tiny sizes on the CPU to check the script itself. Each part is saved as soon as it ends,
so a time-out keeps the rest.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from recipes_lib import attention, checkpointing, chunked_loss, fake_memory, fp8
from recipes_lib.device import describe_device
from recipes_lib.results import package_versions
from recipes_lib.timing import time_interleaved


def sweep_dict(s) -> dict:
    return {"recipe": s.recipe, "dimension": s.dimension, "rows": s.rows(),
            "crossover": s.crossover(), "verdict": s.verdict(), "spread": s.spread(),
            "peaks": vars(s.peaks) if s.peaks else None}


def device_used() -> int | None:
    """Bytes in use on the GPU as its driver counts them (``total - free``): PyTorch's reserved
    blocks plus what lives outside its allocator. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def outside_allocator() -> dict:
    """What the GPU holds outside PyTorch's caching allocator (driver-counted use minus
    ``memory_reserved``: the CUDA context, kernel modules loaded on first use, library handles),
    read after each library a QLoRA step takes kernels from: the context alone, cuBLAS (a bf16
    matmul), SDPA's flash kernel and bitsandbytes' NF4 matmul. ``planner.CUDA_CONTEXT_BYTES``
    models it (0.5 GiB); the Unsloth rows' fixed part is where it matters. Run first, in a fresh
    process."""
    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA: the driver's count is the measurement"}
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    def outside() -> int:
        return device_used() - torch.cuda.memory_reserved()

    torch.cuda.init()
    out = {"context": outside()}
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    float((a @ a).sum())
    out["cublas"] = outside()
    q = torch.randn(1, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
    float(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum())
    out["sdpa"] = outside()
    packed, state = bnbf.quantize_4bit(a, quant_type="nf4", compress_statistics=True)
    float(bnb.matmul_4bit(a[:16], packed.t(), quant_state=state).sum())
    out["bitsandbytes_nf4"] = outside()
    out["reserved_at_end"] = torch.cuda.memory_reserved()
    return out


def allocator_settings(conf: str = "") -> None:
    """Switch CUDA's caching allocator to the settings ``conf`` (a ``PYTORCH_CUDA_ALLOC_CONF``
    value; empty: the defaults) for what follows, as the variable does at start-up, its cache
    emptied first so that no segment of the other kind serves the next run. PyTorch resets
    ``max_split_size_mb`` to unlimited at each setting that leaves it out."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        expandable = "expandable_segments" in conf
        torch.cuda.memory._set_allocator_settings(
            conf if expandable else ",".join(filter(None, ["expandable_segments:False", conf])))


def fake_vs_real(model, stacks, seq_len, batch, device, replay=False,
                 conf: str = "") -> list[dict]:
    """Each stack's fake step beside the real one; ``replay``: also the caching allocator's
    replay of the same run on fake tensors (``fake_memory.replay_allocator``: build, then two
    steps, as the real measurement runs them), beside the real ``max_memory_reserved``;
    ``conf``: the real runs with those allocator settings (``PYTORCH_CUDA_ALLOC_CONF``'s
    value), and the replay as they run."""
    from recipes_lib.allocator import parse_settings

    setting = parse_settings(conf)
    rows = []
    for stack in stacks:
        gc.collect()
        replayed = (fake_memory.replay_allocator(model, stack, seq_len, batch, device, **setting)
                    if replay else None)
        allocator_settings(conf)
        start = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        try:
            r = fake_memory.fake_vs_real(model, stack, seq_len, batch, device)
        finally:
            allocator_settings()
        used = device_used()  # the step's blocks are still cached: context + reserved
        rows.append({"stack": stack.label, "model": model if isinstance(model, str) else
                     type(model).__name__, "seq_len": seq_len, "batch": batch,
                     "alloc_conf": conf, **setting,
                     "fake": r["fake"].by_category, "fake_peak": r["fake"].peak_bytes,
                     "real": r["real"].by_category, "real_peak": r["real"].peak_bytes,
                     "allocated_peak": r["real"].allocator_peak_bytes,
                     "start_allocated": start,
                     "reserved_peak": r["real"].allocator_reserved_bytes,
                     "device_used_after": used,
                     "replayed_allocated": replayed and replayed.peak_allocated,
                     "replayed_reserved": replayed and replayed.peak_reserved,
                     "fake_over_allocated": (r["fake"].peak_bytes / r["real"].allocator_peak_bytes
                                             if r["real"].allocator_peak_bytes else None)})
        print(rows[-1]["stack"], rows[-1]["fake_over_allocated"], flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


CARD_SHARE_SETTINGS = ("", "expandable_segments:True", "max_split_size_mb:128")
_SHARE_TRACES: dict = {}  # (model, length, device) -> the row's trace (13 s each for 8 B)


def card_share_check(model, seq_lens, device, card: str = "24GiB",
                     settings=CARD_SHARE_SETTINGS) -> list[dict]:
    """Unsloth's 24 GB row on a share of this GPU (``set_per_process_memory_fraction``: the
    card's bytes less the modelled CUDA context): at each length, under each allocator setting
    of ``settings`` (``PYTORCH_CUDA_ALLOC_CONF`` values), whether the real run fits beside
    whether its replay does (``allocator.replay(..., fraction=True)``: the share's check, as
    PyTorch makes it). The replay says the default rules fit such a card at some lengths and
    not at shorter ones (docs/planner.md); this is the check. On a CPU (smoke) only the replays
    run."""
    from recipes_lib import allocator, planner, published

    capacity = int(planner.parse_bytes(card) - planner.CUDA_CONTEXT_BYTES)
    cuda = torch.cuda.is_available() and torch.device(device).type == "cuda"
    rows = []
    try:
        if cuda:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(capacity / total, device)
        for seq_len in seq_lens:
            key = (model if isinstance(model, str) else id(model), seq_len, str(device))
            if key not in _SHARE_TRACES:  # one trace a length for every setting's part
                _SHARE_TRACES[key] = fake_memory.allocation_trace(
                    model, published.TRL_2024_QLORA, seq_len, 1, device)
            events = _SHARE_TRACES[key]
            for conf in settings:
                setting = allocator.parse_settings(conf)
                predicted = allocator.fits(events, capacity, fraction=True, **setting)
                row = {"seq_len": seq_len, "alloc_conf": conf, **setting,
                       "capacity": capacity, "replayed_fits": predicted is not None,
                       "replayed_reserved": predicted and predicted.peak_reserved,
                       "real_fits": None, "reserved_peak": None}
                if cuda:
                    allocator_settings(conf)
                    try:
                        report = fake_memory.measure_step(model, published.TRL_2024_QLORA,
                                                          seq_len, 1, device, fake=False)
                        row.update(real_fits=True,
                                   reserved_peak=report.allocator_reserved_bytes)
                    except torch.cuda.OutOfMemoryError:
                        row["real_fits"] = False
                    finally:
                        allocator_settings()
                rows.append(row)
                print(row, flush=True)
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return rows


def unsloth_rows(model, seq_lens, device) -> dict:
    """Unsloth's "HF + FA2" longest-context rows (``published``) checked on the GPU itself:
    Llama-3.1-8B, QLoRA r=32, batch 1, on the stack measured for them (TRL's SFTTrainer as of
    December 2024) and with fp32 embeddings and head, each at several lengths: the fake trace
    beside ``max_memory_allocated``, ``max_memory_reserved`` and the driver's count. A line
    through the driver's points (``published.fit_line``) is the GPU's own memory per token and
    before the first token, to set beside the source's line and ours."""
    from recipes_lib import published

    stacks = {"TRL 2024": published.TRL_2024_QLORA,
              "fp32 embeddings and head": published.HF_QLORA}
    out: dict = {"rows": [], "lines": {}}
    for name, stack in stacks.items():
        for s in seq_lens:
            out["rows"] += [{**row, "name": name} for row in
                            fake_vs_real(model, [stack], s, 1, device)]
        mine = [r for r in out["rows"] if r["name"] == name]
        for key in ("device_used_after", "reserved_peak", "allocated_peak", "fake_peak"):
            if len(mine) >= published.MIN_LINE_ROWS and all(r[key] for r in mine):
                out["lines"][f"{name}: {key}"] = published.fit_line(
                    [r[key] for r in mine], [r["seq_len"] for r in mine])
    return out


def fp8_model_step(device, hidden, layers, seq_len, batch, compile_model=True) -> dict:
    """A Llama-shaped model (random init) trained one step in bf16 and with float8 linear layers
    (torchao's size heuristic choosing which), both compiled, timed in alternation."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                         num_hidden_layers=layers, num_attention_heads=hidden // 128,
                         num_key_value_heads=max(1, hidden // 512), max_position_embeddings=seq_len)
    out, fns = {}, {}
    ids = torch.randint(0, 32000, (batch, seq_len), device=device)
    for name in ("baseline", "recipe"):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).train()
        if name == "recipe":
            out["conversion"] = fp8.convert(m, "tensorwise").summary()
        run = torch.compile(m) if compile_model else m

        def step(run=run, m=m):
            run(input_ids=ids, labels=ids).loss.backward()
            m.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        out[f"compile_s_{name}"] = time.perf_counter() - t0
        fns[name] = step
    t = time_interleaved(fns, warmup=2, repeats=10, device=torch.device(device))
    out.update({"params_B": sum(p.numel() for p in m.parameters()) / 1e9,
                "baseline_ms": 1e3 * t["baseline"].median_s, "fp8_ms": 1e3 * t["recipe"].median_s,
                "speedup": t["baseline"].median_s / t["recipe"].median_s,
                "spread": max(t["baseline"].spread, t["recipe"].spread),
                "tokens": batch * seq_len, "hidden": hidden, "layers": layers})
    return out


def paged_optimizers() -> dict:
    """AdamW vs bitsandbytes' AdamW8bit vs PagedAdamW8bit on a ~0.5 B model in bf16: state bytes,
    the CUDA allocator's peak over a step (paged states live in unified memory, outside it), step
    time and the loss after 10 steps of the same batches."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from recipes_lib import optim8bit

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4)
    ids = torch.randint(0, 32000, (4, 1024), device="cuda")
    out = {}
    for name in ("AdamW", "AdamW8bit", "PagedAdamW8bit"):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().train()
        opt = (torch.optim.AdamW(m.parameters(), lr=1e-4) if name == "AdamW" else
               optim8bit.make_adamw_8bit(m.parameters(), 1e-4, paged=name.startswith("Paged")))
        losses, times = [], []
        for i in range(10):
            torch.cuda.synchronize()
            if i == 5:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        out[name] = {"state_bytes": optim8bit.state_bytes(opt),
                     "allocated_peak": torch.cuda.max_memory_allocated(),
                     "step_ms": 1e3 * sorted(times[2:])[len(times[2:]) // 2],
                     "losses": losses, "params": sum(p.numel() for p in m.parameters())}
        del m, opt
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main(out_dir: str, smoke: bool) -> None:
    device = torch.device("cpu" if smoke else "cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": describe_device(device), "versions": package_versions(),
                    "torch": torch.__version__, "smoke": smoke}
    path = out / "gpu_session.json"
    # a call short of time runs some parts only: GPU_SESSION_PARTS=card_share,... (names below)
    only = set(filter(None, os.environ.get("GPU_SESSION_PARTS", "").split(",")))

    def part(name, fn):
        if only and name not in only:
            report[name] = {"skipped": "not in GPU_SESSION_PARTS"}
            path.write_text(json.dumps(report, indent=1, default=str))
            return
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as err:  # noqa: BLE001 - a failing part is recorded; the others run
            report[name] = {"error": f"{type(err).__name__}: {err}",
                            "trace": traceback.format_exc()[-3000:]}
        report.setdefault("seconds", {})[name] = time.perf_counter() - t0
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"== {name}: {report['seconds'][name]:.0f} s", flush=True)

    S = fake_memory.Stack
    part("outside_allocator", outside_allocator)  # first: a fresh process's context
    if smoke:
        from transformers import LlamaConfig
        model = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512)
        seq, batch, big, lengths = 128, 2, model, [64, 128, 256]
    else:
        model, seq, batch = "Llama-3.2-1B", 2048, 2
        big, lengths = "Llama-3.1-8B", [1024, 4096, 8192, 16384]
    stacks = [S(), S(checkpointing=True), S(method="lora", checkpointing=True),
              S(precision="fp32", checkpointing=True), S(grad_accum_steps=2)]
    part("fake_vs_real", lambda: fake_vs_real(model, stacks, seq, batch, device, replay=True))
    # the replay's prediction with expandable segments (torchtitan's setting), checked
    part("fake_vs_real_expandable", lambda: fake_vs_real(model, stacks[:3], seq, batch, device,
                                                         True, "expandable_segments:True"))
    # and with max_split_size_mb:128, the setting PyTorch's message once suggested: predicted
    # to reserve more on a large card than the default and to need a smaller one
    part("fake_vs_real_max_split", lambda: fake_vs_real(model, stacks[:3], seq, batch, device,
                                                        True, "max_split_size_mb:128"))
    # and axolotl's launch: requests rounded up to 16 steps a power of two, predicted to
    # allocate 0.18 GiB more here (a 128,256 x 2,048 bf16 tensor's 501 MiB take 512)
    part("fake_vs_real_rounding", lambda: fake_vs_real(
        model, stacks[:3], seq, batch, device, True,
        "expandable_segments:True,roundup_power2_divisions:16"))
    # and launch scripts' expandable segments with max_split_size_mb:128: predicted to map
    # 46 GiB for the full fine-tune's 20.5 allocated (best fit passes over merged free
    # blocks of 128 MiB or more, and each such request maps new pages)
    part("fake_vs_real_expandable_max_split", lambda: fake_vs_real(
        model, stacks[:3], seq, batch, device, True,
        "expandable_segments:True,max_split_size_mb:128"))
    part("unsloth_8b", lambda: unsloth_rows(big, lengths, device))
    # last of the memory parts: the replay's fit / out-of-memory verdicts on a 24 GB share
    share = ([160, 192] if smoke else [7040, 7168, 8832, 8960], device,
             "0.52GiB" if smoke else "24GiB")
    part("card_share", lambda: card_share_check(big, *share, CARD_SHARE_SETTINGS[:2]))
    part("card_share_max_split", lambda: card_share_check(big, *share, CARD_SHARE_SETTINGS[2:]))
    if "--memory-only" in sys.argv:
        return
    if not smoke:
        sizes = [512, 1024, 2048, 4096, 8192, 16384]
        part("fp8_tensorwise", lambda: sweep_dict(fp8.linear_sweep(sizes, 16384, "tensorwise")))
    small = smoke
    part("attention", lambda: sweep_dict(attention.seq_len_sweep(
        [64, 128, 256] if small else [256, 512, 1024, 2048, 4096, 8192, 16384],
        dtype=torch.float32 if small else torch.bfloat16, device=device,
        num_heads=8 if small else 32, head_dim=64 if small else 128)))
    part("chunked_ce", lambda: sweep_dict(chunked_loss.tokens_sweep(
        [64, 128, 256] if small else [512, 2048, 8192, 32768],
        1000 if small else 128256, 64 if small else 4096, chunk_size=1024 if not small else 64,
        device=device, dtype=torch.float32 if small else torch.bfloat16,
        include_liger=chunked_loss.liger_available(device))))
    part("checkpointing", lambda: sweep_dict(checkpointing.width_sweep(
        [64, 128, 256] if small else [256, 512, 1024, 2048, 4096],
        seq_len=64 if small else 2048, batch_size=1 if small else 4,
        num_layers=2 if small else 4, vocab_size=1000 if small else 32000,
        dtype=torch.float32 if small else torch.bfloat16, device=device)))
    if not smoke:
        part("fp8_model_step", lambda: fp8_model_step(device, 4096, 4, 4096, 2))
        part("fp8_rowwise", lambda: sweep_dict(fp8.linear_sweep(sizes, 16384, "rowwise")))
        part("paged_adamw8bit", paged_optimizers)
    print(json.dumps({k: v for k, v in report.items() if k == "seconds"}, indent=1))


def record(device_dir: str = "h100", results_dir: Path | None = None) -> Path:
    """The raw files of ``<results_dir>/<device_dir>/raw/*.json`` (each a ``gpu_session.json``
    a GPU call left, whole or in parts: a memory-only call has no sweeps) as figures in the
    results schema, ``<results_dir>/<device_dir>/gpu_session.json``, so the README's table for
    that device lists them. Parts a call did not run, or that failed or were skipped there, are
    left out. Every value is read from the raw files; nothing is typed in. A trace of the run's
    allocations (``raw/fake_traces_*.json.gz``, ``bench/allocator_traces.py``) replayed through
    the caching allocator's rules gives the reserved figure a run did not replay itself.

    Raises:
        ValueError: naming the folder when it holds no raw file.
    """
    from recipes_lib import planner, results, sweep
    from recipes_lib.allocator import load_traces, replay

    folder = Path(results_dir or results.RESULTS_DIR) / device_dir
    files = sorted((folder / "raw").glob("*.json"))
    if not files:
        raise ValueError(f"device_dir={device_dir!r}: no raw files in {folder / 'raw'}")
    raw: dict = {}
    for f in files:
        raw |= json.loads(f.read_text())
    part = {k: v for k, v in raw.items()
            if not (isinstance(v, dict) and ("error" in v or "skipped" in v))}
    out = results.Results("gpu_session", raw["device"], folder)
    # runs of an older loop, traced afterwards on fake tensors (bench/allocator_traces.py)
    traced = {stack: replay(events) for f in sorted((folder / "raw").glob("fake_traces_*.json.gz"))
              for stack, events in load_traces(f).items()}
    for row in (part.get("fake_vs_real", []) + part.get("fake_vs_real_expandable", [])
                + part.get("fake_vs_real_max_split", []) + part.get("fake_vs_real_rounding", [])
                + part.get("fake_vs_real_expandable_max_split", [])):
        if not row["allocated_peak"]:
            continue
        if not row.get("replayed_reserved") and row["stack"] in traced:
            row["replayed_reserved"] = traced[row["stack"]].peak_reserved
        slug = row["stack"].replace(", ", "_").replace(" ", "").replace("=", "")
        conf = row.get("alloc_conf") or ("expandable_segments:True"
                                          if row.get("expandable_segments") else "")
        if conf:  # the same stacks again, under another setting
            name = "_".join(filter(None, [
                "expandable" if row.get("expandable_segments") else "",
                f"max_split_{row['max_split_size_mb']}" if row.get("max_split_size_mb") else "",
                f"roundup_{row['roundup_power2_divisions']}"
                if row.get("roundup_power2_divisions") else ""]))
            if row.get("roundup_power2_divisions") and row.get("replayed_allocated"):
                out.add("fake_memory", f"replayed_over_allocated_{name}_{slug}",
                        row["replayed_allocated"] / row["allocated_peak"], baseline=1.0,
                        unit=f"x max_memory_allocated with {conf}: the requests rounded as the "
                             "replay rounds them")
            if row.get("replayed_reserved") and row["reserved_peak"]:
                out.add("fake_memory", f"replayed_over_reserved_{name}_{slug}",
                        row["replayed_reserved"] / row["reserved_peak"], baseline=1.0,
                        unit=f"x max_memory_reserved with {conf}: the run's allocations on fake "
                             "tensors through the allocator's rules (recipes_lib.allocator)")
            continue
        out.add("fake_memory", f"fake_over_allocated_{slug}",
                row["fake_peak"] / row["allocated_peak"],
                baseline=1.0, unit=f"x max_memory_allocated, {row.get('model', 'Llama-3.2-1B')}, "
                                   f"{row['batch']}x{row['seq_len']} tokens")
        if row.get("replayed_reserved") and row["reserved_peak"]:
            out.add("fake_memory", f"replayed_over_reserved_{slug}",
                    row["replayed_reserved"] / row["reserved_peak"], baseline=1.0,
                    unit="x max_memory_reserved: the run's allocations on fake tensors "
                         "through the caching allocator's rules (recipes_lib.allocator)")
        worst = max(abs(row["fake"][k] - row["real"][k]) for k in row["fake"])
        out.add("fake_memory", f"max_category_diff_bytes_{slug}", worst, baseline=0.0,
                unit="fake vs the real step under the same tracker")
    for lib, used in part.get("outside_allocator", {}).items():
        if lib != "reserved_at_end" and isinstance(used, int):
            out.add("gpu_overhead", f"outside_allocator_after_{lib}_GiB", used / 2**30,
                    predicted=planner.CUDA_CONTEXT_BYTES / 2**30,
                    unit="GiB the driver counts beyond memory_reserved (predicted: the "
                         "planner's CUDA context)")
    for row in part.get("card_share", []) + part.get("card_share_max_split", []):
        if row["real_fits"] is None:
            continue
        setting = ("expandable segments" if row["expandable_segments"] else
                   f"max_split_size_mb:{row['max_split_size_mb']}"
                   if row.get("max_split_size_mb") else "default allocator")
        out.add("card_share", f"fits, {row['seq_len']} tokens, {setting}",
                float(row["real_fits"]), predicted=float(row["replayed_fits"]),
                unit=f"1 if the real step fit a {row['capacity'] / 2**30:.1f} GiB share of the "
                     "card (set_per_process_memory_fraction), 0 if it ran out (predicted: the "
                     "replay's verdict); Llama-3.1-8B QLoRA r=32, batch 1, TRL's 2024 stack")
    unsloth = part.get("unsloth_8b", {})
    for row in unsloth.get("rows", []):
        if not row["allocated_peak"]:
            continue
        where = f"{row['name']}, {row['seq_len']} tokens"
        out.add("unsloth_8b", f"fake_over_allocated, {where}",
                row["fake_peak"] / row["allocated_peak"], baseline=1.0,
                unit="x max_memory_allocated, Llama-3.1-8B QLoRA r=32, batch 1")
        out.add("unsloth_8b", f"device_used_GiB, {where}", row["device_used_after"] / 2**30,
                predicted=(row["fake_peak"] + planner.gpu_overhead(row["fake_peak"])) / 2**30,
                unit="GiB the driver counts after the step (predicted: fake peak + the "
                     "planner's overhead)")
    for name, line in unsloth.get("lines", {}).items():
        out.add("unsloth_8b", f"MiB a token, {name}", line["bytes_per_token"] / 2**20,
                unit="MiB; a line through the lengths measured (published.fit_line)")
        out.add("unsloth_8b", f"GiB before the first token, {name}", line["fixed_bytes"] / 2**30,
                unit="GiB; where that line meets zero tokens")
    named = {"attention": "attention", "chunked_ce": "chunked_ce",
             "activation_checkpointing": "checkpointing", "fp8": "fp8_tensorwise",
             "fp8_rowwise": "fp8_rowwise"}
    for recipe, key in named.items():
        if key in part:
            sweep.from_rows(recipe, part[key]["dimension"], part[key]["rows"]).record(out)
    if "fp8_model_step" in part:
        step = part["fp8_model_step"]
        out.add("fp8", "model_step_speedup", step["speedup"], baseline=1.0,
                unit=f"x bf16, both compiled: {step['params_B']:.2f} B params, {step['layers']} "
                     f"layers x {step['hidden']}, {step['tokens']} tokens")
    if "paged_adamw8bit" in part:
        paged = part["paged_adamw8bit"]
        out.add("optim8bit", "state_bytes_ratio_bf16_params",
                paged["AdamW8bit"]["state_bytes"] / paged["AdamW"]["state_bytes"], baseline=1.0,
                unit="x AdamW's bf16 states, 0.49 B params")
        out.add("optim8bit", "paged_allocator_peak_ratio",
                paged["PagedAdamW8bit"]["allocated_peak"] / paged["AdamW8bit"]["allocated_peak"],
                baseline=1.0, unit="x AdamW8bit: paged states live outside the allocator")
        out.add("optim8bit", "paged_step_time_ratio",
                paged["PagedAdamW8bit"]["step_ms"] / paged["AdamW"]["step_ms"], baseline=1.0,
                unit="x AdamW step time")
    path = out.save()
    results.update_readme(results_dir=folder.parent)
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        print(record(*sys.argv[2:3]))
    else:
        main(sys.argv[1], "--smoke" in sys.argv)
