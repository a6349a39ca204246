import json
import re
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from recipes_lib import calc, planner
from recipes_lib.__main__ import main


def test_published_figures():
    # ZeRO: 16 bytes/param for mixed-precision Adam; Llama-2-7B has 6.74 B parameters.
    assert calc.training_state_bytes(1, "bf16")["total"] == 16.0
    assert round(calc.param_count(calc.PRESETS["Llama-2-7B"])["total"] / 1e9, 2) == 6.74
    # bs 8 x seq 4096 x 256k vocab logits in bf16: 16.8 GB
    assert round(calc.logits_bytes(4096, 8, 256_000, 2) / 1e9, 1) == 16.8


def test_a_7b_qlora_fits_a_t4_and_its_full_fine_tune_does_not():
    result = planner.plan("Llama-2-7B", "16GB", seq_len=512, batch_size=1, grad_accum_steps=1)
    fits = {r["step"]: r["fits"] for r in result["rows"]}
    assert not fits["full fine-tune (bf16 + AdamW)"]
    assert fits["QLoRA (NF4 base)"]
    assert result["cheapest"] == "QLoRA (NF4 base)"


def test_an_8b_qlora_step_at_2048_tokens_needs_checkpointing_on_24gb():
    """Measured on fake tensors, QLoRA without checkpointing holds 30.3 GiB (35.3 on the GPU);
    Korthikanti's GPT layer predicted 17.9 GiB, 'fits', and a trainer run on its word would
    run out of memory. Counted op by op, the row does not fit, and the next one does."""
    result = planner.plan("Llama-3.1-8B", "24GB", 2048, 1)
    qlora = next(r for r in result["rows"] if r["step"] == "QLoRA (NF4 base)")
    assert result["layers_counted"] and not qlora["fits"] and qlora["total_GiB"] > 29
    assert result["cheapest"] == result["trainer"]["step"] == "+ activation checkpointing"


def test_a_sliding_window_model_from_its_window_on_says_how_its_mask_is_counted(tmp_path):
    """From the window's length on the sliding layers are counted with SDPA's mask (exact to the
    byte: tests/test_fake_memory.py), and the note says what checkpointing keeps beyond it."""
    from transformers import MistralConfig

    MistralConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, sliding_window=512,
                  max_position_embeddings=4096).save_pretrained(tmp_path)
    notes = {n: planner.plan(str(tmp_path), "8GB", n, 1)["notes"] for n in (511, 512, 1024)}
    assert not any("sliding window" in n for n in notes[511])
    for n in (512, 1024):  # transformers builds the mask from the window's own length
        assert any("sliding window's length (512 tokens) on" in n and "repeat_kv" in n
                   for n in notes[n])


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_checkpointed_layers_keep_the_sliding_window_mask_as_counted(tmp_path, arch):
    """Past its window a checkpointed step keeps SDPA's 1-byte mask as the layers' input, one
    for the batch (s^2 bytes at 2 x 512 tokens): what the window adds to the checkpointed
    rows, predicted and fake-measured, to the byte (here the loss is the peak, not the layer
    recomputed last)."""
    from transformers import Gemma3TextConfig, MistralConfig

    from recipes_lib import fake_memory

    sizes = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
             "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096}
    added = {}
    for window in (128, 1024):
        config = MistralConfig(num_hidden_layers=2, sliding_window=window, **sizes) \
            if arch == "mistral" else Gemma3TextConfig(
                num_hidden_layers=4, head_dim=64, sliding_window=window, **sizes,
                layer_types=["sliding_attention"] * 3 + ["full_attention"])
        config.save_pretrained(tmp_path / str(window))
        rows = planner.plan(str(tmp_path / str(window)), "8GB", 512, 2, grad_accum_steps=1)["rows"]
        row = next(r for r in rows if r["step"] == "+ activation checkpointing")
        stack = planner._measured_stack(row["step"], 1)
        added[window] = (row["total_GiB"] * 2**30,
                         fake_memory.measure_step(config, stack, 512, 2).peak_bytes)
    predicted, measured = (added[128][i] - added[1024][i] for i in (0, 1))
    assert predicted == measured == 512**2


def test_checkpointed_layers_keep_each_kind_of_layers_attention_mask_as_counted(tmp_path):
    """Padded or packed rows (``attention_mask``): a checkpointed step keeps one 1-byte mask a
    row for each kind of layer (Gemma-3: full and sliding, 2 x 2 x 512^2 at 2 x 512 tokens),
    where the window's broadcast mask alone was s^2: what the mask adds to the checkpointed row,
    predicted and fake-measured, to the byte."""
    from transformers import Gemma3TextConfig

    from recipes_lib import fake_memory

    config = Gemma3TextConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                              max_position_embeddings=4096, num_hidden_layers=4,
                              sliding_window=128,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"])
    config.save_pretrained(tmp_path)
    step = "+ activation checkpointing"
    added = {}
    for mask in (False, True):
        rows = planner.plan(str(tmp_path), "8GB", 512, 2, grad_accum_steps=1,
                            attention_mask=mask)["rows"]
        row = next(r for r in rows if r["step"] == step)
        stack = planner._measured_stack(step, 1, attention_mask=mask)
        assert stack.attention_mask is mask
        added[mask] = (row["total_GiB"] * 2**30,
                       fake_memory.measure_step(config, stack, 512, 2).peak_bytes)
    predicted, measured = (added[True][i] - added[False][i] for i in (0, 1))
    assert predicted == measured == (2 * 2 - 1) * 512**2


def test_the_cli_plans_masked_rows_and_says_what_the_masks_cost(capsys):
    """``--attention-mask``: every layer's masked attention counted (Llama-3.1-8B QLoRA, 4 x
    4096 tokens without checkpointing: 10 GiB more, its 32 layers' 16-bit mask copies and keys
    and values widened to every head), the note said, the trainer's lines naming it."""
    rows = {m: {r["step"]: r["total_GiB"] for r in planner.plan(
        "Llama-3.1-8B", "24GB", 4096, 4, attention_mask=m)["rows"]} for m in (False, True)}
    layers, tokens, q, kv = 32, 4 * 4096, 4096, 1024
    per_layer = 2 * 4096 * tokens + 2 * 2 * (q - kv) * tokens  # mask copy, repeated k and v
    assert rows[True]["QLoRA (NF4 base)"] - rows[False]["QLoRA (NF4 base)"] == pytest.approx(
        layers * per_layer / 2**30)
    assert main(["plan", "--model", "Llama-3.1-8B", "--gpu-mem", "24GB", "--seq", "4096",
                 "--batch", "4", "--attention-mask"]) == 0
    out = capsys.readouterr().out
    assert planner.MASKED_NOTE in out and "padding_free" in out.split("cheapest that fits:")[-1]
    with pytest.raises(TypeError, match="attention_mask='yes'"):
        planner.plan("Llama-3.1-8B", "24GB", 4096, 4, attention_mask="yes")


def test_gemma3_is_counted_op_by_op():
    """Gemma-3-1B (six norms a layer, five sliding layers in six): its layers counted, where
    Korthikanti's count put the full fine-tune with 8-bit AdamW on a 24 GB card (fake-measured:
    19.7 GiB, 23.1 with the GPU overhead; the count: 19.6)."""
    result = planner.plan("Gemma-3-1B", "24GB", 2048, 1)
    assert result["layers_counted"] and result["notes"][0] == planner.COUNTED_NOTE
    eight_bit = next(r for r in result["rows"] if "8-bit AdamW" in r["step"])
    assert not eight_bit["fits"] and 19.4 < eight_bit["total_GiB"] < 19.9


def test_more_gpus_make_fsdp_fit():
    one = planner.plan("Llama-3.1-8B", "80GB", 2048, 8, gpus=1)["rows"]
    eight = planner.plan("Llama-3.1-8B", "80GB", 2048, 8, gpus=8)["rows"]
    assert not one[-1]["fits"] and eight[-3]["fits"]
    # above one GPU, QLoRA with its NF4 base sharded too follows the full fine-tune's FSDP row,
    # then that with FSDP's CPU offload
    assert [r["step"] for r in one[-1:]] == ["full fine-tune, FSDP over 1 GPU + checkpointing"]
    assert [r["step"] for r in eight[-3:]] == [
        "full fine-tune, FSDP over 8 GPUs + checkpointing",
        "QLoRA, FSDP over 8 GPUs + checkpointing",
        "QLoRA, FSDP over 8 GPUs + checkpointing + CPU offload"]


def test_above_one_gpu_the_fsdp_qlora_rows_are_left_to_the_measurement_and_say_why():
    rows = planner.plan("Llama-2-70B", "24GB", 2048, 2, gpus=2)
    assert [r["step"] for r in rows["rows"][-2:]] == [
        "QLoRA, FSDP over 2 GPUs + checkpointing",
        "QLoRA, FSDP over 2 GPUs + checkpointing + CPU offload"]
    for last in rows["rows"][-2:]:
        assert last["total_GiB"] is None and last["fits"] is None
    assert planner.FSDP_QLORA_NOTE in rows["notes"] and rows["cheapest"] == "nothing fits"
    assert "QLoRA, FSDP over 2 GPUs + checkpointing" in planner.format_plan(rows)


def test_fsdp_row_plans_the_busiest_gpus_share_of_a_batch_the_gpus_do_not_divide(
        tmp_path, small_llama, monkeypatch):
    # 3 sequences over 2 GPUs: one GPU takes 2, and its peak decides whether the step fits
    from types import SimpleNamespace

    from recipes_lib import fake_memory

    small_llama.config.save_pretrained(tmp_path)
    calculated = {b: planner.plan(str(tmp_path), "1GB", 64, b, gpus=2)["rows"][-3]["total_GiB"]
                  for b in (2, 3, 4)}
    assert calculated[3] == calculated[4] > calculated[2]
    measured = []  # the batch each fake FSDP step is measured with (no step run here)
    monkeypatch.setattr(fake_memory, "measure_step", lambda model, stack, seq, batch: (
        measured.append((stack.fsdp_ranks, batch)) or SimpleNamespace(peak_bytes=1, host_bytes=0)))
    planner.plan(str(tmp_path), "1GB", 64, 3, gpus=2, measure=True)
    assert (2, 4) in measured and (1, 3) in measured  # FSDP: 2 ranks x 2; one GPU: the batch


def test_config_file_and_hub_style_names(tmp_path, small_llama):
    folder = tmp_path / "my-llama"
    small_llama.config.save_pretrained(folder)
    name, shape = planner.resolve_shape(str(folder))
    assert name == "my-llama" and shape.hidden_size == 64 and shape.num_hidden_layers == 2
    assert planner.resolve_shape(str(folder / "config.json"))[0] == "my-llama"
    small_llama.config.to_json_file(tmp_path / "llama-tiny.json")  # saved under its own name
    assert planner.resolve_shape(str(tmp_path / "llama-tiny.json")) == ("llama-tiny", shape)
    assert planner.resolve_shape("meta-llama/Llama-2-7B")[0] == "Llama-2-7B"


def test_a_fine_tuned_variants_hub_id_names_its_built_in_model(tmp_path, small_llama):
    for hub_id, name in [("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
                         ("meta-llama/Meta-Llama-3.1-70B-Instruct", "Llama-3.1-70B"),
                         ("meta-llama/Llama-2-7b-chat-hf", "Llama-2-7B"),
                         ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
                         ("google/gemma-2-9b-it", "Gemma-2-9B"),
                         ("google/gemma-3-1b-pt", "Gemma-3-1B"), ("microsoft/phi-4", "Phi-4"),
                         ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B-v0.3"),
                         ("mistralai/Mistral-7B-v0.1", "Mistral-7B"),
                         ("mistralai/Mistral-7B-Instruct-v0.2", "Mistral-7B"),
                         ("meta-llama/Llama-3.3-70B-Instruct", "Llama-3.1-70B"),
                         ("Qwen/Qwen3-14B-Base", "Qwen3-14B"),
                         ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B"),
                         ("google/gemma-2-27b-it", "Gemma-2-27B")]:
        assert planner.resolve_shape(hub_id) == (name, calc.preset_shape(name)), hub_id
    # v0.3's 32768 tokens, not the Mistral-7B preset's (v0.1) 32000
    assert calc.preset_shape("Mistral-7B-v0.3").vocab_size == 32768
    assert calc.find_preset("mistralai/Mistral-Nemo-Instruct-2407") is None
    # a folder of the user's own, named like a variant, is read, not replaced by the preset
    small_llama.config.save_pretrained(tmp_path / "Llama-2-7b-hf")
    name, shape = planner.resolve_shape(str(tmp_path / "Llama-2-7b-hf"))
    assert name == "Llama-2-7b-hf" and shape.hidden_size == 64
    with pytest.raises(ValueError, match=r"name='Qwen3-9B': not a built-in model \(Llama-3.2-1B"):
        calc.preset_shape("Qwen3-9B")


def test_any_other_hub_id_is_read_from_the_hub_or_its_cache(tmp_path, small_llama, monkeypatch):
    """huggingface_hub's own download, offline, on a cache laid out as it lays one out: what a
    config.json fetched once with a network (or by huggingface-cli download) gives later."""
    import huggingface_hub.constants

    from recipes_lib import fake_memory
    from recipes_lib import model as models

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny-llama"
    small_llama.config.save_pretrained(repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    name, shape = planner.resolve_shape("acme/tiny-llama")
    assert name == "tiny-llama" and (shape.hidden_size, shape.num_hidden_layers) == (64, 2)
    assert fake_memory.model_config("acme/tiny-llama").hidden_size == 64
    with pytest.raises(ValueError, match=r"^model='acme/other': no config.json from the hub "
                                         r"\(HF_HUB_OFFLINE=1, not cached: "
                                         r"LocalEntryNotFoundError: .*huggingface-cli download"):
        planner.resolve_shape("acme/other")
    with pytest.raises(ValueError, match="model='acme/other': no config.json from the hub"):
        fake_memory.model_config("acme/other")
    # not hub ids: a bare name, a missing .json file, a path; the caller's own error names them
    for not_an_id in ("tiny-llama", "configs/tiny.json", str(tmp_path / "nothing")):
        assert models.hub_config_file(not_an_id) is None


@pytest.mark.parametrize("name, card_billions, config_class", [
    ("Qwen3-0.6B", 0.6, "Qwen3Config"), ("Qwen3-8B", 8.2, "Qwen3Config"),
    ("Qwen3-4B", 4.0, "Qwen3Config"), ("Qwen3-14B", 14.8, "Qwen3Config"),
    ("Qwen3-32B", 32.8, "Qwen3Config"), ("Qwen2.5-72B", 72.7, "Qwen2Config"),
    ("Gemma-2-2B", 2.6, "Gemma2Config"), ("Gemma-2-9B", 9.24, "Gemma2Config"),
    ("Gemma-2-27B", 27.2, "Gemma2Config"),
    ("Gemma-3-1B", 1.0, "Gemma3TextConfig"), ("Mistral-7B-v0.3", 7.25, "MistralConfig"),
    ("Phi-3-mini-4k-instruct", 3.8, "Phi3Config"),
    ("Phi-4", 14.7, "Phi3Config")])
def test_a_built_in_config_counts_as_its_model_card_and_transformers_do(name, card_billions,
                                                                         config_class):
    """The parameter count each model card gives, to its digits; transformers' own model of the
    config, built on the meta device, agrees with the calculator (``check_counted``); the
    fake-tensor meter gets the architecture's config class, not a Llama stand-in. (Qwen3-4B,
    14B and 32B: 4.0, 14.8 and 32.8 B on their cards; Qwen2.5-72B: 72.7 B on its card, whose
    smaller siblings' cards, 14.7 and 32.5 B, disagree with their own config.json's 14.77 and
    32.76 B, so they are not built in; Gemma-2-27B: 27.2 B, the Gemma 2 report's 1.18 B embedding
    and 26.05 B other parameters, arXiv 2408.00118.)"""
    from recipes_lib import fake_memory

    total = calc.param_count(calc.preset_shape(name))["total"] / 1e9
    digits = len(str(card_billions).split(".")[1])
    assert round(total, digits) == card_billions, total
    calc.check_counted(calc.CONFIGS[name], name)
    assert type(fake_memory.model_config(name)).__name__ == config_class


@pytest.mark.parametrize("name, hub_id, config_class, billions, experts", [
    ("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", "Qwen3MoeConfig", 30.5, "num_experts=128"),
    ("gpt-oss-20b", "openai/gpt-oss-20b", "GptOssConfig", 20.9, "num_local_experts=32"),
    ("Mixtral-8x7B", "mistralai/Mixtral-8x7B-Instruct-v0.1", "MixtralConfig", 46.7,
     "num_local_experts=8")])
def test_the_built_in_mixtures_of_experts_count_as_their_model_cards_and_are_measured_only(
        name, hub_id, config_class, billions, experts):
    """Qwen3-30B-A3B: 30.5 B parameters on its card; gpt-oss-20b: 20.9 B (OpenAI's card, its
    experts in bf16 as fine-tuning loads them); Mixtral-8x7B: 46.7 B (Mistral AI's "Mixtral of
    experts" announcement, 2023-12-11; "47B" in arXiv 2401.04088, whose table gives its sizes),
    named by its Instruct repository. Each has its own config class; the formulas
    refuse them and say to measure (their fake steps: the tiny MoEs' tests in
    test_fake_memory.py)."""
    from recipes_lib import fake_memory

    config = fake_memory.model_config(hub_id)
    assert type(config).__name__ == config_class
    assert round(calc.built_param_count(config) / 1e9, 1) == billions
    with pytest.raises(calc.NotDescribedError) as refused:  # --measure's table is named by it
        planner.resolve_shape(hub_id)
    assert refused.value.model_name == name
    with pytest.raises(ValueError, match=rf"a mixture-of-experts model \({experts}\).*--measure"):
        planner.plan(name, "80GB", 2048, 1)


def test_every_built_in_name_has_the_repository_it_was_read_from():
    """The trainer code loads a repository: each built-in name's, which names it back."""
    assert set(calc.HUB_IDS) == set(calc.preset_names())
    for name, hub_id in calc.HUB_IDS.items():
        assert calc.find_preset(hub_id) == name, hub_id
        assert planner.script_model_id(name.upper()) == hub_id


def test_the_accumulation_row_takes_the_fewest_micro_batches_that_fit():
    """8 sequences of 4096 tokens: an 8 B QLoRA step fits 80 GB in 2 micro-batches; a 70 B one
    needs 8 (a fixed k=4 left it 'nothing fits'); where nothing fits, micro-batches of one."""
    def accumulation(result):
        return next(r for r in result["rows"] if r["step"].startswith("+ gradient accumulation"))
    eight_b = planner.plan("Llama-3.1-8B", "80GB", 4096, 8)
    assert accumulation(eight_b)["step"].endswith("(k=2)") and accumulation(eight_b)["fits"]
    seventy_b = planner.plan("Llama-3.1-70B", "80GB", 4096, 8)
    assert seventy_b["cheapest"] == "+ gradient accumulation (k=8)"
    assert seventy_b["grad_accum_steps"] == 8
    four = planner.plan("Llama-3.1-70B", "80GB", 4096, 8, grad_accum_steps=4)  # as asked
    assert four["cheapest"] == "nothing fits" and accumulation(four)["step"].endswith("(k=4)")
    assert accumulation(planner.plan("Llama-3.1-70B", "8GB", 4096, 8))["step"].endswith("(k=8)")
    # a batch that is already one sequence: k=1, the checkpointing row's own step
    assert accumulation(planner.plan("Llama-3.1-8B", "24GB", 2048, 1))["step"].endswith("(k=1)")


def test_the_clis_length_search_accumulates_as_its_plan_does(monkeypatch, capsys):
    searched = {}

    def search(model, gpu_mem, batch_size, grad_accum_steps, **kwargs):
        searched["k"] = grad_accum_steps
        return []
    monkeypatch.setattr(planner, "max_context_per_step", search)
    assert main(["plan", "--model", "Llama-3.1-70B", "--gpu-mem", "80GB", "--seq", "4096",
                 "--batch", "8", "--max-context"]) == 0
    assert searched["k"] == 8 and "+ gradient accumulation (k=8)" in capsys.readouterr().out


def test_the_clis_length_search_takes_the_cores_it_was_given(monkeypatch, capsys):
    import os

    from recipes_lib.__main__ import search_processes

    workers, bars = [], []
    monkeypatch.setattr(planner, "max_context_per_step",  # minutes for an 8 B: a progress bar
                        lambda *a, **kw: workers.append(kw["workers"])
                        or bars.append(kw["progress"]) or [])
    argv = ["plan", "--model", "Llama-3.1-8B", "--gpu-mem", "24GB", "--seq", "2048",
            "--max-context"]
    for given, expected in (("3", 3), ("1", 1), ("", os.cpu_count() or 1), ("x", os.cpu_count())):
        monkeypatch.setenv("OMP_NUM_THREADS", given)
        assert search_processes() == expected and main(argv) == 0
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert main(argv) == 0
    assert workers == [3, 1, os.cpu_count() or 1, os.cpu_count() or 1, os.cpu_count() or 1]
    assert bars == [True] * 5


def test_the_plan_ends_with_its_cheapest_step_in_a_trainers_settings(capsys):
    result = planner.plan("Llama-3.1-8B", "80GB", seq_len=4096, batch_size=8)
    trainer = result["trainer"]
    assert trainer["step"] == result["cheapest"] == "+ gradient accumulation (k=2)"
    assert trainer["settings"]["args"]["gradient_accumulation_steps"] == 2
    assert trainer["settings"]["args"]["per_device_train_batch_size"] == 4
    assert trainer["settings"]["quantization"]["bnb_4bit_quant_type"] == "nf4"
    assert "from_pretrained('meta-llama/Llama-3.1-8B'" in planner.format_plan(result)
    assert planner.plan("Llama-3.1-70B", "8GB", 4096, 8)["trainer"] is None  # nothing fits
    # the FSDP row wraps the architecture's own block class, read from the model built on meta
    fsdp = planner._trainer_settings("Qwen/Qwen3-8B", planner._fsdp_step(8), 8, 1, 8)
    assert fsdp["settings"]["args"]["fsdp_config"]["transformer_layer_cls_to_wrap"] == [
        "Qwen3DecoderLayer"]
    assert "from_pretrained('Qwen/Qwen3-8B'" in fsdp["code"]


def test_a_plan_for_a_gelu_new_model_says_the_one_op_gelu(tmp_path):
    """phi-1.5's config.json (gelu_new): the plan's trainer lines end with the note that
    hidden_act='gelu_pytorch_tanh' computes the same GELU in one op; a Llama's do not."""
    from recipes_lib import published, trainers

    (tmp_path / "config.json").write_text(json.dumps(published.PHI_1_5_HUB))
    code = planner.plan(str(tmp_path), "24GB", seq_len=1024, batch_size=1)["trainer"]["code"]
    assert code.endswith(f"# {trainers.GELU_NEW_NOTE}")
    assert "gelu" not in planner.plan("Llama-3.1-8B", "80GB", 4096, 8)["trainer"]["code"]


def test_the_cli_plans_a_built_in_gemma_by_its_hub_id(capsys):
    assert main(["plan", "--model", "google/gemma-2-9b-it", "--gpu-mem", "24GB", "--seq",
                 "2048", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "Gemma-2-9B" in out and "runs eager attention" in out
    assert planner.COUNTED_NOTE in out  # its layers counted op by op (gemma2=True)


def test_parse_bytes():
    assert planner.parse_bytes("16GB") == 16e9
    assert planner.parse_bytes("24GiB") == planner.parse_bytes("24") == 24 * 2**30
    for bad in ("-3", "0GB", "lots", "16 parsecs"):
        with pytest.raises(ValueError, match="gpu_mem="):
            planner.parse_bytes(bad)


def test_bad_models(tmp_path):
    with pytest.raises(ValueError, match="model='nope': not a built-in model"):
        planner.resolve_shape("nope")
    (tmp_path / "config.json").write_text("not json")
    with pytest.raises(ValueError, match="not a JSON config"):
        planner.resolve_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="not a decoder config"):
        planner.resolve_shape(str(tmp_path))
    with pytest.raises(ValueError, match="batch_size=0"):
        planner.plan("Llama-2-7B", "16GB", batch_size=0)
    # a hybrid: Qwen3.5's linear-attention layers are not what the formulas count (0.92x of
    # Qwen3.5's 9 B at its defaults): refused, pointing to the fake-tensor measurement
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_5_text").save_pretrained(tmp_path / "qwen3.5")
    with pytest.raises(ValueError, match=r"^model='.*qwen3.5': the calculator counts 8.209 B "
                                         r".*'qwen3_5_text' config, transformers' model has "
                                         r"8.954 B \(0.92x\).*fake_memory.measure_step"):
        planner.plan(str(tmp_path / "qwen3.5"), "24GB")


def test_a_sequence_beyond_the_models_positions_is_refused_with_how_to_extend_them(tmp_path):
    """The formulas would plan any length; the planner refuses, as the fake-tensor meter does,
    one beyond the positions the model was trained on: a preset's (Llama-2's 4096, recorded
    with the preset), a built-in config's (Phi-3-mini-4k's) and a config.json's."""
    from recipes_lib import fake_memory

    beyond = r"^seq_len=8192: beyond the model's max_position_embeddings=4096\. RoPE .*linear"
    for model in ("Llama-2-7B", "meta-llama/Llama-2-7b-chat-hf", "Phi-3-mini-4k-instruct"):
        with pytest.raises(ValueError, match=beyond):
            planner.plan(model, "80GB", seq_len=8192, batch_size=1)
        with pytest.raises(ValueError, match=beyond):
            fake_memory.measure_step(model, fake_memory.Stack(method="qlora"), 8192, 1)
    assert planner.plan("Llama-2-7B", "80GB", seq_len=4096, batch_size=1)["rows"]
    raised = {**calc.CONFIGS["Phi-3-mini-4k-instruct"], "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(raised))
    assert planner.resolve_shape(str(tmp_path))[1].max_position_embeddings == 8192
    assert planner.plan(str(tmp_path), "80GB", seq_len=8192, batch_size=1)["rows"]
    assert calc.preset_shape("Qwen2.5-7B").max_position_embeddings is None  # not recorded
    assert planner.plan("Qwen2.5-7B", "80GB", seq_len=65536, batch_size=1)["rows"]


def test_cli(capsys):
    assert main(["plan", "--model", "Llama-2-7B", "--gpu-mem", "16GB", "--seq", "512",
                 "--batch", "1"]) == 0
    assert "cheapest that fits:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "Llama-2-7B", "--gpu-mem", "-1"])
    assert "gpu_mem='-1'" in capsys.readouterr().err


def test_8bit_adamw_row_saves_three_quarters_of_the_moments():
    rows = {r["step"]: r for r in planner.plan("Llama-2-7B", "80GB", 512, 1)["rows"]}
    full, eight = rows["full fine-tune (bf16 + AdamW)"], rows["full fine-tune, 8-bit AdamW states"]
    n = calc.param_count(calc.PRESETS["Llama-2-7B"])["total"]
    saved = (full["state_GiB"] - eight["state_GiB"]) * 2**30
    assert abs(saved - n * (8 - 2 - 8 / 256)) / saved < 1e-9
    assert eight["activations_GiB"] == full["activations_GiB"]


def test_a_row_without_checkpointing_peaks_where_the_kv_cache_is_largest():
    """Llama-2-7B QLoRA at 2 x 1024 tokens: the forward's end, with 2 GiB of fp32 keys and
    values in transformers' KV cache and the bf16 logits, holds more than the loss's three fp32
    copies of a 32000-token vocabulary (measured on fake tensors: 23.45 GiB; 22.16 predicted
    without the cache, 23.55 with it)."""
    from recipes_lib import fake_memory
    from recipes_lib.fake_memory import Stack

    rows = {r["step"]: r for r in planner.plan("Llama-2-7B", "80GB", 1024, 2)["rows"]}
    s = calc.PRESETS["Llama-2-7B"]
    stack = Stack(method="qlora", precision="bf16-mixed")
    cached = fake_memory.counted_layer_bytes("Llama-2-7B", stack, 1024, 2, with_cache=True)
    head = 2 * s.vocab_size * s.hidden_size
    forward_end = s.num_hidden_layers * cached + 2 * 2048 * s.vocab_size + head
    assert rows["QLoRA (NF4 base)"]["activations_GiB"] * 2**30 == pytest.approx(forward_end)
    assert forward_end - s.num_hidden_layers * fake_memory.counted_layer_bytes(
        "Llama-2-7B", stack, 1024, 2) > 2 * 2**30


def test_gemma2_is_counted_with_its_masks_under_checkpointing():
    """Gemma-2 is counted op by op (no sliding-window note: eager attention always has its
    masks), and its checkpointed rows keep the two additive masks (full and sliding layers) as
    the layers' inputs: 2 x 8192^2 fp32 values at 8192 tokens, QLoRA's fp32 embeddings."""
    plans = {n: planner.plan("Gemma-2-2B", "80GB", n, 1) for n in (4096, 8192)}
    for result in plans.values():
        assert result["layers_counted"] and result["notes"][0] == planner.COUNTED_NOTE
        assert not any("sliding window" in n for n in result["notes"])
        assert any("four norms and soft-capped logits" in n for n in result["notes"])
    ckpt = {n: next(r for r in p["rows"] if r["step"] == "+ activation checkpointing")
            for n, p in plans.items()}
    shape = calc.ModelShape.from_config(calc.CONFIGS["Gemma-2-2B"])
    layer = {n: shape.num_hidden_layers * 4 * shape.hidden_size * n for n in plans}
    grown = (ckpt[8192]["activations_GiB"] - ckpt[4096]["activations_GiB"]) * 2**30
    assert grown > layer[8192] - layer[4096] + 2 * 4 * (8192**2 - 4096**2)


def test_measure_puts_a_fake_measurement_or_its_reason_beside_each_row(tmp_path, capsys):
    """A Llama config wide enough for its layers and logits to outweigh a step's odd bytes:
    each single-GPU row's prediction, its layers counted op by op, within 5 % of the
    measured peak (Korthikanti's 34 sbh left the LoRA rows 0.55-0.7x on Llama-3.1-8B)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=512).save_pretrained(tmp_path)
    result = planner.plan(str(tmp_path), "1GB", seq_len=256, batch_size=4, grad_accum_steps=2,
                          measure=True, gpus=2, progress=True)
    assert "fake-tensor steps, one a row" in capsys.readouterr().err  # what the CLI shows
    assert result["layers_counted"] and result["notes"][0] == planner.COUNTED_NOTE
    for r in result["rows"][:-3]:  # the full fine-tune's FSDP row keeps Korthikanti's count
        assert r["total_GiB"] / r["measured_GiB"] == pytest.approx(1, abs=0.05), r
    sharded_qlora = result["rows"][-2]  # torchao's NF4 under FSDP2, as notebook 02 runs it,
    # dequantized as the trainer lines' bitsandbytes kernel does (its output alone)
    assert sharded_qlora["total_GiB"] is None and sharded_qlora["measured_GiB"] > 0
    assert sharded_qlora["measured_stack"] == ("QLoRA (torchao NF4) r=16, bf16-mixed, adamw, "
                                               "checkpointing, FSDP over 2 ranks, NF4 "
                                               "dequantized in chunks")
    assert planner.FSDP_QLORA_NOTE not in result["notes"]  # measured: nothing left blank
    measured = [r for r in result["rows"] if "measured_GiB" in r]
    assert [r["step"] for r in measured] == [
        "full fine-tune (bf16 + AdamW)", "full fine-tune, 8-bit AdamW states",
        "LoRA on a bf16 base", "QLoRA (NF4 base)", "+ activation checkpointing",
        "+ gradient accumulation (k=2)", "+ CPU offload of optimizer states",
        "full fine-tune, FSDP over 2 GPUs + checkpointing",
        "QLoRA, FSDP over 2 GPUs + checkpointing",
        "QLoRA, FSDP over 2 GPUs + checkpointing + CPU offload"]
    assert len(measured) == len(result["rows"])
    offload = measured[-4]
    assert offload["host_GiB"] > 0 and offload["measured_GiB"] < measured[-5]["measured_GiB"]
    # FSDP's CPU offload: the shards, their gradients and optimizer states in CPU RAM
    sharded_offload = measured[-1]
    assert sharded_offload["measured_stack"] == sharded_qlora["measured_stack"] + (
        ", FSDP's CPU offload")
    assert sharded_offload["host_GiB"] > 0 == sharded_qlora["host_GiB"]
    assert sharded_offload["measured_GiB"] < sharded_qlora["measured_GiB"]
    assert "QLoRA" in measured[4]["measured_stack"]  # builds on the QLoRA row, as calc does
    for r in measured:
        assert r["gpu_GiB"] * 2**30 == pytest.approx(
            r["measured_GiB"] * 2**30 + planner.gpu_overhead(r["measured_GiB"] * 2**30))
    assert result["cheapest_measured"] == "full fine-tune (bf16 + AdamW)"
    assert "chunked_loss" not in result  # 4 x 256 tokens: one chunk of the chunked loss
    impls = measured[0]["adamw_GiB"]
    assert list(impls) == ["for-loop (as measured)", "foreach", "fused"]
    assert impls["foreach"] >= impls["for-loop (as measured)"] == measured[0]["measured_GiB"]
    assert impls["fused"] <= impls["for-loop (as measured)"]
    text = planner.format_plan(result)
    assert "measured on fake tensors" in text and "G foreach" in text and "G fused" in text
    # the AdamW note belongs to the measured table, before the trainer's lines and without them
    assert text.index("G foreach") < text.index("in your trainer")
    assert "G foreach" in planner.format_plan({**result, "trainer": None})


def test_the_cli_says_when_no_length_fits(tmp_path, small_llama, capsys):
    small_llama.config.max_position_embeddings = 512  # two of the CLI's 256-token steps
    small_llama.config.save_pretrained(tmp_path)  # 0.4 GiB: under the CUDA context alone
    assert main(["plan", "--model", str(tmp_path), "--gpu-mem", "0.4GiB", "--seq", "64",
                 "--batch", "1", "--max-context"]) == 0
    out = capsys.readouterr().out.split("longest sequence that fits")[1]
    assert re.search(r"QLoRA \(NF4 base\) +nothing fits: 256 tokens need 0\.\d GiB on the GPU",
                     out), out
    assert " 0 tokens" not in out


def test_max_context_is_the_longest_measured_length_within_the_budget(tmp_path, small_llama):
    from recipes_lib import fake_memory

    small_llama.config.save_pretrained(tmp_path)
    stack = fake_memory.Stack(precision="fp32")

    def need(s):
        peak = fake_memory.measure_step(str(tmp_path), stack, s, 1).peak_bytes
        return peak + planner.gpu_overhead(peak)
    found = planner.max_context(str(tmp_path), f"{need(64):.0f}B", stack, step=16)
    assert 64 <= found["max_seq_len"] < 128
    assert need(found["max_seq_len"]) <= need(64) < need(found["max_seq_len"] + 16)
    assert planner.max_context(str(tmp_path), "0.4GiB", stack, step=16)["max_seq_len"] == 0
    with pytest.raises(ValueError, match=r"^step=256: .* up to the longest length tried, 128 "
                                         r"\(the model's positions\)"):
        planner.max_context(str(tmp_path), "1GiB", stack)


def test_a_replayed_longest_context_search_judges_each_length_by_the_smallest_card(
        tmp_path, small_llama):
    """With replay, a length's need is the smallest card its run's replay fits
    (allocator.min_capacity) plus the CUDA context: the length found fits the budget so, and
    one step more does not."""
    from recipes_lib import allocator, fake_memory

    small_llama.config.save_pretrained(tmp_path)
    stack, model = fake_memory.Stack(precision="fp32"), str(tmp_path)

    def need(n, expandable=False, mss=None):
        events = fake_memory.allocation_trace(model, stack, n, 1)
        return planner.CUDA_CONTEXT_BYTES + allocator.min_capacity(events, expandable,
                                                                   max_split_size_mb=mss)
    budget = need(64)  # a 32-token step: fewer runs traced
    keys = []
    for expandable, mss in ((False, None), (True, None), (False, 20)):
        found = planner.max_context(model, f"{budget}B", stack, step=32, replay=True,
                                    expandable_segments=expandable, max_split_size_mb=mss,
                                    memo=lambda key, measure: keys.append(key) or measure())
        n, tries = found["max_seq_len"], dict(found["tries"])
        assert found["replayed"] and found["expandable_segments"] is expandable
        assert found["max_split_size_mb"] == mss
        assert tries[n] * 2**30 <= budget < tries[n + 32] * 2**30, expandable
        assert found["gpu_GiB"] == tries[n] and found["host_GiB"] == 0
        if not expandable:  # the search's figure is the need above
            assert tries[n] == need(n, mss=mss) / 2**30
        if expandable:
            assert keys[-1].endswith("expandable_segments=True")
    assert keys[0].startswith(f"replayed run: {model!r}, {stack!r}, 1 x ")
    assert keys[0].endswith("expandable_segments=False")  # unset: the key it always had
    assert keys[-1].endswith("expandable_segments=False, max_split_size_mb=20")
    with pytest.raises(ValueError, match=r"expandable_segments=True: .*replay=True"):
        planner.max_context(model, "1GiB", stack, step=16, expandable_segments=True)
    with pytest.raises(ValueError, match=r"max_split_size_mb=128: .*replay=True"):
        planner.max_context(model, "1GiB", stack, step=16, max_split_size_mb=128)


def test_the_clis_replay_reaches_the_length_search_and_says_what_it_needs(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(planner, "max_context_per_step",
                        lambda *a, **kw: calls.append(kw) or [])
    argv = ["plan", "--model", "Llama-3.1-8B", "--gpu-mem", "24GB", "--seq", "2048"]
    assert main([*argv, "--max-context", "--replay-allocator", "--expandable-segments"]) == 0
    assert calls[0]["replay"] and calls[0]["expandable_segments"]
    assert "judged by their runs replayed through the caching allocator with expandable " \
        "segments" in capsys.readouterr().out
    assert main([*argv, "--max-context", "--replay-allocator", "--max-split-size-mb", "128"]) == 0
    assert calls[1]["max_split_size_mb"] == 128 and not calls[1]["expandable_segments"]
    assert "caching allocator with max_split_size_mb:128" in capsys.readouterr().out
    # a launch's own value: what it sets that the replay models, the rest changing nothing
    conf = "garbage_collection_threshold:0.6,max_split_size_mb:512"
    assert main([*argv, "--max-context", "--replay-allocator", "--alloc-conf", conf]) == 0
    assert calls[2]["max_split_size_mb"] == 512 and not calls[2]["expandable_segments"]
    assert "caching allocator with max_split_size_mb:512" in capsys.readouterr().out
    # axolotl's: expandable segments, requests rounded to 16 steps a power of two
    conf = "expandable_segments:True,roundup_power2_divisions:16"
    assert main([*argv, "--max-context", "--replay-allocator", "--alloc-conf", conf]) == 0
    assert calls[3]["roundup_power2_divisions"] == 16 and calls[3]["expandable_segments"]
    assert ("caching allocator with expandable segments, roundup_power2_divisions:16"
            in capsys.readouterr().out)
    replayed = ["--max-context", "--replay-allocator"]
    for bad, why in ((["--replay-allocator"], "add --measure or --max-context"),
                     (["--max-context", "--expandable-segments"], "add --replay-allocator"),
                     (["--max-context", "--max-split-size-mb", "128"], "add --replay-allocator"),
                     ([*replayed, "--max-split-size-mb", "19"], "max_split_size_mb=19: a whole"),
                     ([*replayed, "--max-split-size-mb", "64", "--alloc-conf", ""], "not both"),
                     (["--max-context", "--alloc-conf", "expandable_segments:True"],
                      "add --replay-allocator"),
                     ([*replayed, "--alloc-conf",
                       "max_split_size_mb:128,max_non_split_rounding_mb:40"],
                      ("--alloc-conf: conf='max_split_size_mb:128,max_non_split_rounding_mb:"
                       "40': max_non_split_rounding_mb:40 with max_split_size_mb lets")),
                     ([*replayed, "--alloc-conf", "roundup_power2_divisions:3"],
                      "roundup_power2_divisions:3 does not parse"),
                     ([*replayed, "--alloc-conf", "", "--expandable-segments"], "not both")):
        with pytest.raises(SystemExit):
            main([*argv, *bad])
        assert why in capsys.readouterr().err


def test_a_stopped_longest_context_search_keeps_each_length_it_measured(tmp_path, small_llama,
                                                                        monkeypatch):
    """make bench keeps a search's measurements one length at a time (results.Progress), so a
    search stopped part-way resumes from the lengths it measured."""
    from recipes_lib import fake_memory

    small_llama.config.save_pretrained(tmp_path)
    stack = fake_memory.Stack(precision="fp32")
    kept = {}

    def memo(key, measure):
        if key not in kept:
            kept[key] = measure()
        return kept[key]

    first = planner.max_context(str(tmp_path), "1GiB", stack, step=16, memo=memo)
    assert len(kept) == len(first["tries"]) >= 2
    assert all(k.startswith(f"fake step: {str(tmp_path)!r}, {stack!r}, 1 x ") for k in kept)

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(fake_memory, "step_meter", lambda *a, **k: refuse)
    assert planner.max_context(str(tmp_path), "1GiB", stack, step=16, memo=memo) == first


def test_max_context_per_step_searches_each_measured_stack_once(tmp_path, small_llama,
                                                                 monkeypatch, capsys):
    small_llama.config.save_pretrained(tmp_path)
    searched = []
    real = planner.max_context

    def counting(model, gpu_mem, stack, batch_size, step, **kwargs):
        searched.append(stack)
        return real(model, gpu_mem, stack, batch_size, step=step, **kwargs)
    monkeypatch.setattr(planner, "max_context", counting)
    rows = planner.max_context_per_step(str(tmp_path), "0.6GiB", batch_size=1, step=16)
    by_step = {r["step"]: r for r in rows}
    assert by_step["full fine-tune, FSDP over 1 GPU + checkpointing"]["measured_stack"] \
        .startswith("not measured")
    # with batch 1, accumulation k=1 is the checkpointing row's stack: searched once
    assert by_step["+ gradient accumulation (k=1)"] is not by_step["+ activation checkpointing"]
    assert by_step["+ gradient accumulation (k=1)"]["tries"] is \
        by_step["+ activation checkpointing"]["tries"]
    assert len(searched) == len(set(searched)) == 6  # 8 rows, FSDP not measured, k=1 shared
    lengths = [r["max_seq_len"] for r in rows if "tries" in r]
    assert all(0 <= n <= small_llama.config.max_position_embeddings for n in lengths)
    # the same searches in two spawned processes (the command line's, one per core)
    assert planner.max_context_per_step(str(tmp_path), "0.6GiB", batch_size=1, step=16,
                                        workers=2, progress=True) == rows
    assert "longest-context searches" in capsys.readouterr().err


def test_max_context_per_step_searches_the_sharded_rows_above_one_gpu(tmp_path, monkeypatch,
                                                                       capsys):
    """Above one GPU the search covers the plan's FSDP rows too: the full fine-tune's, and
    FSDP + QLoRA without and with FSDP's CPU offload (its shards, gradients and optimizer
    states in CPU RAM, reported beside the GPU's figure). The single-GPU rows' searches are
    tested above; here they are stubbed."""
    from transformers import LlamaConfig

    # NF4's blocks (64 weights x 256 scales) split over 2 ranks: 2 x 16,384 weights a matrix
    LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128).save_pretrained(tmp_path)
    real = planner.max_context

    def sharded_only(model, gpu_mem, stack, batch_size, step, **kwargs):
        if stack.fsdp_ranks == 1:
            return {"max_seq_len": 0, "gpu_GiB": 0.0, "host_GiB": 0.0, "tries": []}
        return real(model, gpu_mem, stack, batch_size, step=step)
    monkeypatch.setattr(planner, "max_context", sharded_only)
    rows = planner.max_context_per_step(str(tmp_path), "0.6GiB", batch_size=2, gpus=2, step=64)
    plan_rows = planner.plan(str(tmp_path), "0.6GiB", 128, 2, gpus=2)["rows"]
    assert [r["step"] for r in rows] == [r["step"] for r in plan_rows]
    full, qlora, offload = rows[-3:]
    assert offload["step"] == "QLoRA, FSDP over 2 GPUs + checkpointing + CPU offload"
    assert offload["stack"].endswith(", FSDP's CPU offload")
    assert all(r["max_seq_len"] == 128 for r in (full, qlora, offload))  # all fit 0.6 GiB
    assert full["host_GiB"] == qlora["host_GiB"] == 0 < offload["host_GiB"]
    assert offload["gpu_GiB"] < qlora["gpu_GiB"] < full["gpu_GiB"]
    # the command line prints the CPU RAM beside the GPU's figure
    monkeypatch.setattr(planner, "max_context_per_step", lambda *a, **k: rows)
    assert main(["plan", "--model", str(tmp_path), "--gpu-mem", "0.6GiB", "--seq", "128",
                 "--batch", "2", "--gpus", "2", "--max-context"]) == 0
    out = capsys.readouterr().out.split("longest sequence that fits")[1]
    assert re.search(r"\+ CPU offload +128 tokens, +0\.\d GiB on the GPU \+ 0\.\d+ GiB of "
                     r"CPU RAM \(the longest length tried: the model's positions\)\n", out), out
    assert all(r["limit"] == 128 for r in rows[-3:])


def test_a_plan_says_what_the_losss_logits_take_where_they_are_most_of_the_activations():
    """Gemma-2-2B's 256,000-entry vocabulary at 4096 tokens: the logits, three fp32 copies
    (3 x 4096 x 256,000 x 4 bytes, 11.7 GiB), are most of the checkpointed row's activations,
    which do not fit 24 GB; Llama-2-7B's 32,000 entries are not, and get no note."""
    result = planner.plan("Gemma-2-2B", "24GB", seq_len=4096, batch_size=1, grad_accum_steps=1)
    row = next(r for r in result["rows"] if r["step"] == "+ activation checkpointing")
    [note] = [n for n in result["notes"] if n.startswith(planner.LOGITS_NOTE_START)]
    logits = 3 * 4096 * 256_000 * 4
    assert logits >= planner.LOGITS_NOTE_SHARE * row["activations_GiB"] * 2**30
    assert (f"are {logits / 2**30:.3g} GiB of the checkpointed row's "
            f"{row['activations_GiB']:.3g} GiB of activations") in note
    assert "use_liger_kernel=True" in note and result["cheapest"] == "nothing fits"
    llama = planner.plan("Llama-2-7B", "24GB", seq_len=4096, batch_size=1, grad_accum_steps=1)
    assert not any(n.startswith(planner.LOGITS_NOTE_START) for n in llama["notes"])


def test_a_measured_plan_measures_the_checkpointed_row_again_with_a_chunked_loss(tmp_path):
    """Where the logits are most of the checkpointed row's activations, its stack is measured
    again with 1024-token chunks (2 chunks of a 2 x 1024-token step here): the figure a
    fake-tensor step of that stack gives, said at the end of the note; where no row fits and it
    does, the trainer's settings are its. (A step of one chunk: test_measure_puts_a_fake_...)"""
    from transformers import LlamaConfig

    from recipes_lib import fake_memory

    LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024).save_pretrained(tmp_path)
    out = planner.plan(str(tmp_path), "0.9GiB", seq_len=1024, batch_size=2, grad_accum_steps=1,
                       measure=True)
    row = next(r for r in out["rows"] if r["step"] == "+ activation checkpointing")
    stack = replace(planner._measured_stack(row["step"], 1), chunked_loss=planner.LOGITS_CHUNK)
    chunked = out["chunked_loss"]
    assert chunked["measured_GiB"] * 2**30 == fake_memory.measure_step(
        str(tmp_path), stack, 1024, 2).peak_bytes
    assert chunked["measured_stack"] == stack.label == row["measured_stack"] + ", chunked CE (1024)"
    assert chunked["measured_fits"] and not row["measured_fits"]
    assert out["cheapest_measured"] == "nothing measured fits"
    [note] = [n for n in out["notes"] if n.startswith(planner.LOGITS_NOTE_START)]
    assert note.endswith(f"that row needs {chunked['gpu_GiB']:.3g} GiB on the GPU against "
                         f"{row['gpu_GiB']:.3g} without them: fits")
    trainer = out["trainer"]
    assert trainer["step"] == "+ activation checkpointing, a chunked loss (1024-token chunks)"
    assert "use_liger_kernel=True" in trainer["code"]
    assert "in your trainer (+ activation checkpointing, a chunked loss" in planner.format_plan(out)


def test_a_gemma2_config_json_is_read_as_transformers_reads_it(tmp_path):
    """A Gemma-2 config.json leaves out tie_word_embeddings (True in Gemma2Config) and its
    layer types; transformers has no SDPA for it, so the plan counts eager attention's scores
    (8 bytes each, in the layer's op-by-op count) and says so."""
    fields = calc.CONFIGS["Gemma-2-9B"]  # google/gemma-2-9b's config.json
    assert "tie_word_embeddings" not in fields
    (tmp_path / "config.json").write_text(json.dumps(fields))
    _, shape = planner.resolve_shape(str(tmp_path))
    assert shape == calc.preset_shape("Gemma-2-9B")
    assert shape.tie_word_embeddings and shape.sliding_layers == 21 and shape.score_bytes == 8
    assert round(calc.param_count(shape)["total"] / 1e9, 2) == 9.24  # Gemma-2-9B's published
    result = planner.plan(str(tmp_path), "24GB", seq_len=2048, batch_size=1, grad_accum_steps=1)
    assert result["layers_counted"]
    scores = 42 * 8 * 16 * 2048**2  # every layer's, without checkpointing
    assert result["rows"][0]["activations_GiB"] * 2**30 > scores
    per_token = {s: calc.llama_layer_bytes(shape, s, 1, "full", "bf16-mixed",
                                           gemma2=True)["per_token"] for s in (1024, 2048)}
    assert per_token[2048] - per_token[1024] == 8 * 16 * 1024
    assert "runs eager attention, which keeps 8 bytes per score" in planner.format_plan(result)


def test_a_multimodal_config_plans_and_measures_its_language_model(tmp_path):
    """Gemma-3 4B and up, Mistral-3, Qwen2.5-VL: the decoder's sizes sit in text_config, and
    the top level alone read as 'not a decoder config'."""
    from recipes_lib import fake_memory

    text = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text, "vision_config": vision}))
    _, shape = planner.resolve_shape(str(tmp_path))
    assert (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size) == (64, 2, 512)
    assert shape.tie_word_embeddings  # Gemma3TextConfig's default
    result = planner.plan(str(tmp_path), "1GB", seq_len=64, batch_size=1)
    assert "multimodal checkpoint: planned and measured is its language model" in \
        planner.format_plan(result)
    report = fake_memory.measure_step(str(tmp_path), fake_memory.Stack(precision="fp32"), 64, 1)
    from transformers import AutoConfig, AutoModelForCausalLM

    decoder = AutoModelForCausalLM.from_config(AutoConfig.for_model(**text))
    assert type(decoder).__name__ == "Gemma3ForCausalLM"  # no vision tower
    assert report.by_category["parameters"] == 4 * sum(p.numel() for p in decoder.parameters())


def test_the_calculators_verdict_counts_the_gpu_overhead_a_measured_trace_gets():
    """Llama-2-7B's QLoRA row needs its total plus the CUDA context and the allocator's
    reserve: a card between the two does not fit it, as a measured trace of it would not."""
    rows = planner.plan("Llama-2-7B", "80GB", 512, 1, grad_accum_steps=1)["rows"]
    qlora = next(r for r in rows if r["step"] == "QLoRA (NF4 base)")
    total = qlora["total_GiB"] * 2**30
    assert qlora["total_gpu_GiB"] * 2**30 == pytest.approx(total + planner.gpu_overhead(total))
    between = (total + total + planner.gpu_overhead(total)) / 2 / 2**30  # a bare number: GiB
    row = next(r for r in planner.plan("Llama-2-7B", between, 512, 1, grad_accum_steps=1)["rows"]
               if r["step"] == "QLoRA (NF4 base)")
    assert not row["fits"]
    assert "on GPU: the total plus the modelled overhead" in planner.format_plan(
        planner.plan("Llama-2-7B", "80GB", 512, 1))


def test_an_architecture_the_formulas_miscount_is_planned_by_measurement_only(tmp_path,
                                                                              monkeypatch):
    """A hybrid (Qwen3.5's linear-attention layers): no formula figure, every row measured, the
    count from transformers' model; the per-step context search runs too. (A hybrid's fake step
    equals its real one: tests/test_fake_memory.py; here the measurement is a stand-in, a
    Qwen3.5 fake step takes ~3 s.)"""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from recipes_lib import fake_memory

    AutoConfig.for_model("qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512).save_pretrained(tmp_path)
    measured = []
    monkeypatch.setattr(fake_memory, "measure_step", lambda model, stack, *a: measured.append(
        stack) or SimpleNamespace(peak_bytes=2**28, host_bytes=0, by_category={"activations": 0}))
    monkeypatch.setattr(planner, "max_context", lambda model, gpu, stack, *a, **kw: {
        "max_seq_len": 256, "gpu_GiB": 0.5, "tries": [(256, 0.5)], "stack": stack.label})
    with pytest.raises(ValueError, match=r"'qwen3_5_text' config.*--measure"):
        planner.plan(str(tmp_path), "1GiB", 64, 1)
    out = planner.plan(str(tmp_path), "1GiB", 64, 1, measure=True)
    assert all(r["total_GiB"] is None and r["fits"] is None for r in out["rows"])
    assert len([r for r in out["rows"] if "measured_GiB" in r]) >= 5 and len(measured) >= 7
    assert out["cheapest"].startswith("not predicted")
    assert out["cheapest_measured"] == out["rows"][0]["step"]
    assert out["notes"][0].startswith("not predicted, measured only: model=")
    with torch.device("meta"):  # transformers' count, not the formulas'
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert out["params_B"] * 1e9 == sum(p.numel() for p in built.parameters())
    text = planner.format_plan(out)
    assert "measured on fake tensors" in text and "not predicted: the formulas" in text
    rows = planner.max_context_per_step(str(tmp_path), "1GiB")
    assert [r["step"] for r in rows] == [r["step"] for r in out["rows"]]
    # Gemma-4: layers of two head widths, which no one shape describes; named as the planner
    # names a model, with transformers' count
    AutoConfig.for_model("gemma4_text").save_pretrained(tmp_path / "gemma-4")
    with pytest.raises(ValueError, match=r"^model='.*gemma-4': a 'gemma4_text' config whose "
                                         r"layers differ in head_dim .*--measure"):
        planner.plan(str(tmp_path / "gemma-4"), "24GB")
    out = planner.plan(str(tmp_path / "gemma-4"), "24GB", measure=True)
    assert out["model"] == "gemma-4" and all(r["total_GiB"] is None for r in out["rows"])
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "gemma-4"))
    assert out["params_B"] * 1e9 == sum(p.numel() for p in built.parameters())
    with pytest.raises(ValueError, match="batch_size=0"):
        planner.max_context_per_step(str(tmp_path), "1GiB", batch_size=0)
    with pytest.raises(ValueError, match="workers=0: must be an integer >= 1"):
        planner.max_context_per_step(str(tmp_path), "1GiB", workers=0)


def test_a_measured_plan_says_what_eager_attention_keeps_where_the_model_has_no_sdpa(
        tmp_path, monkeypatch):
    """GPT-OSS has no SDPA in transformers (its attention sinks): its steps are measured with
    eager attention, and the plan says what that keeps, at least 2 bytes per score a layer,
    which the fake steps confirm (doubling s adds at least that much); a model with SDPA gets
    no such note."""
    from transformers import AutoConfig

    from recipes_lib import fake_memory
    from recipes_lib.fake_memory import Stack
    from recipes_lib.memory import MemoryReport

    AutoConfig.for_model("gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=256).save_pretrained(tmp_path)
    lora = Stack(method="lora", precision="bf16")
    kept = [fake_memory.measure_step(str(tmp_path), lora, s, 1).by_category["activations"]
            for s in (64, 128)]
    assert kept[1] - kept[0] >= 2 * 4 * (128**2 - 64**2) * 2  # heads, scores, bytes, layers
    with monkeypatch.context() as m:  # the plan's wiring, its rows' steps stood in for
        m.setattr(fake_memory, "measure_step",
                  lambda *a, **k: MemoryReport(1, {"activations": 0}))
        out = planner.plan(str(tmp_path), "1GiB", 64, 1, measure=True)
    [note] = [n for n in out["notes"] if n.startswith("attention: the steps were measured with "
                                                      "eager attention")]
    assert "at least 4 heads x 64 x 64 in 16 bits a sequence and layer, 0.0 GiB a sequence " \
        "over its 2 layers" in note, note
    notes = ["attention: transformers has no SDPA for X's architecture"]  # the formulas' note
    planner.note_eager_attention(str(tmp_path), 64, notes)
    assert len(notes) == 1
    planner.note_eager_attention("Qwen3-30B-A3B", 2048, notes)  # SDPA
    assert len(notes) == 1


def test_a_mixture_of_experts_is_planned_by_measurement_with_each_substitution_said(tmp_path):
    """No formula figure for an MoE; every row measured on fake tensors (real fake steps: a tiny
    Qwen3-MoE takes well under a second each), those whose stack would keep the experts in fp32,
    which transformers' grouped GEMM cannot multiply, in pure bf16, named and said once; a note
    says what QLoRA leaves unquantized, and one what the loss's logits take of the checkpointed
    row's measured activations (a vocabulary of 16,384 at this width: most). An MoE that routes
    in its own code: no row measured, each says why."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_moe", vocab_size=16384, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=256).save_pretrained(tmp_path / "qwen3-moe")
    moe = str(tmp_path / "qwen3-moe")
    with pytest.raises(ValueError, match=r"a mixture-of-experts model \(num.*--measure"):
        planner.plan(moe, "1GiB", 64, 1)
    out = planner.plan(moe, "1GiB", 64, 1, measure=True)
    by_step = {r["step"]: r for r in out["rows"]}
    assert by_step["full fine-tune (bf16 + AdamW)"]["measured_stack"] == "full, bf16, adamw"
    assert by_step["QLoRA (NF4 base)"]["measured_stack"] == "QLoRA r=16, bf16, adamw"
    assert by_step["LoRA on a bf16 base"]["measured_stack"] == "LoRA r=16, bf16, adamw"
    assert all(r["measured_fits"] for r in out["rows"] if "measured_GiB" in r)
    assert out["notes"].count(planner.SUBSTITUTED) == 1
    assert len([n for n in out["notes"] if "grouped_mm experts" in n]) == 2  # once per reason
    assert any("bitsandbytes #1849" in n for n in out["notes"])
    [logits] = [n for n in out["notes"] if n.startswith(planner.LOGITS_NOTE_START)]
    assert (f"are {3 * 64 * 16384 * 4 / 2**30:.3g} GiB of the checkpointed row's" in logits
            and "GiB of measured activations" in logits)
    assert "chunked_loss" not in out  # 64 tokens: one chunk
    # LoRA's "all-linear" adapts the experts whole: said, and the LoRA row measured again with
    # adapters on the attention only (tests/test_fake_memory.py checks what each keeps)
    adapted = out["expert_adapters"]
    assert adapted["attention_targets"] == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert adapted["attention_only_GiB"] < by_step["LoRA on a bf16 base"]["measured_GiB"]
    [note] = [n for n in out["notes"] if "target_parameters" in n]
    assert f"{adapted['attention_only_GiB']:.1f} GiB measured" in note
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe))
    assert out["params_B"] * 1e9 == sum(p.numel() for p in built.parameters())
    rows = {r["step"]: r for r in planner.max_context_per_step(moe, "1GiB", step=64)}
    assert rows["QLoRA (NF4 base)"]["max_seq_len"] == 256  # the model's positions fit
    assert rows["QLoRA (NF4 base)"]["stack"] == "QLoRA r=16, bf16, adamw"
    AutoConfig.for_model("jetmoe", vocab_size=256, hidden_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, kv_channels=16,
                         num_local_experts=4).save_pretrained(tmp_path / "jetmoe")
    out = planner.plan(str(tmp_path / "jetmoe"), "1GiB", 64, 1, measure=True)
    assert {r["measured_stack"] for r in out["rows"]} >= {
        "not measured: its experts' shapes depend on the router"}
    assert out["cheapest_measured"] == "nothing measured fits"


def test_a_card_by_name_is_its_nvidia_smi_total_and_a_t4_plans_fp16_settings(capsys):
    """``--gpu-mem T4``: the card's total (15360 MiB), and a card without bf16 gets fp16 trainer
    settings, said aloud; the rows' bytes are those of the same size in GiB, and bf16 cards'
    settings are unchanged."""
    t4 = planner.plan("Llama-2-7B", "T4", seq_len=512, batch_size=1, grad_accum_steps=1)
    by_size = planner.plan("Llama-2-7B", "15GiB", seq_len=512, batch_size=1, grad_accum_steps=1)
    assert t4["gpu"] == "T4" and by_size["gpu"] is None
    assert t4["gpu_bytes"] == by_size["gpu_bytes"] == 15360 * 2**20
    assert t4["rows"] == by_size["rows"] and t4["cheapest"] == by_size["cheapest"]
    settings = t4["trainer"]["settings"]
    assert settings["args"]["fp16"] and "bf16" not in settings["args"]
    assert settings["quantization"]["bnb_4bit_compute_dtype"] == settings["load"]["dtype"] == (
        "float16")
    assert any(n.startswith("a T4 (compute capability 7.5) has no bf16") for n in t4["notes"])
    assert by_size["trainer"]["settings"]["args"]["bf16"]
    h100 = planner.plan("Llama-2-7B", "h100", seq_len=512, batch_size=1, grad_accum_steps=1)
    assert h100["gpu_bytes"] == 81559 * 2**20 and h100["trainer"]["settings"]["args"]["bf16"]
    assert not any("no bf16" in n for n in h100["notes"])
    assert main(["plan", "--model", "Llama-2-7B", "--gpu-mem", "T4", "--seq", "512", "--batch",
                 "1"]) == 0
    out = capsys.readouterr().out
    assert "15.0 GiB per GPU (a T4: nvidia-smi's total)" in out and "fp16=True" in out
    with pytest.raises(ValueError, match="gpu_mem='T5': not a size; .* or a card: T4, L4"):
        planner.plan("Llama-2-7B", "T5")


def test_fp16_holds_the_bytes_bf16_does_in_a_step():
    """The note a card without bf16 gets: its 16-bit tensors are fp16, the same bytes. Fake
    steps of LoRA and QLoRA (checkpointed and not) in fp16 and in bf16, category by category."""
    from transformers import LlamaConfig

    from recipes_lib import fake_memory
    from recipes_lib.fake_memory import Stack

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for kw in ({"method": "qlora"}, {"method": "qlora", "checkpointing": True},
               {"method": "lora"}):
        bf16, fp16 = (fake_memory.measure_step(cfg, Stack(precision=p, **kw), 64, 2)
                      for p in ("bf16", "fp16"))
        assert bf16.peak_bytes == fp16.peak_bytes, kw
        assert bf16.by_category == fp16.by_category, kw


def test_a_stack_two_rows_share_is_measured_and_replayed_once(tmp_path, small_llama,
                                                              monkeypatch):
    """At one micro-batch the accumulation row (k=1) is the checkpointed row's step: the plan
    measures and replays it once and gives both rows its figures (each call here returns other
    bytes, so equal figures come from one call)."""
    from types import SimpleNamespace

    from recipes_lib import fake_memory

    small_llama.config.save_pretrained(tmp_path)
    asked: dict[str, list] = {"measure_step": [], "allocation_trace": []}

    def measure_step(model, stack, *args, **kwargs):
        asked["measure_step"].append(stack)
        return SimpleNamespace(peak_bytes=len(asked["measure_step"]) * 2**20, host_bytes=0,
                               by_category={"activations": 2**20})

    def allocation_trace(model, stack, *args, **kwargs):
        asked["allocation_trace"].append(stack)
        return [("alloc", 0, len(asked["allocation_trace"]) * 2**20)]
    monkeypatch.setattr(fake_memory, "measure_step", measure_step)
    monkeypatch.setattr(fake_memory, "allocation_trace", allocation_trace)
    out = planner.plan(str(tmp_path), "1GB", 64, 1, grad_accum_steps=1, measure=True,
                       replay=True)
    rows = {r["step"]: r for r in out["rows"]}
    for key in ("measured_stack", "measured_GiB", "reserved_GiB", "needs_GiB",
                "needs_by_setting"):
        assert rows["+ gradient accumulation (k=1)"][key] == rows[
            "+ activation checkpointing"][key]
    for name, stacks in asked.items():
        assert stacks and len(stacks) == len(set(stacks)), name


def test_replay_puts_the_caching_allocator_in_place_of_the_fixed_reserve(tmp_path, small_llama):
    from recipes_lib import allocator, fake_memory

    small_llama.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"replay=True: .*measure=True"):
        planner.plan(str(tmp_path), "1GB", 64, 2, replay=True)
    with pytest.raises(ValueError, match=r"expandable_segments=True: .*replay=True"):
        planner.plan(str(tmp_path), "1GB", 64, 2, measure=True, expandable_segments=True)
    out = planner.plan(str(tmp_path), "1GB", 64, 2, gpus=2, measure=True, replay=True,
                       expandable_segments=True)
    measured = [r for r in out["rows"] if "measured_GiB" in r]
    one_device = [r for r in measured if "FSDP" not in r["measured_stack"]]
    assert one_device and len(one_device) < len(measured)  # FSDP rows keep the fixed reserve
    for r in measured:
        if r in one_device:
            assert r["measured_GiB"] <= r["reserved_GiB"]  # what is cached holds what is handed out
            assert r["gpu_GiB"] == pytest.approx(r["reserved_GiB"]
                                                 + planner.CUDA_CONTEXT_BYTES / 2**30)
            assert r["measured_fits"] and r["cache_released"] == 0
            assert r["expandable_segments"] and not r["other_allocator"]["expandable_segments"]
            assert r["advice"] is None  # both settings fit
            assert list(r["needs_by_setting"]) == list(allocator.SETTINGS)
            assert r["needs_by_setting"]["expandable segments"] == r["needs_GiB"]
        else:
            assert "reserved_GiB" not in r
            assert r["gpu_GiB"] * 2**30 == pytest.approx(
                r["measured_GiB"] * 2**30 + planner.gpu_overhead(r["measured_GiB"] * 2**30))
    assert "the caching allocator's replayed reserve with expandable segments" in (
        planner.format_plan(out))
    table = planner.format_plan(out).split("smallest card by allocator setting (GiB, replayed; "
                                           "PYTORCH_CUDA_ALLOC_CONF):\n")[1].splitlines()
    assert table[0].split()[1:] == ["default", "expandable", "segments", "max_split_size_mb:128",
                                    "max_split_size_mb:512"]
    assert [line[:52].strip() for line in table[1:1 + len(one_device)]] == [
        r["step"] for r in one_device]
    # both settings fit the same steps: no line for the other; where a cheaper one fits, one
    assert out["cheapest_measured_other_allocator"] == {
        "expandable_segments": False, "step": out["cheapest_measured"],
        "roundup_power2_divisions": None}
    assert "with the default allocator settings:" not in planner.format_plan(out)
    # the trainer's lines end by saying how to launch it as the replay assumed
    assert planner.format_plan(out).endswith(
        "\n  # launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the replay assumed it")
    out["cheapest_measured_other_allocator"]["step"] = "LoRA on a bf16 base"
    assert "\nwith the default allocator settings: LoRA on a bf16 base\n" in (
        planner.format_plan(out))
    for r in one_device:  # as a replay with max_split_size_mb would have them
        r.update(expandable_segments=False, max_split_size_mb=128)
    out["cheapest_measured_other_allocator"]["expandable_segments"] = True
    shown = planner.format_plan(out)
    assert "the caching allocator's replayed reserve with max_split_size_mb:128" in shown
    assert "\nwith PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: LoRA on a bf16 base\n" in (
        shown)
    assert shown.endswith("\n  # launch with PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128: the "
                          "replay assumed it")
    with pytest.raises(ValueError, match=r"max_split_size_mb=128: .*replay=True"):
        planner.plan(str(tmp_path), "1GB", 64, 2, measure=True, max_split_size_mb=128)
    assert planner.allocator_setting(True, 128, False) == (
        "expandable segments, max_split_size_mb:128")  # launch scripts set both
    # a card too small for the run: not fitting, with the reserved peak an unlimited card reaches
    stack = fake_memory.Stack(precision="fp32")
    small = planner.replayed_reserve(str(tmp_path), stack, 64, 2,
                                     planner.CUDA_CONTEXT_BYTES + 2**20)
    whole = allocator.replay(fake_memory.allocation_trace(str(tmp_path), stack, 64, 2))
    assert not small["measured_fits"] and small["reserved_GiB"] == whole.peak_reserved / 2**30
    assert not small["other_allocator"]["measured_fits"] and small["advice"] is None


def test_the_replay_says_where_expandable_segments_change_the_verdict(monkeypatch):
    """A run whose 40 MiB segment, split to serve 10 MiB, strands 30 MiB: on a card of 60 MiB
    beside the context the default allocator runs out and expandable segments fit; each setting
    says what the other does."""
    from recipes_lib import allocator, fake_memory

    events = [("alloc", 0, 40 * 2**20), ("free", 0, 0), ("alloc", 1, 10 * 2**20),
              ("alloc", 2, 35 * 2**20)]
    monkeypatch.setattr(fake_memory, "allocation_trace", lambda *args: events)
    budget = planner.CUDA_CONTEXT_BYTES + 60 * 2**20
    default = planner.replayed_reserve("any", None, 64, 2, budget)
    assert not default["measured_fits"] and default["other_allocator"]["measured_fits"]
    assert default["reserved_GiB"] == allocator.replay(events).peak_reserved / 2**30
    assert default["advice"] == ("fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                 "(0.1 GiB reserved, replayed)")
    expandable = planner.replayed_reserve("any", None, 64, 2, budget, expandable_segments=True)
    assert expandable["measured_fits"] and expandable["reserved_GiB"] == 60 / 1024
    # the smallest cards: 40 + 36 MiB segments under the default rules, three pages expandable
    context = planner.CUDA_CONTEXT_BYTES / 2**30
    assert (default["needs_GiB"], expandable["needs_GiB"]) == (76 / 1024 + context,
                                                               60 / 1024 + context)
    # every setting's, from either replay: max_split_size_mb changes nothing under 128 MiB
    assert default["needs_by_setting"] == expandable["needs_by_setting"] == {
        name: (60 if name == "expandable segments" else 76) / 1024 + context
        for name in allocator.SETTINGS}
    assert expandable["advice"].startswith("fits only with expandable segments: the default")
    # max_split_size_mb:40 keeps the 40 MiB segment whole, and releases it to make room
    oversize = planner.replayed_reserve("any", None, 64, 2, budget, max_split_size_mb=40)
    assert oversize["measured_fits"] and oversize["cache_released"] == 1
    assert oversize["reserved_GiB"] == 50 / 1024  # 40 + 10 MiB, before the 40 went
    other = oversize["other_allocator"]  # beside it: expandable segments
    assert oversize["max_split_size_mb"] == 40 and other["expandable_segments"]
    assert other["measured_fits"] and other["max_split_size_mb"] is None
    assert oversize["needs_GiB"] <= 48 / 1024 + context and oversize["advice"] is None


def test_a_rounding_setting_is_said_with_the_rest():
    """``roundup_power2_divisions`` (axolotl's launch sets 16) travels with the replay's other
    settings into the launch line and the advice, the other ``expandable_segments`` setting
    keeping it."""
    assert planner.allocator_setting(True, roundup_power2_divisions=16) == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,roundup_power2_divisions:16")
    assert planner.allocator_setting(True, None, False, 16) == (
        "expandable segments, roundup_power2_divisions:16")
    assert planner.allocator_setting(roundup_power2_divisions=(0,) * 9 + (2,) * 7, env=False) \
        == "roundup_power2_divisions:[256:0,>:2]"
    replayed = {"measured_fits": True, "expandable_segments": True, "max_split_size_mb": None,
                "roundup_power2_divisions": 16,
                "other_allocator": {"measured_fits": False, "reserved_GiB": 25.0,
                                    "expandable_segments": False, "max_split_size_mb": None,
                                    "roundup_power2_divisions": 16}}
    assert planner.allocator_advice(replayed) == (
        "fits only with expandable segments, roundup_power2_divisions:16: the default allocator "
        "with roundup_power2_divisions:16 runs out (25.0 GiB reserved on an unlimited card)")
    replayed["measured_fits"], replayed["other_allocator"]["measured_fits"] = False, True
    assert planner.allocator_advice(replayed) == (
        "fits with PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:16 (25.0 GiB reserved, "
        "replayed)")
    with pytest.raises(ValueError, match=r"roundup_power2_divisions=16: .*replay=True"):
        planner.check_allocator_setting(False, False, None, 16)
    with pytest.raises(ValueError, match="roundup_power2_divisions=5: a power of two"):
        planner.check_allocator_setting(True, False, None, 5)


def test_a_launchs_own_setting_joins_the_smallest_cards_compared(tmp_path, small_llama):
    from recipes_lib import allocator, fake_memory

    small_llama.config.save_pretrained(tmp_path)
    out = planner.replayed_reserve(str(tmp_path), fake_memory.Stack(), 64, 2, 2**30, True, None,
                                   16)  # axolotl's launch
    words = "expandable segments, roundup_power2_divisions:16"
    assert list(out["needs_by_setting"]) == [*allocator.SETTINGS, words]
    assert out["needs_by_setting"][words] == out["needs_GiB"]
    assert out["roundup_power2_divisions"] == 16
    assert out["other_allocator"]["roundup_power2_divisions"] == 16  # kept on the other side
