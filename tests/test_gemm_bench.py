import pytest
import torch

from recipes_lib import gemm_bench


def test_alignment():
    assert [gemm_bench.alignment(n) for n in (255, 250, 256, 768, 4096, 96)] == [1, 2, 128, 128,
                                                                                 128, 32]


def test_sizing_table_rows():
    rows = gemm_bench.sizing_table([63, 64], tokens=32, repeats=1)
    assert [r["size"] for r in rows] == [63, 64] and all(r["gflops"] > 0 for r in rows)
    with pytest.raises(ValueError, match="sizes"):
        gemm_bench.sizing_table([])


def test_dtype_sweep_times_16_bit_against_fp32():
    s = gemm_bench.dtype_sweep([64, 128, 256], tokens=64, repeats=1)
    assert (s.recipe, s.dimension) == ("bf16", "hidden") and len(s.speedups) == 3
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        gemm_bench.dtype_sweep([64, 128, 256], dtype=torch.float64)
