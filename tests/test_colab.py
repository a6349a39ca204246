import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from recipes_lib import colab

NB = colab.ROOT / "notebooks" / "01_large_models_limited_hardware.ipynb"


def test_stamp_is_idempotent_and_the_install_cell_does_nothing_off_colab(tmp_path):
    path = tmp_path / NB.name
    shutil.copy(NB, path)
    before = nbformat.read(path, as_version=4)
    colab.stamp_notebook(path, "acme/recipes")
    colab.stamp_notebook(path, "acme/recipes", ref="v1")  # replaces, never duplicates
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert len(nb.cells) == len(before.cells) + 2
    assert nb.cells[0].metadata.tags == [colab.BADGE_TAG]
    assert "github/acme/recipes/blob/v1/notebooks/01_large_models_limited_hardware.ipynb" \
        in nb.cells[0].source
    assert nb.cells[1].metadata.tags == [colab.INSTALL_TAG]
    assert [c.source for c in nb.cells[2:]] == [c.source for c in before.cells]
    # Off Colab the cell must run and change nothing (no clone, no pip, same directory).
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    subprocess.run([sys.executable, "-c", nb.cells[1].source + "\nimport os; print(os.getcwd())"],
                   cwd=cwd, check=True, capture_output=True)
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("repo, ref, match", [
    ("acme", "main", "repo='acme'"), ("https://github.com/a/b", "main", "repo="),
    ("a/b.git", "main", "repo="), ("a/b", "x y", "ref='x y'"), ("a/b", "../etc", "ref="),
])
def test_bad_repo_or_ref(repo, ref, match):
    with pytest.raises(ValueError, match=match):
        colab.badge_markdown(repo, "x.ipynb", ref)


def test_missing_notebook(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such notebook"):
        colab.stamp_notebook(tmp_path / "nope.ipynb", "a/b")


def test_colab_installs_every_requirement_it_does_not_ship_as_requirements_txt_pins_it():
    lines = [line.split("#")[0].strip() for line in
             (colab.ROOT / "requirements.txt").read_text().splitlines()]
    wanted = {re.split(r"[<>=!~\[]", line)[0]: line for line in lines if line}
    installed = {re.split(r"[<>=!~\[]", p)[0]: p for p in colab.COLAB_PACKAGES}
    assert set(wanted) == set(installed) | set(colab.COLAB_SHIPS) | set(colab.NOT_ON_COLAB)
    assert all(wanted[name] == spec for name, spec in installed.items()), installed
