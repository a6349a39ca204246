import pytest
import torch

from recipes_lib import max_context as mc
from recipes_lib.chunked_loss import ChunkedCausalLMLoss
from recipes_lib.grad_accumulation import causal_lm_loss_sum


def test_search_finds_the_largest_fitting_multiple():
    calls = []

    def peak(n):
        calls.append(n)
        return 1000 * n
    out = mc.max_seq_len(peak, budget_bytes=1000 * 3000, start=256, limit=65536, multiple_of=128)
    assert out["seq_len"] == 2944 and set(out["probes"]) == set(calls)
    assert mc.max_seq_len(peak, 10, start=256)["seq_len"] == 0
    assert mc.max_seq_len(peak, 1e12, start=256, limit=1024)["seq_len"] == 1024


@pytest.mark.parametrize("kwargs, match", [({"budget_bytes": 0}, "budget_bytes"),
                                           ({"multiple_of": 0}, "multiple_of"),
                                           ({"start": 4096, "limit": 1024}, "start=4096")])
def test_bad_search_settings(kwargs, match):
    args = {"peak_at": lambda n: n, "budget_bytes": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        mc.max_seq_len(**args)


def test_sequence_beyond_positions_says_how_rope_scaling_extends_it(small_llama):
    with pytest.raises(ValueError, match=r"seq_len=512: beyond .*max_position_embeddings=128.*"
                                         r"config\.rope_parameters .*'factor': 4\b"):
        mc.check_positions(small_llama.config, 512)
    with pytest.raises(ValueError, match="seq_len"):
        mc.training_step_peak(small_llama, 512)


def test_chunked_causal_lm_loss_equals_the_model_loss(small_llama, varlen_batch):
    inputs = {k: varlen_batch[k] for k in ("input_ids", "attention_mask")}
    ref = causal_lm_loss_sum(small_llama(**inputs).logits, varlen_batch["labels"])
    ref.backward()
    g_ref = {n: p.grad.clone() for n, p in small_llama.named_parameters()}
    small_llama.zero_grad()
    got = ChunkedCausalLMLoss(chunk_size=7)(small_llama, varlen_batch)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    for n, p in small_llama.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[n], rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedCausalLMLoss(0)


def test_each_recipe_lowers_the_measured_peak(small_llama):
    from recipes_lib import checkpointing

    base = mc.training_step_peak(small_llama, 128, batch_size=2)
    chunked = mc.training_step_peak(small_llama, 128, batch_size=2, loss_fn=ChunkedCausalLMLoss(16))
    checkpointing.enable_activation_checkpointing(small_llama)
    both = mc.training_step_peak(small_llama, 128, batch_size=2, loss_fn=ChunkedCausalLMLoss(16))
    assert both < chunked < base


def test_rope_scaling_stretches_positions(tiny_model_path):
    m = mc.load_with_rope_scaling(tiny_model_path, 4096)
    assert m.config.max_position_embeddings == 4096
    assert m.config.rope_parameters["rope_type"] == "linear"
    assert m.config.rope_parameters["factor"] == 4096 / 512
    mc.check_positions(m.config, 4096)
    with pytest.warns(UserWarning, match="trained on 512 positions, max_positions=256 needs no "
                                         "stretching: loaded as trained"):
        same = mc.load_with_rope_scaling(tiny_model_path, 256)
    assert same.config.max_position_embeddings == 512
    assert same.config.rope_parameters["rope_type"] == "default"
    with pytest.raises(ValueError, match="max_positions=0: must be a positive integer"):
        mc.load_with_rope_scaling(tiny_model_path, 0)


def _saved(tmp_path, model_type: str, **fields) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=1, **fields)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / model_type)
    return str(tmp_path / model_type)


def test_a_scaled_or_per_layer_rope_is_stretched_as_its_own(tmp_path):
    """Llama-3.1's "llama3" RoPE keeps its type, its factor multiplied (plain linear would drop
    it); Gemma-3 stretches its full-attention RoPE only; Phi-3's per-dimension "longrope"
    factors and a type other than the model's own are refused."""
    llama31 = _saved(tmp_path, "llama", max_position_embeddings=1024, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128, "rope_theta": 500000.0})
    rope = mc.load_with_rope_scaling(llama31, 4096).config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert rope["original_max_position_embeddings"] == 128 and rope["rope_theta"] == 500000.0
    with pytest.raises(ValueError, match=r"^rope_type='linear': .* already scaled by 'llama3'"):
        mc.load_with_rope_scaling(llama31, 4096, rope_type="linear")
    gemma3 = mc.load_with_rope_scaling(_saved(tmp_path, "gemma3_text", sliding_window=64,
                                              max_position_embeddings=512), 2048)
    rope = gemma3.config.rope_parameters
    assert rope["full_attention"]["factor"] == 4.0 and rope["full_attention"]["rope_theta"] > 0
    assert rope["sliding_attention"]["rope_type"] == "default"
    phi3 = _saved(tmp_path, "phi3", max_position_embeddings=1024,
                  original_max_position_embeddings=256, rope_parameters={
                      "rope_type": "longrope", "short_factor": [1.0] * 8,
                      "long_factor": [2.0] * 8, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="'longrope' has no single factor"):
        mc.load_with_rope_scaling(phi3, 4096)


def test_calculator_max_seq_len_grows_with_each_recipe():
    from recipes_lib import calc

    shape = calc.ModelShape(32000, 64, 192, 2, 2, 1)
    base = calc.max_seq_len(shape, 192 * 2**20, 33e6)
    flash = calc.max_seq_len(shape, 192 * 2**20, 33e6, flash_attention=True)
    chunked = calc.max_seq_len(shape, 192 * 2**20, 33e6, flash_attention=True, recompute="full",
                               loss_chunk=128)
    assert 0 < base <= flash < chunked
    with pytest.raises(ValueError, match="budget_bytes"):
        calc.max_seq_len(shape, 0)


def test_search_recipes_rows():
    rows = mc.search_recipes({"base": {"attn": "eager"},
                              "combined": {"attn": "sdpa", "ckpt": True, "chunk": 64}},
                             budget_bytes=24 * 2**20, limit=1024, vocab_size=4000)
    assert [r["variant"] for r in rows] == ["base", "combined"]
    assert rows[1]["max seq_len (measured)"] >= rows[0]["max seq_len (measured)"] > 0
    assert all(r["predicted"] > 0 for r in rows)


def test_checkpointing_peaks_measure_both_and_leave_the_model_as_it_came(small_llama):
    rows = mc.checkpointing_peaks(small_llama, [64, 128])
    assert [r["seq_len"] for r in rows] == [64, 128]
    assert not small_llama.is_activation_checkpointing
    for r in rows:
        assert r["plain MiB"] == mc.training_step_peak(small_llama, r["seq_len"]) / 2**20
        assert r["ratio"] == r["checkpointed MiB"] / r["plain MiB"] < 1
        assert 0 < r["predicted ratio"] < 1
