import pytest

from recipes_lib import comm_bench


def test_bus_bandwidth_follows_nccl_tests():
    assert comm_bench.bus_bandwidth("all_reduce", 2e9, 1.0, 4) == (2.0, 3.0)
    assert comm_bench.bus_bandwidth("all_gather", 2e9, 1.0, 4) == (2.0, 1.5)
    assert comm_bench.bus_bandwidth("all_reduce", 1e9, 1.0, 1)[1] == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="op='broadcast'"):
        comm_bench.bus_bandwidth("broadcast", 1, 1, 2)
    with pytest.raises(ValueError, match="seconds=0"):
        comm_bench.bus_bandwidth("all_reduce", 1, 0, 2)
    with pytest.raises(RuntimeError, match=">= 2 ranks"):
        comm_bench.run([1024])
