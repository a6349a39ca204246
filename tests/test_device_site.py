"""bench/device_site.py: what a lent GPU machine is given to run the notebooks (no downloads here:
the closure is read from this Python's installed packages)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def device_site(bench_script):
    return bench_script("device_site")


def test_the_runtime_closure_carries_what_the_image_lacks_and_leaves_what_it_has(device_site):
    roots = [n for n in device_site.requirement_names(ROOT / "requirements.txt")
             if n not in device_site.DEV_ONLY]
    assert "torch" not in roots and "bitsandbytes" in roots and "papermill" in roots
    found = device_site.closure(roots)
    carried = set(found) - device_site.DEVICE_HAS
    # the packages the course needs that the device image lacks or holds too old
    assert {"bitsandbytes", "torchao", "trl", "datasets", "transformers", "peft", "papermill",
            "ipykernel", "nbclient", "jupyter-client", "pyzmq"} <= carried
    assert not {"torch", "numpy", "pandas"} & carried
    assert all(v for v in found.values())  # each with the version this Python runs


def test_names_are_canonical_and_a_missing_package_is_named(device_site):
    assert device_site.canonical("Jupyter_Client") == "jupyter-client"
    with pytest.raises(SystemExit, match="no-such-package-xyz is not installed"):
        device_site.closure(["no-such-package-xyz"])
