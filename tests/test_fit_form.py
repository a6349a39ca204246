import pytest

from recipes_lib import allocator, fit_form


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("cfg")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256).save_pretrained(path)
    return str(path)


def test_the_verdict_is_the_measured_step_plus_the_modelled_overhead(config_dir):
    from recipes_lib import fake_memory, planner

    stack = fit_form.make_stack("lora", checkpointing=True)
    small = fit_form.verdict(config_dir, "0.5GiB", 128, 2, stack)  # the CUDA context alone
    peak = fake_memory.measure_step(config_dir, stack, 128, 2).peak_bytes
    assert small["need_bytes"] == peak + planner.gpu_overhead(peak)
    assert not small["fits"] and "does NOT fit" in small["text"]
    fits = fit_form.verdict(config_dir, "1GiB", 128, 2, stack)
    assert fits["fits"] and "in your trainer" not in small["text"]
    # where it fits, the text ends with the stack as a training script's settings
    assert fits["text"].endswith(fits["trainer_code"])
    # bf16-mixed: fp32 masters under autocast
    assert f"from_pretrained({config_dir!r}, dtype=torch.float32)" in fits["trainer_code"]
    assert "LoraConfig(r=16" in fits["trainer_code"]
    fig = fit_form.plot_verdict(small)
    assert fig.axes[0].get_ylabel() == "GiB at peak"


def test_the_verdict_can_replay_the_caching_allocator_instead_of_a_fixed_reserve(config_dir):
    from recipes_lib import planner

    stack = fit_form.make_stack("lora", checkpointing=True)
    fixed = fit_form.verdict(config_dir, "1GiB", 128, 2, stack)
    replayed = fit_form.verdict(config_dir, "1GiB", 128, 2, stack, replay=True)
    expected = planner.replayed_reserve(config_dir, stack, 128, 2, 2**30)
    assert replayed["report"].peak_bytes == fixed["report"].peak_bytes
    assert replayed["need_bytes"] == pytest.approx(expected["gpu_GiB"] * 2**30)
    assert replayed["fits"] and "allocator cache, replayed) of 1.0 GiB: fits" in replayed["text"]
    assert f"the smallest card it fits: {expected['needs_GiB']:.1f} GiB" in replayed["text"]
    assert not fit_form.verdict(config_dir, "0.5GiB", 128, 2, stack, replay=True)["fits"]
    with pytest.raises(ValueError, match="expandable_segments=True: .*replay=True"):
        fit_form.verdict(config_dir, "1GiB", 128, 2, stack, expandable_segments=True)


def test_the_verdict_on_a_mixture_of_experts_says_what_lora_does_to_its_experts(tmp_path):
    """The planner's note (planner.note_expert_adapters) under the form's verdict: LoRA adapts
    the experts whole, with the step measured again with adapters on the attention only."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=256).save_pretrained(tmp_path)
    stack = fit_form.make_stack("lora", checkpointing=False, precision="bf16")
    text = fit_form.verdict(str(tmp_path), "1GiB", 32, 1, stack)["text"]
    assert "\nnote: LoRA on 'all-linear' adapts this model's experts whole" in text
    assert "'LoRA r=16, bf16, adamw' row with adapters on the attention only" in text
    assert text.index("\nnote: ") < text.index("in your trainer")  # the settings stay last


def test_a_mixture_of_experts_under_the_forms_default_precision_is_measured_in_bf16(tmp_path):
    """The form's default, bf16-mixed, would keep a mixture of experts' experts in fp32, which
    transformers' grouped GEMM cannot multiply: the form measures the nearest stack, pure bf16,
    as plan --measure does, says so, and writes that stack's trainer settings."""
    from transformers import AutoConfig

    from recipes_lib.fake_memory import measure_step

    AutoConfig.for_model("qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=256).save_pretrained(tmp_path)
    asked = fit_form.make_stack("lora")  # bf16-mixed, checkpointing
    result = fit_form.verdict(str(tmp_path), "1GiB", 32, 1, asked)
    bf16 = fit_form.make_stack("lora", precision="bf16")
    assert result["text"].startswith(f"{tmp_path}, 32 x 1 tokens, {bf16.label}: ")
    assert f"; measured {bf16.label!r} instead of {asked.label!r}, the nearest stack" \
        in result["text"]
    assert result["report"].peak_bytes == measure_step(str(tmp_path), bf16, 32, 1).peak_bytes
    assert "dtype=torch.bfloat16" in result["trainer_code"]
    assert "bf16=True" not in result["trainer_code"]  # pure bf16, no autocast


def test_the_form_measures_on_click_and_shows_bad_input_as_an_error(config_dir):
    pytest.importorskip("ipywidgets")
    box = fit_form.form(config_dir, "1GiB", 64, 1)
    shown = box.run()  # replayed: the smallest card the run fits, then the trainer's lines
    assert ": fits\nnote: the smallest card it fits: " in shown and "\nin your trainer" in shown
    assert "; by allocator setting: default " in shown and ", max_split_size_mb:512 " in shown
    box.children[5].value = "bf16"  # precision
    assert ", bf16, adamw, checkpointing: " in box.run()
    box.children[9].value = True  # padded or packed rows
    assert ", checkpointing, attention mask (padded or packed rows): " in box.run()
    box.children[1].value = "T4"  # GPU memory: a card, its total; fp16 where it has no bf16
    shown = box.run()
    assert "of 15.0 GiB: fits" in shown and "fp16=True" in shown and "bf16=True" not in shown
    box.children[11].value = "expandable segments"  # the allocator setting replayed
    shown = box.run()
    assert "allocator cache, replayed with expandable segments) of 15.0 GiB: fits" in shown
    assert shown.endswith("\n# launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: "
                          "the replay assumed it")
    box.children[11].value = "expandable segments, roundup_power2_divisions:16 (axolotl)"
    shown = box.run()
    assert ("allocator cache, replayed with expandable segments, roundup_power2_divisions:16) "
            "of 15.0 GiB: fits") in shown
    assert shown.endswith("\n# launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,"
                          "roundup_power2_divisions:16: the replay assumed it")
    assert list(fit_form.LAUNCHES)[:len(allocator.SETTINGS)] == list(allocator.SETTINGS)
    box.children[1].value = "lots"
    assert box.run().startswith("error: gpu_mem='lots'")
    button = box.children[-2]  # disabled while it measures, clickable again after an error too
    assert not button.disabled and button.description == "Measure"


def test_an_unexpected_error_in_the_form_is_shown_not_lost_in_the_front_ends_log(
        config_dir, monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    box = fit_form.form(config_dir, "1GiB", 64, 1)

    def broken(*args, **kwargs):
        raise RuntimeError("something below the form broke")
    monkeypatch.setattr(fit_form, "verdict", broken)
    assert box.run() == "error: RuntimeError: something below the form broke"
    assert "Traceback" in capsys.readouterr().out  # headless, the output area is stdout
    assert not box.children[-2].disabled


def test_bad_toggles_name_the_field():
    with pytest.raises(ValueError, match="method='dora'"):
        fit_form.make_stack("dora")
    with pytest.raises(ValueError, match="chunked_loss=-1"):
        fit_form.make_stack(chunked_loss=-1)


def test_a_full_fine_tune_in_pure_bf16_on_a_card_without_bf16_says_what_to_train_instead(
        config_dir):
    """Pure 16-bit trainable weights under fp16's gradient scaler fail on a T4: the verdict
    measures the step as asked and, in place of the trainer's lines, says why and what instead."""
    stack = fit_form.make_stack("full", checkpointing=True, precision="bf16")
    result = fit_form.verdict(config_dir, "T4", 64, 1, stack)
    assert result["fits"]
    assert result["trainer_code"].startswith("# stack.precision='bf16': 16-bit trainable weights")
    assert result["text"].endswith(result["trainer_code"])
    mixed = fit_form.make_stack("full", checkpointing=True)  # bf16-mixed: fp32 weights
    assert "fp16=True" in fit_form.verdict(config_dir, "T4", 64, 1, mixed)["trainer_code"]
    assert "bf16=True" in fit_form.verdict(config_dir, "A100-40GB", 64, 1, mixed)["trainer_code"]
