"""The results report as one self-contained HTML page: status, figures and the notebooks' plots.

``make run`` writes ``results/report.html`` (and ``results/report.md``) from ``results/*.json``
and the executed notebooks in ``notebooks/executed/``: one table of every figure with its
same-run baseline, the ratio and the calculator's prediction, the device and library versions
that produced it, and every plot the notebooks drew, inlined as PNG so the page needs no other
file.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from recipes_lib.results import _fmt, load_results, output_dir, run_status

STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ccc;
padding:.25em .6em;text-align:left}th{background:#f3f3f3}.ok{color:#176f2c}.failed{color:#b00020}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}figcaption{font-size:.85em;color:#555}"""


def notebook_images(path: Path | str) -> list[tuple[str, str]]:
    """Every image output of an executed notebook, in order.

    Args:
        path: the executed notebook.

    Returns:
        ``(caption, base64 PNG)`` pairs.
    """
    nb = json.loads(Path(path).read_text())
    images = []
    for i, cell in enumerate(nb.get("cells", [])):
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png")
            if png:
                source = "".join(cell.get("source", "")).strip().splitlines()
                images.append((f"cell {i}: {source[0][:80] if source else ''}",
                               "".join(png).replace("\n", "")))
    return images


def _ratio(value: float, baseline: float | None) -> str:
    if baseline in (None, 0):
        return ""
    return _fmt(value / baseline)


def write_html_report(status: dict[str, str], executed_dir: Path | str,
                      results_dir: Path | str | None = None) -> Path:
    """Write ``report.html`` in the results directory; return its path.

    Args:
        status: notebook stem -> "ok" or the failure, from the run.
        executed_dir: where the executed notebooks are (their plots are inlined).
        results_dir: where ``*.json`` figures are; the report is written there (default: the
            results setting, ``results.output_dir()``).

    Returns:
        The report's path.
    """
    results_dir = Path(results_dir) if results_dir is not None else output_dir()
    executed_dir = Path(executed_dir)
    runs = load_results(results_dir)
    esc = html.escape
    parts = [("<!doctype html><html><head><meta charset='utf-8'><title>Results report</title>"
              f"<style>{STYLE}</style></head><body><h1>Results report</h1>"),
             "<table><tr><th>notebook</th><th>status</th><th>device</th></tr>"]
    for stem, state in status.items():
        cls = "ok" if state == "ok" else "failed"
        parts.append(f"<tr><td>{esc(stem)}</td><td class='{cls}'>"
                     f"{esc(run_status(stem, state, results_dir))}</td>"
                     f"<td>{esc(runs.get(stem, {}).get('device', ''))}</td></tr>")
    parts.append("</table>")
    versions = next(iter(runs.values()), {}).get("versions", {})
    parts.append("<p>Versions: " + esc(", ".join(f"{k} {v}" for k, v in versions.items()))
                 + "</p>")
    for stem, res in runs.items():
        parts.append(f"<h2>{esc(stem)}</h2><p>device: {esc(res.get('device', ''))}</p><table>"
                     "<tr><th>recipe</th><th>metric</th><th>value</th><th>baseline</th>"
                     "<th>value / baseline</th><th>predicted</th><th>unit</th></tr>")
        for f in res["figures"]:
            parts.append(f"<tr><td>{esc(f['recipe'])}</td><td>{esc(f['metric'])}</td>"
                         f"<td>{_fmt(f['value'])}</td><td>{_fmt(f['baseline'])}</td>"
                         f"<td>{_ratio(f['value'], f['baseline'])}</td>"
                         f"<td>{_fmt(f['predicted'])}</td><td>{esc(f['unit'])}</td></tr>")
        parts.append("</table>")
        executed = executed_dir / f"{stem}.ipynb"
        for caption, png in notebook_images(executed) if executed.exists() else []:
            parts.append(f"<figure><img alt='{esc(caption)}' src='data:image/png;base64,{png}'>"
                         f"<figcaption>{esc(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    path = results_dir / "report.html"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(parts))
    tmp.replace(path)
    return path
