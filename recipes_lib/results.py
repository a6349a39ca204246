"""The one results writer: every notebook records its figures to ``results/<stem>.json``.

Schema: ``{"device": str, "versions": {pkg: version}, "figures": [{"recipe", "metric", "value",
"baseline", "predicted", "unit"}]}``. The README table and the report are generated from these.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "torchao")
README_BEGIN = "<!-- results-table:begin -->"
README_END = "<!-- results-table:end -->"


@dataclass
class Figure:
    """One measured figure, with its same-run baseline and the calculator's prediction."""

    recipe: str
    metric: str
    value: float
    baseline: float | None = None
    predicted: float | None = None
    unit: str = ""


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed versions of the stack (``"missing"`` where a package is not installed)."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def _number(name: str, value) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value}: figures must be finite numbers")
    return value


class Results:
    """Collect a notebook's figures and write them atomically.

    Example:
        >>> r = Results("01_large_models_limited_hardware", device="cpu")
        >>> f = r.add("qlora", "quantized_linear_bytes_ratio", 0.26, predicted=0.258)
    """

    def __init__(self, stem: str, device: str, results_dir: Path | str = RESULTS_DIR):
        if not stem or "/" in stem:
            raise ValueError(f"stem={stem!r}: expected a notebook file stem")
        self.stem, self.device, self.results_dir = stem, device, Path(results_dir)
        self.figures: list[Figure] = []

    def add(self, recipe: str, metric: str, value: float, baseline: float | None = None,
            predicted: float | None = None, unit: str = "") -> Figure:
        """Record a figure (replacing an earlier one with the same recipe and metric)."""
        fig = Figure(recipe, metric, _number("value", value), _number("baseline", baseline),
                     _number("predicted", predicted), unit)
        self.figures = [f for f in self.figures if (f.recipe, f.metric) != (recipe, metric)]
        self.figures.append(fig)
        return fig

    def get(self, recipe: str, metric: str) -> Figure:
        for f in self.figures:
            if (f.recipe, f.metric) == (recipe, metric):
                return f
        raise KeyError(f"no figure {recipe}/{metric}")

    def to_dict(self) -> dict:
        return {"device": self.device, "versions": package_versions(),
                "figures": [asdict(f) for f in self.figures]}

    def save(self) -> Path:
        """Write ``results/<stem>.json`` (temporary file + rename: never half-written)."""
        self.results_dir.mkdir(parents=True, exist_ok=True)
        path = self.results_dir / f"{self.stem}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
        return path


def load_results(results_dir: Path | str = RESULTS_DIR) -> dict[str, dict]:
    """Every ``results/*.json`` file, keyed by stem, sorted."""
    return {p.stem: json.loads(p.read_text())
            for p in sorted(Path(results_dir).glob("*.json"))}


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


def markdown_table(results_dir: Path | str = RESULTS_DIR) -> str:
    """One Markdown table of all figures: notebook, recipe, metric, value, baseline, predicted."""
    lines = ["| notebook | recipe | metric | value | baseline | predicted | unit | device |",
             "|---|---|---|---|---|---|---|---|"]
    for stem, res in load_results(results_dir).items():
        for f in res["figures"]:
            lines.append(f"| {stem} | {f['recipe']} | {f['metric']} | {_fmt(f['value'])} | "
                         f"{_fmt(f['baseline'])} | {_fmt(f['predicted'])} | {f['unit']} | "
                         f"{res['device']} |")
    return "\n".join(lines)


def _markers(section: str | None) -> tuple[str, str]:
    if section is None:
        return README_BEGIN, README_END
    return f"<!-- results-table:{section}:begin -->", f"<!-- results-table:{section}:end -->"


def update_readme(readme: Path | str, results_dir: Path | str = RESULTS_DIR) -> bool:
    """Replace the table between the README's results markers; return True if it changed.

    A sub-folder of ``results_dir`` (e.g. ``results/h100/``, figures from a run on another
    machine) fills the table between ``<!-- results-table:h100:begin -->`` and its end marker,
    where the README has them.

    Raises:
        ValueError: if the README lacks the begin/end markers.
    """
    readme, results_dir = Path(readme), Path(results_dir)
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"readme={str(readme)!r}: missing {README_BEGIN} / {README_END} markers")
    new = text
    sections = [(None, results_dir)] + [(d.name, d) for d in sorted(results_dir.iterdir())
                                        if d.is_dir() and any(d.glob("*.json"))]
    for section, folder in sections:
        begin, end = _markers(section)
        if begin not in new or end not in new:
            continue
        head, rest = new.split(begin, 1)
        _, tail = rest.split(end, 1)
        new = f"{head}{begin}\n{markdown_table(folder)}\n{end}{tail}"
    if new != text:
        readme.write_text(new)
    return new != text


def write_report(status: dict[str, str], results_dir: Path | str = RESULTS_DIR) -> Path:
    """Write ``results/report.md``: each notebook's run status, device, versions and figures."""
    results_dir = Path(results_dir)
    runs = load_results(results_dir)
    lines = ["# Results report", "", "| notebook | status | device |", "|---|---|---|"]
    for stem, state in status.items():
        lines.append(f"| {stem} | {state} | {runs.get(stem, {}).get('device', '')} |")
    versions = next(iter(runs.values()), {}).get("versions", {})
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
              markdown_table(results_dir), ""]
    path = results_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
