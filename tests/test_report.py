import base64
import io
import json

import nbformat

from recipes_lib import report, results


def _png() -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [1, 0])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def test_html_report_has_status_figures_ratios_and_plots(tmp_path):
    r = results.Results("02_demo", device="cpu", results_dir=tmp_path)
    r.add("fsdp", "state_ratio", 0.5, baseline=2.0, predicted=0.5, unit="x")
    r.save()
    executed = tmp_path / "executed"
    executed.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("plot()")])
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data={"image/png": _png()})]
    nbformat.write(nb, executed / "02_demo.ipynb")
    results.Results("04_stopped", "cpu", tmp_path).add("curriculum", "ratio", 0.6)  # then died
    page = report.write_html_report({"02_demo": "ok", "03_broken": "failed: CellExecutionError",
                                     "04_stopped": "failed: DeadKernelError"}, executed, tmp_path)
    text = page.read_text()
    assert "<td class='failed'>failed: CellExecutionError</td>" in text
    kept = results.partial_path("04_stopped", tmp_path)
    assert f"failed: DeadKernelError (1 figure recorded before it stopped: {kept})" in text
    assert "state_ratio" in text and "<td>0.25</td>" in text  # value / baseline
    assert text.count("data:image/png;base64,") == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_make_run_pieces_a_failing_notebook_does_not_stop_the_others(tmp_path):
    from recipes_lib.notebooks import execute

    paths = []
    for name, src in (("a_fails", "raise RuntimeError('boom')"), ("b_runs", "x = 1 + 1")):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
        paths.append(tmp_path / f"{name}.ipynb")
    status = execute(paths, tmp_path / "executed", timeout=120)
    assert status["a_fails"].startswith("failed") and "boom" in status["a_fails"]
    assert status["b_runs"] == "ok"
    assert (tmp_path / "executed" / "b_runs.ipynb").exists()
    json.loads((tmp_path / "executed" / "a_fails.ipynb").read_text())  # saved even when failed
