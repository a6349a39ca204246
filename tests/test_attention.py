import pytest
import torch

from recipes_lib import attention


@pytest.mark.parametrize("impl", ["sdpa", "sdpa-math", "sdpa-flash"])
def test_backends_agree_with_eager_forward_and_backward(impl):
    err = attention.max_abs_error(impl, "eager", seq_len=128, num_heads=2, head_dim=32)
    assert err["output"] <= 1e-5 and err["grad"] <= 1e-5, err


def test_eager_matches_the_definition_with_gqa():
    q = torch.randn(1, 4, 10, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64) for _ in range(2))
    out = attention.eager_attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    # position 0 attends only to itself
    torch.testing.assert_close(out[0, :, 0], v.repeat_interleave(2, dim=1)[0, :, 0])


def test_backend_that_ran_is_reported():
    q = torch.randn(1, 2, 64, 32)
    assert attention.sdpa_backend_used(lambda: attention.eager_attention(q, q, q)) == "math"
    flash = attention.sdpa_backend_used(lambda: attention.sdpa_attention(q, q, q, backend="flash"))
    assert flash == "flash"
    assert attention.sdpa_backend_used(lambda: q + 1) == "none"


def test_transformers_attn_implementation_picks_the_kernel(small_llama):
    ids = torch.randint(0, 128, (1, 16))
    assert attention.sdpa_backend_used(lambda: small_llama(input_ids=ids)) == "flash"


def test_cpu_backends():
    assert attention.available_backends("cpu") == ["flash", "math"]


def test_unavailable_backend_gives_a_clear_error():
    q = torch.randn(1, 2, 16, 32)
    with pytest.raises(ValueError, match="backend='efficient': not available.*available"):
        attention.sdpa_attention(q, q, q, backend="efficient")
    with pytest.raises(ValueError, match="flash-attn"):
        attention.attention_fn("flash-attn", "cpu")
    with pytest.raises(ValueError, match="impl='xformers'"):
        attention.attention_fn("xformers", "cpu")


def test_benchmark_rows_and_memory_shape():
    rows = attention.benchmark_attention([64, 256], ["eager", "sdpa"], num_heads=2, head_dim=16,
                                         repeats=1, progress=False)
    assert len(rows) == 4
    by = {(r["impl"], r["seq_len"]): r for r in rows}
    # the eager score matrix grows as s^2: 16x the bytes for 4x the length, flash grows ~linearly
    assert by[("eager", 256)]["peak_bytes"] > 8 * by[("eager", 64)]["peak_bytes"]
    assert by[("sdpa", 256)]["peak_bytes"] < by[("eager", 256)]["peak_bytes"]
    with pytest.raises(ValueError, match="seq_lens"):
        attention.benchmark_attention([], ["eager"])
