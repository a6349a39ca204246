import pytest
import torch

pytest.importorskip("torchao")

from recipes_lib import fp8


def _model(hidden=128, inter=352):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_cpu_has_no_float8_matmul_and_says_emulation_checks_numerics_only():
    ok, why = fp8.hardware_support("cpu")
    assert not ok and "emulation" in why


def test_convert_names_every_linear_layer_converted_or_skipped_with_its_reason():
    auto = fp8.convert(_model(), "tensorwise")  # torchao's H100 size heuristic: all too small
    assert auto.converted == [] and len(auto.skipped) == 15
    assert auto.skipped["lm_head"] == "excluded by name"
    assert "too small" in auto.skipped["model.layers.0.mlp.down_proj"]
    odd = fp8.convert(_model(inter=344), "rowwise", skip_small=False)
    assert odd.skipped["model.layers.0.mlp.up_proj"] == "dimension not divisible by 16"
    every = _model()
    conv = fp8.convert(every, "tensorwise", skip_small=False)
    assert len(conv.converted) == 14 and "14 linear layers in float8" in conv.summary()
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(every.model.layers[0].self_attn.q_proj, Float8Linear)
    assert not isinstance(every.lm_head, Float8Linear)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_emulated_fp8_loss_and_gradients_stay_close_to_bf16(recipe):
    ref = _model().to(torch.bfloat16)
    q = _model().to(torch.bfloat16)
    q.load_state_dict(ref.state_dict())
    fp8.convert(q, recipe, skip_small=False)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = [m(input_ids=ids, labels=ids).loss for m in (ref, q)]
    for loss in losses:
        loss.backward()
    assert abs(losses[1].item() / losses[0].item() - 1) < 0.01
    g_ref = ref.model.layers[0].mlp.down_proj.weight.grad.float()
    g_q = q.model.layers[0].mlp.down_proj.weight.grad.float()
    assert ((g_q - g_ref).norm() / g_ref.norm()) < 0.15  # e4m3/e5m2 keep 3/2 mantissa bits


def test_bad_inputs_name_the_parameter():
    with pytest.raises(ValueError, match="recipe="):
        fp8.convert(_model(), "blockwise")
    with pytest.raises(ValueError, match="device='cpu'"):
        fp8.linear_sweep([256, 512, 1024], device="cpu")
