import pytest
import torch

from recipes_lib import sparse_attention as sa


@pytest.mark.parametrize("seq_len, window, n_global", [
    (100, 16, 0), (100, 16, 4), (64, 64, 0), (77, None, 0), (128, 8, 20), (50, 7, 50), (33, 1, 3),
])
def test_blockwise_equals_dense_masked_reference_forward_and_backward(seq_len, window, n_global):
    q = torch.randn(2, 4, seq_len, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, seq_len, 16, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    mask = sa.attention_mask(seq_len, window, n_global)
    ref = sa.dense_masked_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask)
    out = sa.blockwise_attention(q, k, v, window, n_global)
    grad = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, (q, k, v), grad)
    g_out = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("window, n_global", [(16, 0), (16, 4), (None, 0)])
def test_soft_capped_and_scaled_scores_equal_the_reference(window, n_global):
    """Gemma-2's soft-capping (scores written out: SDPA cannot cap) and its own scale."""
    q = torch.randn(2, 4, 70, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 70, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = sa.attention_mask(70, window, n_global)
    kw = {"softcap": 0.5, "scale": 0.3}  # a cap the scores reach, so tanh changes them
    ref = sa.dense_masked_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                    mask, **kw)
    uncapped = sa.dense_masked_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         mask, scale=0.3)
    assert float((ref - uncapped).detach().abs().max()) > 1e-2
    out = sa.blockwise_attention(q, k, v, window, n_global, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g_out, g_ref = (torch.autograd.grad(x.sum(), (q, k, v)) for x in (out, ref))
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="softcap=0"):
        sa.blockwise_attention(q, k, v, window, n_global, softcap=0)


def test_fp32_within_1e5():
    q, k, v = (torch.randn(1, 2, 300, 32, requires_grad=True) for _ in range(3))
    ref = sa.dense_masked_attention(q, k, v, sa.attention_mask(300, 64, 8))
    assert (sa.blockwise_attention(q, k, v, 64, 8) - ref).abs().max().item() <= 1e-5


def test_mask_pattern():
    m = sa.attention_mask(6, window=2, n_global=1).int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                 [1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 0}, "window=0"), ({"window": 20}, "window=20: larger than the sequence"),
    ({"window": 4, "n_global": -1}, "n_global"), ({"window": 4, "n_global": 11}, "n_global"),
])
def test_bad_patterns_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.attention_mask(10, **kwargs)
    q = torch.randn(1, 1, 10, 4)
    with pytest.raises(ValueError, match=match):
        sa.blockwise_attention(q, q, q, **kwargs)


def test_plugs_into_a_transformers_model(small_llama):
    ids = torch.randint(3, 128, (2, 40))
    name = sa.register_with_transformers(window=None)
    with torch.no_grad():
        ref = small_llama(input_ids=ids).logits
        small_llama.set_attn_implementation(name)
        same = small_llama(input_ids=ids).logits
        small_llama.set_attn_implementation(sa.register_with_transformers(window=8))
        local = small_llama(input_ids=ids).logits
    torch.testing.assert_close(same, ref, rtol=1e-5, atol=1e-5)
    # the first 8 positions see the same keys either way; later ones do not
    torch.testing.assert_close(local[:, :8], ref[:, :8], rtol=1e-5, atol=1e-5)
    assert float((local[:, 8:] - ref[:, 8:]).abs().max()) > 1e-3


def test_in_a_model_right_padding_is_exact_and_left_padding_or_packing_refused(small_llama):
    # transformers hands a registered attention no mask of its own: without the registered mask
    # function, left padding and packed documents both ran, silently wrong (0.36 and 0.40 off)
    from recipes_lib.packing import collate_padding_free

    ids = torch.randint(3, 128, (2, 12))
    right, left = torch.ones_like(ids), torch.ones_like(ids)
    right[0, 8:], left[0, :4] = 0, 0
    with torch.no_grad():
        ref = small_llama(input_ids=ids, attention_mask=right).logits
        small_llama.set_attn_implementation(sa.register_with_transformers(window=None))
        got = small_llama(input_ids=ids, attention_mask=right).logits
        torch.testing.assert_close(got[right.bool()], ref[right.bool()], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="attention_mask: left padding"):
            small_llama(input_ids=ids, attention_mask=left)
        docs = [{"input_ids": list(range(3, 3 + n))} for n in (9, 14, 6)]
        packed = collate_padding_free([docs[:2], docs[2:]], pad_token_id=0)
        with pytest.raises(ValueError, match="position_ids: packed documents"):
            small_llama(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                        use_cache=False)


def test_time_exponent():
    assert sa.time_exponent([1, 2, 4], [3.0, 12.0, 48.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="seq_lens"):
        sa.time_exponent([1], [1.0])


def test_flex_is_gpu_only_here():
    assert sa.flex_available("cpu") is False


def test_benchmark_rows():
    rows = sa.benchmark([64, 128], window=16, n_global=2, num_heads=1, head_dim=8, repeats=1,
                        progress=False)
    assert len(rows) == 6 and all(r["forward_backward_s"] > 0 for r in rows)
    with pytest.raises(ValueError, match="seq_lens"):
        sa.benchmark([8], window=16)


def test_small_llama_from_the_model_module():
    from recipes_lib.model import small_llama

    m = small_llama(None, 256, vocab_size=1000, attn_implementation="eager")
    assert m.config.vocab_size == 1000 and m.config._attn_implementation == "eager"
