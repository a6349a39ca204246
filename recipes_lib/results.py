"""The one results writer: every notebook records its figures to ``<results dir>/<stem>.json``.

Schema: ``{"device": str, "versions": {pkg: version}, "figures": [{"recipe", "metric", "value",
"baseline", "predicted", "unit"}], "claims": [{"recipe", "claim", "value", "target", "at_least",
"spread", "met"}]}``. The README table and the report are generated from these.

The results directory is a setting: ``$RECIPES_RESULTS_DIR``, else the repository's ``results/``.
The test suite points it at a temporary folder, so only ``make run`` and ``make bench`` write
``results/`` and the README's table.

A run that stops before its end loses nothing it measured: every figure is also kept at once in
``<results dir>/.partial/<stem>.json`` (not tracked), which :meth:`Results.save` removes. After a
notebook failed or was stopped (a GPU call's deadline), :func:`keep_partial` makes those figures
its results file, marked ``"partial": true``; the README's table says so on each of its rows.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "results"  # the committed figures; see output_dir() for the setting
RESULTS_ENV = "RECIPES_RESULTS_DIR"
README = ROOT / "README.md"
PLANNER_DOC = ROOT / "docs" / "planner.md"  # the planner in full: the published table
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "torchao")
PARTIAL_DIR = ".partial"  # <results dir>/.partial/<stem>.json: a run's figures so far
README_BEGIN = "<!-- results-table:begin -->"
README_END = "<!-- results-table:end -->"


@dataclass
class Figure:
    """One measured figure, with its same-run baseline and the calculator's prediction.

    Attributes:
        recipe: the recipe it belongs to.
        metric: what it measures.
        value: the figure.
        baseline: the same-run baseline's figure (None: none).
        predicted: the calculator's prediction (None: none).
        unit: its unit, in words.
    """

    recipe: str
    metric: str
    value: float
    baseline: float | None = None
    predicted: float | None = None
    unit: str = ""


@dataclass
class Claim:
    """A speed claim checked in a run (``checks.check_speed``): the figure, its target, its
    verdict.

    Attributes:
        recipe: the recipe it belongs to.
        claim: the claim, in words.
        value: the measured figure.
        target: what it has to reach.
        at_least: the figure must be at least (else at most) the target.
        spread: the timing's spread (None: not timed).
        met: the verdict.
    """

    recipe: str
    claim: str
    value: float
    target: float
    at_least: bool = True  # value >= target (else value <= target)
    spread: float | None = None  # (max - min) / median of the timed runs behind the value
    met: bool = False


def output_dir() -> Path:
    """Where results go: ``$RECIPES_RESULTS_DIR`` if set, else the repository's ``results/``.

    Returns:
        The folder.
    """
    return Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)


def check_writable(folder: Path | str) -> Path:
    """Create ``folder`` if needed and check a file can be written there.

    Args:
        folder: the folder.

    Returns:
        It, as a ``Path``.

    Raises:
        ValueError: naming the folder and the setting, when it cannot be created or written.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"results_dir={str(folder)!r}: cannot be written ({err.strerror or err}); "
                         f"set {RESULTS_ENV} to a writable folder") from err
    return folder


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed versions of the stack (``"missing"`` where a package is not installed).

    Args:
        packages: the distributions' names.

    Returns:
        name -> version.
    """
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

    Args:
        stem: the notebook's file stem, e.g. "01_large_models_limited_hardware".
        device: the device the figures come from, in words (``device.describe_device``).
        results_dir: where the file goes (default: ``results/``, or $RECIPES_RESULTS_DIR).

    Raises:
        ValueError: for a ``stem`` that is not a file stem, or a folder that cannot be written
            (checked now, not after an hour of measurements).

    Example:
        >>> r = Results("01_large_models_limited_hardware", device="cpu")
        >>> f = r.add("qlora", "quantized_linear_bytes_ratio", 0.26, predicted=0.258)
    """

    def __init__(self, stem: str, device: str, results_dir: Path | str | None = None):
        if not stem or "/" in stem:
            raise ValueError(f"stem={stem!r}: expected a notebook file stem")
        # checked now, not after an hour of measurements
        self.results_dir = check_writable(results_dir if results_dir is not None
                                          else output_dir())
        self.stem, self.device = stem, device
        self.figures: list[Figure] = []
        self.claims: list[Claim] = []
        self._versions: dict[str, str] | None = None  # read once: a figure is kept at each add
        partial_path(stem, self.results_dir).unlink(missing_ok=True)  # an earlier run's

    def add(self, recipe: str, metric: str, value: float, baseline: float | None = None,
            predicted: float | None = None, unit: str = "") -> Figure:
        """Record a figure (replacing an earlier one with the same recipe and metric)."""
        fig = Figure(recipe, metric, _number("value", value), _number("baseline", baseline),
                     _number("predicted", predicted), unit)
        self.figures = [f for f in self.figures if (f.recipe, f.metric) != (recipe, metric)]
        self.figures.append(fig)
        self._keep_so_far()
        return fig

    def add_claim(self, claim: Claim) -> Claim:
        """Record a checked speed claim (replacing an earlier one with the same recipe and text)."""
        self.claims = [c for c in self.claims if (c.recipe, c.claim) != (claim.recipe, claim.claim)]
        self.claims.append(claim)
        self._keep_so_far()
        return claim

    def get(self, recipe: str, metric: str) -> Figure:
        for f in self.figures:
            if (f.recipe, f.metric) == (recipe, metric):
                return f
        raise KeyError(f"no figure {recipe}/{metric}")

    def to_dict(self) -> dict:
        if self._versions is None:
            self._versions = package_versions()
        return {"device": self.device, "versions": self._versions,
                "figures": [asdict(f) for f in self.figures],
                "claims": [asdict(c) for c in self.claims]}

    def save(self) -> Path:
        """Write ``<results dir>/<stem>.json`` (temporary file + rename: never half-written)."""
        check_writable(self.results_dir)
        path = _write_json(self.results_dir / f"{self.stem}.json", self.to_dict())
        partial = partial_path(self.stem, self.results_dir)
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # another run's figures are still there
            partial.parent.rmdir()
        return path

    def _keep_so_far(self) -> None:
        """Everything recorded so far, in :func:`partial_path` (a run stopped before
        :meth:`save` keeps what it measured)."""
        path = partial_path(self.stem, self.results_dir)
        path.parent.mkdir(exist_ok=True)
        _write_json(path, {**self.to_dict(), "partial": True})


def _write_json(path: Path, content: dict) -> Path:
    """``content`` as ``path``, through a temporary file and a rename: never half-written."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(content, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def partial_path(stem: str, results_dir: Path | str | None = None) -> Path:
    """Where a run keeps the figures of ``stem`` as it records them: ``<results
    dir>/.partial/<stem>.json``, there only while the run has not saved its results file.

    Args:
        stem: the results file's stem.
        results_dir: the results folder (default: :func:`output_dir`).

    Returns:
        The path (which may not exist).
    """
    return Path(results_dir if results_dir is not None else output_dir()) / PARTIAL_DIR / \
        f"{stem}.json"


def run_status(stem: str, state: str, results_dir: Path | str | None = None) -> str:
    """A notebook run's outcome in words: ``state``, and for a run that did not finish, where
    the figures it recorded before stopping are (:func:`partial_path`), if it recorded any.

    Args:
        stem: the notebook's file stem.
        state: "ok" or the failure (``notebooks.execute``'s status).
        results_dir: the results folder (default: :func:`output_dir`).

    Returns:
        The line.
    """
    kept = partial_path(stem, results_dir)
    if state == "ok" or not kept.is_file():
        return state
    n = len(json.loads(kept.read_text())["figures"])
    return f"{state} ({n} figure{'s' * (n != 1)} recorded before it stopped: {kept})"


def keep_partial(stem: str, results_dir: Path | str | None = None,
                 replace: bool = False) -> Path | None:
    """After a run of ``stem`` stopped before saving (a failed cell, a deadline), make the
    figures it had recorded its results file, marked ``"partial": true``: what the README's
    table and the report then show, each row saying the run stopped early.

    Args:
        stem: the notebook's file stem.
        results_dir: the results folder (default: :func:`output_dir`).
        replace: also where the folder holds a whole run's results file for ``stem`` (an
            earlier run's, e.g. the committed one), which the partial figures then replace.

    Returns:
        The results file written, or None where the run left no figures (it saved its file,
        or stopped before its first figure).

    Raises:
        ValueError: naming the file, where a whole run's results would be replaced without
            ``replace=True``.

    Example:
        >>> keep_partial("03_optimizing_inference_speed")  # doctest: +SKIP
    """
    partial = partial_path(stem, results_dir)
    if not partial.is_file():
        return None
    path = partial.parent.parent / f"{stem}.json"
    if not replace and path.is_file() and not json.loads(path.read_text()).get("partial"):
        raise ValueError(f"stem={stem!r}: {path} holds a whole run's figures, which the partial "
                         "ones would replace; pass replace=True to replace them")
    os.replace(partial, path)
    with contextlib.suppress(OSError):  # another run's figures are still there
        partial.parent.rmdir()
    return path


def load_results(results_dir: Path | str | None = None) -> dict[str, dict]:
    """Every ``*.json`` file of the results directory, keyed by stem, sorted.

    Args:
        results_dir: the folder (default: :func:`output_dir`).

    Returns:
        stem -> the file's contents.
    """
    folder = Path(results_dir) if results_dir is not None else output_dir()
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def load_raw(device: str, name: str) -> dict:
    """A GPU run's own file, ``results/<device>/raw/<name>.json`` (written by
    ``bench/gpu_session.py`` on that GPU), to show its figures where the GPU is absent.

    Args:
        device: the GPU's folder name, e.g. "h100".
        name: the file's stem.

    Returns:
        The file's contents.

    Raises:
        ValueError: naming the file when it does not exist.
    """
    path = RESULTS_DIR / device / "raw" / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"name={name!r}: no recorded run at {path}")
    return json.loads(path.read_text())


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


# results files the README shows in a table of their own (the architecture x notebook matrix)
OWN_TABLE = ("architectures",)


def markdown_table(results_dir: Path | str | None = None) -> str:
    """One Markdown table of all figures: notebook, recipe, metric, value, baseline, predicted.

    Args:
        results_dir: the folder (default: :func:`output_dir`).

    Returns:
        The table.
    """
    lines = ["| notebook | recipe | metric | value | baseline | predicted | unit | device |",
             "|---|---|---|---|---|---|---|---|"]
    for stem, res in load_results(results_dir).items():
        if stem in OWN_TABLE:
            continue
        where = res["device"] + (" (partial: the run stopped before its end)"
                                 if res.get("partial") else "")
        for f in res["figures"]:
            lines.append(f"| {stem} | {f['recipe']} | {f['metric']} | {_fmt(f['value'])} | "
                         f"{_fmt(f['baseline'])} | {_fmt(f['predicted'])} | {f['unit']} | "
                         f"{where} |")
    return "\n".join(lines)


def _markers(section: str | None) -> tuple[str, str]:
    if section is None:
        return README_BEGIN, README_END
    return f"<!-- results-table:{section}:begin -->", f"<!-- results-table:{section}:end -->"


def write_readme_section(name: str, table: str, doc: Path | str | None = None) -> bool:
    """Put ``table`` between the README's ``<!-- {name}:begin -->`` and ``<!-- {name}:end -->``
    markers (or another page's of the repository), only when results go to the repository's
    ``results/`` (a test run's figures never reach the README).

    Args:
        name: the markers' name.
        table: the text to put there.
        doc: the page that has the markers (None: the README; ``PLANNER_DOC``: the planner's
            page, where the published figures' table is).

    Returns:
        True if the page changed.

    Raises:
        ValueError: if the page lacks the markers.
    """
    doc = Path(doc) if doc is not None else README
    if output_dir().resolve() != RESULTS_DIR.resolve():
        print(f"{doc.name} {name} not refreshed: results went to {output_dir()} ({RESULTS_ENV})")
        return False
    text = doc.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"{doc.name}: missing {begin} / {end} markers")
    head, rest = text.split(begin, 1)
    new = f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}"
    doc.write_text(new)
    return new != text


def update_readme(readme: Path | str = README, results_dir: Path | str | None = None) -> bool:
    """Replace the table between the README's results markers; return True if it changed.

    The repository's README shows the committed figures only: when the results setting points
    elsewhere (the test suite, a user's own folder), its table is left alone and this says so.

    A sub-folder of ``results_dir`` (e.g. ``results/h100/``, figures from a run on another
    machine) fills the table between ``<!-- results-table:h100:begin -->`` and its end marker,
    where the README has them.

    Args:
        readme: the README to update.
        results_dir: the results folder (default: the results setting's).

    Returns:
        True if the README changed.

    Raises:
        ValueError: if the README lacks the begin/end markers.
    """
    readme = Path(readme)
    results_dir = Path(results_dir) if results_dir is not None else output_dir()
    if readme.resolve() == README.resolve() and results_dir.resolve() != RESULTS_DIR.resolve():
        print(f"README table not refreshed: these figures went to {results_dir} ({RESULTS_ENV})")
        return False
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


def write_report(status: dict[str, str], results_dir: Path | str | None = None) -> Path:
    """Write ``report.md`` in the results directory: each notebook's status, device, versions and
    figures.

    Args:
        status: notebook stem -> "ok" or the failure.
        results_dir: the folder (default: :func:`output_dir`).

    Returns:
        The report's path.
    """
    results_dir = Path(results_dir) if results_dir is not None else output_dir()
    runs = load_results(results_dir)
    lines = ["# Results report", "", "| notebook | status | device |", "|---|---|---|"]
    for stem, state in status.items():
        lines.append(f"| {stem} | {run_status(stem, state, results_dir)} | "
                     f"{runs.get(stem, {}).get('device', '')} |")
    versions = next(iter(runs.values()), {}).get("versions", {})
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
              markdown_table(results_dir), ""]
    path = results_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _source_fingerprint() -> str:
    """A digest of the package's source: figures kept by an interrupted run are reused only by
    the same code."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "recipes_lib").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class Progress:
    """What a long run has measured so far, kept on disk after each measurement so that an
    interrupted run loses nothing: the next run with the same device, package versions and
    source reuses each recorded value instead of measuring it again.

    The file is ``<results dir>/.progress/<stem>.json`` (not tracked); :meth:`done` removes it.

    Args:
        stem: the results file's stem, e.g. "real_scale".
        device: the device, in words (``device.describe_device``): values from another device
            are not reused.
        results_dir: the results folder (default: :func:`output_dir`).

    Raises:
        ValueError: for a ``stem`` that is not a file stem, or a folder that cannot be written.

    Example:
        >>> p = Progress("real_scale", "cpu")
        >>> ratio = p.value("tiny: fp32", lambda: 1.0)  # measured once, then read back
    """

    def __init__(self, stem: str, device: str, results_dir: Path | str | None = None):
        if not stem or "/" in stem:
            raise ValueError(f"stem={stem!r}: expected a results file stem")
        folder = check_writable(Path(results_dir if results_dir is not None else output_dir())
                                / ".progress")
        self.path = folder / f"{stem}.json"
        self.fingerprint = {"device": device, "versions": package_versions(),
                            "source": _source_fingerprint()}
        self.values: dict = {}
        if self.path.is_file():
            try:
                kept = json.loads(self.path.read_text())
            except (OSError, ValueError):
                kept = {}
            if kept.get("fingerprint") == self.fingerprint:
                self.values = kept.get("values", {})
        self.reused = len(self.values)
        self._read_back = set(self.values)

    def value(self, key: str, measure: Callable[[], Any]) -> Any:
        """The value recorded under ``key``, or ``measure()``'s, recorded at once.

        Args:
            key: what was measured, in words (unique within the run).
            measure: a function of no arguments returning a JSON-serialisable value.

        Returns:
            The value (read back from the file where it was recorded: tuples come back as
            lists).
        """
        if key not in self.values:
            self.values[key] = json.loads(json.dumps(measure()))
            _write_json(self.path, {"fingerprint": self.fingerprint, "values": self.values})
        return self.values[key]

    def said(self, key: str) -> str:
        """How a printed line says where its value came from: " (kept from the interrupted run)"
        for a value read back from the file, "" for one measured by this run.

        Args:
            key: a key given to :meth:`value`.

        Returns:
            The words to append to the line.
        """
        return " (kept from the interrupted run)" if key in self._read_back else ""

    def done(self) -> None:
        """Remove the file: the run finished and its results are saved."""
        self.path.unlink(missing_ok=True)
