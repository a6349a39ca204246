import pytest
import torch

pytest.importorskip("bitsandbytes")

from recipes_lib import calc, optim8bit


def _steps(model, opt, steps=3):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(3, 128, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_state_bytes_equal_the_calculator_and_are_a_quarter_of_adamw(small_llama):
    opt = optim8bit.make_adamw_8bit(small_llama.parameters())
    _steps(small_llama, opt, 1)
    numels = [p.numel() for p in small_llama.parameters()]
    assert optim8bit.state_bytes(opt) == calc.adamw_8bit_state_bytes(numels)
    big = torch.nn.Linear(1024, 1024, bias=False)  # the regime of real models: large tensors
    ref, q = torch.optim.AdamW(big.parameters()), optim8bit.make_adamw_8bit(big.parameters())
    for o in (ref, q):
        big(torch.randn(2, 1024)).sum().backward()
        o.step()
    assert optim8bit.state_bytes(q) / optim8bit.state_bytes(ref) <= 0.26


def test_overrides_left_in_the_process_do_not_reach_the_course_optimizer(small_llama):
    """Trainer's optim="adamw_bnb_8bit" leaves a 32-bit override for every embedding in
    bitsandbytes' process-wide manager, keyed by position too: here another model's, at the
    position of small_llama's first parameter."""
    from bitsandbytes.optim import AdamW8bit, GlobalOptimManager

    other = torch.nn.Embedding(128, 64)
    manager = GlobalOptimManager.get_instance()
    manager.register_module_override(other, "weight", {"optim_bits": 32})
    try:
        plain = AdamW8bit(other.parameters())  # as Trainer builds it: (0, 0) is `other`'s
        other(torch.tensor([1])).sum().backward()
        plain.step()
        assert (0, 0) in manager.index2config
        opt = optim8bit.make_adamw_8bit(small_llama.parameters())
        _steps(small_llama, opt, 1)
        numels = [p.numel() for p in small_llama.parameters()]
        assert optim8bit.state_bytes(opt) == calc.adamw_8bit_state_bytes(numels)
    finally:
        assert optim8bit.forget_overrides(other) == 1
    assert (0, 0) not in manager.index2config and not manager.module_weight_config_triple


def test_fp32_states_keep_the_embedding_as_trainer_does(small_llama):
    from recipes_lib import trainers

    opt = optim8bit.make_adamw_8bit(small_llama.parameters(),
                                    fp32_states=[small_llama.get_input_embeddings().weight])
    _steps(small_llama, opt, 1)
    adamw = calc.optimizer_bytes(sum(p.numel() for p in small_llama.parameters()), "adamw")
    assert optim8bit.state_bytes(opt) / adamw == pytest.approx(
        trainers.predicted_8bit_state_ratio(small_llama), abs=1e-12)


def test_updates_match_adamw_within_the_quantization_band(small_llama):
    import copy

    ref_model, q_model = small_llama, copy.deepcopy(small_llama)
    start = {n: p.detach().clone() for n, p in small_llama.named_parameters()}
    _steps(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-3))
    _steps(q_model, optim8bit.make_adamw_8bit(q_model.parameters(), lr=1e-3))
    # The 8-bit dynamic map resolves a moment to ~1 % of its block's absmax: each tensor's
    # update (new - start) stays within 5 % of AdamW's (measured: ~1 %, 4 % for the embedding,
    # whose rows see a gradient only when their token occurs).
    with torch.no_grad():
        for (name, a), (_, b) in zip(ref_model.named_parameters(), q_model.named_parameters()):
            step_ref, step_q = a - start[name], b - start[name]
            assert float((step_q - step_ref).norm() / step_ref.norm()) <= 0.05, name


def test_bad_inputs(small_llama):
    with pytest.raises(ValueError, match="backend='torchao'"):
        optim8bit.make_adamw_8bit(small_llama.parameters(), backend="torchao")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="paged=True"):
            optim8bit.make_adamw_8bit(small_llama.parameters(), paged=True)
    with pytest.raises(ValueError, match="fp32_states"):
        optim8bit.make_adamw_8bit(small_llama.parameters(),
                                  fp32_states=[torch.nn.Parameter(torch.zeros(2))])
    for p in small_llama.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="params"):
        optim8bit.make_adamw_8bit(small_llama.parameters())
    with pytest.raises(ValueError, match="block_size=0"):
        calc.adamw_8bit_state_bytes([10], block_size=0)


def test_compare_with_adamw_starts_both_from_the_same_weights(small_llama):
    import copy

    from recipes_lib import train

    examples = [{"input_ids": list(range(3, 40)), "labels": list(range(3, 40))}] * 8
    runs = optim8bit.compare_with_adamw(lambda: copy.deepcopy(small_llama), examples, 0,
                                        train.TrainConfig(steps=2, micro_batch_size=4,
                                                          progress=False))
    assert list(runs) == ["AdamW", "8-bit AdamW"]
    assert runs["AdamW"]["losses"][0] == runs["8-bit AdamW"]["losses"][0]  # same start
    assert runs["8-bit AdamW"]["state_bytes"] < runs["AdamW"]["state_bytes"]
