import pytest
import torch

from recipes_lib import model as models


def test_default_model_is_a_pretrained_llama(tiny_model_path):
    report = models.pretrain_report(tiny_model_path)
    assert report["eval_loss_after"] < 0.3 * report["eval_loss_before"]
    m = models.load_model(tiny_model_path)
    assert m.config.model_type == "llama" and m.config._attn_implementation == "sdpa"
    assert models.build_tiny_model() == tiny_model_path  # cached, not rebuilt


def test_build_is_deterministic(tmp_path):
    spec = models.TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, pretrain_steps=2,
                                pretrain_batch_size=4, pretrain_seq_len=32)
    a = models.build_tiny_model(tmp_path / "a", spec, progress=False)
    b = models.build_tiny_model(tmp_path / "b", spec, progress=False)
    ma, mb = models.load_model(a), models.load_model(b)
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.equal(p, q), n
    assert models.load_tokenizer(a).encode("the chef") == models.load_tokenizer(b).encode("the chef")
    assert not list(tmp_path.glob("*.partial"))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1"):
        models.load_model("meta-llama/Llama-3.2-1B")


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not be loaded"):
        models.load_model(tmp_path)


def test_layernorm_architecture_builds(tmp_path):
    spec = models.TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, pretrain_steps=2,
                                pretrain_batch_size=4, pretrain_seq_len=32, architecture="gpt_neox")
    m = models.load_model(models.build_tiny_model(tmp_path / "neox", spec, progress=False))
    assert m.config.model_type == "gpt_neox"
    assert any(isinstance(x, torch.nn.LayerNorm) for x in m.modules())
    with pytest.raises(ValueError, match="architecture='mamba'"):
        models.build_tiny_model(tmp_path / "x", models.TinyModelSpec(architecture="mamba"))


def test_save_temporary_round_trip(small_llama, tokenizer):
    path = models.save_temporary(small_llama, tokenizer)
    again = models.load_model(path)
    assert all(torch.equal(a, b) for a, b in zip(small_llama.parameters(), again.parameters()))
