import time

import pytest
import torch

from recipes_lib import data, data_loading


@pytest.fixture(scope="module")
def texts():
    return [row["text"] for row in data.load_corpus("base", "train")][:64]


def test_distributed_sampler_gives_disjoint_complete_shards_reshuffled_per_epoch(texts):
    ds = list(range(64))
    shards = {}
    for epoch in (0, 1):
        per_rank = []
        for rank in (0, 1):
            s = data_loading.distributed_sampler(ds, rank=rank, world_size=2)
            s.set_epoch(epoch)
            per_rank.append(list(s))
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == ds
        shards[epoch] = per_rank
    assert shards[0][0] != shards[1][0]


def test_epochs_advances_the_sampler_epoch():
    ds = list(range(8))
    s = data_loading.distributed_sampler(ds, rank=0, world_size=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=s)
    it = data_loading.epochs(loader)
    first, second = next(it).tolist(), next(it).tolist()
    assert sorted(first) != first or sorted(second) != second or first != second


def test_loader_yields_padded_batches_with_workers(texts, tokenizer):
    ds = data_loading.StoredTextDataset(texts, tokenizer, 64)
    loader = data_loading.make_loader(ds, 4, tokenizer.pad_token_id, num_workers=2,
                                      prefetch_factor=2, persistent_workers=True)
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 64
    assert loader.pin_memory == torch.cuda.is_available()
    one = data_loading.make_loader(ds, 4, tokenizer.pad_token_id)
    ref = ds[int(next(iter(one.sampler)))]
    assert ref["input_ids"][0] == tokenizer.bos_token_id


def test_packing_keeps_every_token_in_order_without_padding(texts, tokenizer):
    examples = data.tokenize_examples([{"text": t} for t in texts], tokenizer, 512, "lm")
    packed = data_loading.pack_examples(examples, 128)
    stream = [t for e in examples for t in e["input_ids"]]
    assert all(len(p["input_ids"]) == 128 for p in packed)
    assert [t for p in packed for t in p["input_ids"]] == stream[:len(packed) * 128]
    padded = data.collate(examples[:16], tokenizer.pad_token_id)
    assert data_loading.padding_fraction(padded) > 0
    assert data_loading.padding_fraction(data.collate(packed[:16], tokenizer.pad_token_id)) == 0


def test_measure_loader_counts_waits_and_compute():
    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.tensor([i])

    loader = torch.utils.data.DataLoader(Slow(), batch_size=2)
    res = data_loading.measure_loader(loader, lambda b: time.sleep(0.02), steps=3)
    assert 0.15 < res["stall_fraction"] < 0.7 and res["steps"] == 3
    assert data_loading.stall_fraction([1.0], [3.0]) == 0.25


def test_predicted_stall():
    assert data_loading.predicted_stall(0.05, 4, 0.2) == 0.5
    assert data_loading.predicted_stall(0.05, 4, 0.05, num_workers=2) == 0.5
    assert data_loading.predicted_stall(0.05, 4, 0.2, num_workers=1) == 0.0
    with pytest.raises(ValueError, match="step_s=0"):
        data_loading.predicted_stall(0.05, 4, 0)


def test_bad_inputs(tokenizer, texts):
    ds = data_loading.StoredTextDataset(texts, tokenizer, 64)
    with pytest.raises(ValueError, match="num_workers=-1"):
        data_loading.make_loader(ds, 4, 0, num_workers=-1)
    with pytest.raises(ValueError, match="need num_workers > 0"):
        data_loading.make_loader(ds, 4, 0, prefetch_factor=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        data_loading.make_loader(ds, 0, 0)
    with pytest.raises(ValueError, match="read_latency_s=-1"):
        data_loading.StoredTextDataset(texts, tokenizer, 64, read_latency_s=-1)
    with pytest.raises(ValueError, match="seq_len=1"):
        data_loading.pack_examples([], 1)
