"""bench/gpu_session.py: the one call a lent GPU runs. Its memory parts are checked here at tiny
sizes on the CPU (``--smoke``), so a rare GPU session does not find the script broken."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_memory_parts_run_and_the_unsloth_lines_are_fitted(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_session.py"), str(tmp_path),
                    "--smoke", "--memory-only"], check=True, cwd=ROOT, capture_output=True)
    report = json.loads((tmp_path / "gpu_session.json").read_text())
    assert "needs CUDA" in report["outside_allocator"]["skipped"]
    assert all("error" not in report[p] for p in ("fake_vs_real", "unsloth_8b")), report
    rows = report["unsloth_8b"]["rows"]
    assert {r["name"] for r in rows} == {"TRL 2024", "fp32 embeddings and head"}
    assert all(r["fake_peak"] == r["real_peak"] for r in rows)  # fake equals real on a CPU
    lines = report["unsloth_8b"]["lines"]
    # on a CPU only the traces make lines (the allocator's and the driver's counts are CUDA's)
    assert set(lines) == {"TRL 2024: fake_peak", "fp32 embeddings and head: fake_peak"}
    assert all(line["bytes_per_token"] > 0 for line in lines.values())
