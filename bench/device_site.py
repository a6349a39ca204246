"""The Python packages a lent GPU machine lacks, as one archive to carry there.

    .venv/bin/python bench/device_site.py [--python 3.12] [--cuda 130]

The device tool's machines (one H100 or H200, no network) run an image whose Python holds CUDA
torch, numpy, pandas, matplotlib and the like, but not bitsandbytes, torchao, trl, datasets or
the Jupyter kernel stack that papermill needs, and an older transformers (5.17, where this course
needs >= 5.23). Its packages can only be carried, within 64 MiB. This script takes the runtime
closure of ``requirements.txt`` from the local ``.venv`` (the versions the CPU runs used), leaves
out the heavy packages the image has (``DEVICE_HAS``), installs the rest for the device's Python
with ``pip install --target`` (wheels only, no dependency resolution: the closure is already
complete), keeps only the bitsandbytes library for the device's CUDA (its wheel ships one per
CUDA version, 129 MB unpacked) and packs the folder into ``.device_site.tar.xz`` (~185 MiB
unpacked, ~28 MiB packed; git ignores it). A device ``run`` per notebook, with
``.device_site.tar.xz`` named in ``carry`` (``NB`` one of the four notebooks' stems):

    python3 -c "import tarfile; tarfile.open('.device_site.tar.xz').extractall('/tmp/site')" &&
    export PYTHONPATH=/tmp/site:$PWD MPLBACKEND=Agg HF_HUB_OFFLINE=1 RECIPES_RESULTS_DIR=$OUT &&
    timeout 560 python3 -m recipes_lib run notebooks/NB.ipynb -p SCALE gpu;
    cp notebooks/executed/NB.ipynb $OUT/

then, here, copy ``NB.json`` from the returned files into ``results/<device>/`` and run
``python -m recipes_lib readme``. The papermill kernel inherits ``PYTHONPATH``; the default
model's build (``.cache/``, ignored) stays on the machine between calls while it is warm (30 s
after each call). Checked here with Python 3.12 without torch: papermill ran a notebook on a
kernel whose packages all came from the archive (transformers 5.24, datasets, ipywidgets).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# What the runs need and the CPU's requirements.txt has for development only is left out.
DEV_ONLY = {"torch", "jupyterlab", "nbval", "pytest", "ruff", "tensorboard"}
# Heavy or compiled packages the device image already holds (read off the device tool's
# package list, 2026-11-17); the image's versions are used for these.
DEVICE_HAS = {
    "torch", "triton", "numpy", "pandas", "pyarrow", "matplotlib", "pillow", "scipy", "sympy",
    "mpmath", "networkx", "contourpy", "kiwisolver", "fonttools", "cycler", "pyparsing",
    "python-dateutil", "pytz", "tzdata", "six", "packaging", "setuptools", "psutil", "pyyaml",
    "regex", "requests", "urllib3", "certifi", "idna", "charset-normalizer", "aiohttp",
    "aiosignal", "aiohappyeyeballs", "frozenlist", "multidict", "yarl", "propcache", "attrs",
    "jinja2", "markupsafe", "fsspec", "filelock", "typing-extensions", "hf-xet", "httpx",
    "httpcore", "h11", "anyio", "sniffio", "click", "rich", "pygments", "markdown-it-py", "mdurl",
    "tqdm", "xxhash", "sentencepiece",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.append(canonical(Requirement(line).name))
    return names


def closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version, for ``roots`` and everything they require (no extras)."""
    env = default_environment() | {"extra": ""}
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed in this Python ({sys.executable}): "
                             "run make .venv/.installed first") from None
        found[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(canonical(req.name))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="the device's Python (major.minor)")
    parser.add_argument("--cuda", default="130", help="the device torch's CUDA, e.g. 130 for 13.0")
    parser.add_argument("--out", default=str(ROOT / ".device_site.tar.xz"))
    args = parser.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python):
        raise SystemExit(f"--python={args.python!r}: expected major.minor, e.g. 3.12")

    roots = [n for n in requirement_names(ROOT / "requirements.txt") if n not in DEV_ONLY]
    wanted = {n: v for n, v in closure(roots).items() if n not in DEVICE_HAS}
    archive = Path(args.out)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)]
    with tempfile.TemporaryDirectory(prefix="device_site-") as tmp:
        out = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                        "--only-binary=:all:", f"--python-version={args.python}",
                        "--implementation=cp", *platforms, "--platform=manylinux2014_x86_64",
                        "--target", str(out), *sorted(f"{n}=={v}" for n, v in wanted.items())],
                       check=True)
        kept = f"libbitsandbytes_cuda{args.cuda}.so"
        libs = list((out / "bitsandbytes").glob("libbitsandbytes_*.so"))
        if not any(p.name == kept for p in libs):
            raise SystemExit(f"--cuda={args.cuda}: bitsandbytes has no {kept} "
                             f"(it has {sorted(p.name for p in libs)})")
        for lib in libs:
            if lib.name not in (kept, "libbitsandbytes_cpu.so"):
                lib.unlink()
        shutil.rmtree(out / "bin", ignore_errors=True)  # console scripts point at this Python
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        subprocess.run(["tar", "-C", str(out), "-cJf", str(archive), "."], check=True,
                       env={**os.environ, "XZ_OPT": "-T0"})
    print(f"{archive}: {len(wanted)} packages, {size / 2**20:.1f} MiB unpacked, "
          f"{archive.stat().st_size / 2**20:.1f} MiB packed (the device tool carries at most "
          "64 MiB with the working tree)")

if __name__ == "__main__":
    main()
