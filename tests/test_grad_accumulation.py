import pytest
import torch
import torch.nn.functional as F

from recipes_lib import grad_accumulation as ga
from recipes_lib.numerics import max_rel_error


def test_loss_sum_matches_cross_entropy(varlen_batch):
    logits = torch.randn(*varlen_batch["input_ids"].shape, 128)
    labels = varlen_batch["labels"]
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1),
                          ignore_index=-100)
    got = ga.causal_lm_loss_sum(logits, labels) / ga.count_target_tokens(labels)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_accumulated_equals_large_batch_with_padding(small_llama, varlen_batch, k):
    ref = ga.batch_gradients(small_llama, varlen_batch, 1)
    got = ga.batch_gradients(small_llama, varlen_batch, k)
    assert max_rel_error(got, ref) <= 1e-5


def test_mean_of_means_is_wrong_on_variable_lengths(small_llama, varlen_batch):
    ref = ga.batch_gradients(small_llama, varlen_batch, 1)
    naive = ga.batch_gradients(small_llama, varlen_batch, 4, "mean_of_means")
    assert max_rel_error(naive, ref) > 1e-3


def test_split_trims_padding_and_validates(varlen_batch):
    micro = ga.split_micro_batches(varlen_batch, 4)
    assert len(micro) == 4
    assert all(m["attention_mask"][:, -1].any() for m in micro)
    with pytest.raises(ValueError, match="grad_accum_steps=0"):
        ga.split_micro_batches(varlen_batch, 0)
    with pytest.raises(ValueError, match="grad_accum_steps=3: does not divide"):
        ga.split_micro_batches(varlen_batch, 3)


def _left_padded(batch):
    # each row's pad columns moved to its front, as a tokenizer with padding_side="left" pads
    shifts = (batch["attention_mask"] == 0).sum(1)
    return {k: torch.stack([row.roll(int(n)) for row, n in zip(v, shifts)])
            for k, v in batch.items()}


def test_a_left_padded_batch_keeps_every_token_and_still_equals_one_batch(small_llama,
                                                                          varlen_batch):
    left = _left_padded(varlen_batch)
    assert not left["attention_mask"][:, 0].all() and left["attention_mask"][:, -1].all()
    micro = ga.split_micro_batches(left, 4)
    assert sum(int(m["attention_mask"].sum()) for m in micro) == int(left["attention_mask"].sum())
    ref = ga.batch_gradients(small_llama, left, 1)
    assert max_rel_error(ga.batch_gradients(small_llama, left, 4), ref) <= 1e-5


def test_no_targets_is_a_clear_error(small_llama, varlen_batch):
    empty = dict(varlen_batch, labels=torch.full_like(varlen_batch["labels"], -100))
    with pytest.raises(ValueError, match="no target tokens"):
        ga.forward_backward(small_llama, empty)


def test_the_loss_stays_on_the_device_until_read(small_llama, varlen_batch):
    loss = ga.forward_backward(small_llama, varlen_batch, 4)  # no host sync per micro-batch
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
    logits = small_llama(input_ids=varlen_batch["input_ids"],
                         attention_mask=varlen_batch["attention_mask"]).logits
    labels = varlen_batch["labels"]
    ref = ga.causal_lm_loss_sum(logits, labels) / ga.count_target_tokens(labels)
    assert abs(float(loss) - ref.item()) <= 1e-5


def test_the_step_holds_no_logits_through_backward():
    """The logits are the largest tensor of a small model's step. Autograd keeps the
    log-probabilities; the loop must not also hold the logits while backward runs (it did: one
    more tokens x vocab tensor than Trainer's step, notebook 04 §3 measures both)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes_lib import compare

    cfg = LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 8192, (2, 64))
    step = compare.measure_training_step(model, {"input_ids": ids, "labels": ids.clone()},
                                         repeats=0)
    logits_bytes = ids.numel() * 8192 * 4
    # log-probabilities, their gradient and the logits' gradient, with the layers' few bytes
    assert step.memory.activation_bytes < 3.2 * logits_bytes, (
        step.memory.activation_bytes / logits_bytes)
