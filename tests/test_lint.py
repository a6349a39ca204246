"""The style the code is read in: ruff's rules (pyproject.toml) over the library, the tests, the
benchmarks and the notebooks' code cells, 100 columns included."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_passes_on_the_library_tests_benchmarks_and_notebooks():
    pytest.importorskip("ruff", reason="ruff is in requirements.txt; this environment lacks it")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                          "--output-format", "concise", "recipes_lib", "tests", "bench",
                          "notebooks", "conftest.py"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
