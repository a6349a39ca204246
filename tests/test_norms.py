import pytest
import torch

from recipes_lib import norms


def test_swap_keeps_shapes_and_learned_scale():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=64)
    model = GPTNeoXForCausalLM(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
    scales = {n: m.weight.detach().clone() for n, m in model.named_modules()
              if isinstance(m, torch.nn.LayerNorm)}
    ids = torch.randint(0, 64, (2, 8))
    shape = model(input_ids=ids).logits.shape
    info = norms.swap_layernorm_for_rmsnorm(model)
    assert info["swapped"] == 5 and norms.count_norms(model) == {"LayerNorm": 0, "RMSNorm": 5}
    for name, w in scales.items():
        new = model.get_submodule(name)
        assert isinstance(new, torch.nn.RMSNorm) and torch.equal(new.weight, w)
    assert model(input_ids=ids).logits.shape == shape
    # the swapped module computes the RMSNorm formula
    x = torch.randn(4, 32)
    mod = model.get_submodule(next(iter(scales)))
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps) * mod.weight
    torch.testing.assert_close(mod(x), ref)


def test_rmsnorm_equals_layernorm_on_centred_input_without_bias():
    x = torch.randn(8, 64, dtype=torch.float64)
    x = x - x.mean(-1, keepdim=True)
    ln = torch.nn.LayerNorm(64, eps=1e-6, dtype=torch.float64)
    m = torch.nn.Sequential(ln)
    norms.swap_layernorm_for_rmsnorm(m)
    torch.testing.assert_close(m(x), ln(x))


def test_model_without_layernorm_is_refused(small_llama):
    with pytest.raises(ValueError, match="no torch.nn.LayerNorm"):
        norms.swap_layernorm_for_rmsnorm(small_llama)


def test_norm_sweep_times_layernorm_against_rmsnorm_at_each_width():
    s = norms.norm_sweep([64, 128, 256], tokens=64, repeats=1)
    assert (s.recipe, s.dimension, s.sizes) == ("rmsnorm", "hidden", [64, 128, 256])
    assert len(s.regimes()) == 3
    with pytest.raises(ValueError, match="at least three sizes"):
        norms.norm_sweep([64, 128])
