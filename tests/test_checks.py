import json

import pytest

from recipes_lib import checks, results
from recipes_lib.timing import Timing


def test_speed_claims_are_reported_not_asserted_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(checks.STRICT_ENV, raising=False)
    r = results.Results("nb", "cpu", tmp_path)
    assert checks.check_speed(r, "sdpa", "speed-up over eager", 4.6, 3.5, spread=0.12)
    assert not checks.check_speed(r, "ckpt", "step time", 1.8, 1.5, at_least=False)
    out = capsys.readouterr().out
    assert ("speed claim MET: sdpa: speed-up over eager 4.6x >= 3.5x "
            "(spread of the timed runs 12%)") in out
    assert "speed claim NOT MET: ckpt: step time 1.8x <= 1.5x" in out
    saved = json.loads(r.save().read_text())["claims"]
    assert [(c["recipe"], c["met"], c["at_least"]) for c in saved] == [
        ("sdpa", True, True), ("ckpt", False, False)]


def test_strict_speed_asserts(monkeypatch):
    with pytest.raises(AssertionError, match="speed claim not met: ckpt: step time 1.8x"):
        checks.check_speed(None, "ckpt", "step time", 1.8, 1.5, at_least=False, strict=True)
    monkeypatch.setenv(checks.STRICT_ENV, "1")
    with pytest.raises(AssertionError):
        checks.check_speed(None, "ckpt", "step time", 1.8, 1.5, at_least=False)
    assert checks.check_speed(None, "ckpt", "step time", 1.8, 1.5, at_least=False,
                              strict=False) is False
    assert checks.check_speed(None, "ckpt", "step time", 1.2, 1.5, at_least=False)


@pytest.mark.parametrize("value, target, name", [(float("nan"), 1.0, "value"),
                                                 (1.0, float("inf"), "target")])
def test_a_speed_claim_needs_finite_numbers(value, target, name):
    with pytest.raises(ValueError, match=f"{name}="):
        checks.check_speed(None, "x", "y", value, target)


def test_spread_of_a_ratio_is_its_noisier_side():
    a, b = Timing(1.0, [0.9, 1.0, 1.2]), Timing(2.0, [1.9, 2.0, 2.1])
    assert checks.spread_of(a, b) == pytest.approx(0.3)


def test_show_error_shows_the_message_and_fails_without_one(capsys):
    err = checks.show_error(lambda: int("four"), ValueError, match="invalid literal")
    assert isinstance(err, ValueError)
    assert "ValueError: invalid literal" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="raised nothing"):
        checks.show_error(lambda: None, ValueError)
    with pytest.raises(AssertionError, match="does not mention 'seq_len'"):
        checks.show_error(lambda: int("four"), ValueError, match="seq_len")
    with pytest.raises(KeyError):  # an unexpected error is not swallowed
        checks.show_error(lambda: {}["k"], ValueError)


def test_reference_machine_is_described():
    ok, why = checks.is_reference_machine()
    here = checks.this_machine()
    assert ok == all(here[k] == v for k, v in checks.REFERENCE.items())
    assert why == "the reference machine" if ok else "reference:" in why
