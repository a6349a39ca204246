import pytest
import torch

from recipes_lib import calc, fake_memory
from recipes_lib.fake_memory import Stack


@pytest.fixture(scope="module")
def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("stack", [
    Stack(precision="fp32"), Stack(precision="bf16"), Stack(precision="fp16"),
    Stack(precision="fp32", checkpointing=True), Stack(method="lora", precision="fp32"),
    Stack(method="lora", checkpointing=True), Stack(grad_accum_steps=2),
    Stack(optimizer="sgd", precision="fp32"), Stack(precision="bf16-mixed")],
    ids=lambda s: s.label)
def test_fake_step_equals_the_real_step_in_every_category(config, stack):
    r = fake_memory.fake_vs_real(config, stack, seq_len=128, batch_size=2)
    assert r["real"].peak_bytes > 0
    assert r["fake"].by_category == r["real"].by_category
    assert r["peak_ratio"] == 1.0


def test_the_counted_states_are_what_the_stack_says(config):
    full = fake_memory.measure_step(config, Stack(precision="bf16"), 64, 1)
    params = list(fake_memory.build_model(config, Stack(), "cpu")[0].parameters())
    n = sum(p.numel() for p in params)
    assert full.by_category["parameters"] == 2 * n
    assert full.by_category["optimizer"] == 4 * n + 4 * len(params)  # 2 bf16 moments + fp32 step
    stack = Stack(method="lora", precision="fp32")
    lora = fake_memory.measure_step(config, stack, 64, 1)
    trainable = [p for p in fake_memory.build_model(config, stack, "cpu")[0].parameters()
                 if p.requires_grad]
    assert lora.by_category["optimizer"] == 8 * sum(p.numel() for p in trainable) + 4 * len(
        trainable)  # two fp32 moments, the adapters' only


def test_a_preset_is_built_on_fake_tensors_without_its_memory():
    cfg = fake_memory.model_config("Llama-3.2-1B")
    assert cfg.hidden_size == 2048 and cfg.tie_word_embeddings
    model, mode = fake_memory.build_model(cfg, Stack(method="lora"), "cpu")
    from torch._subclasses.fake_tensor import FakeTensor

    assert mode is not None and isinstance(next(model.parameters()), FakeTensor)
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight  # re-tied after to_empty
    n = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert n == calc.param_count(calc.PRESETS["Llama-3.2-1B"])["total"]


def test_bad_inputs_name_the_parameter(config, tmp_path):
    with pytest.raises(ValueError, match="model='Llama-9-1T'.*Llama-3.1-8B"):
        fake_memory.model_config("Llama-9-1T")
    from transformers import ViTConfig

    ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        fake_memory.model_config(tmp_path)
    with pytest.raises(ValueError, match="seq_len=512.*RoPE scaling"):
        fake_memory.measure_step(config, Stack(), 512, 1)
    with pytest.raises(ValueError, match="grad_accum_steps=2"):
        fake_memory.measure_step(config, Stack(grad_accum_steps=2), 64, 3)
    for kw, name in (({"method": "qlora-full"}, "method"), ({"precision": "fp8"}, "precision"),
                     ({"optimizer": "lion"}, "optimizer"), ({"grad_accum_steps": 0}, "grad_")):
        with pytest.raises(ValueError, match=name):
            Stack(**kw)
    with pytest.raises(ValueError, match="batch_size=0"):
        fake_memory.measure_step(config, Stack(), 64, 0)
    assert torch.get_default_dtype() == torch.float32
