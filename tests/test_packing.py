import pytest
import torch
from transformers import DataCollatorWithFlattening

from recipes_lib import data_loading, packing
from recipes_lib import model as models


def _docs(lengths, vocab=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def test_best_fit_decreasing_packs_every_document_once_within_the_row():
    docs = _docs([30, 5, 17, 40, 12, 9, 33, 2])
    rows = packing.pack_documents(docs, 48)
    assert sorted(i for r in rows for i in r) == list(range(len(docs)))
    assert all(sum(len(docs[i]["input_ids"]) for i in r) <= 48 for r in rows)
    # 148 tokens need at least 4 rows of 48; best-fit decreasing finds 4
    assert len(rows) == 4


def test_a_document_longer_than_the_row_is_refused_by_name():
    with pytest.raises(ValueError, match="seq_len=16: document 1 has 20 tokens"):
        packing.pack_documents(_docs([4, 20]), 16)
    with pytest.raises(ValueError, match="seq_len"):
        packing.pack_documents(_docs([4]), 1)
    with pytest.raises(ValueError, match="rows_per_batch"):
        packing.layouts(_docs([4, 5]), 16, 0, 0)


def test_rows_restart_positions_mask_first_labels_and_fill_with_their_own_document():
    docs = _docs([3, 4])
    batch = packing.collate_padding_free([docs, docs[:1]], pad_token_id=0, width=8)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 0, 1, 2, 3, 4]]
    assert batch["labels"][0, [0, 3, 7]].tolist() == [-100, -100, -100]
    assert batch["labels"][0, 4:7].tolist() == docs[1]["input_ids"][1:]
    assert batch["input_ids"][1, 3:].tolist() == [0] * 5
    assert data_loading.padding_fraction([batch], pad_token_id=0) == pytest.approx(6 / 16)
    flat = packing.collate_padding_free([docs, docs[:1]], 0, flatten=True)
    ref = DataCollatorWithFlattening(return_tensors="pt")(docs + docs[:1])
    assert all(torch.equal(flat[k], ref[k]) for k in ("input_ids", "labels", "position_ids"))
    with pytest.raises(ValueError, match="pad_token_id"):
        data_loading.padding_fraction(batch)
    with pytest.raises(ValueError, match="width=4"):
        packing.collate_padding_free([docs], 0, width=4)


def test_a_packed_row_equals_its_documents_run_one_by_one():
    """The numerical-equivalence check against the reference: the same documents, one at a time."""
    model = models.small_llama(vocab_size=64, max_positions=128)
    docs = _docs([11, 30, 7, 19])
    out = packing.check_against_one_by_one(model, docs, pad_token_id=0)
    assert out["loss_max_diff"] <= 1e-5 and out["grad_max_diff"] <= 1e-5, out
    assert out["concatenated_loss_diff"] > 1e-3, out  # without the mask, documents mix
    with pytest.raises(ValueError, match="docs"):
        packing.check_against_one_by_one(model, docs[:1], 0)


def test_the_layouts_hold_the_same_documents_and_padding_free_wastes_least():
    examples = _docs([40] * 30)
    docs = packing.long_tailed_documents(examples, 40, 64, 12, seed=1)
    assert all(8 <= len(d["input_ids"]) <= 64 for d in docs)
    assert docs == packing.long_tailed_documents(examples, 40, 64, 12, seed=1)
    lay = packing.layouts(docs, 64, 4, pad_token_id=0)
    assert set(lay) == set(packing.LAYOUTS)
    tokens = sum(len(d["input_ids"]) for d in docs)
    assert sum(int(b["attention_mask"].sum()) for b in lay["padded"]) == tokens
    free = sum(int((b["position_ids"] >= 0).sum()) for b in lay["padding-free"])
    pad = data_loading.padding_fraction(lay["padding-free"], pad_token_id=0)
    assert round(free * (1 - pad)) == tokens
    assert pad < data_loading.padding_fraction(lay["padded"]) and \
        data_loading.padding_fraction(lay["concatenated"]) == 0.0
    with pytest.raises(ValueError, match="n=999"):
        packing.long_tailed_documents(examples, 999, 64, 12)
    with pytest.raises(ValueError, match="median_len"):
        packing.long_tailed_documents(examples, 4, 64, 100)


def test_compare_layouts_reports_every_layout(tiny_model_path):
    from recipes_lib import data

    tok = models.load_tokenizer(tiny_model_path)
    examples = data.tokenize_examples(data.load_corpus("base", "test"), tok, 128, "lm")
    docs = packing.long_tailed_documents(examples, 12, 128, 24)
    out = packing.compare_layouts(models.load_model(tiny_model_path), docs, 128, 4,
                                  tok.pad_token_id, repeats=1)
    assert set(out) == set(packing.LAYOUTS)
    assert out["padding-free"]["document_tokens"] == sum(len(d["input_ids"]) for d in docs)
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 for r in out.values())
    with pytest.raises(ValueError, match="repeats"):
        packing.compare_layouts(None, docs, 128, 4, 0, repeats=0)
