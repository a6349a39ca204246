"""Open-in-Colab badges and a Colab-only install cell, stamped into every notebook.

A badge needs the repository's public GitHub address, which only its publisher knows, so the
notebooks are stamped once that address exists::

    python -m recipes_lib colab --repo OWNER/NAME [--ref main]

Each notebook then starts with a badge (a markdown cell tagged ``colab-badge``) and a code cell
(tagged ``colab-install``) that does nothing outside Colab. On Colab it clones the repository
(the notebooks read ``data/`` and the library from it) and installs the package with the
dependencies Colab lacks, keeping Colab's own CUDA build of torch. Stamping again replaces both
cells, so a new address or branch is one command.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BADGE_TAG, INSTALL_TAG = "colab-badge", "colab-install"
# What the notebooks need that Colab lacks, as requirements.txt names it (a test keeps them
# equal); Colab ships the rest of what they import. Not needed there: the test and lint tools, and
# litgpt (its model measures litgpt's published rows in `make bench` and the tests, no notebook).
COLAB_PACKAGES = ("transformers>=5.23,<6", "peft>=0.19", "bitsandbytes>=0.50", "accelerate>=1.7",
                  "trl>=0.26", "datasets", "torchao>=0.18", "safetensors", "tqdm", "tensorboard")
COLAB_SHIPS = ("torch", "tokenizers", "numpy", "pandas", "matplotlib", "ipykernel", "ipywidgets")
NOT_ON_COLAB = ("jupyterlab", "nbval", "nbclient", "nbformat", "papermill", "pytest",
                "pytest-xdist", "ruff", "litgpt")
_REPO = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_REF = re.compile(r"^[A-Za-z0-9_./-]+$")


def _check(repo: str, ref: str) -> None:
    if not isinstance(repo, str) or not _REPO.match(repo) or repo.endswith(".git"):
        raise ValueError(f"repo={repo!r}: expected the GitHub 'owner/name', "
                         "e.g. 'acme/llm-recipes'")
    if not isinstance(ref, str) or not _REF.match(ref) or ".." in ref:
        raise ValueError(f"ref={ref!r}: expected a branch or tag name, e.g. 'main'")


def badge_markdown(repo: str, notebook: str, ref: str = "main") -> str:
    """The "Open in Colab" badge for ``notebooks/<notebook>`` of ``repo`` at ``ref``.

    Args:
        repo: the GitHub repository, ``owner/name``.
        notebook: the notebook's file name.
        ref: the branch or tag the badge opens.

    Returns:
        The badge, as Markdown.

    Raises:
        ValueError: for a repo that is not ``owner/name`` or a malformed ref.

    Example:
        >>> badge_markdown("acme/recipes", "01_x.ipynb").split("](")[-1]
        'https://colab.research.google.com/github/acme/recipes/blob/main/notebooks/01_x.ipynb)'
    """
    _check(repo, ref)
    url = f"https://colab.research.google.com/github/{repo}/blob/{ref}/notebooks/{notebook}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def install_source(repo: str, ref: str = "main") -> str:
    """The first code cell: on Colab, clone ``repo`` at ``ref`` and install it; elsewhere nothing.

    Args:
        repo: the GitHub repository, ``owner/name``.
        ref: the branch or tag to clone.

    Returns:
        The cell's source.

    Raises:
        ValueError: for a repo that is not ``owner/name`` or a malformed ref.
    """
    _check(repo, ref)
    packages = ", ".join(repr(p) for p in COLAB_PACKAGES)
    return (
        "# Colab only: fetch the course and install what Colab lacks (its CUDA torch is kept).\n"
        "# Elsewhere this cell does nothing: install with `make lab` / requirements.txt instead.\n"
        "import os, subprocess, sys\n"
        'if "google.colab" in sys.modules and not os.path.isdir("/content/course"):\n'
        f'    subprocess.run(["git", "clone", "-q", "--depth", "1", "-b", "{ref}",\n'
        f'                    "https://github.com/{repo}", "/content/course"], check=True)\n'
        '    subprocess.run([sys.executable, "-m", "pip", "install", "-q", '
        f'{packages},\n'
        '                    "-e", "/content/course"], check=True)\n'
        'if "google.colab" in sys.modules:\n'
        '    sys.path.insert(0, "/content/course")\n'
        '    os.chdir("/content/course/notebooks")'
    )


def stamp_notebook(path: Path | str, repo: str, ref: str = "main") -> None:
    """Put (or replace) the badge and install cells at the top of one notebook, in place.

    Args:
        path: the notebook.
        repo: the GitHub repository, ``owner/name``.
        ref: the branch or tag.

    Raises:
        ValueError: for a bad repo / ref.
        FileNotFoundError: if the notebook does not exist.
    """
    import nbformat

    _check(repo, ref)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no such notebook")
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells
                if not {BADGE_TAG, INSTALL_TAG} & set(c.get("metadata", {}).get("tags", []))]
    badge = nbformat.v4.new_markdown_cell(badge_markdown(repo, path.name, ref),
                                          metadata={"tags": [BADGE_TAG]})
    install = nbformat.v4.new_code_cell(install_source(repo, ref),
                                        metadata={"tags": [INSTALL_TAG]})
    nb.cells[:0] = [badge, install]
    for cell in nb.cells:  # nbformat >= 5.1 wants cell ids; keep the file valid
        cell.setdefault("id", nbformat.corpus.words.generate_corpus_id())
    nbformat.write(nb, path)


def stamp_notebooks(repo: str, ref: str = "main",
                    notebooks: list[Path] | None = None) -> list[Path]:
    """:func:`stamp_notebook` on every notebook (default: ``notebooks/*.ipynb``).

    Args:
        repo: the GitHub repository, ``owner/name``.
        ref: the branch or tag.
        notebooks: the notebooks to stamp.

    Returns:
        The notebooks stamped.

    Raises:
        ValueError: for a bad repo / ref.
    """
    paths = notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for p in paths:
        stamp_notebook(p, repo, ref)
    return paths
