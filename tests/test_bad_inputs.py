"""The bad-input table: wrong configurations across the four notebooks' functions.

Each must fail at once with one ValueError whose message names the offending parameter (and
says what is allowed), leaving nothing half-written on disk. The count is printed in the test
summary (see conftest.py).
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path

import pytest
import torch

from recipes_lib import (
    architectures,
    attention,
    calc,
    checkpointing,
    curriculum,
    data,
    data_loading,
    device,
    distillation,
    distributed,
    fake_memory,
    gemm_bench,
    grad_accumulation,
    max_context,
    model,
    norms,
    numerics,
    optim8bit,
    packing,
    passkey,
    planner,
    ptq,
    quantization,
    results,
    sparse_attention,
    timing,
    train,
    trainers,
)
from recipes_lib.chunked_loss import chunked_cross_entropy, chunked_linear_loss

TRIED: dict[str, bool] = {}


def _llama(vocab=128):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=64))


def _plan_moe():
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps({"model_type": "mixtral",
                                                              "num_local_experts": 8}))
        planner.plan(folder, "24GB")


def _frozen_llama():
    return _llama().requires_grad_(False)


def _biased_head():
    net = _llama()
    net.lm_head = torch.nn.Linear(32, 128, bias=True)
    return net


def _headless_llama():
    from transformers import LlamaModel

    return LlamaModel(_llama().config)


def _batch():
    ids = torch.randint(0, 100, (2, 8))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _ce_sum(logits, y):
    return torch.nn.functional.cross_entropy(logits, y, reduction="sum")


def _kd_vocab_mismatch():
    ids = torch.randint(0, 100, (1, 8))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    distillation.DistillationLoss(_llama(128))(_llama(100), batch)


# (notebook, what is wrong, call, the parameter its message must name)
CASES = [
    ("01", "zero training steps", lambda: train.TrainConfig(steps=0).validate(), "steps"),
    ("01", "negative learning rate", lambda: train.TrainConfig(lr=-1.0).validate(), "lr"),
    ("01", "unknown LR schedule", lambda: train.TrainConfig(schedule="exp").validate(), "schedule"),
    ("01", "unknown training precision", lambda: train.TrainConfig(precision="fp8").validate(),
     "precision"),
    ("01", "a model folder that does not exist", lambda: model.load_tokenizer("./no-such-model"),
     "model_id_or_path"),
    ("01", "tiny model whose heads do not divide its width",
     lambda: model.TinyModelSpec(hidden_size=250), "num_attention_heads"),
    ("01", "tiny model with no layers", lambda: model.TinyModelSpec(num_hidden_layers=0),
     "num_hidden_layers"),
    ("01", "unknown corpus", lambda: data.load_corpus("wiki"), "name"),
    ("01", "unknown tokenization kind", lambda: data.tokenize_examples([], None, 16, "chat"),
     "kind"),
    ("01", "unknown weight format", lambda: calc.bytes_per_param("int3"), "fmt"),
    ("01", "zero sequence length in the calculator",
     lambda: calc.activation_bytes_per_layer(0, 1, 64, 4), "seq_len"),
    ("01", "LoRA on layers the model does not have (Phi-3's names on a Llama)",
     lambda: quantization.add_lora(_llama(), target_modules=["qkv_proj", "o_proj"]),
     "target_modules"),
    ("01", "fake-tensor LoRA on layers the model does not have",
     lambda: fake_memory.measure_step(_llama().config, fake_memory.Stack(
         method="lora", lora_targets=("query", "value")), 16), "lora_targets"),
    ("01", "timer with no repeats", lambda: timing.time_fn(lambda: None, repeats=0), "repeats"),
    ("01", "a non-finite figure", lambda: results.Results("x", "cpu").add("r", "m", math.nan),
     "value"),
    ("02", "NCCL without GPUs", lambda: distributed.check_backend("nccl", 2), "backend"),
    ("02", "global batch not divisible by ranks", lambda: distributed.check_global_batch(7, 2),
     "global_batch_size"),
    ("02", "negative GPU memory", lambda: planner.parse_bytes("-16GB"), "gpu_mem"),
    ("02", "unparsable GPU memory", lambda: planner.parse_bytes("sixteen"), "gpu_mem"),
    ("02", "unknown model offline", lambda: planner.resolve_shape("Llama-9-1T"), "model"),
    ("03", "int8 on a model without Linear layers",
     lambda: ptq.quantize_int8_dynamic(torch.nn.Sequential(torch.nn.ReLU())), "model"),
    ("03", "zero distillation temperature",
     lambda: distillation.DistillationLoss(_llama(), temperature=0.0), "temperature"),
    ("03", "student vocabulary differs from the teacher's", _kd_vocab_mismatch, "student"),
    ("03", "SDPA backend this device lacks",
     lambda: attention.sdpa_attention(*(torch.randn(1, 1, 8, 8),) * 3, backend="efficient"),
     "backend"),
    ("03", "RMSNorm surgery on a model without LayerNorm",
     lambda: norms.swap_layernorm_for_rmsnorm(_llama()), "model"),
    ("03", "student with no attention head left",
     lambda: distillation.make_student(_llama(), width_factor=0.1), "width_factor"),
    ("01", "a mixture-of-experts config to plan by the formulas",
     lambda: _plan_moe(), "model"),
    ("01", "mixture-of-experts weights the grouped GEMM cannot multiply",
     lambda: fake_memory.measure_step({"model_type": "mixtral", "num_local_experts": 4,
                                       "hidden_size": 64, "intermediate_size": 128,
                                       "num_hidden_layers": 1, "num_attention_heads": 4,
                                       "num_key_value_heads": 2, "vocab_size": 256},
                                      fake_memory.Stack(precision="fp32"), 32), "stack"),
    ("04", "window larger than the sequence",
     lambda: sparse_attention.attention_mask(16, window=32), "window"),
    ("04", "chunk size 0", lambda: chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8),
                                                          torch.zeros(4, dtype=torch.long), 0),
     "chunk_size"),
    ("04", "curriculum with min > max",
     lambda: curriculum.SeqLenCurriculum(512, 128, warmup_steps=10), "min_len"),
    ("04", "sequence beyond the positional capacity",
     lambda: max_context.check_positions(_llama().config, 4096), "seq_len"),
    ("04", "needle depth outside [0, 1]",
     lambda: passkey.episode(None, 100, 1.5, random.Random(0)), "depth"),
    # the argument checks the rest of the suite never reaches (found by a coverage run of the
    # unit tests, 2026-12-08): each says what it was given and what it needs
    ("01", "NF4 bytes of an empty weight", lambda: calc.nf4_tensor_bytes(0, 64), "out_features"),
    ("01", "8-bit AdamW state of a negative size",
     lambda: calc.adamw_8bit_state_bytes([4096, -1]), "numels"),
    ("01", "accumulation steps that do not divide the batch",
     lambda: calc.escalation_table(planner.resolve_shape("Llama-3.2-1B")[1], 512, 3, 2**30,
                                   grad_accum_steps=2), "grad_accum_steps"),
    ("01", "checkpointing every 0 layers",
     lambda: checkpointing.enable_activation_checkpointing(_llama(), every_n_layers=0),
     "every_n_layers"),
    ("01", "unknown loss normalization",
     lambda: grad_accumulation.forward_backward(_llama(), _batch(), normalization="mean"),
     "normalization"),
    ("01", "gradients under different names",
     lambda: numerics.max_rel_error({"x": torch.ones(1)}, {"y": torch.ones(1)}), "a"),
    ("01", "8-bit AdamW over tensors on the meta device",
     lambda: optim8bit.make_adamw_8bit([torch.nn.Parameter(torch.empty(4, device="meta"))]),
     "params"),
    ("01", "an optimizer over a frozen model",
     lambda: train.make_optimizer(_frozen_llama(), train.TrainConfig()), "model"),
    ("01", "negative evaluation interval", lambda: train.TrainConfig(eval_every=-1).validate(),
     "eval_every"),
    ("01", "unknown precision's dtype", lambda: device.dtype_of("fp8"), "precision"),
    ("01", "examples cut to one token", lambda: data.tokenize_examples([], None, 1, "lm"),
     "max_length"),
    ("01", "a batch of no examples", lambda: data.collate([], 0), "examples"),
    ("01", "tiny model with a zero learning rate", lambda: model.TinyModelSpec(pretrain_lr=0.0),
     "pretrain_lr"),
    ("01", "tiny model whose key-value heads do not divide its heads",
     lambda: model.TinyModelSpec(num_key_value_heads=3), "num_key_value_heads"),
    ("01", "a tokenizer smaller than the bytes", lambda: model.train_tokenizer(["a"], 100, 16),
     "vocab_size"),
    ("01", "fake-tensor LoRA with dropout 1",
     lambda: fake_memory.Stack(method="lora", lora_dropout=1.0), "lora_dropout"),
    ("01", "fake-tensor LoRA targets that are not names",
     lambda: fake_memory.Stack(method="lora", lora_targets=(1, 2)), "lora_targets"),
    ("01", "LoRA weight bytes of layers the model lacks",
     lambda: quantization.linear_weight_bytes(_llama(), ["model.nope"]), "names"),
    ("02", "data parallel over no ranks",
     lambda: calc.data_parallel_bytes(planner.resolve_shape("Llama-3.2-1B")[1], 0, "ddp", 512, 1),
     "world_size"),
    ("02", "fake-tensor FSDP on one rank", lambda: fake_memory.fsdp_per_rank("Llama-3.2-1B", 1),
     "ranks"),
    ("02", "a torchrun job with nothing to run", lambda: distributed.launch([]), "calls"),
    ("02", "a loader over no texts", lambda: data_loading.StoredTextDataset([], None, 16),
     "texts"),
    ("02", "no documents to draw",
     lambda: packing.long_tailed_documents([{"input_ids": [1] * 20}], 0, 64, 32), "n"),
    ("02", "document lengths with no spread",
     lambda: packing.long_tailed_documents([{"input_ids": [1] * 20}], 4, 64, 32, sigma=0.0),
     "sigma"),
    ("02", "packing no documents", lambda: packing.pack_documents([], 64), "examples"),
    ("02", "a padding-free batch with an empty row",
     lambda: packing.collate_padding_free([[]], 0), "rows"),
    ("02", "unknown accelerate precision", lambda: trainers.accelerate_config(_llama(), 2, "fp8"),
     "mixed_precision"),
    ("02", "unknown trainer figure",
     lambda: trainers.compare_runs(None, [], None, {}, metric="speed"), "metric"),
    ("02", "a GPU run never recorded", lambda: results.load_raw("no-such-gpu", "01_x"), "name"),
    ("03", "unknown SDPA backend",
     lambda: attention.sdpa_attention(*(torch.randn(1, 1, 8, 8),) * 3, backend="fast"),
     "backend"),
    ("03", "availability of an unknown SDPA backend",
     lambda: attention.backend_available("fast", "cpu", torch.float32), "backend"),
    ("03", "int8 bytes of an empty weight", lambda: calc.int8_linear_bytes(0, 64),
     "out_features"),
    ("03", "Amdahl's law with a zero speed-up", lambda: calc.amdahl_speedup(0.5, 0.0),
     "part_speedup"),
    ("03", "int8 kernel speed-up of a model with no Linear layers",
     lambda: ptq.linear_kernel_speedup(torch.nn.Sequential(torch.nn.ReLU())), "model"),
    ("03", "GEMM sizing table at no tokens",
     lambda: gemm_bench.sizing_table([64, 128, 256], tokens=0), "tokens"),
    ("04", "chunked loss over 3-D hidden states",
     lambda: chunked_linear_loss(torch.randn(2, 4, 8), torch.randn(10, 8), _ce_sum, 4,
                                 torch.zeros(8, dtype=torch.long)), "hidden"),
    ("04", "chunked loss targets shorter than the tokens",
     lambda: chunked_linear_loss(torch.randn(4, 8), torch.randn(10, 8), _ce_sum, 4,
                                 torch.zeros(3, dtype=torch.long)), "targets"),
    ("04", "chunked loss on a module that is not a transformers model",
     lambda: architectures.lm_head_weight(torch.nn.Linear(8, 10)), "model"),
    ("04", "chunked loss on a model without an output head",
     lambda: architectures.lm_head_weight(_headless_llama()), "model"),
    ("04", "chunked loss on an output head with a bias",
     lambda: architectures.lm_head_weight(_biased_head()), "model"),
    ("04", "ring attention's sequence not split into 2 x ranks",
     lambda: calc.ring_attention_bytes(planner.resolve_shape("Llama-3.2-1B")[1], 100, 1, 4),
     "seq_len"),
    ("04", "a curriculum's token budget of none",
     lambda: curriculum.SeqLenCurriculum(128, 512, warmup_steps=10).steps_for_token_budget(0, 4),
     "tokens"),
    ("04", "a sequence of no tokens", lambda: max_context.check_positions(_llama().config, 0),
     "seq_len"),
    ("04", "passkey batches of no episodes",
     lambda: passkey.PasskeyStream(None, 0, lambda step: 64), "batch_size"),
]


@pytest.mark.parametrize("notebook, what, call, param", CASES,
                         ids=[f"{c[0]}-{c[1].replace(' ', '_')}" for c in CASES])
def test_bad_input_gives_one_clear_error(notebook, what, call, param):
    TRIED[what] = False
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert message.startswith(param) or f"{param}=" in message or f"{param}:" in message, message
    TRIED[what] = True


def test_offline_hub_id_and_bad_build_leave_nothing_on_disk(tmp_path, monkeypatch, summary):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    TRIED["hub id without a network"] = False
    with pytest.raises(ValueError, match="model_id_or_path"):
        model.load_model("meta-llama/Llama-3.2-1B")
    TRIED["hub id without a network"] = True
    TRIED["unknown architecture for the tiny model"] = False
    with pytest.raises(ValueError, match="architecture"):
        model.build_tiny_model(tmp_path / "m", model.TinyModelSpec(architecture="rwkv"))
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    TRIED["unknown architecture for the tiny model"] = True
    # the last test of this file: report the whole table
    summary.append(f"bad inputs: {len(TRIED)} tried, {sum(TRIED.values())} gave one clear error "
                   "naming the parameter")
