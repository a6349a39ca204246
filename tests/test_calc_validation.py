"""The calculator against measured bytes, for Llama models at several sizes."""

import json

import pytest

from recipes_lib import calc_validation


@pytest.fixture(scope="module")
def errors():
    return {size: calc_validation.relative_errors(size) for size in calc_validation.SIZES}


@pytest.mark.parametrize("size", calc_validation.SIZES,
                         ids=[f"h{s[0]}-L{s[1]}-s{s[5]}" for s in calc_validation.SIZES])
def test_calculator_terms_match_measured_bytes(errors, size):
    e = errors[size]
    assert e["params"] <= 0.10 and e["grads"] <= 0.10 and e["optimizer"] <= 0.10, e
    assert e["activations"] <= 0.25, e


def test_worst_errors_are_the_largest_and_are_saved(errors, tmp_path, summary):
    worst = calc_validation.worst_errors(list(errors.values()))
    assert worst == {t: max(e[t] for e in errors.values()) for t in calc_validation.TERMS}
    path = calc_validation.save(worst, tmp_path)
    saved = {f["metric"]: f["value"] for f in json.loads(path.read_text())["figures"]}
    assert saved == {f"{t}_rel_error": worst[t] for t in calc_validation.TERMS}
    summary.append(f"calculator vs measured (worst of {len(errors)} sizes): "
                   + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))


def test_a_bad_size_is_refused():
    with pytest.raises(ValueError, match="size="):
        calc_validation.relative_errors((64, 1, 192))


def test_heads_wider_than_hidden_over_heads_are_counted():
    # Qwen3 and Gemma: head_dim set wider than hidden / heads, so q_proj and o_proj are wider
    e = calc_validation.relative_errors((128, 2, 384, 2, 1, 128, 2), head_dim=128)
    assert e["params"] == 0.0 and e["grads"] == 0.0 and e["optimizer"] == 0.0, e
    assert e["activations"] <= 0.05, e
