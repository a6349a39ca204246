"""Command line: ``python -m recipes_lib {run,readme,data,plan,colab}``.

- ``run``: execute every notebook headless into ``notebooks/executed/``, then refresh the README's
  results table from ``results/`` and write ``results/report.md`` and the self-contained
  ``results/report.html`` (figures, ratios, predictions, plots). A notebook that fails is
  reported as failed and the others still run.
- ``readme``: refresh the README's results table only.
- ``data``: regenerate the corpora in ``data/``.
- ``plan``: which recipes make a training run fit (``recipes_lib.planner``).
- ``colab``: stamp the "Open in Colab" badge and the Colab-only install cell into every notebook
  (``recipes_lib.colab``), given the repository's public GitHub ``owner/name``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_notebooks(paths: list[Path], out_dir: Path, timeout: int = 1800) -> dict[str, str]:
    """Execute notebooks one by one (cell progress bar each); return name -> "ok" or the error."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from tqdm.auto import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    status = {}
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        bar = tqdm(total=sum(c.cell_type == "code" for c in nb.cells), desc=path.stem)
        try:
            with client.setup_kernel():
                for i, cell in enumerate(nb.cells):
                    if cell.cell_type == "code":
                        client.execute_cell(cell, i)
                        bar.update()
            status[path.stem] = "ok"
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
            # a failing notebook must not stop the others
            status[path.stem] = f"failed: {type(err).__name__}: {str(err).splitlines()[-1][:200]}"
        finally:
            bar.close()
            nbformat.write(nb, out_dir / path.name)
    return status


def main(argv: list[str] | None = None) -> int:
    from recipes_lib import data, results
    from recipes_lib.report import write_html_report

    parser = argparse.ArgumentParser(prog="python -m recipes_lib")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute the notebooks and refresh the results table")
    run.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    sub.add_parser("readme", help="refresh the README's results table")
    sub.add_parser("data", help="regenerate data/")
    pl = sub.add_parser("plan", help="which recipes make a training run fit in GPU memory")
    pl.add_argument("--model", required=True, help="built-in name or a config.json path")
    pl.add_argument("--gpu-mem", required=True, help="memory per GPU, e.g. 16GB or 80GiB")
    pl.add_argument("--seq", type=int, default=2048, help="sequence length")
    pl.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    pl.add_argument("--gpus", type=int, default=1, help="GPUs for the FSDP row")
    cb = sub.add_parser("colab", help="stamp Colab badges and install cells into the notebooks")
    cb.add_argument("--repo", required=True, help="the public GitHub repository, owner/name")
    cb.add_argument("--ref", default="main", help="branch or tag the badges open")
    args = parser.parse_args(argv)

    if args.command == "colab":
        from recipes_lib.colab import stamp_notebooks

        try:
            for path in stamp_notebooks(args.repo, args.ref):
                print(f"stamped {path.relative_to(ROOT)}")
        except ValueError as err:
            parser.error(str(err))
        return 0
    if args.command == "plan":
        from recipes_lib.planner import format_plan, plan

        try:
            print(format_plan(plan(args.model, args.gpu_mem, args.seq, args.batch, args.gpus)))
        except ValueError as err:
            parser.error(str(err))
        return 0

    if args.command == "data":
        for name, path in data.generate_corpora().items():
            print(f"{name}: {path.relative_to(ROOT)}")
        return 0
    if args.command == "run":
        paths = [Path(p) for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
        status = run_notebooks(paths, ROOT / "notebooks" / "executed")
        for name, state in status.items():
            print(f"{name}: {state}")
        results.update_readme(ROOT / "README.md")
        report = results.write_report(status)
        page = write_html_report(status, ROOT / "notebooks" / "executed")
        print(results.markdown_table())
        print(f"report: {report.relative_to(ROOT)} and {page.relative_to(ROOT)}")
        return 0 if all(s == "ok" for s in status.values()) else 1
    results.update_readme(ROOT / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
