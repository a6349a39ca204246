import random

import pytest

from recipes_lib import curriculum, passkey


def test_episode_has_the_exact_length_and_scores_only_the_answer(tokenizer):
    for depth in (0.0, 0.5, 1.0):
        ep = passkey.episode(tokenizer, 200, depth, random.Random(0))
        assert len(ep["input_ids"]) == 200
        scored = [t for t in ep["labels"] if t != -100]
        assert tokenizer.decode(scored, skip_special_tokens=True) == ep["answer"]
        text = tokenizer.decode(ep["prompt_ids"], skip_special_tokens=True)
        assert f"The pass key is{ep['answer']}." in text and text.endswith("The pass key is")


def test_depth_moves_the_needle(tokenizer):
    early = tokenizer.decode(passkey.episode(tokenizer, 300, 0.0, random.Random(1))["prompt_ids"])
    late = tokenizer.decode(passkey.episode(tokenizer, 300, 1.0, random.Random(1))["prompt_ids"])
    assert early.index("pass key is") < late.index("pass key is")


def test_stream_follows_the_curriculum_and_is_reproducible(tokenizer):
    c = curriculum.SeqLenCurriculum(64, 128, warmup_steps=2)
    a = [b["input_ids"] for _, b in zip(range(3), passkey.PasskeyStream(tokenizer, 2, c.length_at))]
    b = [b["input_ids"] for _, b in zip(range(3), passkey.PasskeyStream(tokenizer, 2, c.length_at))]
    assert [x.shape[1] for x in a] == [64, 96, 128]
    assert all((x == y).all() for x, y in zip(a, b))


def test_test_set_round_trip(tokenizer, tmp_path):
    path = passkey.write_test_set(tokenizer, lengths=(64,), depths=(0.0, 1.0), per_cell=2,
                                  path=tmp_path / "pk.jsonl")
    rows = passkey.load_test_set(path)
    assert len(rows) == 4 and {r["length"] for r in rows} == {64}
    assert set(rows[0]) == set(passkey.FIELDS)


def test_shipped_test_set_and_accuracy(tokenizer):
    from recipes_lib.model import small_llama

    rows = passkey.load_test_set()
    assert {r["length"] for r in rows} == {128, 256, 512} and len(rows) == 60
    acc = passkey.accuracy_by_depth(small_llama(tokenizer, 1024), tokenizer, rows[:2])
    assert set(acc) == {(128, 0.0)} and 0.0 <= acc[(128, 0.0)] <= 1.0


def test_bad_inputs(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="depth"):
        passkey.episode(tokenizer, 100, 1.5, random.Random(0))
    with pytest.raises(ValueError, match="length=10"):
        passkey.episode(tokenizer, 10, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="path"):
        passkey.load_test_set(tmp_path / "missing.jsonl")
