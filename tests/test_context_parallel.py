import pytest
import torch

from recipes_lib import calc, context_parallel, distributed


def test_the_sequence_is_cut_into_two_chunks_per_rank_one_from_each_end():
    x = torch.arange(16)[None]
    parts = [context_parallel.shard(x, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(context_parallel.unshard(parts), x)


def test_bad_splits_are_refused_by_name():
    with pytest.raises(ValueError, match="seq_len=1000: must be a multiple of 2 x world_size = 16"):
        context_parallel.check_split(1000, 8)
    with pytest.raises(ValueError, match="world_size=1"):
        context_parallel.check_split(1024, 1)
    with pytest.raises(ValueError, match="process group"):
        context_parallel.ring_attention(*(torch.zeros(1, 2, 8, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="world_size=1"):
        calc.ring_attention_bytes(calc.ModelShape(512, 64, 192, 2, 2, 1), 1024, 1, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_the_cpu_kernel_and_the_written_out_block_agree_forward_and_backward(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse = context_parallel.block_forward(q, k, v, causal, 0.3, kernel=True)
    ref_out, ref_lse = context_parallel.block_forward(q, k, v, causal, 0.3, kernel=False)
    assert (out - ref_out).abs().max() <= 1e-12 and (lse - ref_lse).abs().max() <= 1e-12
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.requires_grad_() for t in (q, k, v)), is_causal=causal, scale=0.3)
    ref_grads = torch.autograd.grad(dense, (q, k, v), dout)
    for kernel in (True, False):
        grads = context_parallel.block_backward(dout, q.detach(), k.detach(), v.detach(),
                                                out, lse, causal, 0.3, kernel=kernel)
        assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)) <= 1e-10


def test_ring_attention_equals_dense_attention_on_four_ranks():
    """The numerical-equivalence check on real gloo ranks (2 ranks: the shared job below)."""
    [errors] = distributed.launch([("recipes_lib.context_parallel:check_against_dense",
                                    {"seq_len": 128})], world_size=4, verbose=False)
    assert len(errors) == 4
    for e in errors:
        assert e["float64"]["output"] <= 1e-10 and e["float64"]["grad"] <= 1e-10, e
        assert e["float32"]["output"] <= 1e-5 and e["float32"]["grad"] <= 1e-5, e


def test_a_model_step_split_over_two_ranks_equals_one_rank(sharded_runs):
    attention, model = sharded_runs["ring_attention"], sharded_runs["context_parallel"]
    assert all(e["float64"]["grad"] <= 1e-10 and e["float32"]["grad"] <= 1e-5 for e in attention)
    for r in model:
        assert r["loss_abs_diff"] <= 1e-5 and r["grad_max_abs_diff"] <= 1e-5, r
        assert r["activation_bytes"]["ring"] <= 0.6 * r["activation_bytes"]["one rank"], r
    m = model[0]
    predicted = calc.ring_attention_bytes(calc.ModelShape.from_config(m["config"]), m["seq_len"],
                                          1, 2, 4)
    assert m["sent_bytes"] == {"forward": predicted["forward"], "backward": predicted["backward"]}
    assert m["longest"]["ring"]["max_seq_len"] >= 1.8 * m["longest"]["one rank"]["max_seq_len"]
    summary = context_parallel.summarize(attention, m, predicted["total"])
    assert summary["traffic_ratio"] == 1.0 and summary["max_seq_gain"] >= 1.8
    assert summary["max_error"]["float64"] <= 1e-10 and set(summary["errors"]) == {"rank 0",
                                                                                     "rank 1"}


def test_pytorch_context_parallel_is_refused_without_nccl():
    """Its GPU run is tests/test_gpu_paths.py's (2 GPUs); elsewhere it says why not."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the refusal is for machines without it")
    with pytest.raises(ValueError, match="needs NCCL"):
        context_parallel.check_torch_context_parallel()


def test_a_padded_batch_is_refused_before_the_ring_runs(small_llama):
    # the ring knows only whole sequences; without a registered mask function transformers
    # handed it no mask and a padded batch went through unseen
    small_llama.set_attn_implementation(context_parallel.register_with_transformers())
    ids = torch.randint(3, 128, (2, 8))
    padded = torch.ones_like(ids)
    padded[1, 6:] = 0
    with pytest.raises(ValueError, match="attention_mask: ring attention takes whole"):
        small_llama(input_ids=ids, attention_mask=padded)
