"""The recipes in transformers' Trainer and TRL's SFTTrainer: the same figures as the course's
loop, measured with the course's meter, and the settings that conflict said aloud."""

from pathlib import Path

import pytest

from recipes_lib import checkpointing, data, trainers
from recipes_lib import model as models


@pytest.fixture(scope="module")
def small():
    path = models.build_tiny_model(spec=models.TinyModelSpec.smallest(), progress=False)
    tok = models.load_tokenizer(path)
    examples = data.tokenize_examples(data.load_corpus("topic", "train"), tok, 128, "sft")[:8]
    return path, tok, examples


def test_checkpointing_setting_cuts_the_trainers_activations_and_keeps_its_losses(small):
    path, tok, examples = small
    plain = trainers.run_trainer(models.load_model(path), examples, tok, steps=1)
    ckpt = trainers.run_trainer(models.load_model(path), examples, tok,
                                trainers.SETTINGS["activation_checkpointing"], steps=1)
    assert ckpt.step.activation_bytes < 0.6 * plain.step.activation_bytes
    assert ckpt.losses == plain.losses


def test_selective_checkpointing_reaches_trainer_through_the_model(small):
    """No TrainingArguments field sets the policy (a function in activation_checkpointing_kwargs
    trains, but TrainingArguments.to_json_string, which tensorboard's callback calls, cannot
    write it): enabled on the model, with the trainer's own flag off, it is what runs."""
    path, tok, examples = small
    plain = trainers.run_trainer(models.load_model(path), examples, tok, steps=1)
    full = trainers.run_trainer(models.load_model(path), examples, tok,
                                trainers.SETTINGS["activation_checkpointing"], steps=1)
    model = checkpointing.enable_activation_checkpointing(models.load_model(path),
                                                          selective=True)
    selective = trainers.run_trainer(model, examples, tok, steps=1)
    assert (full.step.activation_bytes < selective.step.activation_bytes
            < plain.step.activation_bytes)
    assert selective.losses == plain.losses


def test_trainer_accumulation_equals_one_batch_on_variable_lengths(small):
    path, tok, examples = small
    assert len({len(e["input_ids"]) for e in examples}) > 2  # lengths differ
    gap = trainers.update_gap(lambda: models.load_model(path), examples, tok, 2, 4)
    assert gap < 1e-5, gap


def test_a_course_loss_in_trainer_equals_its_own_under_accumulation(small):
    """Chunked cross-entropy as Trainer's compute_loss (the CPU bridge for use_liger_kernel):
    divided by num_items_in_batch, it gives Trainer's own losses and update, with the
    accumulation steps' variable token counts."""
    out = trainers.course_loss_against_own(str(small[0]))
    assert out["course_losses"] == pytest.approx(out["own_losses"], rel=1e-5)
    assert out["update_rel_diff"] < 1e-4
    assert out["course_dtype"] == out["own_dtype"] == "torch.float32"


def test_a_course_loss_in_trainer_without_a_token_count_does_as_trainer_does(small):
    """A model whose forward takes no loss keywords (accepts_loss_kwargs=False) gets no
    num_items_in_batch from Trainer, which then divides each micro-batch's mean by the
    accumulation steps: the course loss does the same, not a sum of means."""
    out = trainers.course_loss_against_own(str(small[0]), accepts_loss_kwargs=False)
    assert out["course_losses"] == pytest.approx(out["own_losses"], rel=1e-5)
    assert out["update_rel_diff"] < 1e-4


def test_a_course_loss_in_trainer_runs_under_its_mixed_precision(small):
    """accelerate's autocast is part of the model's forward, which a course loss (reading the
    decoder and the head itself) used to bypass: with bf16=True the decoder ran in fp32."""
    out = trainers.course_loss_against_own(str(small[0]), {"bf16": True}, steps=1)
    assert out["course_dtype"] == out["own_dtype"] == "torch.bfloat16"
    assert out["course_losses"] == pytest.approx(out["own_losses"], rel=1e-3)
    assert out["update_rel_diff"] < 1e-2  # 0.0034 here


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_distillation_in_trainer_is_the_course_loops_step(small, precision):
    """Notebook 03's distillation loss (a teacher frozen beside the student) in Trainer: the
    first step's loss is the course loop's on the same batch, in fp32 and under bf16 autocast
    (the teacher's forward inside the student's, under accelerate's autocast)."""
    from recipes_lib import distillation
    from recipes_lib.grad_accumulation import forward_backward

    path, tok, examples = small
    kd = distillation.DistillationLoss(models.load_model(path), chunk_size=16)
    student = lambda: distillation.make_student(models.load_model(path), width_factor=0.5)
    batch = data.collate(examples[:4], tok.pad_token_id)
    loop = float(forward_backward(student(), batch, precision=precision, loss_fn=kd))
    run = trainers.run_trainer(student(), examples[:4], tok, {"bf16": precision == "bf16"},
                               steps=1, micro_batch_size=4, measure_step=0, loss_fn=kd)
    assert run.losses[0] == pytest.approx(loop, rel=1e-5)


def test_a_course_loss_in_trainer_on_two_ranks_equals_its_own(sharded_runs):
    """On 2 DDP ranks (accelerate on CPU), the course loss runs through DDP's forward (which
    prepares the gradients' all-reduce) and is scaled by the ranks sharing the token count, as
    Trainer's own loss: same losses and update. Before, it raised (the DDP wrapper has no LM
    head), and its loss would have been a rank count too small."""
    for rank in sharded_runs["trainer_course_loss"]:
        assert rank["world_size"] == 2
        assert rank["course_losses"] == pytest.approx(rank["own_losses"], rel=1e-5)
        assert rank["update_rel_diff"] < 1e-4


def test_8bit_optimizer_setting_shrinks_the_trainers_states(small):
    """Trainer keeps the embeddings' AdamW states in 32 bits (it registers a bitsandbytes
    override for every nn.Embedding), so its ratio sits above the course's 8-bit-everywhere
    one; the prediction that counts this is exact."""
    pytest.importorskip("bitsandbytes")
    path, tok, examples = small
    plain = trainers.run_trainer(models.load_model(path), examples, tok, steps=1, measure_step=0)
    eight = trainers.run_trainer(models.load_model(path), examples, tok,
                                 trainers.SETTINGS["optim8bit"], steps=1, measure_step=0)
    ratio = eight.optimizer_state_bytes / plain.optimizer_state_bytes
    assert ratio == pytest.approx(trainers.predicted_8bit_state_ratio(models.load_model(path)),
                                  abs=1e-12)
    assert ratio > 0.2545  # the course's ratio on the default model: all 8-bit
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()  # the run took its overrides away with it
    assert not [m for m, _, _ in manager.module_weight_config_triple
                if m is eight.trainer.model.get_input_embeddings()]


def test_padding_free_sft_keeps_the_loss_and_drops_the_padding(small):
    pytest.importorskip("trl")
    path, tok, examples = small
    padded = trainers.run_trainer(models.load_model(path), examples, tok, steps=1, sft=True)
    free = trainers.run_trainer(models.load_model(path), examples, tok,
                                trainers.SETTINGS["padding_free"], steps=1, sft=True)
    assert free.losses[0] == pytest.approx(padded.losses[0], rel=1e-4)
    assert free.step.activation_bytes < padded.step.activation_bytes


def test_sft_qlora_keeps_the_base_in_its_load_dtype_and_adapters_in_bf16(small):
    """What notebook 01 says of TRL's SFTTrainer on a 4-bit model (trl #4577 dropped peft's k-bit
    preparation): the same 4-bit layers and adapter count as the course's ``add_lora``, but the
    embeddings, norms and head stay in the dtype the model was loaded in and the adapters are
    bf16, where the course keeps both in fp32."""
    pytest.importorskip("trl")
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import LoraConfig

    from recipes_lib import quantization

    path, tok, examples = small
    cfg = quantization.nf4_config(compute_dtype=torch.bfloat16)

    def fresh():
        return models.load_model(path, dtype=torch.bfloat16, quantization_config=cfg)

    course = quantization.held_bytes_by_kind(quantization.add_lora(fresh(), r=4))
    run = trainers.run_trainer(fresh(), examples, tok, steps=1, sft=True, measure_step=0,
                               peft_config=LoraConfig(r=4, target_modules="all-linear",
                                                      task_type="CAUSAL_LM"))
    trl = quantization.held_bytes_by_kind(run.trainer.model)
    assert trl["4-bit layers"] == course["4-bit layers"]
    assert trl["unquantized base"]["dtypes"] == ["bfloat16"]
    assert course["unquantized base"]["dtypes"] == ["float32"]
    assert 2 * trl["unquantized base"]["bytes"] == course["unquantized base"]["bytes"]
    assert (trl["adapters"]["dtypes"], 2 * trl["adapters"]["bytes"]) == (
        ["bfloat16"], course["adapters"]["bytes"])


def test_fsdp_settings_name_the_architectures_block(small):
    settings = trainers.fsdp_settings(models.load_model(small[0]))
    assert settings["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]


def test_trainer_fsdp_on_cpu_ranks_runs_as_ddp(sharded_runs):
    """accelerate enables FSDP only on accelerator ranks: on 2 CPU ranks the FSDP2 settings
    train as DDP (each rank keeps the whole state), which ``fsdp_rank_state`` reports."""
    ranks = sharded_runs["trainer_fsdp"]
    assert [r["distributed_type"] for r in ranks] == ["MULTI_CPU", "MULTI_CPU"]
    assert ranks[0]["state_bytes"]["parameters"] == ranks[1]["state_bytes"]["parameters"]
    assert ranks[0]["losses"] == ranks[1]["losses"]


def test_reentrant_checkpointing_with_frozen_inputs_is_said_aloud(small):
    from recipes_lib import quantization

    model = quantization.add_lora(models.load_model(small[0]), r=4)
    reentrant = trainers.checkpointing_settings(use_reentrant=True)
    with pytest.warns(UserWarning, match="use_reentrant=True with frozen input embeddings"):
        assert trainers.check_settings(model, reentrant) == reentrant


@pytest.mark.parametrize("version, name", [("5.0.0", "gradient_checkpointing"),
                                           ("5.22.2", "gradient_checkpointing"),
                                           ("5.23.0", "activation_checkpointing")])
def test_checkpointing_settings_use_the_names_transformers_takes(version, name):
    assert trainers.checkpointing_settings(version=version) == {
        name: True, f"{name}_kwargs": {"use_reentrant": False}}


def test_the_installed_trainingarguments_take_the_checkpointing_settings(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                             **trainers.SETTINGS["activation_checkpointing"])
    assert args.gradient_checkpointing is True
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}


def test_8bit_optimizer_without_bitsandbytes_is_an_error(small, monkeypatch):
    from recipes_lib import device

    monkeypatch.setattr(device, "has_module", lambda name: name != "bitsandbytes")
    with pytest.raises(ValueError, match="optim='adamw_bnb_8bit': needs bitsandbytes"):
        trainers.check_settings(models.load_model(small[0]), trainers.SETTINGS["optim8bit"])


def test_precision_settings_fall_back_aloud_on_cpu_without_bf16(monkeypatch):
    from recipes_lib import device

    monkeypatch.setattr(device, "supports_bf16", lambda d: False)
    with pytest.warns(UserWarning, match="no native bf16: training in fp32"):
        assert trainers.precision_settings("cpu") == {}
    monkeypatch.setattr(device, "supports_bf16", lambda d: True)
    assert trainers.precision_settings("cpu") == {"bf16": True}


def test_sft_trains_in_the_precision_the_device_supports(small, monkeypatch):
    """SFTConfig defaults to bf16=True, which a CPU without native bf16 only emulates: run_trainer
    trains in fp32 there, said aloud, and keeps a precision the settings name."""
    pytest.importorskip("trl")
    from recipes_lib import device

    path, tok, examples = small

    def args(settings):
        return trainers.run_trainer(models.load_model(path), examples[:2], tok, settings, steps=1,
                                    sft=True, micro_batch_size=2, measure_step=0).trainer.args

    monkeypatch.setattr(device, "supports_bf16", lambda d: False)
    with pytest.warns(UserWarning, match="no native bf16: training in fp32"):
        fell_back = args({})
    assert (fell_back.bf16, fell_back.fp16) == (False, False)
    monkeypatch.setattr(device, "supports_bf16", lambda d: True)
    assert args({}).bf16
    monkeypatch.setattr(device, "supports_bf16", lambda d: False)
    assert args({"bf16": True}).bf16  # named: the caller's choice


def test_a_trainer_run_leaves_no_output_folder(small):
    path, tok, examples = small
    run = trainers.run_trainer(models.load_model(path), examples[:2], tok, steps=1,
                               micro_batch_size=2, measure_step=0)
    assert not Path(run.trainer.args.output_dir).exists()


def test_bad_inputs(small):
    path, tok, examples = small
    with pytest.raises(ValueError, match="steps=0"):
        trainers.run_trainer(models.load_model(path), examples, tok, steps=0)
    with pytest.raises(ValueError, match="examples: empty"):
        trainers.run_trainer(models.load_model(path), [], tok)
    with pytest.raises(ValueError, match="examples: 8 given, one step of 3 x 2 needs 6"):
        trainers.update_gap(lambda: models.load_model(path), examples, tok, 2, 3)



def test_accelerate_config_is_one_accelerate_reads(small, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    text = trainers.accelerate_config(models.load_model(small[0]), 8)
    (tmp_path / "fsdp.yaml").write_text(text)
    cfg = ClusterConfig.from_yaml_file(str(tmp_path / "fsdp.yaml"))
    assert str(cfg.distributed_type).endswith("FSDP")
    assert cfg.fsdp_config["fsdp_version"] == 2 and cfg.num_processes == 8
    assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    with pytest.raises(ValueError, match="num_processes=1"):
        trainers.accelerate_config(models.load_model(small[0]), 1)


def test_a_loss_compared_in_the_loop_and_in_trainer(small):
    """Notebook 04's bridge: chunked CE cuts the activations by the same ratio in the course's
    loop and in Trainer, and Trainer's loss does not change."""
    from recipes_lib.chunked_loss import ChunkedCausalLMLoss

    path, tok, examples = small
    out = trainers.compare_losses(lambda: models.load_model(path), examples[:4], tok,
                                  {"own": None, "chunked": ChunkedCausalLMLoss(16)},
                                  micro_batch_size=4)
    assert out["trainer_ratio"] < 1 and abs(out["trainer_ratio"] - out["loop_ratio"]) <= 0.05
    assert out["trainer_losses"]["chunked"] == pytest.approx(out["trainer_losses"]["own"],
                                                             rel=1e-5)
    assert set(out["rows"]["own"]) == {"loop MiB", "Trainer MiB", "Trainer loss"}
    with pytest.raises(ValueError, match="loss_fns"):
        trainers.compare_losses(lambda: models.load_model(path), examples[:4], tok, {"own": None},
                                micro_batch_size=4)
    with pytest.raises(ValueError, match="examples: 8 given"):
        trainers.compare_losses(lambda: models.load_model(path), examples, tok,
                                {"own": None, "chunked": None}, micro_batch_size=4)


def test_a_planned_stack_runs_as_the_lines_a_training_script_writes(tmp_path, small_llama):
    """``format_settings``' lines executed as written on a tiny model's folder, with the real
    transformers, peft and bitsandbytes: the 4-bit layers, peft's k-bit preparation, the adapters
    and the TrainingArguments the stack asks for (on this CPU the test adds ``use_cpu=True``,
    which ``bf16=True`` needs without a GPU)."""
    import functools

    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, TrainingArguments

    from recipes_lib import published
    from recipes_lib.fake_memory import Stack

    small_llama.save_pretrained(tmp_path)
    names = {"AutoModelForCausalLM": AutoModelForCausalLM, "torch": torch,
             "BitsAndBytesConfig": BitsAndBytesConfig, "LoraConfig": LoraConfig,
             "prepare_model_for_kbit_training": prepare_model_for_kbit_training,
             "TrainingArguments": functools.partial(TrainingArguments, use_cpu=True)}
    qlora = Stack(method="qlora", precision="bf16-mixed", checkpointing=True, grad_accum_steps=2)
    run = dict(names)
    # the printed lines themselves are what is tested: run as a user's script would run them
    exec(trainers.format_settings(trainers.stack_settings(qlora, 4), str(tmp_path)), run)  # noqa: S102
    model, args = run["model"], run["args"]
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    assert model.model.embed_tokens.weight.dtype == torch.float32  # k-bit preparation
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 2)
    assert args.bf16 and args.optim == "adamw_torch_fused"
    assert trainers.checkpointing_settings().items() <= args.to_dict().items()
    adapted = get_peft_model(model, run["peft_config"])
    r = qlora.lora_rank  # r x (in + out) per adapted linear, every one of them
    assert adapted.get_nb_trainable_parameters()[0] == sum(
        r * (m.in_features + m.out_features) for n, m in small_llama.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head")

    sharded = dict(names)
    code = trainers.format_settings(trainers.stack_settings(
        Stack(precision="bf16-mixed", fsdp_ranks=2), 4, small_llama), str(tmp_path))
    exec(code, sharded)  # noqa: S102 - as above
    assert sharded["model"].dtype == torch.float32  # fp32 masters under bf16 autocast
    assert sharded["args"].fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert sharded["args"].per_device_train_batch_size == 2
    # FSDP + QLoRA as bitsandbytes' guide runs it: 16-bit quant storage, no k-bit preparation
    fsdp_qlora = trainers.stack_settings(Stack(method="qlora", precision="bf16-mixed",
                                               checkpointing=True, fsdp_ranks=2), 4, small_llama)
    assert fsdp_qlora["quantization"]["bnb_4bit_quant_storage"] == "bfloat16"
    assert fsdp_qlora["kbit_preparation"] is None and trainers.FSDP_QLORA_NOTE in fsdp_qlora[
        "notes"]
    quantized = dict(names)
    exec(trainers.format_settings(fsdp_qlora, str(tmp_path)), quantized)  # noqa: S102 - as above
    down = quantized["model"].model.layers[0].mlp.down_proj
    assert type(down).__name__ == "Linear4bit" and down.weight.dtype == torch.bfloat16
    assert quantized["args"].fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    # ... and with FSDP's CPU offload: fsdp_config's cpu_offload, said in a note
    offloaded = trainers.stack_settings(Stack(method="qlora", precision="bf16-mixed",
                                              checkpointing=True, fsdp_ranks=2,
                                              fsdp_cpu_offload=True), 4, small_llama)
    assert trainers.FSDP_OFFLOAD_NOTE in offloaded["notes"]
    assert "cpu_offload" not in fsdp_qlora["args"]["fsdp_config"]
    on_host = dict(names)
    exec(trainers.format_settings(offloaded, str(tmp_path)), on_host)  # noqa: S102 - as above
    assert on_host["args"].fsdp_config["cpu_offload"] is True
    with pytest.raises(ValueError, match="batch_size=4: must be a positive multiple of the ranks "
                                         "x micro-batches, 1 x 3"):
        trainers.stack_settings(Stack(grad_accum_steps=3), 4)
    with pytest.raises(ValueError, match="stack.nf4_keeps_input=True: how a past library"):
        trainers.stack_settings(Stack(method="qlora", nf4_keeps_input=True), 1)
    with torch.device("meta"):
        phi = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{
            **published.PHI_1_5_HUB, "num_hidden_layers": 1}))
    assert trainers.stack_settings(Stack(method="lora"), 1, phi)["notes"] == [
        trainers.GELU_NEW_NOTE]
    # the keyword the note gives reaches the config: one op instead of eight
    phi.config.save_pretrained(tmp_path / "phi")
    with torch.device("meta"):
        fused = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
            tmp_path / "phi", hidden_act="gelu_pytorch_tanh"))
    assert type(fused.model.layers[0].mlp.activation_fn).__name__ == "GELUTanh"
    bf16_adapters = trainers.stack_settings(Stack(method="lora", autocast_adapter_dtype=False), 1)
    assert "autocast_adapter_dtype=False" in bf16_adapters["notes"][0]
    selective = trainers.stack_settings(Stack(checkpointing=True, selective_checkpointing=True), 1)
    assert not set(trainers.checkpointing_settings()) & set(selective["args"])  # on the model
    assert "selective=True" in selective["notes"][0]


def test_a_gpu_without_bf16_gets_settings_that_train_in_fp16_with_fp32_trainable_weights(
        tmp_path, small_llama):
    """``stack_settings(bf16=False)`` (a T4), run as the lines a script writes: the model loads in
    fp16 (fp32 for the full fine-tune under autocast), QLoRA computes in fp16, and one Trainer
    step runs fp16 mixed precision with every trainable weight in fp32, which the gradient scaler
    a GPU adds needs: on 16-bit ones it refuses (checked here with a CPU scaler), and so do the
    settings."""
    import functools

    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    from recipes_lib.fake_memory import Stack

    small_llama.save_pretrained(tmp_path)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 128, (4, 32)).tolist()]
    names = {"AutoModelForCausalLM": AutoModelForCausalLM, "torch": torch,
             "BitsAndBytesConfig": BitsAndBytesConfig, "LoraConfig": LoraConfig,
             "prepare_model_for_kbit_training": prepare_model_for_kbit_training,
             "TrainingArguments": functools.partial(
                 TrainingArguments, use_cpu=True, output_dir=str(tmp_path / "out"),
                 report_to="none", max_steps=1, save_strategy="no", disable_tqdm=True)}
    stacks = {"qlora": Stack(method="qlora", precision="bf16-mixed", checkpointing=True),
              "lora": Stack(method="lora"), "full": Stack(precision="bf16-mixed")}
    loaded = {"qlora": torch.float16, "lora": torch.float16, "full": torch.float32}
    for name, stack in stacks.items():
        settings = trainers.stack_settings(stack, 4, bf16=False)
        assert settings["args"]["fp16"] and "bf16" not in settings["args"], name
        assert settings["notes"][0].startswith("no bf16 on this GPU"), name
        run = dict(names)
        exec(trainers.format_settings(settings, str(tmp_path)), run)  # noqa: S102 - as above
        model = run["model"]
        if name == "qlora":
            assert model.model.layers[0].mlp.down_proj.compute_dtype == torch.float16
        else:
            assert model.model.layers[0].mlp.down_proj.weight.dtype == loaded[name], name
        if "peft_config" in run:
            model = get_peft_model(model, run["peft_config"])
        trainer = Trainer(model=model, args=run["args"], train_dataset=rows)
        trainer.train()
        assert trainer.accelerator.mixed_precision == "fp16", name
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert trainable and all(p.dtype == torch.float32 for p in trainable), name
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer, scaler = torch.optim.SGD([weight], lr=0.1), torch.amp.GradScaler("cpu")
    scaler.scale(weight.float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(optimizer)
    for stack, field in ((Stack(precision="bf16"), "precision"),
                         (Stack(method="lora", autocast_adapter_dtype=False),
                          "autocast_adapter_dtype")):
        with pytest.raises(ValueError, match=f"stack.{field}=.*: 16-bit trainable weights"):
            trainers.stack_settings(stack, 1, bf16=False)
        assert trainers.stack_settings(stack, 1)  # a bf16 GPU runs them
