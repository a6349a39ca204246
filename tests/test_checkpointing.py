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
