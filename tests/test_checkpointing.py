from collections import defaultdict

import pytest
import torch

from recipes_lib import checkpointing
from recipes_lib.compare import measure_training_step
from recipes_lib.grad_accumulation import batch_gradients
from recipes_lib.numerics import max_abs_diff


def test_checkpointing_gives_identical_gradients_and_less_activation_memory(small_llama,
                                                                            varlen_batch):
    ref = batch_gradients(small_llama, varlen_batch)
    plain = measure_training_step(small_llama, varlen_batch, repeats=1).memory
    checkpointing.enable_activation_checkpointing(small_llama)
    got = batch_gradients(small_llama, varlen_batch)
    ckpt = measure_training_step(small_llama, varlen_batch, repeats=1).memory
    assert max_abs_diff(got, ref) <= 1e-6
    assert ckpt.activation_bytes < plain.activation_bytes


@pytest.mark.parametrize("partial", [{"every_n_layers": 2}, {"selective": True}],
                         ids=["every other layer", "selective"])
def test_partial_checkpointing_keeps_the_gradients_between_full_and_none(small_llama,
                                                                       varlen_batch, partial):
    """Checkpointing every other layer, or selectively inside each layer (every other matmul's
    output and attention's kept), recomputes exactly (the gradients of the plain step) and keeps
    more than full checkpointing, less than none."""
    ref = batch_gradients(small_llama, varlen_batch)
    plain = measure_training_step(small_llama, varlen_batch, repeats=1).memory
    checkpointing.enable_activation_checkpointing(small_llama, **partial)
    got = batch_gradients(small_llama, varlen_batch)
    between = measure_training_step(small_llama, varlen_batch, repeats=1).memory
    checkpointing.enable_activation_checkpointing(small_llama)
    full = measure_training_step(small_llama, varlen_batch, repeats=1).memory
    assert max_abs_diff(got, ref) <= 1e-6
    assert full.activation_bytes < between.activation_bytes < plain.activation_bytes


def test_selective_must_be_a_bool(small_llama):
    with pytest.raises(TypeError, match="selective='op'"):
        checkpointing.enable_activation_checkpointing(small_llama, selective="op")


def test_the_selective_policy_keeps_every_other_matmul_in_forward_and_recompute_alike():
    keep = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    counts = defaultdict(int)
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    for recompute in (False, True):
        ctx = type("Ctx", (), {"is_recompute": recompute})()
        verdicts = [checkpointing._selective_policy(counts, ctx, f) == keep
                    for f in (mm, add, mm, mm, add, mm)]
        assert verdicts == [True, False, False, True, False, False]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert checkpointing._selective_policy(counts, ctx, flash) == keep


class _OlderModel(torch.nn.Module):
    """A model as transformers 5.0-5.22 exposes it: gradient_checkpointing_enable only (5.16
    added every_n_layers to it); records the calls."""

    supports_gradient_checkpointing = True

    def __init__(self, every_n: bool):
        super().__init__()
        self.config, self.calls = type("Config", (), {})(), []
        if every_n:
            self.gradient_checkpointing_enable = self._with_every_n

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.calls.append(gradient_checkpointing_kwargs)

    def _with_every_n(self, gradient_checkpointing_kwargs=None, every_n_layers=1):
        self.calls.append((gradient_checkpointing_kwargs, every_n_layers))


def test_older_transformers_get_the_call_their_version_has():
    between = _OlderModel(every_n=True)  # 5.16 to 5.22
    checkpointing.enable_activation_checkpointing(between, every_n_layers=3)
    assert between.calls == [({"use_reentrant": False}, 3)]
    before = _OlderModel(every_n=False)  # 5.0 to 5.15
    checkpointing.enable_activation_checkpointing(before)
    assert before.calls == [{"use_reentrant": False}] and before.config.use_cache is False
    with pytest.raises(ValueError, match="every_n_layers=2: needs transformers >= 5.16"):
        checkpointing.enable_activation_checkpointing(_OlderModel(every_n=False), every_n_layers=2)


def test_unsupported_model_is_a_clear_error():
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        checkpointing.enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_offload_on_cpu_says_it_does_nothing_and_changes_nothing(small_llama, varlen_batch):
    ref = batch_gradients(small_llama, varlen_batch)
    with pytest.warns(UserWarning, match="already in CPU memory"):
        ctx = checkpointing.offload_activations("cpu")
    with ctx:
        got = batch_gradients(small_llama, varlen_batch)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.gpu
def test_offload_on_gpu_moves_saved_tensors_to_cpu(small_llama, varlen_batch):
    from recipes_lib.memory import measure_memory

    model = small_llama.cuda()
    batch = {k: v.cuda() for k, v in varlen_batch.items()}
    plain = measure_memory(lambda: model(**batch).logits.sum().backward(), model)
    with checkpointing.offload_activations("cuda"):
        off = measure_memory(lambda: model(**batch).logits.sum().backward(), model)
    assert off.activation_bytes < plain.activation_bytes
