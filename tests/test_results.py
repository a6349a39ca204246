import json
import os
import signal
import subprocess
import sys

import pytest

from recipes_lib import results


def test_save_schema_and_replace(tmp_path):
    r = results.Results("nb", "cpu", tmp_path)
    r.add("qlora", "ratio", 0.3, baseline=1.0)
    r.add("qlora", "ratio", 0.26, baseline=1.0, predicted=0.258, unit="x")
    path = r.save()
    saved = json.loads(path.read_text())
    assert saved["device"] == "cpu" and "torch" in saved["versions"]
    assert saved["figures"] == [{"recipe": "qlora", "metric": "ratio", "value": 0.26,
                                 "baseline": 1.0, "predicted": 0.258, "unit": "x"}]
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_figures_are_rejected(tmp_path):
    r = results.Results("nb", "cpu", tmp_path)
    with pytest.raises(ValueError, match="value=nan"):
        r.add("a", "b", float("nan"))
    with pytest.raises(ValueError, match="stem="):
        results.Results("a/b", "cpu", tmp_path)


def test_readme_table_between_markers(tmp_path):
    r = results.Results("01_x", "cpu", tmp_path)
    r.add("qlora", "task_accuracy", 0.9, baseline=0.0)
    r.save()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{results.README_BEGIN}\nold\n{results.README_END}\nend\n")
    assert results.update_readme(readme, tmp_path)
    text = readme.read_text()
    assert "| 01_x | qlora | task_accuracy | 0.9 | 0 |" in text and "old" not in text
    assert not results.update_readme(readme, tmp_path)
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(ValueError, match="missing"):
        results.update_readme(tmp_path / "bare.md", tmp_path)


def test_report_lists_status_and_figures(tmp_path):
    r = results.Results("01_x", "cpu", tmp_path)
    r.add("qlora", "task_accuracy", 0.9, baseline=0.0)
    r.save()
    results.Results("03_z", "cpu", tmp_path).add("kv_cache", "speedup", 2.0)  # then it failed
    report = results.write_report({"01_x": "ok", "02_y": "failed: AssertionError",
                                   "03_z": "failed: DeadKernelError"}, tmp_path)
    text = report.read_text()
    assert "| 02_y | failed: AssertionError |" in text and "task_accuracy" in text
    kept = results.partial_path("03_z", tmp_path)
    assert (f"| 03_z | failed: DeadKernelError (1 figure recorded before it stopped: {kept}) |"
            in text)


def test_readme_section_from_a_results_subfolder(tmp_path):
    results.Results("01_x", "cpu", tmp_path).save()
    gpu = results.Results("01_x", "cuda: H100", tmp_path / "h100")
    gpu.add("qlora", "task_accuracy", 1.0, baseline=0.0)
    gpu.save()
    readme = tmp_path / "README.md"
    readme.write_text(f"{results.README_BEGIN}\n{results.README_END}\n"
                      "<!-- results-table:h100:begin -->\nold\n<!-- results-table:h100:end -->\n")
    assert results.update_readme(readme, tmp_path)
    gpu_part = readme.read_text().split("results-table:h100:begin")[1]
    assert "| 01_x | qlora | task_accuracy | 1 | 0 |  |  | cuda: H100 |" in gpu_part
    assert "old" not in gpu_part


def test_results_dir_is_a_setting(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path / "elsewhere"))
    r = results.Results("nb", "cpu")
    assert r.save() == tmp_path / "elsewhere" / "nb.json"
    assert results.load_results() == {"nb": json.loads(r.save().read_text())}


def test_unwritable_results_dir_is_refused_early(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(results.RESULTS_ENV, str(blocker / "results"))
    with pytest.raises(ValueError, match=f"results_dir=.*cannot be written.*{results.RESULTS_ENV}"):
        results.Results("nb", "cpu")


def test_repository_readme_is_left_alone_when_results_go_elsewhere(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path))
    results.Results("01_x", "cpu").save()
    before = results.README.read_text()
    assert not results.update_readme()
    assert results.README.read_text() == before
    assert "README table not refreshed" in capsys.readouterr().out


def test_claims_are_saved_with_the_figures(tmp_path):
    r = results.Results("nb", "cpu", tmp_path)
    r.add_claim(results.Claim("sdpa", "SDPA vs eager", 4.6, 3.5, spread=0.1, met=True))
    r.add_claim(results.Claim("sdpa", "SDPA vs eager", 3.0, 3.5, spread=0.2, met=False))
    saved = json.loads(r.save().read_text())
    assert saved["claims"] == [{"recipe": "sdpa", "claim": "SDPA vs eager", "value": 3.0,
                                "target": 3.5, "at_least": True, "spread": 0.2, "met": False}]


def test_readme_section_is_written_only_for_the_repositorys_results(tmp_path, monkeypatch,
                                                                     capsys):
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- archs:begin -->\nold\n<!-- archs:end -->\nb\n")
    monkeypatch.setattr(results, "README", readme)
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path))
    assert results.write_readme_section("archs", "| new |")
    assert readme.read_text() == "a\n<!-- archs:begin -->\n| new |\n<!-- archs:end -->\nb\n"
    with pytest.raises(ValueError, match="missing <!-- other:begin -->"):
        results.write_readme_section("other", "x")
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path / "elsewhere"))
    assert not results.write_readme_section("archs", "| newer |")
    assert "README.md archs not refreshed" in capsys.readouterr().out
    # another page of the repository: the planner's, where the published figures' table is
    page = tmp_path / "planner.md"
    page.write_text("<!-- published-table:begin -->\n<!-- published-table:end -->\n")
    assert not results.write_readme_section("published-table", "| row |", page)
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path))
    assert results.write_readme_section("published-table", "| row |", page)
    assert "| row |" in page.read_text() and "| new |" in readme.read_text()
    with pytest.raises(ValueError, match=r"planner.md: missing <!-- archs:begin -->"):
        results.write_readme_section("archs", "x", page)
    results.Results("architectures", "cpu", tmp_path).save()
    assert "architectures" not in results.markdown_table(tmp_path)


def test_an_interrupted_runs_measurements_are_reused_and_only_by_the_same_run(tmp_path,
                                                                             monkeypatch):
    calls = []

    def measure(x):
        calls.append(x)
        return {"ratio": x, "inf": float("inf"), "pair": (x, x)}

    first = results.Progress("demo", "cpu: here", tmp_path)
    assert first.value("a", lambda: measure(1.0)) == {"ratio": 1.0, "inf": float("inf"),
                                                      "pair": [1.0, 1.0]}
    assert first.value("a", lambda: measure(2.0))["ratio"] == 1.0  # kept, not measured again
    # the process dies here; the next run reads what was measured and measures the rest
    again = results.Progress("demo", "cpu: here", tmp_path)
    assert again.reused == 1
    assert again.value("a", lambda: measure(3.0))["ratio"] == 1.0
    assert again.value("b", lambda: measure(4.0))["ratio"] == 4.0
    assert calls == [1.0, 4.0]
    # a printed line says which values were read back rather than measured
    assert again.said("a") == " (kept from the interrupted run)" and again.said("b") == ""
    # another device, or other code, measures afresh
    assert results.Progress("demo", "cpu: elsewhere", tmp_path).reused == 0
    monkeypatch.setattr(results, "_source_fingerprint", lambda: "edited")
    assert results.Progress("demo", "cpu: here", tmp_path).reused == 0
    again.done()
    assert not again.path.exists() and not list(tmp_path.rglob("*.json"))
    with pytest.raises(ValueError, match="stem="):
        results.Progress("a/b", "cpu", tmp_path)


def test_a_run_killed_before_saving_keeps_the_figures_it_recorded(tmp_path):
    """What a GPU call's deadline does to a notebook: the process is killed before its last cell
    saves. Each figure was kept as it was recorded, so keep_partial turns them into the results
    file, marked partial, and the README's table says so on each row."""
    script = ("import os, signal; from recipes_lib import results\n"
              "r = results.Results('03_x', 'cuda: H100', os.environ['DIR'])\n"
              "r.add('attention', 'speedup', 2.5, baseline=1.0)\n"
              "r.add_claim(results.Claim('attention', 'SDPA over eager', 2.5, 1.5, spread=0.1,"
              " met=True))\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    gpu = tmp_path / "h200"
    run = subprocess.run([sys.executable, "-c", script], check=False,
                         env={**os.environ, "DIR": str(gpu)})
    assert run.returncode == -signal.SIGKILL and not (gpu / "03_x.json").exists()
    assert results.keep_partial("03_x", gpu) == gpu / "03_x.json"
    kept = json.loads((gpu / "03_x.json").read_text())
    assert kept["partial"] and kept["figures"][0]["value"] == 2.5 and len(kept["claims"]) == 1
    assert not results.partial_path("03_x", gpu).exists()
    assert results.keep_partial("03_x", gpu) is None  # nothing left to keep
    readme = tmp_path / "README.md"
    readme.write_text(f"{results.README_BEGIN}\n{results.README_END}\n"
                      "<!-- results-table:h200:begin -->\n<!-- results-table:h200:end -->\n")
    results.update_readme(readme, tmp_path)
    assert ("| 03_x | attention | speedup | 2.5 | 1 |  |  | cuda: H100 (partial: the run "
            "stopped before its end) |") in readme.read_text()


def test_a_saved_run_leaves_no_partial_figures_and_a_new_run_drops_the_old_ones(tmp_path):
    first = results.Results("01_x", "cpu", tmp_path)
    first.add("qlora", "ratio", 0.3)
    partial = results.partial_path("01_x", tmp_path)
    assert json.loads(partial.read_text())["figures"][0]["value"] == 0.3
    second = results.Results("01_x", "cpu", tmp_path)  # the first run stopped; this one starts
    assert not partial.exists()
    second.add("qlora", "ratio", 0.26)
    assert "partial" not in json.loads(second.save().read_text())
    assert not partial.parent.exists() and results.keep_partial("01_x", tmp_path) is None
    # a later run stops: its figures do not silently replace the whole run's
    results.Results("01_x", "cpu", tmp_path).add("qlora", "ratio", 0.5)
    with pytest.raises(ValueError, match="stem='01_x': .*01_x.json holds a whole run's"):
        results.keep_partial("01_x", tmp_path)
    assert json.loads(results.keep_partial("01_x", tmp_path, replace=True).read_text())["partial"]
