"""The calculator against measured bytes, for Llama models at several sizes.

Parameters, gradients and optimizer state are measured as the bytes of the real tensors after a
training step; activations as the bytes autograd saves for backward (``memory.saved_tensor_bytes``,
storages counted once, parameter views excluded). The worst relative error of each term is
written to ``results/calc_validation.json``.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recipes_lib import calc, grad_accumulation, memory, results

SIZES = [  # (hidden, layers, intermediate, heads, kv heads, seq_len, batch)
    (64, 1, 192, 1, 1, 64, 2), (128, 2, 384, 2, 1, 128, 2), (256, 2, 768, 4, 2, 128, 4),
    (256, 4, 768, 4, 2, 256, 2), (512, 2, 1376, 8, 4, 256, 2),
]
WORST: dict[str, float] = {}


@pytest.mark.parametrize("size", SIZES, ids=[f"h{s[0]}-L{s[1]}-s{s[5]}" for s in SIZES])
def test_calculator_terms_match_measured_bytes(size):
    h, layers, inter, heads, kv, seq, batch = size
    cfg = LlamaConfig(vocab_size=512, hidden_size=h, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(3, 512, (batch, seq))
    shape = calc.ModelShape.from_config(cfg)
    n = calc.param_count(shape)["total"]
    saved = memory.saved_tensor_bytes(
        lambda: grad_accumulation.causal_lm_loss_sum(model(input_ids=ids).logits, ids).backward())
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    measured = {
        "params": memory.tensor_bytes(model.parameters()),
        "grads": memory.tensor_bytes(p.grad for p in model.parameters()),
        "optimizer": memory.tensor_bytes(t for st in opt.state.values() for t in st.values()
                                         if t.dim() > 0),  # the moments, not the step counters
        "activations": sum(saved.values()),
    }
    predicted = {"params": 4 * n, "grads": calc.gradient_bytes(n, "fp32"),
                 "optimizer": calc.optimizer_bytes(n, "adamw"),
                 "activations": calc.llama_activation_bytes(shape, seq, batch, 4)["total"]}
    for term, value in measured.items():
        WORST[term] = max(WORST.get(term, 0.0), abs(value - predicted[term]) / value)
    assert WORST["params"] <= 0.10 and WORST["grads"] <= 0.10 and WORST["optimizer"] <= 0.10
    assert WORST["activations"] <= 0.25, (measured, predicted)


def test_worst_errors_are_written(summary):
    if len(WORST) < 4:
        pytest.skip("run with the size cases")
    r = results.Results("calc_validation", "cpu (calculator vs measured tensors)")
    for term, err in WORST.items():
        r.add("calculator", f"{term}_rel_error", err, baseline=0.0, unit="worst relative error")
    path = r.save()
    summary.append(f"calculator vs measured (worst of {len(SIZES)} sizes): "
                   + ", ".join(f"{k} {v:.3f}" for k, v in WORST.items()) + f" -> {path.name}")
