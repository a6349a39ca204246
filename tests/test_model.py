import shutil

import pytest
import torch

from recipes_lib import model as models


def test_default_model_is_a_pretrained_llama(tiny_model_path):
    report = models.pretrain_report(tiny_model_path)
    assert report["eval_loss_after"] < 0.3 * report["eval_loss_before"]
    m = models.load_model(tiny_model_path)
    assert m.config.model_type == "llama" and m.config._attn_implementation == "sdpa"
    assert models.build_tiny_model() == tiny_model_path  # cached, not rebuilt


def test_a_report_measured_on_fewer_held_out_sequences_says_how_many(tmp_path, monkeypatch):
    """The unit tests' models report losses on 32 held-out sequences; the default (and every
    spec built before the field existed, whose folder names stay) on the whole split."""
    from recipes_lib import evaluation

    assert models.TinyModelSpec().cache_name() == "tiny-llama-256h6l-3b0fb492"
    assert models.TinyModelSpec.smallest().eval_sequences == 32
    evaluated = []
    real = evaluation.eval_loss
    monkeypatch.setattr(evaluation, "eval_loss", lambda m, examples, pad: evaluated.append(
        len(examples)) or real(m, examples, pad))
    spec = models.TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, pretrain_steps=1,
                                pretrain_batch_size=2, pretrain_seq_len=32, eval_sequences=3)
    path = models.build_tiny_model(tmp_path / "m", spec, progress=False)
    assert evaluated == [3, 3]
    assert models.pretrain_report(path)["spec"]["eval_sequences"] == 3
    with pytest.raises(ValueError, match="eval_sequences=-1: must be an integer >= 0"):
        models.TinyModelSpec(eval_sequences=-1)


def test_build_is_deterministic(tmp_path):
    spec = models.TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, pretrain_steps=2,
                                pretrain_batch_size=4, pretrain_seq_len=32,
                                eval_sequences=8)
    a = models.build_tiny_model(tmp_path / "a", spec, progress=False)
    stale = tmp_path / "b.partial-99999"  # a build that was killed left its folder behind
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    b = models.build_tiny_model(tmp_path / "b", spec, progress=False)
    ma, mb = models.load_model(a), models.load_model(b)
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.equal(p, q), n
    tok_a, tok_b = models.load_tokenizer(a), models.load_tokenizer(b)
    assert tok_a.encode("the chef") == tok_b.encode("the chef")
    assert not list(tmp_path.glob("*.partial*"))


def test_a_build_asked_for_twice_at_once_runs_once(tmp_path, monkeypatch, capsys):
    """Two notebooks or two test workers asking for the same model: the second waits."""
    import threading

    spec = models.TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, pretrain_steps=2,
                                pretrain_batch_size=4, pretrain_seq_len=32,
                                eval_sequences=8)
    started, builds, build = threading.Event(), [], models._build

    def slow_build(*args):
        builds.append(args[0])
        started.set()
        return build(*args)

    monkeypatch.setattr(models, "_build", slow_build)
    paths = []
    first = threading.Thread(target=lambda: paths.append(
        models.build_tiny_model(tmp_path / "m", spec, progress=False)))
    first.start()
    started.wait()
    paths.append(models.build_tiny_model(tmp_path / "m", spec, progress=False))
    first.join()
    assert builds == [tmp_path / "m"] and paths == [tmp_path / "m"] * 2
    assert "waiting for another process to finish building m" in capsys.readouterr().out


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1"):
        models.load_model("meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match="^model_id_or_path=.*HF_HUB_OFFLINE=1"):
        models.load_tokenizer("meta-llama/Llama-3.2-1B")


def test_a_cached_hub_id_loads_offline_from_its_cached_folder(tmp_path, tiny_model_path,
                                                                monkeypatch):
    """What a model downloaded once with a network gives later without one: transformers is
    handed the cached folder, and asks the hub for nothing."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny-llama"
    shutil.copytree(tiny_model_path, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    assert models.model_source("acme/tiny-llama") == str(repo / "snapshots" / ("0" * 40))
    assert models.load_tokenizer("acme/tiny-llama").vocab_size == \
        models.load_tokenizer(tiny_model_path).vocab_size
    model = models.load_model("acme/tiny-llama")
    assert model.config.hidden_size == models.load_model(tiny_model_path).config.hidden_size


def test_without_a_network_a_hub_id_fails_at_once_not_after_retries(monkeypatch):
    """No HF_HUB_OFFLINE, and the hub's host does not resolve: huggingface_hub would retry each
    file five times (~23 s, seen here) before its cache; the name lookup decides at once."""
    import time

    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # CI sets both
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(models, "_resolves", lambda host: False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    assert models.hub_offline() == "huggingface.co does not resolve (no network)"
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^model_id_or_path='acme/uncached': not a local folder, "
                                         r"not in the Hugging Face cache, and huggingface.co does "
                                         r"not resolve \(no network\); download it first"):
        models.load_model("acme/uncached")
    with pytest.raises(ValueError, match=r"^model='acme/uncached': no config.json from the hub "
                                         r"\(huggingface.co does not resolve \(no network\), not "
                                         r"cached: LocalEntryNotFoundError"):
        models.hub_config_file("acme/uncached")
    assert time.perf_counter() - start < 5
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # the proxy resolves names
    assert models.hub_offline() is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(models, "_resolves", lambda host: True)
    assert models.hub_offline() is None
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # huggingface_hub honours it too
    assert models.hub_offline() == "TRANSFORMERS_OFFLINE=1"


@pytest.mark.parametrize("folder", ["/no/such/model", "./no-such-model", "runs/no/such-model"])
def test_a_folder_that_does_not_exist_is_named_not_taken_for_a_hub_id(folder, monkeypatch):
    # transformers takes a missing folder for a malformed hub id ("Repo id must be in the form
    # 'repo_name' or 'namespace/repo_name'"), online or not; the notebooks load the tokenizer first
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for load in (models.load_tokenizer, models.load_model):
        with pytest.raises(ValueError, match=f"^model_id_or_path='{folder}': no such folder"):
            load(folder)


def test_a_folder_without_a_tokenizer_is_named(tmp_path):
    with pytest.raises(ValueError, match="^model_id_or_path=.*no tokenizer could be loaded"):
        models.load_tokenizer(tmp_path)


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not be loaded"):
        models.load_model(tmp_path)


@pytest.fixture
def gemma2_folder(tmp_path):
    """A tiny Gemma-2 (tied embeddings, soft-capping): transformers has no SDPA path for it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       max_position_embeddings=128)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "gemma2")
    return tmp_path / "gemma2"


def test_an_architecture_without_sdpa_loads_with_what_it_has_and_says_so(gemma2_folder):
    with pytest.warns(UserWarning, match="Gemma2ForCausalLM has no SDPA attention.*'eager'"):
        m = models.load_model(gemma2_folder)
    assert m.config._attn_implementation == "eager"
    ids = torch.randint(0, 128, (1, 8))
    assert m(input_ids=ids).logits.shape == (1, 8, 128)


def test_an_explicit_attention_the_architecture_lacks_gives_transformers_reason(gemma2_folder):
    with pytest.raises(ValueError, match="could not be loaded: ValueError: Gemma2ForCausalLM "
                       "does not support an attention implementation"):
        models.load_model(gemma2_folder, attn_implementation="sdpa")


def test_layernorm_architecture_builds(tmp_path):
    spec = models.TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, pretrain_steps=2,
                                pretrain_batch_size=4, pretrain_seq_len=32, architecture="gpt_neox",
                                eval_sequences=8)
    m = models.load_model(models.build_tiny_model(tmp_path / "neox", spec, progress=False))
    assert m.config.model_type == "gpt_neox"
    assert any(isinstance(x, torch.nn.LayerNorm) for x in m.modules())
    with pytest.raises(ValueError, match="architecture='mamba'"):
        models.build_tiny_model(tmp_path / "x", models.TinyModelSpec(architecture="mamba"))


def test_save_temporary_round_trip(small_llama, tokenizer):
    path = models.save_temporary(small_llama, tokenizer)
    again = models.load_model(path)
    assert all(torch.equal(a, b) for a, b in zip(small_llama.parameters(), again.parameters()))


def test_transformers_bars_are_left_out_for_small_checkpoints_only(tiny_model_path, capfd):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from recipes_lib.architectures import PROGRESS_BAR_BYTES, transformers_progress_bars

    was = hf_logging.is_progress_bar_enabled()  # put back at the end, whatever happens
    try:
        hf_logging.enable_progress_bar()
        AutoModelForCausalLM.from_pretrained(tiny_model_path)  # the bar looked for exists
        assert "Loading weights" in capfd.readouterr().err
        model = models.load_model(tiny_model_path)
        models.save_temporary(model, models.load_tokenizer(tiny_model_path))
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "Writing model shards" not in err
        for size, shown in ((None, True), (PROGRESS_BAR_BYTES, True),
                            (PROGRESS_BAR_BYTES - 1, False)):
            with transformers_progress_bars(size):
                assert hf_logging.is_progress_bar_enabled() is shown, size
            assert hf_logging.is_progress_bar_enabled()  # restored
        hf_logging.disable_progress_bar()  # switched off by the user: left off
        with transformers_progress_bars(None):
            assert not hf_logging.is_progress_bar_enabled()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_a_scratch_folder_goes_when_its_process_exits():
    import subprocess
    import sys
    from pathlib import Path

    code = ("from recipes_lib import model; "
            "p = model.scratch_folder('t-'); (p / 'f').write_text('x'); print(p)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.strip()
    assert out and not Path(out).exists()


def test_the_tiny_qwen3_has_wide_heads_as_its_checkpoints_do():
    # Qwen3-0.6B: 16 heads of 128 on a 1024-wide stream; the architecture tests run on the same
    # layout, so a recipe that assumes heads x head_dim == hidden fails there
    from recipes_lib.model import TinyModelSpec, model_config

    class Tokenizer:  # what model_config reads of one
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

        def __len__(self):
            return 512

    cfg = model_config(TinyModelSpec.smallest("qwen3"), Tokenizer())
    assert cfg.head_dim * cfg.num_attention_heads == 2 * cfg.hidden_size


def _multimodal_gemma3(folder, rename=None):
    """A tiny Gemma-3 vision-language checkpoint (its published layout, or with the weights
    renamed by ``rename(key)``); returns the full model it was saved from."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    text = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}
    full = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gemma3", text_config=text, vision_config=vision))
    full.save_pretrained(folder)
    if rename is not None:
        weights = load_file(folder / "model.safetensors")
        save_file({rename(k): v for k, v in weights.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
    return full


@pytest.mark.parametrize("layout", ["published", "newer"])
def test_a_multimodal_checkpoint_loads_as_its_language_model_and_says_so(tmp_path, layout):
    """With the vision tower in, the recipes' blocks were SigLIP's and LoRA's targets took the
    vision encoder's fc1 / fc2 / out_proj too."""
    from recipes_lib import architectures

    newer = {"published": None, "newer": lambda k: k.replace("language_model.model.",
                                                             "model.language_model.")}[layout]
    full = _multimodal_gemma3(tmp_path, newer)
    with pytest.warns(UserWarning, match="Gemma3ForConditionalGeneration checkpoint: loaded its "
                                         "language model alone"):
        lm = models.load_model(tmp_path)
    assert type(lm).__name__ == "Gemma3ForCausalLM"
    for mine, theirs in zip(lm.model.parameters(), full.model.language_model.parameters(),
                            strict=True):
        assert torch.equal(mine, theirs)
    described = architectures.describe(lm)
    assert described["blocks"] == "2 x Gemma3DecoderLayer"
    assert described["adapter_targets"] == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj")


def test_a_multimodal_checkpoint_whose_language_model_is_elsewhere_is_refused(tmp_path):
    _multimodal_gemma3(tmp_path, lambda k: k.replace("language_model.model.", "text.model."))
    with pytest.raises(ValueError, match="language model did not load: .* weights missing"):
        models.load_model(tmp_path)
