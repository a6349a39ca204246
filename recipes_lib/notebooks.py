"""Run the course notebooks the way the README documents: papermill, with the parameters cell.

``make run`` and ``make bench`` call :func:`execute`, which checks the parameters given against
each notebook's ``parameters`` cell (an unknown name is an error here; papermill itself only logs
it and runs the defaults), executes each notebook into ``notebooks/executed/`` and keeps going
when one fails. :func:`unclean_cells` is what CI checks: committed notebooks carry no outputs and
no execution counts, so their diffs stay readable.
"""

from __future__ import annotations

import ast
import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from recipes_lib.results import RESULTS_ENV, ROOT

NOTEBOOKS = ROOT / "notebooks"
EXECUTED = NOTEBOOKS / "executed"
def course_notebooks() -> list[Path]:
    """The four course notebooks, in order.

    Returns:
        Their paths.
    """
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def notebook_parameters(path: Path | str) -> dict[str, str]:
    """A notebook's parameters and their defaults (as written), read the way papermill reads
    them (one ``NAME = value`` per line of the cell tagged ``parameters``); empty if none.

    Args:
        path: the notebook.

    Returns:
        name -> default, as written.
    """
    import papermill

    return {name: p["default"] for name, p in papermill.inspect_notebook(str(path)).items()}


def parse_value(text: str) -> Any:
    """A command-line value as Python: ``3``, ``2e-3``, ``True``, ``None``, ``(256, 512)``; any
    other text stays a string (a hub id or a folder).

    Args:
        text: the value as typed.

    Returns:
        The Python value.

    Example:
        >>> parse_value("(256, 512)"), parse_value("meta-llama/Llama-3.2-1B")
        ((256, 512), 'meta-llama/Llama-3.2-1B')
    """
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def execute(paths: list[Path], out_dir: Path = EXECUTED, parameters: dict[str, Any] | None = None,
            timeout: int = 1800) -> dict[str, str]:
    """Execute notebooks with papermill (a cell progress bar each); return stem -> status.

    Args:
        paths: the notebooks, run in this order.
        out_dir: where the executed copies go (saved even when a notebook fails).
        parameters: injected after each notebook's ``parameters`` cell, as ``papermill -p``
            does; only the names a notebook declares are passed to it.
        timeout: seconds per cell.

    Returns:
        stem -> ``"ok"`` or ``"failed: <error>"``: a failing notebook does not stop the others.

    Raises:
        ValueError: for a parameter that no notebook in ``paths`` declares (before running any).
    """
    import papermill
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    parameters = parameters or {}
    declared = {path: notebook_parameters(path) for path in paths}
    unknown = sorted(set(parameters) - set().union(*map(set, declared.values())))
    if unknown:  # papermill would log "Passed unknown parameter" and run the defaults
        known = sorted(set().union(*map(set, declared.values())))
        raise ValueError(f"parameters: {', '.join(unknown)} not declared by "
                         f"{', '.join(p.name for p in paths)}; known: {', '.join(known)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    status = {}
    for path in paths:
        mine = {k: v for k, v in parameters.items() if k in declared[path]}
        # papermill writes a tuple as the string "(1, 2)"; a list stays a list
        mine = {k: list(v) if isinstance(v, tuple) else v for k, v in mine.items()}
        try:
            papermill.execute_notebook(str(path), str(out_dir / path.name), parameters=mine,
                                       cwd=str(path.parent), kernel_name="python3",
                                       execution_timeout=timeout, progress_bar=True)
            status[path.stem] = "ok"
        except PapermillExecutionError as err:
            status[path.stem] = f"failed: {err.ename}: {_error_summary(err.evalue)}"
        except (CellTimeoutError, DeadKernelError) as err:
            status[path.stem] = f"failed: {type(err).__name__}: {str(err).splitlines()[-1][:200]}"
    return status


def unclean_cells(paths: list[Path]) -> list[str]:
    """Cells that carry outputs or an execution count.

    Args:
        paths: the notebooks.

    Returns:
        One line per cell, ``"<file> cell <n>: <what>"``.
    """
    import nbformat

    problems = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if cell.get("outputs"):
                problems.append(f"{Path(path).name} cell {i}: {len(cell.outputs)} output(s)")
            if cell.get("execution_count") is not None:
                problems.append(f"{Path(path).name} cell {i}: execution count "
                                f"{cell.execution_count}")
    return problems


def strip(paths: list[Path]) -> list[Path]:
    """Remove outputs and execution counts in place.

    Args:
        paths: the notebooks.

    Returns:
        The notebooks that changed.
    """
    import nbformat

    changed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        dirty = False
        for cell in nb.cells:
            if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
                cell.outputs, cell.execution_count, dirty = [], None, True
        if dirty:
            Path(path).write_text(nbformat.writes(nb) + "\n")
            changed.append(Path(path))
    return changed


def architecture_matrix(architectures: tuple[str, ...] | None = None, out_dir: Path = EXECUTED,
                        parameters: dict[str, Any] | None = None,
                        on_row: Callable[[str, dict[str, str]], None] | None = None
                        ) -> dict[str, dict[str, str]]:
    """Every course notebook at its test size with ``MODEL_ID`` set to a tiny model of each
    architecture, built and pretrained the way the default is (``model.build_tiny_model``).

    Args:
        architectures: names from ``model.ARCHITECTURES`` (default: every decoder but GPT-NeoX,
            which notebook 03 builds itself as its LayerNorm baseline).
        out_dir: the executed copies go to ``out_dir/<architecture>/`` and their figures to
            ``out_dir/<architecture>/results/``, never to the results folder.
        parameters: more papermill parameters for every run.
        on_row: called with each architecture and its row as soon as its notebooks have run
            (the whole matrix takes most of an hour: a stop then loses only the row running).

    Returns:
        architecture -> notebook stem -> ``"ok"`` or ``"failed: <error>"``.

    Raises:
        ValueError: for an architecture the course cannot build (before running anything).
    """
    from recipes_lib import model as models

    archs = architectures or tuple(a for a in models.ARCHITECTURES if a != "gpt_neox")
    unknown = [a for a in archs if a not in models.ARCHITECTURES]
    if unknown:
        raise ValueError(f"architectures={unknown}: expected some of {models.ARCHITECTURES}")
    matrix = {}
    for arch in archs:
        path = models.build_tiny_model(spec=models.TinyModelSpec(architecture=arch))
        # each run's figures go beside its executed copies: in the results folder they would
        # replace the reference-size figures the README's table is built from
        with results_dir(Path(out_dir) / arch / "results"):
            matrix[arch] = execute(course_notebooks(), Path(out_dir) / arch,
                                   {**(parameters or {}), "MODEL_ID": str(path)})
        if on_row is not None:
            on_row(arch, matrix[arch])
    return matrix


@contextlib.contextmanager
def results_dir(folder: Path) -> Iterator[Path]:
    """``$RECIPES_RESULTS_DIR`` set to ``folder`` (which the notebook kernels inherit) for the
    duration, then restored.

    Args:
        folder: where results go meanwhile.

    Yields:
        ``folder``.
    """
    old = os.environ.get(RESULTS_ENV)
    os.environ[RESULTS_ENV] = str(folder)
    try:
        yield folder
    finally:
        if old is None:
            del os.environ[RESULTS_ENV]
        else:
            os.environ[RESULTS_ENV] = old


def matrix_table(matrix: dict[str, dict[str, str]]) -> str:
    """The architecture x notebook matrix as a markdown table ("run" or the failure).

    Args:
        matrix: architecture -> notebook -> status.

    Returns:
        The table.
    """
    stems = sorted({stem for row in matrix.values() for stem in row})
    lines = ["| architecture | " + " | ".join(s[:2] for s in stems) + " |",
             "|---" * (len(stems) + 1) + "|"]
    for arch, row in matrix.items():
        cells = ["run" if row.get(s) == "ok" else (row.get(s) or "not run").replace("|", "/")
                 for s in stems]
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _error_summary(message: object, limit: int = 600) -> str:
    """An error message on one line: its non-blank lines joined with " | ", cut at ``limit``
    characters (a distributed run's first line only says that it failed; the next say why)."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    text = " | ".join(lines)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def executed_status(path: Path | str) -> str:
    """A papermill-executed notebook's outcome, read from the cells' papermill metadata: "ok",
    "failed: <error>" (the first failed cell's), or "not finished" (stopped before the end).

    Args:
        path: the executed notebook.

    Returns:
        The outcome.
    """
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    states = [c.metadata.get("papermill", {}).get("status") for c in nb.cells]
    for cell, state in zip(nb.cells, states):
        if state == "failed":
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    return f"failed: {out.get('ename')}: {_error_summary(out.get('evalue', ''))}"
            return "failed"
    return "ok" if all(s == "completed" for s in states) else "not finished"
