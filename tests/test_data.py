import pytest

from recipes_lib import data


def test_generation_is_deterministic_and_matches_committed(tmp_path):
    a = data.generate_corpora(tmp_path / "a")
    b = data.generate_corpora(tmp_path / "b")
    for key in a:
        assert a[key].read_bytes() == b[key].read_bytes()
        assert a[key].read_bytes() == (data.DATA_DIR / a[key].name).read_bytes()


def test_load_corpus_and_bad_names():
    ds = data.load_corpus("topic", "test")
    assert set(ds.column_names) == {"prompt", "answer"}
    assert ds[0]["answer"].strip() in data.TOPICS
    with pytest.raises(ValueError, match="name='wiki'"):
        data.load_corpus("wiki")
    with pytest.raises(ValueError, match="split='dev'"):
        data.load_corpus("base", "dev")


def test_tokenize_masks_prompt_and_rejects_too_long(tokenizer):
    rows = [{"prompt": "Text: The chef baked the bread.\nTopic:", "answer": " cooking"}]
    ex = data.tokenize_examples(rows, tokenizer, 64, "sft")[0]
    n_answer = sum(label != data.IGNORE_INDEX for label in ex["labels"])
    assert n_answer == len(tokenizer.encode(" cooking", add_special_tokens=False)) + 1
    with pytest.raises(ValueError, match="max_length=4"):
        data.tokenize_examples(rows, tokenizer, 4, "sft")
    with pytest.raises(ValueError, match="max positions"):
        data.tokenize_examples(rows, tokenizer, 10_000, "sft")
    with pytest.raises(ValueError, match="kind='x'"):
        data.tokenize_examples(rows, tokenizer, 64, "x")


def test_collate_pads_and_batches_validate():
    b = data.collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
                      {"input_ids": [8], "labels": [8]}], pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]]
    assert b["labels"][1].tolist() == [8] + [-100] * 7
    assert b["attention_mask"].sum().item() == 4
    exact = data.collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}], 0, pad_to_multiple_of=1)
    assert exact["input_ids"].shape == (1, 3)
    with pytest.raises(ValueError, match="pad_to_multiple_of=0"):
        data.collate([{"input_ids": [5], "labels": [5]}], 0, pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="batch_size=0"):
        next(data.batches([{"input_ids": [1], "labels": [1]}], 0, 0))
    with pytest.raises(ValueError, match="batch_size=5"):
        next(data.batches([{"input_ids": [1], "labels": [1]}], 5, 0))


def test_tokenizer_without_bos(tokenizer):
    class NoBos:
        bos_token_id = None
        eos_token_id = tokenizer.eos_token_id
        model_max_length = tokenizer.model_max_length

        def encode(self, text, add_special_tokens=False):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    ex = data.tokenize_examples([{"text": "The chef baked the bread."}], NoBos(), 32, "lm")[0]
    assert ex["input_ids"][0] != tokenizer.bos_token_id
    assert ex["input_ids"][-1] == tokenizer.eos_token_id
