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
    attention,
    calc,
    curriculum,
    data,
    distillation,
    distributed,
    fake_memory,
    max_context,
    model,
    norms,
    passkey,
    planner,
    ptq,
    quantization,
    results,
    sparse_attention,
    timing,
    train,
)
from recipes_lib.chunked_loss import chunked_cross_entropy

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
