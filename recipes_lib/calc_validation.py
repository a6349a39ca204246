"""The calculator against measured bytes, for Llama models at several sizes.

Parameters, gradients and optimizer state are measured as the bytes of the real tensors after a
training step; activations as the bytes autograd saves for backward (``memory.saved_tensor_bytes``,
storages counted once, parameter views excluded). ``make run`` writes each term's worst relative
error to ``calc_validation.json`` in the results directory; the tests assert the bounds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from recipes_lib import calc, grad_accumulation, memory, results

# (hidden, layers, intermediate, heads, kv heads, seq_len, batch)
SIZES = [(64, 1, 192, 1, 1, 64, 2), (128, 2, 384, 2, 1, 128, 2), (256, 2, 768, 4, 2, 128, 4),
         (256, 4, 768, 4, 2, 256, 2), (512, 2, 1376, 8, 4, 256, 2)]
TERMS = ("params", "grads", "optimizer", "activations")


def relative_errors(size: tuple[int, ...], vocab_size: int = 512, head_dim: int | None = None
                    ) -> dict[str, float]:
    """|measured - predicted| / measured for each term, at one size (fp32, AdamW, eager).

    Args:
        size: the model's 7 sizes, as in :data:`SIZES`.
        vocab_size: the model's vocabulary.
        head_dim: the attention heads' width (None: hidden / heads; Qwen3 and Gemma set it
            wider).

    Returns:
        term -> relative error.

    Raises:
        ValueError: for a size that is not 7 positive integers.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if len(size) != 7 or min(size) < 1:
        raise ValueError(f"size={size!r}: expected (hidden, layers, intermediate, heads, "
                         "kv_heads, seq_len, batch), all >= 1")
    h, layers, inter, heads, kv, seq, batch = size
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=h, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=max(512, seq),
                      tie_word_embeddings=False, head_dim=head_dim or h // heads)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(3, vocab_size, (batch, seq))
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
    return {term: abs(measured[term] - predicted[term]) / measured[term] for term in TERMS}


def worst_errors(per_size: list[dict[str, float]]) -> dict[str, float]:
    """Each term's worst relative error over sizes.

    Args:
        per_size: :func:`relative_errors` at each size.

    Returns:
        term -> the largest error.
    """
    return {term: max(errors[term] for errors in per_size) for term in TERMS}


def save(worst: dict[str, float], results_dir: Path | str | None = None) -> Path:
    """Write the worst errors as ``calc_validation.json`` (results directory by default).

    Args:
        worst: :func:`worst_errors`' result.
        results_dir: where to write it.

    Returns:
        The file written.
    """
    r = results.Results("calc_validation", "cpu (calculator vs measured tensors)", results_dir)
    for term, err in worst.items():
        r.add("calculator", f"{term}_rel_error", err, baseline=0.0, unit="worst relative error")
    return r.save()


def run(sizes: list[tuple[int, ...]] = SIZES) -> Path:
    """Measure every size and save the worst errors (what ``make run`` calls).

    Args:
        sizes: the model sizes measured.

    Returns:
        The file written.
    """
    torch.manual_seed(0)
    return save(worst_errors([relative_errors(size) for size in sizes]))
