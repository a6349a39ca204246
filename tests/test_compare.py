import matplotlib
import pytest

from recipes_lib import compare
from recipes_lib import grad_accumulation as ga

matplotlib.use("Agg")


def test_side_by_side_ratio_and_plots(small_llama, varlen_batch):
    table = compare.side_by_side({"bytes": (200.0, 50.0)})
    assert table.loc["bytes", "ratio"] == 0.25
    m = compare.measure_training_step(small_llama, varlen_batch, repeats=1)
    assert m.memory.activation_bytes > 0 and m.timing.median_s > 0
    assert all(p.grad is None for p in small_llama.parameters())
    assert compare.memory_table({"a": m.memory}).loc["peak", "a"] > 0
    assert compare.plot_memory_breakdown({"a": m.memory, "b": m.memory}).axes
    assert compare.plot_losses({"run": [3.0, 2.0]}).axes


def test_several_variants_measured_with_interleaved_timing(small_llama, varlen_batch):
    m = compare.measure_training_steps({"a": small_llama, "b": small_llama}, varlen_batch,
                                       repeats=2)
    assert set(m) == {"a", "b"}
    assert m["a"].memory.peak_bytes == m["b"].memory.peak_bytes
    assert len(m["a"].timing.times_s) == 2


def test_memory_only_and_no_warmup(small_llama, varlen_batch):
    m = compare.measure_training_step(small_llama, varlen_batch, repeats=0, warmup=False)
    assert m.timing is None and m.memory.peak_bytes > 0
    with pytest.raises(ValueError, match="repeats"):
        compare.measure_training_step(small_llama, varlen_batch, repeats=-1)


def test_a_step_runs_the_loss_it_is_given(small_llama, varlen_batch):
    """``loss_fn`` reaches the step's forward and backward: chunked cross-entropy, whose
    logits never exist whole, keeps fewer activations than the model's own loss."""
    from recipes_lib.chunked_loss import ChunkedCausalLMLoss

    calls = []

    def chunked(model, batch):
        calls.append(1)
        return ChunkedCausalLMLoss(4)(model, batch)

    own = compare.measure_training_step(small_llama, varlen_batch, repeats=0)
    m = compare.measure_training_step(small_llama, varlen_batch, repeats=0, loss_fn=chunked)
    assert len(calls) == 2  # the warm-up step and the measured one
    assert m.memory.activation_bytes < own.memory.activation_bytes


def test_accumulation_holds_one_micro_batchs_activations(small_llama, varlen_batch):
    m = compare.measure_accumulation(small_llama, varlen_batch, 4)
    full = compare.measure_training_step(small_llama, varlen_batch, repeats=0).memory
    acc, largest = m["accumulated"], m["largest_micro_batch"]
    assert acc.activation_bytes <= 1.1 * largest.activation_bytes
    assert acc.activation_bytes < full.activation_bytes
    micro = [compare.measure_training_step(small_llama, mb, repeats=0).memory.peak_bytes
             for mb in ga.split_micro_batches(varlen_batch, 4)]
    assert largest.peak_bytes == max(micro)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        compare.measure_accumulation(small_llama, varlen_batch, 5)
