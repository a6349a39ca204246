import pytest

from recipes_lib.timing import time_fn


def test_time_fn_counts_calls_and_validates():
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and len(t.times_s) == 3 and t.median_s >= 0
    with pytest.raises(ValueError, match="repeats=0"):
        time_fn(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        time_fn(lambda: None, warmup=-1)


def test_interleaved_timing_alternates():
    from recipes_lib.timing import time_interleaved

    order = []
    t = time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                         warmup=1, repeats=2)
    assert order == ["a", "b"] * 3 and len(t["a"].times_s) == 2
    with pytest.raises(ValueError, match="fns"):
        time_interleaved({})
