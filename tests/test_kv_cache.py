import pytest
import torch

from recipes_lib import calc, kv_cache, latency


def test_measured_cache_equals_the_calculator(small_llama):
    ids = torch.randint(3, 128, (2, 10))
    got = kv_cache.measure_kv_cache(small_llama, ids)
    shape = calc.ModelShape.from_config(small_llama.config)
    assert got["bytes_per_token"] == calc.kv_cache_bytes_per_token(shape, bytes_per_value=4)
    assert got["bytes"] == calc.kv_cache_bytes(shape, 10, 2, bytes_per_value=4)


def test_generation_with_and_without_cache_gives_the_same_tokens(small_llama):
    ids = torch.randint(3, 128, (1, 6))
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        a = small_llama.generate(input_ids=ids, use_cache=True, **kw)
        b = small_llama.generate(input_ids=ids, use_cache=False, **kw)
    assert torch.equal(a, b)


def test_generation_speed_and_prefill_time(small_llama):
    ids = torch.randint(3, 128, (1, 6))
    out = latency.generation_speed(small_llama, ids, new_tokens=4, repeats=1)
    assert out["tokens_per_s"] > 0
    assert latency.prefill_time(small_llama, {"input_ids": ids}, repeats=1).median_s > 0
    with pytest.raises(ValueError, match="new_tokens"):
        latency.generation_speed(small_llama, ids, new_tokens=0)
    with pytest.raises(ValueError, match="input_ids"):
        latency.prefill_time(small_llama, {})


def test_module_time_share_is_a_fraction(small_llama):
    ids = torch.randint(3, 128, (2, 32))
    share = latency.module_time_share(small_llama, lambda: small_llama(input_ids=ids),
                                      lambda m: type(m) is torch.nn.Linear)
    assert 0.0 < share < 1.0


def test_interleaved_generation_and_prefill_timings(small_llama):
    ids = torch.randint(3, 128, (1, 6))
    g = latency.generation_speeds({"a": small_llama, "b": small_llama}, ids, new_tokens=2,
                                  repeats=1)
    assert set(g) == {"a", "b"} and g["a"]["tokens_per_s"] > 0 and g["a"]["spread"] >= 0
    p = latency.prefill_times({"a": small_llama}, {"input_ids": ids}, repeats=1)
    assert p["a"].median_s > 0
    with pytest.raises(ValueError, match="new_tokens"):
        latency.generation_speeds({"a": small_llama}, ids, new_tokens=0)


def test_length_sweep_times_generation_with_and_without_the_cache(small_llama):
    s = kv_cache.length_sweep(small_llama, torch.tensor([[1, 5, 7, 9]]), [2, 4, 8], repeats=1)
    assert (s.recipe, s.dimension, s.sizes) == ("kv_cache", "new_tokens", [2, 4, 8])
    assert s.flops[2] > s.flops[0]  # the baseline recomputes longer prefixes


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "qwen2", "qwen3"])
def test_the_calculator_counts_sliding_windows_and_wide_heads(arch):
    import transformers

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
             "pad_token_id": 0}
    config = {"mistral": lambda: transformers.MistralConfig(sliding_window=16, **sizes),
              "gemma2": lambda: transformers.Gemma2Config(sliding_window=16, head_dim=32, **sizes),
              "qwen2": lambda: transformers.Qwen2Config(sliding_window=16, use_sliding_window=True,
                                                        max_window_layers=1, **sizes),
              "qwen3": lambda: transformers.Qwen3Config(head_dim=32, **sizes)}[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = calc.ModelShape.from_config(config)
    for seq in (8, 40):  # below and beyond the window
        got = kv_cache.measure_kv_cache(model, torch.randint(1, 64, (2, seq)))
        assert got["bytes"] == calc.kv_cache_bytes(shape, seq, 2, bytes_per_value=4), seq
