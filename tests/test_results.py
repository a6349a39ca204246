import json

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
    text = results.write_report({"01_x": "ok", "02_y": "failed: AssertionError"}, tmp_path).read_text()
    assert "| 02_y | failed: AssertionError |" in text and "task_accuracy" in text


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
