"""The notebooks run anywhere: papermill reads their parameters, no cell relies on a tag, the
runner refuses unknown parameters, committed notebooks carry no outputs."""

import logging
import os

import nbformat
import pytest

from recipes_lib import notebooks
from recipes_lib.__main__ import format_claims, main

COURSE = notebooks.course_notebooks()


@pytest.mark.parametrize("path", COURSE, ids=[p.stem[:2] for p in COURSE])
def test_papermill_reads_every_parameter_without_warnings(path, caplog):
    nb = nbformat.read(path, as_version=4)
    [cell] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assigned = [line.split("=")[0].split(":")[0].strip() for line in cell.source.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    with caplog.at_level(logging.WARNING, logger="papermill"):
        params = notebooks.notebook_parameters(path)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert list(params) == assigned
    assert "MODEL_ID" in params and "STRICT_SPEED" in params


@pytest.mark.parametrize("path", COURSE, ids=[p.stem[:2] for p in COURSE])
def test_no_cell_needs_a_raises_exception_tag(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "raises-exception" in c.metadata.get("tags", [])]
    assert not tagged, f"cells {tagged}: papermill and Colab stop there; use checks.show_error"


def test_unknown_parameter_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="parameters: QLORA_STPES not declared.*QLORA_STEPS"):
        notebooks.execute(COURSE[:1], tmp_path, {"QLORA_STPES": 3})
    assert not list(tmp_path.iterdir())


def test_command_line_names_the_unknown_parameter(capsys):
    with pytest.raises(SystemExit):
        main(["run", str(COURSE[0]), "-p", "NOPE", "1"])
    assert "NOPE not declared" in capsys.readouterr().err


def test_parameter_values_parse_as_papermill_would():
    assert notebooks.parse_value("3") == 3 and notebooks.parse_value("2e-3") == 2e-3
    assert notebooks.parse_value("None") is None and notebooks.parse_value("True") is True
    assert notebooks.parse_value("(256, 512)") == (256, 512)
    assert notebooks.parse_value("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"


def test_outputs_are_found_and_stripped(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1"),
                                         nbformat.v4.new_markdown_cell("text")])
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"},
                                                  execution_count=1)]
    nb.cells[0].execution_count = 1
    path = tmp_path / "dirty.ipynb"
    nbformat.write(nb, path)
    assert notebooks.unclean_cells([path]) == ["dirty.ipynb cell 0: 1 output(s)",
                                               "dirty.ipynb cell 0: execution count 1"]
    assert notebooks.strip([path]) == [path] and notebooks.strip([path]) == []
    assert notebooks.unclean_cells([path]) == []


def test_committed_notebooks_are_clean():
    assert notebooks.unclean_cells(COURSE) == []


def test_claims_are_listed_with_their_verdict():
    rows = [{"notebook": "03_optimizing", "recipe": "flash_attention", "claim": "SDPA vs eager",
             "value": 4.61, "target": 3.5, "at_least": True, "spread": 0.12, "met": True},
            {"notebook": "04_training", "recipe": "chunked_ce", "claim": "step time",
             "value": 1.41, "target": 1.3, "at_least": False, "spread": None, "met": False}]
    assert format_claims(rows).splitlines() == [
        "MET      03  flash_attention: SDPA vs eager: 4.61 >= 3.5  spread 12%",
        "NOT MET  04  chunked_ce: step time: 1.41 <= 1.3"]


def test_bench_fails_only_on_the_reference_machine():
    from recipes_lib.__main__ import bench_verdict

    met = {"met": True}
    missed = {"met": False}
    assert bench_verdict([met, met], True, "")[1]
    line, ok = bench_verdict([met, missed], True, "")
    assert not ok and line == "1 of 2 speed claims NOT MET on the reference machine"
    line, ok = bench_verdict([met, missed], False, "cores 16 (reference: 2)")
    assert ok and line.startswith("not the reference machine (cores 16 (reference: 2)): 1 of 2")
    assert not bench_verdict([], True, "")[1]



def test_capped_claims_sit_beside_the_uncapped_ones(tmp_path):
    from recipes_lib import results
    from recipes_lib.__main__ import isa_claims_markdown

    for folder, device, value in (("native", "cpu (AVX512)", 4.6), ("capped", "cpu (AVX2)", 1.2)):
        r = results.Results("03_opt", device, tmp_path / folder)
        r.add_claim(results.Claim("sdpa", "SDPA vs eager", value, 3.5, spread=0.1,
                                  met=value >= 3.5))
        r.add_claim(results.Claim("int8", f"prefill, kernels' ({value:.2f}x)", 2.0, 1.0, met=True))
        if folder == "native":
            r.add_claim(results.Claim("bf16", "bf16 over fp32", 2.0, 1.0, met=True))
            results.Results("real_scale", device, tmp_path / folder).save()  # not in capped
        r.save()
    lines = isa_claims_markdown(tmp_path / "native", tmp_path / "capped").splitlines()
    assert lines[0] == "Uncapped: cpu (AVX512). Capped: cpu (AVX2)."
    assert lines[4:] == [("| 03 | sdpa: SDPA vs eager | >= 3.5 | 4.6 (spread 10%) met | "
                          "1.2 (spread 10%) **NOT MET** |"),
                         "| 03 | int8: prefill, kernels' | >= 1 | 2 met | 2 met |",
                         "| 03 | bf16: bf16 over fp32 | >= 1 | 2 met | not claimed |"]


@pytest.mark.slow
def test_papermill_runs_a_course_notebook_to_the_end_on_a_local_model(tiny_model_path, tmp_path):
    """The README's path: papermill with -p MODEL_ID <a local folder>, top to bottom (notebook 04
    here; `make test` runs the other three under nbval and `make run` all four with papermill)."""
    import json

    from recipes_lib import results

    path = notebooks.NOTEBOOKS / "04_training_long_sequences.ipynb"
    status = notebooks.execute([path], tmp_path, {"MODEL_ID": str(tiny_model_path)})
    assert status == {path.stem: "ok"}, status
    out = nbformat.read(tmp_path / path.name, as_version=4)
    [injected] = [c for c in out.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert f"MODEL_ID = \"{tiny_model_path}\"" in injected.source
    shown = "".join(o.get("text", "") for c in out.cells for o in c.get("outputs", []))
    # the bad-input demonstration ran and showed: twice the model's 512 positions
    assert "ValueError: seq_len=1024: beyond the model's max_position_embeddings=512" in shown
    saved = json.loads((results.output_dir() / f"{path.stem}.json").read_text())
    assert {c["recipe"] for c in saved["claims"]} == {"sliding_window", "chunked_ce"}


def test_tuple_parameters_reach_the_notebook_as_sequences(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("SIZES: tuple = (1, 2)\nNAME = None"),
        nbformat.v4.new_code_cell("assert sum(SIZES) == 7 and NAME == 'x', (SIZES, NAME)")])
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = tmp_path / "p.ipynb"
    nbformat.write(nb, path)
    status = notebooks.execute([path], tmp_path / "out", {"SIZES": (3, 4), "NAME": "x"},
                               timeout=120)
    assert status == {"p": "ok"}, status


def test_architecture_matrix_runs_each_notebook_on_each_folder(monkeypatch, tmp_path):
    from recipes_lib import model as models

    calls = []
    monkeypatch.setattr(models, "build_tiny_model", lambda spec: tmp_path / spec.architecture)
    monkeypatch.setattr(notebooks, "execute", lambda paths, out, params: calls.append(
        (out.name, params["MODEL_ID"], os.environ["RECIPES_RESULTS_DIR"])) or {
            p.stem: "ok" if "phi3" not in str(out) else "failed: AssertionError: loss"
            for p in paths})
    monkeypatch.setenv("RECIPES_RESULTS_DIR", str(tmp_path / "mine"))
    matrix = notebooks.architecture_matrix(("qwen2", "phi3"), tmp_path)
    # each architecture's figures stay beside its run, never in the results the README is from
    assert calls == [(a, str(tmp_path / a), str(tmp_path / a / "results"))
                     for a in ("qwen2", "phi3")]
    assert os.environ["RECIPES_RESULTS_DIR"] == str(tmp_path / "mine")  # restored
    table = notebooks.matrix_table(matrix).splitlines()
    assert table[0] == "| architecture | 01 | 02 | 03 | 04 |"
    assert table[2] == "| qwen2 | run | run | run | run |"
    assert table[3].startswith("| phi3 | failed: AssertionError: loss |")
    with pytest.raises(ValueError, match=r"architectures=\['bert'\]"):
        notebooks.architecture_matrix(("bert",))


def test_archs_rerun_keeps_the_other_architectures_rows(monkeypatch, tmp_path):
    import torch

    from recipes_lib import __main__ as cli
    from recipes_lib import device, results

    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path))
    runs = iter([{"qwen2": {"01_x": "failed: AssertionError: kd"}, "phi3": {"01_x": "ok"}},
                 {"qwen2": {"01_x": "ok"}}])
    asked = []

    def matrix(names=None, parameters=None, on_row=None):
        asked.append(parameters)
        return next(runs)  # rows not handed to on_row: the returned matrix is recorded
    monkeypatch.setattr(notebooks, "architecture_matrix", matrix)
    assert not cli.architectures_matrix()
    saved = results.load_results(tmp_path)["architectures"]["figures"]
    assert [(f["recipe"], f["value"], f["unit"]) for f in saved] == [
        ("qwen2", 0.0, "0: failed: AssertionError: kd"), ("phi3", 1.0, "1: ran top to bottom")]
    assert cli.architectures_matrix(["qwen2"])
    saved = results.load_results(tmp_path)["architectures"]["figures"]
    assert sorted((f["recipe"], f["value"]) for f in saved) == [("phi3", 1.0), ("qwen2", 1.0)]
    here = device.describe_device(torch.device("cpu"))  # both rows ran here: one machine
    assert results.load_results(tmp_path)["architectures"]["device"] == here
    # notebook 03's compiled decode (Gemma-2 recompiles at every token) runs in the matrix
    assert asked == [{"COMPILE_GENERATION": True}] * 2


def test_each_rows_machine_is_read_back_and_grouped():
    from recipes_lib.__main__ import machines_by_architecture

    a = "cpu: AMD EPYC (Zen 4, family 25 model 17; x86_64 AVX512, 2 threads)"
    b = "cpu: AMD EPYC (x86_64 AVX2, 2 threads)"
    archs = ["llama", "qwen2", "phi3"]
    assert machines_by_architecture(b, archs) == dict.fromkeys(archs, b)  # one machine for all
    # the nested lines partial reruns wrote until 2026-12-05, one inside the other
    nested = f"phi3: {a}; llama, qwen2 as recorded: qwen2: {a}; llama, phi3 as recorded: {b}"
    assert machines_by_architecture(nested, archs) == {"llama": b, "qwen2": a, "phi3": a}
    assert machines_by_architecture(f"llama: {b} | qwen2, phi3: {a}", archs) == {
        "llama": b, "qwen2": a, "phi3": a}


def test_reruns_on_two_machines_name_each_rows_machine(monkeypatch, tmp_path):
    """make archs end to end over two machines: every row run on one, then one row rerun on
    another, then a second row rerun there: the device line groups the rows by the machine each
    last ran on, and reads back as such."""
    from recipes_lib import __main__ as cli
    from recipes_lib import device, results

    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path))
    a = "cpu: AMD EPYC (Zen 4, family 25 model 17; x86_64 AVX512, 2 threads)"
    b = "cpu: Intel Xeon (x86_64 AVX512 AMX, 2 threads)"
    runs = iter([({"llama": {"01_x": "ok"}, "qwen2": {"01_x": "failed: AssertionError: kd"},
                   "phi3": {"01_x": "ok"}}, a),
                 ({"qwen2": {"01_x": "ok"}}, b), ({"phi3": {"01_x": "ok"}}, b)])

    def matrix(names=None, parameters=None, on_row=None):
        rows, machine = next(runs)
        assert names is None or tuple(rows) == names
        monkeypatch.setattr(device, "describe_device", lambda d: machine)
        for arch, row in rows.items():
            on_row(arch, row)
        return rows
    monkeypatch.setattr(notebooks, "architecture_matrix", matrix)

    def line():
        return results.load_results(tmp_path)["architectures"]["device"]
    assert not cli.architectures_matrix()
    assert line() == a
    assert cli.architectures_matrix(["qwen2"])
    assert line() == f"llama, phi3: {a} | qwen2: {b}"
    assert cli.architectures_matrix(["phi3"])
    assert line() == f"llama: {a} | qwen2, phi3: {b}"
    archs = ["llama", "qwen2", "phi3"]
    assert cli.machines_by_architecture(line(), archs) == {"llama": a, "qwen2": b, "phi3": b}
    saved = results.load_results(tmp_path)["architectures"]["figures"]
    assert sorted((f["recipe"], f["value"]) for f in saved) == [
        ("llama", 1.0), ("phi3", 1.0), ("qwen2", 1.0)]


def test_a_stopped_archs_run_keeps_the_rows_it_finished(monkeypatch, tmp_path):
    """make archs takes most of an hour: each architecture's row is recorded as it finishes,
    beside the recorded rows of those still to run, so a stop loses only the running one."""
    from recipes_lib import __main__ as cli
    from recipes_lib import device, results

    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path))
    a = "cpu: AMD EPYC (Zen 4, family 25 model 17; x86_64 AVX512, 2 threads)"
    b = "cpu: Intel Xeon (x86_64 AVX512 AMX, 2 threads)"
    monkeypatch.setattr(device, "describe_device", lambda d: a)
    cli.record_matrix({"llama": {"01_x": "ok"}, "qwen2": {"01_x": "ok"}, "phi3": {"01_x": "ok"}})
    monkeypatch.setattr(device, "describe_device", lambda d: b)

    def stopped(names=None, parameters=None, on_row=None):
        on_row("llama", {"01_x": "failed: AssertionError: loss"})
        raise KeyboardInterrupt  # while qwen2's notebooks run
    monkeypatch.setattr(notebooks, "architecture_matrix", stopped)
    with pytest.raises(KeyboardInterrupt):
        cli.architectures_matrix()
    saved = results.load_results(tmp_path)["architectures"]
    assert [(f["recipe"], f["value"]) for f in saved["figures"]] == [
        ("llama", 0.0), ("qwen2", 1.0), ("phi3", 1.0)]
    assert saved["device"] == f"llama: {b} | qwen2, phi3: {a}"

    def whole(names=None, parameters=None, on_row=None):
        rows = {"llama": {"01_x": "ok"}, "qwen2": {"01_x": "ok"}}  # phi3 no longer in the list
        for arch, row in rows.items():
            on_row(arch, row)
        return rows
    monkeypatch.setattr(notebooks, "architecture_matrix", whole)
    assert cli.architectures_matrix()
    saved = results.load_results(tmp_path)["architectures"]  # a whole run: its own rows only
    assert [(f["recipe"], f["value"]) for f in saved["figures"]] == [("llama", 1.0),
                                                                     ("qwen2", 1.0)]
    assert saved["device"] == b


def test_executed_status_reads_papermills_cell_metadata(tmp_path):
    def run(*states, error=None):
        cells = []
        for s in states:
            c = nbformat.v4.new_code_cell("x")
            c.metadata["papermill"] = {"status": s}
            if s == "failed":
                c.outputs = [nbformat.v4.new_output("error", ename="AssertionError",
                                                    evalue=error, traceback=[])]
            cells.append(c)
        path = tmp_path / "nb.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
        return notebooks.executed_status(path)

    assert run("completed", "completed") == "ok"
    assert run("completed", "failed", "pending", error="0.56\n\nmore") == \
        "failed: AssertionError: 0.56 | more"  # every line: a distributed error's first says little
    assert len(run("failed", error="x" * 2000)) == len("failed: AssertionError: ") + 600
    assert run("completed", "running") == "not finished"


def test_the_parallel_suite_names_units_that_exist():
    """tests/conftest.py hands the longest units out first and keeps the files that share the
    torchrun job together: a renamed file would silently fall out of both."""
    from conftest import LONGEST_FIRST, SHARDED_RUNS_FILES

    root = notebooks.course_notebooks()[0].parent.parent
    assert all((root / unit).exists() for unit in LONGEST_FIRST if unit != "sharded_runs")
    assert all((root / "tests" / name).exists() for name in SHARDED_RUNS_FILES)


def test_ci_runs_the_harness_tests_that_make_test_leaves_out():
    """`make test` (the 10-minute loop) deselects the tests marked harness and `make
    test-harness` selects exactly them; CI runs both, so no test falls out of CI."""
    import re

    root = COURSE[0].parent.parent
    makefile = (root / "Makefile").read_text()

    def recipe(target: str) -> str:
        return re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE).group(1)

    assert '-m "not harness"' in recipe("test") and "-m harness" in recipe("test-harness")
    ci = [line.split("#")[0].strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    assert ci.index("make test") < ci.index("make test-harness")
    assert "harness:" in (root / "pyproject.toml").read_text()  # registered: a typo would warn


@pytest.mark.harness
def test_a_notebook_run_alone_under_pytest_leaves_nothing_behind():
    """`pytest notebooks/<one>.ipynb --nbval-lax`, without tests/ (and its conftest): the
    repository's conftest.py still sends the results to a temporary folder, removed at the end,
    so the committed results/ and README are not rewritten by a debugging run. And nbval kills its
    kernels, so a notebook's scratch folder (removed at its process's exit) outlives it: the run
    gets a temporary directory of its own, which every process it starts inherits, removed at the
    end too."""
    import subprocess
    import sys

    root = COURSE[0].parent.parent
    killed = ("import os; from recipes_lib import model; "
              "print(model.scratch_folder('adapter-'), flush=True); os._exit(0)")  # no atexit
    code = (
        "import os, subprocess, sys, tempfile, pytest\n"
        "seen = {}\n"
        "class Seen:\n"
        "    def pytest_collection_finish(self, session):\n"
        "        seen['results'] = os.environ.get('RECIPES_RESULTS_DIR')\n"
        "        seen['tmp'] = tempfile.gettempdir()\n"
        f"        seen['left'] = subprocess.run([sys.executable, '-c', {killed!r}],"
        " capture_output=True, text=True, check=True).stdout.strip()\n"
        f"pytest.main(['--co', '-q', '-p', 'no:cacheprovider', '--nbval-lax', {str(COURSE[0])!r}],"
        " plugins=[Seen()])\n"
        "print('SEEN', *(f'{v} {os.path.exists(v)}' for v in seen.values()))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RECIPES_RESULTS_DIR", "RECIPES_TEST_TMPDIR")}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("SEEN "))
    _, results, results_exist, tmp, tmp_exists, left, left_exists = line.split(" ")
    assert "recipes-results-" in results and not results.startswith(str(root)), line
    assert "recipes-tests-" in tmp and left.startswith(tmp + os.sep), line
    assert results_exist == tmp_exists == left_exists == "False", line  # removed when pytest ended
