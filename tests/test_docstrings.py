"""The library's docstrings, as a reader meets them: every ``Example:`` in ``recipes_lib`` runs
and prints what it says (doctest), and every public function or class documents its arguments,
what it returns and what it raises, in the Args / Returns / Raises form (STYLE.md; classes:
Attributes).
"""
import ast
import doctest
import importlib
import inspect
import os
import pkgutil
import textwrap

import pytest

import recipes_lib

MODULES = sorted(m.name for m in pkgutil.iter_modules(recipes_lib.__path__)
                 if m.name != "__main__")


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_in_the_docstrings_run_as_written(name, monkeypatch):
    for key, value in os.environ.items():  # restored afterwards, whatever an example sets
        monkeypatch.setenv(key, value)
    module = importlib.import_module(f"recipes_lib.{name}")
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, module.__name__, globs=vars(module).copy()):
        runner.run(test, out=lambda text: None)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, (f"{result.failed} of {result.attempted} examples in "
                                f"recipes_lib/{name}.py fail: python -m doctest recipes_lib/"
                                f"{name}.py shows them")


def public_callables() -> dict[str, object]:
    """``module.name`` -> every public function or class defined in a recipes_lib module."""
    found = {}
    for name in [*MODULES, "__main__"]:
        module = importlib.import_module(f"recipes_lib.{name}")
        for attr, obj in vars(module).items():
            if (not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                    and obj.__module__ == module.__name__
                    and not (inspect.isclass(obj) and issubclass(obj, BaseException))):
                found[f"{module.__name__}.{attr}"] = obj
    return found


def _raises(fn) -> bool:
    """Whether the function's own source raises an exception it names."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return any(isinstance(n, ast.Raise) and n.exc is not None for n in ast.walk(tree))


def missing_sections(obj) -> list[str]:
    """The sections ``obj``'s docstring lacks: Args (if it takes any), Returns (a function that
    returns something; Yields for a generator) and Raises (if its own code raises)."""
    doc = inspect.getdoc(obj) or ""
    params = [p for p in inspect.signature(obj).parameters.values()
              if p.name not in ("self", "cls")]
    missing = [s for s, needed in (("Args:", bool(params)),) if needed and s not in doc]
    if inspect.isclass(obj):
        return [m for m in missing if "Attributes:" not in doc]
    returns = inspect.signature(obj).return_annotation
    if returns not in (None, "None", inspect.Signature.empty) and not (
            "Returns:" in doc or "Yields:" in doc):
        missing.append("Returns:")
    if _raises(obj) and "Raises:" not in doc:
        missing.append("Raises:")
    return missing


def test_every_public_function_documents_its_args_returns_and_raises():
    callables = public_callables()
    assert len(callables) > 300  # every module's, found
    lacking = {name: missing_sections(obj) for name, obj in sorted(callables.items())}
    lacking = {name: sections for name, sections in lacking.items() if sections}
    assert not lacking, "\n".join(f"{n}: {', '.join(s)}" for n, s in lacking.items())
