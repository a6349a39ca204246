import pytest
import torch
import torch.nn.functional as F

from recipes_lib import chunked_loss
from recipes_lib.chunked_loss import chunked_cross_entropy, chunked_linear_loss


def _reference(h, w, y, **kw):
    return F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), **kw)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_equals_full_cross_entropy_forward_and_backward(chunk_size):
    h = torch.randn(3, 50, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 32, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 300, (3, 50))
    y[0, :10] = -100
    ref = _reference(h, w, y, ignore_index=-100)
    g_ref = torch.autograd.grad(ref, (h, w))
    out = chunked_cross_entropy(h, w, y, chunk_size=chunk_size)
    g_out = torch.autograd.grad(out, (h, w))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_fp32_gradients_within_1e5():
    h = torch.randn(2, 256, 64, requires_grad=True)
    w = torch.randn(2048, 64, requires_grad=True)
    y = torch.randint(0, 2048, (2, 256))
    ref = _reference(h, w, y)
    g_ref = torch.autograd.grad(ref, (h, w))
    g = torch.autograd.grad(chunked_cross_entropy(h, w, y, chunk_size=100), (h, w))
    assert max(float((a - b).abs().max()) for a, b in zip(g, g_ref)) <= 1e-5


def test_bf16_inputs_within_bf16_tolerance():
    h = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(100, 32, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 100, (64,))
    ref = F.cross_entropy((h @ w.T).float(), y)
    out = chunked_cross_entropy(h, w, y, chunk_size=16)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    out.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_sum_reduction_and_no_grad_path():
    h, w, y = torch.randn(10, 8), torch.randn(20, 8), torch.randint(0, 20, (10,))
    ref = F.cross_entropy(h @ w.T, y, reduction="sum")
    torch.testing.assert_close(chunked_cross_entropy(h, w, y, 3, reduction="sum"), ref)
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(h, w, y, 3, reduction="sum"), ref)


def test_only_one_chunk_of_logits_is_alive():
    """Peak memory of the loss step is about one chunk's logits, not all of them."""
    from recipes_lib.memory import measure_memory

    h = torch.randn(2048, 64, requires_grad=True)
    w = torch.randn(8000, 64, requires_grad=True)
    y = torch.randint(0, 8000, (2048,))
    full = measure_memory(lambda: _reference(h[None], w, y[None]).backward()).peak_bytes
    chunked = measure_memory(lambda: chunked_cross_entropy(h, w, y, 256).backward()).peak_bytes
    assert chunked / full < 0.25, (chunked, full)


@pytest.mark.parametrize("kwargs, match", [
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": -3}, "chunk_size"),
    ({"reduction": "none"}, "reduction"),
])
def test_bad_arguments_name_the_parameter(kwargs, match):
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(h, w, y, **kwargs)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8),
                              torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        chunked_linear_loss(torch.randn(4, 8), torch.randn(10, 9), lambda z: z.sum(), 2)


def test_default_chunk_size_follows_liger_rule():
    from recipes_lib.chunked_loss import default_chunk_size

    assert default_chunk_size(2048, 32000, 256) == 32
    assert default_chunk_size(8192, 128256, 4096) == 256


def test_compare_with_full_reports_both_sides():
    from recipes_lib.chunked_loss import compare_with_full

    out = compare_with_full(tokens=256, vocab_size=2000, hidden_size=32, chunk_size=32, repeats=1)
    assert out["peak_chunked"] < out["peak_full"] and out["max_grad_error"] <= 1e-5
    assert out["time_full"] > 0 and out["time_chunked"] > 0


@pytest.mark.parametrize("cap", [None, 30.0])
def test_compiled_chunks_equal_full_cross_entropy(cap):
    from recipes_lib.compiling import compile_available

    if not compile_available("cpu")[0]:
        pytest.skip("no C++ compiler for torch.compile")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(100, 32, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(300, 32, generator=g, dtype=torch.float64) / 6).requires_grad_()
    y = torch.randint(0, 300, (100,), generator=g)
    y[:10] = chunked_loss.IGNORE_INDEX
    ref = F.cross_entropy(chunked_loss.softcap(h @ w.T, cap), y)
    got = chunked_loss.chunked_cross_entropy(h, w, y, 32, compiled=True, logit_softcap=cap)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_chunk_leaves_its_logits_gradient_in_place_of_its_logits(compiled):
    """The compiled chunk's contract: it returns the chunk's summed loss and overwrites the
    logits with the loss's gradient, as autograd computes them (soft cap included)."""
    from recipes_lib.compiling import compile_available

    if compiled and not compile_available("cpu")[0]:
        pytest.skip("no C++ compiler for torch.compile")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(24, 50, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 50, (24,), generator=g)
    y[:3] = chunked_loss.IGNORE_INDEX
    for cap in (None, 5.0):
        leaf = z.clone().requires_grad_()
        ref = F.cross_entropy(chunked_loss.softcap(leaf, cap), y, reduction="sum")
        (ref_grad,) = torch.autograd.grad(ref, leaf)
        buf = z.clone()
        fn = (chunked_loss.compiled_ce_chunk if compiled else chunked_loss.ce_chunk)(
            logit_softcap=cap)
        loss = fn(buf, y)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(buf, ref_grad, rtol=1e-10, atol=1e-12)


def test_full_cross_entropy_compiled_as_cce_compiles_it_equals_the_eager_one():
    """The stand-in for Cut Cross-Entropy's CPU path; fp32 and dynamic shapes, so the sweep
    test below reuses its compiled graph."""
    from recipes_lib.compiling import compile_available

    if not compile_available("cpu")[0]:
        pytest.skip("no C++ compiler for torch.compile")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(100, 32, generator=g, requires_grad=True)
    w = (torch.randn(300, 32, generator=g) / 6).requires_grad_()
    y = torch.randint(0, 300, (100,), generator=g)
    y[:10] = chunked_loss.IGNORE_INDEX
    ref = F.cross_entropy(h @ w.T, y)
    got = chunked_loss.compiled_full_cross_entropy()(h, w, y)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_compiled_and_cce_join_the_tokens_sweep_or_say_why_not(monkeypatch):
    from recipes_lib import compiling

    if compiling.compile_available("cpu")[0]:
        s = chunked_loss.tokens_sweep([16, 32, 64], 128, 32, chunk_size=16, repeats=1,
                                      include_compiled=True, compiled_chunk_size=32)
        assert {"chunked (compiled)", "chunked (compiled, 32 tokens)",
                "full (compiled)"} <= s.extra.keys()
        assert len(s.ratio("full (compiled)", "chunked (compiled, 32 tokens)")[0]) == 3
    with pytest.raises(ValueError, match="compiled_chunk_size=32: .* include_compiled=True"):
        chunked_loss.tokens_sweep([16, 32, 64], 128, 32, compiled_chunk_size=32)
    monkeypatch.setattr(chunked_loss, "cce_available", lambda: False)
    with pytest.raises(ValueError, match="include_cce=True: cut-cross-entropy"):
        chunked_loss.tokens_sweep([16, 32, 64], 128, 32, include_cce=True)


def test_a_head_with_lora_adapters_is_refused_and_a_trained_head_is_followed(small_llama):
    # peft's LoRA layer answers .weight with its base layer's: multiplying by it would drop the
    # adapters (silently: 145.6 for the model's 149.0 on a tiny Llama)
    from peft import LoraConfig, get_peft_model

    from recipes_lib.grad_accumulation import causal_lm_loss_sum

    ids = torch.randint(0, small_llama.config.vocab_size, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss = chunked_loss.ChunkedCausalLMLoss(8)
    adapted = get_peft_model(small_llama, LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                     init_lora_weights=False))
    with pytest.raises(ValueError, match="output head carries LoRA adapters"):
        loss(adapted, batch)
    adapted.merge_adapter()  # merged into the head's weight, the product is the model's again
    torch.testing.assert_close(loss(adapted, batch), causal_lm_loss_sum(adapted(**batch).logits,
                                                                        ids))
    adapted.unmerge_adapter()
    base = adapted.unload()
    trained_head = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"],
                                                   modules_to_save=["lm_head"]))
    torch.testing.assert_close(loss(trained_head, batch),
                               causal_lm_loss_sum(trained_head(**batch).logits, ids))


def test_packed_rows_stay_packed_documents(small_llama):
    # padding-free rows (position_ids restarting at each document, no attention mask): the
    # chunked loss's hidden states are the model's own, each document attending only to itself
    from recipes_lib.grad_accumulation import causal_lm_loss_sum
    from recipes_lib.packing import collate_padding_free

    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(3, 128, (n,), generator=g).tolist()} for n in (9, 14, 6)]
    batch = collate_padding_free([docs[:2], docs[2:]], pad_token_id=0)
    full = causal_lm_loss_sum(small_llama(input_ids=batch["input_ids"], use_cache=False,
                                          position_ids=batch["position_ids"]).logits,
                              batch["labels"])
    torch.testing.assert_close(chunked_loss.ChunkedCausalLMLoss(8)(small_llama, batch), full)
    as_one_sequence = causal_lm_loss_sum(small_llama(input_ids=batch["input_ids"]).logits,
                                         batch["labels"])
    # what ignoring the positions would give
    assert abs(float((as_one_sequence - full).detach())) > 1e-3


def test_compiled_ratios_are_recorded_at_the_largest_size_and_the_second_is_the_claim():
    from recipes_lib.results import Results
    from recipes_lib.sweep import Sweep
    from recipes_lib.timing import Timing

    def t(ms):
        return [Timing(ms / 1e3, [ms / 1e3])] * 3
    s = Sweep("chunked_ce", "tokens", [256, 512, 1024], t(10), t(12),
              extra={"full (compiled)": t(9), "chunked (compiled)": t(10),
                     "chunked (compiled, 512 tokens)": t(6)})
    r = Results("demo", "cpu")
    chunked_loss.record_compiled_ratios(s, r, 128, 512, strict=False)
    assert r.get("chunked_ce", "compiled_speedup_at_tokens_1024").value == pytest.approx(0.9)
    fig = r.get("chunked_ce", "compiled_speedup_chunk_512_at_tokens_1024")
    assert fig.value == pytest.approx(1.5) and fig.unit.endswith("512-token chunks")
    [claim] = r.claims
    assert claim.claim.startswith("compiled chunks (512 tokens)")
