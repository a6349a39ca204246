import pytest
import torch

from recipes_lib.train import TrainConfig, make_optimizer, train


def _examples(n=32):
    return [{"input_ids": [1] + [3 + (i + j) % 7 for j in range(12)],
             "labels": [1] + [3 + (i + j) % 7 for j in range(12)]} for i in range(n)]


def test_loss_falls_and_history_is_kept(small_llama):
    cfg = TrainConfig(steps=30, micro_batch_size=4, grad_accum_steps=2, lr=3e-3, progress=False)
    res = train(small_llama, _examples(), 0, cfg)
    assert len(res.losses) == 30 and len(res.step_times) == 30
    assert res.losses[-1] < 0.5 * res.losses[0]
    assert res.target_tokens == 30 * 8 * 12


def test_tensorboard_log(small_llama, tmp_path):
    cfg = TrainConfig(steps=2, micro_batch_size=4, progress=False, log_dir=str(tmp_path))
    train(small_llama, _examples(), 0, cfg)
    assert list(tmp_path.glob("events.out.tfevents*"))


@pytest.mark.parametrize("field, value", [("steps", 0), ("grad_accum_steps", 0),
                                          ("micro_batch_size", -1), ("lr", 0.0),
                                          ("warmup_steps", 500), ("schedule", "cyclic"),
                                          ("max_grad_norm", -1.0)])
def test_bad_config_names_the_field(small_llama, field, value):
    cfg = TrainConfig(**{"steps": 10, "progress": False, field: value})
    with pytest.raises(ValueError, match=field):
        train(small_llama, _examples(), 0, cfg)


def test_global_batch_larger_than_data(small_llama):
    with pytest.raises(ValueError, match="batch_size=64"):
        train(small_llama, _examples(8), 0, TrainConfig(steps=1, micro_batch_size=64,
                                                        progress=False))


def test_eval_every_records_step_tokens_and_value(small_llama, varlen_batch):
    from recipes_lib import train

    examples = [{"input_ids": ids[m.bool()].tolist(), "labels": lab[m.bool()].tolist()}
                for ids, lab, m in zip(varlen_batch["input_ids"], varlen_batch["labels"],
                                       varlen_batch["attention_mask"])]
    calls = []
    result = train.train(small_llama, examples, 0, train.TrainConfig(
        steps=5, micro_batch_size=4, eval_every=2, progress=False),
        eval_fn=lambda m: calls.append(m.training) or 1.5)
    assert [e[0] for e in result.evals] == [2, 4, 5] and calls == [True, True, True]
    assert result.evals[-1][1] == result.target_tokens and result.evals[0][2] == 1.5


def test_on_step_sees_every_step_and_can_stop_the_run(small_llama):
    seen = []

    def on_step(step, result):
        seen.append((step, len(result.losses), type(result.losses[-1])))
        if step == 3:
            raise KeyboardInterrupt  # as a user's early stop, or a test's injected fault
    with pytest.raises(KeyboardInterrupt):
        train(small_llama, _examples(), 0, TrainConfig(steps=5, micro_batch_size=4,
                                                       progress=False), on_step=on_step)
    assert seen == [(1, 1, float), (2, 2, float), (3, 3, float)]


def test_kill_rank_after_spares_other_ranks_and_restarts(monkeypatch):
    from recipes_lib import distributed

    killed = []
    monkeypatch.setattr(distributed.os, "kill", lambda pid, sig: killed.append(sig))
    distributed.kill_rank_after(rank=1, step=2)(2, None)  # this process is rank 0: spared
    distributed.kill_rank_after(rank=0, step=2)(1, None)  # not the step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    distributed.kill_rank_after(rank=0, step=2)(2, None)  # a restarted attempt runs on
    assert killed == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    distributed.kill_rank_after(rank=0, step=2)(2, None)
    assert killed == [distributed.signal.SIGKILL]


def test_adamw_is_fused_where_every_parameter_is_on_a_gpu():
    # fused holds no temporary the size of the second moments, as foreach (CUDA's default) does
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # a CUDA parameter without a GPU
        on_gpu = torch.nn.Module()
        on_gpu.w = torch.nn.Parameter(torch.empty(4, 4, device="cuda"))
        assert make_optimizer(on_gpu, TrainConfig()).param_groups[0]["fused"]
    on_cpu = make_optimizer(torch.nn.Linear(4, 4), TrainConfig())
    assert not on_cpu.param_groups[0]["fused"]  # the CPU keeps torch's default, the for-loop


def test_compare_optimizers_runs_each_from_the_same_weights_in_the_one_loop(small_llama):
    import copy

    from recipes_lib.train import compare_optimizers

    cfg = TrainConfig(steps=2, micro_batch_size=4, lr=1e-3, progress=False)
    runs = compare_optimizers(
        lambda: copy.deepcopy(small_llama), _examples(8), 0, cfg,
        {"default": None, "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=1e-3)},
        lambda model, run, opt: {"losses": run.losses, "optimizer": type(opt).__name__})
    assert [r["optimizer"] for r in runs.values()] == ["AdamW", "SGD"]  # None: make_optimizer
    assert runs["default"]["losses"][0] == runs["SGD"]["losses"][0]  # same start, same batch
    with pytest.raises(ValueError, match="optimizers"):
        compare_optimizers(lambda: small_llama, _examples(8), 0, cfg, {}, lambda *a: {})
