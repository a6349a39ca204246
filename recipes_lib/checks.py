"""The checks a notebook makes that are not plain ``assert``: speed claims and bad-input demos.

Speed is a benchmark, not a test. A speed claim is a ratio of timings taken on whatever machine
runs the notebook, so by default :func:`check_speed` prints the verdict (MET / NOT MET) with the
measured figure, its target and the spread of the timed runs behind it, and records it in the
notebook's results; a learner on another laptop sees the verdict, not a crash. ``make bench``
runs the notebooks on the reference machine (:data:`REFERENCE`) and fails if a recorded claim is
not met; ``strict=True`` (a notebook's ``STRICT_SPEED``) or ``RECIPES_STRICT_SPEED=1`` asserts
each claim where it is made. Correctness and memory claims stay plain ``assert`` everywhere.

:func:`show_error` runs a deliberately bad call, shows the error it raised and fails if it raised
none: a bad-input demonstration that every front end runs top to bottom (a cell tagged
``raises-exception`` stops papermill and any front end that ignores cell tags).
"""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Callable
from typing import Any

import torch

from recipes_lib.device import native_cpu_isa
from recipes_lib.results import Claim, Results

STRICT_ENV = "RECIPES_STRICT_SPEED"
# The machine the speed claims were established on (and CI runs on): a 2-core x86_64 CPU with
# AVX2 and no accelerator. `make bench` asserts the claims there and reports them elsewhere. A
# newer CPU with its kernels capped to AVX2 (device.cap_cpu_isa) is not it: "hardware_isa" differs.
REFERENCE = {"arch": "x86_64", "cores": 2, "cpu_isa": "AVX2", "hardware_isa": "AVX2",
             "accelerator": "none"}


def this_machine() -> dict[str, Any]:
    """The fields of :data:`REFERENCE`, read off this machine.

    Returns:
        ``arch``, ``cores``, ``cpu_isa``, ``hardware_isa`` and ``accelerator``.
    """
    accelerator = ("cuda" if torch.cuda.is_available()
                   else "mps" if torch.backends.mps.is_available() else "none")
    return {"arch": platform.machine(), "cores": os.cpu_count(),
            "cpu_isa": torch.backends.cpu.get_cpu_capability(),
            "hardware_isa": native_cpu_isa(), "accelerator": accelerator}


def is_reference_machine() -> tuple[bool, str]:
    """Whether this is the reference machine, and a line saying how it differs if not.

    Returns:
        ``(is_reference, how)``.
    """
    here = this_machine()
    diff = [f"{k} {here[k]} (reference: {v})" for k, v in REFERENCE.items() if here[k] != v]
    return not diff, "; ".join(diff) or "the reference machine"


def _strict(strict: bool | None) -> bool:
    if strict is not None:
        return bool(strict)
    return os.environ.get(STRICT_ENV, "").lower() in ("1", "true", "yes")


def check_speed(results: Results | None, recipe: str, claim: str, value: float, target: float,
                at_least: bool = True, spread: float | None = None, unit: str = "x",
                strict: bool | None = None) -> bool:
    """Check a speed claim: print its verdict, record it, assert it only when strict.

    Args:
        results: the notebook's results (the claim is saved with its figures), or None.
        recipe: the recipe the claim belongs to, e.g. ``"flash_attention"``.
        claim: what is claimed, e.g. ``"SDPA speed-up over eager at s=2048"``.
        value: the measured figure (a ratio of same-run timings).
        target: the figure the claim needs.
        at_least: the claim is ``value >= target`` (True) or ``value <= target`` (False).
        spread: (max - min) / median of the timed runs behind ``value`` (the larger of the
            two sides' for a ratio), printed so a reader can tell a miss from noise.
        unit: printed after the numbers ("x" for ratios, "" for a plain figure).
        strict: assert the claim (True), report it (False), or None: ``$RECIPES_STRICT_SPEED``.

    Returns:
        Whether the claim is met.

    Raises:
        ValueError: for a value or target that is not a finite number.
        AssertionError: when the claim is not met and the check is strict.

    Example:
        >>> check_speed(None, "ckpt", "checkpointed step time", 1.27, 1.5, at_least=False)
        speed claim MET: ckpt: checkpointed step time 1.27x <= 1.5x
        True
    """
    for name, x in (("value", value), ("target", target)):
        try:
            finite = math.isfinite(float(x))
        except (TypeError, ValueError):
            finite = False
        if not finite:
            raise ValueError(f"{name}={x!r}: must be a finite number")
    value, target = float(value), float(target)
    met = value >= target if at_least else value <= target
    if results is not None:
        results.add_claim(Claim(recipe, claim, value, target, at_least,
                                None if spread is None else float(spread), met))
    noise = "" if spread is None else f" (spread of the timed runs {spread:.0%})"
    line = (f"{recipe}: {claim} {value:.3g}{unit} {'>=' if at_least else '<='} "
            f"{target:.3g}{unit}{noise}")
    print(f"speed claim {'MET' if met else 'NOT MET'}: {line}")
    if not met and _strict(strict):
        raise AssertionError(f"speed claim not met: {line}")
    return met


def spread_of(*timings: Any) -> float:
    """The largest spread among timings: a ratio of two timings is as noisy as its noisier side.

    Args:
        *timings: ``timing.Timing`` objects, or plain numbers (spreads).

    Returns:
        The largest spread ((max - min) / median of each side's timed runs).

    Example:
        >>> spread_of(0.05, 0.12)
        0.12
    """
    return max(float(getattr(t, "spread", t)) for t in timings)


def show_error(fn: Callable[[], Any], expected: type[BaseException] | tuple = ValueError,
               match: str | None = None) -> BaseException:
    """Run a deliberately bad call, print the error it raised and return it.

    Args:
        fn: the bad call, e.g. ``lambda: check_positions(config, 4096)``.
        expected: the exception type(s) it must raise.
        match: a regular expression the message must contain (e.g. the parameter's name).

    Returns:
        The exception raised.

    Raises:
        AssertionError: if ``fn`` raised nothing, or a message without ``match``.

    Example:
        >>> err = show_error(lambda: int("four"), ValueError, match="invalid literal")
        ValueError: invalid literal for int() with base 10: 'four'
    """
    try:
        fn()
    except expected as err:
        print(f"{type(err).__name__}: {err}")
        if match is not None and not re.search(match, str(err)):
            raise AssertionError(f"the error does not mention {match!r}: {err}") from err
        return err
    names = getattr(expected, "__name__", None) or "/".join(e.__name__ for e in expected)
    raise AssertionError(f"expected {names}, but the call raised nothing")
