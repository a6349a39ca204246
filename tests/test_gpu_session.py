"""bench/gpu_session.py and bench/gpu_plan.sh: the call a lent GPU runs. The memory parts are
checked here at tiny sizes on the CPU (``--smoke``), so a rare GPU session does not find the
script broken."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes_lib import allocator

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.harness
def test_smoke_memory_parts_run_and_the_unsloth_lines_are_fitted(tmp_path, bench_script):
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_session.py"), str(tmp_path),
                    "--smoke", "--memory-only"], check=True, cwd=ROOT, capture_output=True)
    report = json.loads((tmp_path / "gpu_session.json").read_text())
    assert "needs CUDA" in report["outside_allocator"]["skipped"]
    settings = ("fake_vs_real", "fake_vs_real_expandable", "fake_vs_real_max_split",
                "fake_vs_real_rounding", "fake_vs_real_expandable_max_split")
    shares = ("card_share", "card_share_max_split")
    assert all("error" not in report[p] for p in (*settings, "unsloth_8b", *shares)), report
    assert all(r["expandable_segments"] for r in report["fake_vs_real_expandable"])
    assert all(r["max_split_size_mb"] == 128 for r in report["fake_vs_real_max_split"])
    assert all(r["roundup_power2_divisions"] == 16 and r["expandable_segments"]
               for r in report["fake_vs_real_rounding"])
    assert all(r["max_split_size_mb"] == 128 and r["expandable_segments"]
               for r in report["fake_vs_real_expandable_max_split"])
    # the 24 GB share's check: on a CPU the replays' verdicts only, each length each setting
    share = report["card_share"] + report["card_share_max_split"]
    assert [(r["seq_len"], r["alloc_conf"]) for r in share] == [
        (n, conf) for n in (160, 192) for conf in ("", "expandable_segments:True")] + [
        (160, "max_split_size_mb:128"), (192, "max_split_size_mb:128")]
    assert all(isinstance(r["replayed_fits"], bool) and r["real_fits"] is None for r in share)
    rows = report["unsloth_8b"]["rows"]
    assert {r["name"] for r in rows} == {"TRL 2024", "fp32 embeddings and head"}
    assert all(r["fake_peak"] == r["real_peak"] for r in rows)  # fake equals real on a CPU
    # the allocator's replay of each >= 1 B row's run (on a GPU: beside max_memory_reserved)
    assert all(r["replayed_reserved"] >= r["replayed_allocated"] > 0
               for p in settings for r in report[p])
    lines = report["unsloth_8b"]["lines"]
    # on a CPU only the traces make lines (the allocator's and the driver's counts are CUDA's)
    assert set(lines) == {"TRL 2024: fake_peak", "fp32 embeddings and head: fake_peak"}
    assert all(line["bytes_per_token"] > 0 for line in lines.values())

    # a memory-only call records on its own (no sweeps), into its device's folder; on a CPU the
    # allocator's figures are absent, so only the traces' lines are filed
    raw = tmp_path / "results" / "cpu-smoke" / "raw"
    raw.mkdir(parents=True)
    (tmp_path / "gpu_session.json").rename(raw / "gpu_session_memory.json")
    path = bench_script("gpu_session").record("cpu-smoke", tmp_path / "results")
    names = {f["metric"] for f in json.loads(path.read_text())["figures"]}
    assert names == {f"{kind}, {stack}: fake_peak" for kind in ("MiB a token",
                                                                "GiB before the first token")
                     for stack in ("TRL 2024", "fp32 embeddings and head")}


def test_record_turns_the_h100_raw_files_into_the_committed_figures(tmp_path, bench_script):
    shutil.copytree(ROOT / "results" / "h100" / "raw", tmp_path / "h100" / "raw")
    path = bench_script("gpu_session").record("h100", tmp_path)
    committed = json.loads((ROOT / "results" / "h100" / "gpu_session.json").read_text())
    assert json.loads(path.read_text())["figures"] == committed["figures"]


def test_record_files_the_card_shares_verdicts_beside_the_replays(tmp_path, bench_script):
    raw = tmp_path / "h200" / "raw"
    raw.mkdir(parents=True)
    rows = [{"seq_len": 7040, "expandable_segments": e, "max_split_size_mb": mss,
             "capacity": 23.5 * 2**30, "replayed_fits": e, "real_fits": True,
             "reserved_peak": 1, "replayed_reserved": 1}
            for e, mss in ((False, None), (True, None), (False, 128))]
    (raw / "gpu_session_share.json").write_text(json.dumps(
        {"device": "cuda: NVIDIA H200", "card_share": rows}))
    figures = json.loads(bench_script("gpu_session").record("h200", tmp_path).read_text())
    got = {f["metric"]: (f["value"], f["predicted"]) for f in figures["figures"]}
    assert got == {"fits, 7040 tokens, default allocator": (1.0, 0.0),
                   "fits, 7040 tokens, expandable segments": (1.0, 1.0),
                   "fits, 7040 tokens, max_split_size_mb:128": (1.0, 0.0)}


def test_record_names_each_settings_figures_after_the_setting(tmp_path, bench_script):
    raw = tmp_path / "h200" / "raw"
    raw.mkdir(parents=True)
    row = {"stack": "full, bf16, adamw", "allocated_peak": 100, "reserved_peak": 200,
           "replayed_reserved": 210, "replayed_allocated": 101}
    part = {name: [{**row, "alloc_conf": conf, **allocator.parse_settings(conf)}]
            for name, conf in (("fake_vs_real_max_split", "max_split_size_mb:128"),
                               ("fake_vs_real_rounding",
                                "expandable_segments:True,roundup_power2_divisions:16"),
                               ("fake_vs_real_expandable_max_split",
                                "expandable_segments:True,max_split_size_mb:128"))}
    (raw / "gpu_session_memory.json").write_text(json.dumps({"device": "cuda: H200", **part}))
    figures = json.loads(bench_script("gpu_session").record("h200", tmp_path).read_text())
    got = {f["metric"]: f["value"] for f in figures["figures"]}
    assert got == {"replayed_over_reserved_max_split_128_full_bf16_adamw": 1.05,
                   "replayed_over_allocated_expandable_roundup_16_full_bf16_adamw": 1.01,
                   "replayed_over_reserved_expandable_roundup_16_full_bf16_adamw": 1.05,
                   "replayed_over_reserved_expandable_max_split_128_full_bf16_adamw": 1.05}


def test_a_short_call_runs_the_parts_it_names_only(tmp_path, bench_script, monkeypatch):
    monkeypatch.setenv("GPU_SESSION_PARTS", "outside_allocator")
    monkeypatch.setattr(sys, "argv", ["gpu_session.py", str(tmp_path), "--smoke", "--memory-only"])
    bench_script("gpu_session").main(str(tmp_path), True)
    report = json.loads((tmp_path / "gpu_session.json").read_text())
    assert "needs CUDA" in report["outside_allocator"]["skipped"]
    assert report["card_share"] == {"skipped": "not in GPU_SESSION_PARTS"}
    assert set(report["seconds"]) == {"outside_allocator"}


def test_record_names_a_device_folder_without_raw_files(tmp_path, bench_script):
    with pytest.raises(ValueError, match="device_dir='h200'"):
        bench_script("gpu_session").record("h200", tmp_path)


def test_gpu_plan_says_what_it_lacks_and_its_parts_name_notebooks(tmp_path):
    script = ROOT / "bench" / "gpu_plan.sh"
    run = subprocess.run(["bash", str(script), str(tmp_path)], check=False, capture_output=True,
                         text=True,
                         env={**os.environ, "DEVICE_SITE": str(tmp_path / "none.tar.xz")})
    assert run.returncode == 2 and "bench/device_site.py" in run.stderr
    default = re.search(r"parts=\$\{3:-([^}]*)\}", script.read_text()).group(1).split()
    assert default[0] == "memory"
    for part in default[1:]:
        assert len(list((ROOT / "notebooks").glob(f"{part}_*.ipynb"))) == 1, part
