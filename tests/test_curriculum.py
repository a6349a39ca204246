import pytest
import torch

from recipes_lib.curriculum import SeqLenCurriculum


def _batch(b=4, s=64):
    ids = torch.arange(b * s).reshape(b, s)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_linear_schedule_grows_to_max_and_stays():
    c = SeqLenCurriculum(16, 128, warmup_steps=10, multiple_of=8)
    lengths = [c.length_at(s) for s in range(15)]
    assert lengths[0] == 16 and lengths[10:] == [128] * 5
    assert lengths == sorted(lengths) and all(x % 8 == 0 for x in lengths)


def test_step_schedule_has_plateaus():
    c = SeqLenCurriculum(32, 128, warmup_steps=8, schedule="step", n_stages=4)
    assert [c.length_at(s) for s in range(9)] == [32, 32, 56, 56, 80, 80, 104, 104, 128]


def test_crop_and_split_modes():
    crop = SeqLenCurriculum(16, 64, warmup_steps=4)
    out = crop.shorten(_batch(), 0)
    assert out["input_ids"].shape == (4, 16)
    assert torch.equal(out["input_ids"], _batch()["input_ids"][:, :16])
    split = SeqLenCurriculum(16, 64, warmup_steps=4, mode="split")
    out = split.shorten(_batch(), 0)
    assert out["input_ids"].shape == (16, 16)
    assert torch.equal(out["input_ids"].reshape(4, 64), _batch()["input_ids"])  # same tokens


def test_wrap_follows_the_steps_and_token_budget():
    c = SeqLenCurriculum(16, 64, warmup_steps=4)
    widths = [b["input_ids"].shape[1] for b in c.wrap(_batch() for _ in range(6))]
    assert widths == [16, 24, 40, 48, 64, 64]
    assert c.tokens_until(6, 4) == 4 * sum(widths)
    steps = c.steps_for_token_budget(4 * sum(widths), 4)
    assert steps == 6 and c.steps_for_token_budget(10 * 4 * 64, 4) > 10


def test_wrap_plugs_into_the_training_loop(small_llama):
    from recipes_lib import train

    c = SeqLenCurriculum(8, 32, warmup_steps=3)
    ids = torch.randint(3, 128, (4, 32))
    stream = c.wrap({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
                    for _ in range(5))
    result = train.train(small_llama, [], 0, train.TrainConfig(steps=5, micro_batch_size=4,
                                                               progress=False),
                         batch_stream=stream)
    assert len(result.losses) == 5
    assert result.target_tokens == 4 * sum(c.length_at(s) - 1 for s in range(5))


@pytest.mark.parametrize("kwargs, match", [
    ({"min_len": 128, "max_len": 64}, "min_len=128 > max_len=64"),
    ({"min_len": 0}, "min_len"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"schedule": "cosine"}, "schedule"),
    ({"mode": "pack"}, "mode"),
    ({"min_len": 24, "mode": "split"}, "must divide"),
])
def test_bad_settings_name_the_parameter(kwargs, match):
    args = {"min_len": 16, "max_len": 64, "warmup_steps": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        SeqLenCurriculum(**args)


def test_tokens_to_reach_interpolates():
    from recipes_lib.curriculum import tokens_to_reach

    evals = [(1, 100, 5.0), (2, 200, 3.0), (3, 300, 2.0)]
    assert tokens_to_reach(evals, 4.0) == 150.0 and tokens_to_reach(evals, 5.0) == 100.0
    assert tokens_to_reach(evals, 1.0) is None


def test_train_with_curriculum_spends_the_budget(tokenizer):
    from recipes_lib import model as models
    from recipes_lib.curriculum import train_with_curriculum

    ids = list(range(3, 67))
    packed = [{"input_ids": ids, "labels": ids}] * 8
    sched = SeqLenCurriculum(16, 64, warmup_steps=2)
    result = train_with_curriculum(models.small_llama(tokenizer, 64), packed,
                                   tokenizer.pad_token_id, sched, token_budget=4 * 64 * 3,
                                   batch_size=4, lr=1e-3, eval_fn=lambda m: 1.0, eval_points=2)
    assert len(result.losses) == sched.steps_for_token_budget(4 * 64 * 3, 4)
    assert result.evals and result.evals[-1][0] == len(result.losses)
