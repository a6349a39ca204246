"""Keep the accelerator fed: DataLoader workers, prefetching, a distributed sampler, packing.

When each sample costs a storage read plus tokenisation, a single-process loader makes every
step wait ``batch_size * per_sample_cost`` before compute starts. With ``num_workers`` processes
each preparing whole batches ``prefetch_factor`` batches ahead, loading overlaps compute; the
wait disappears once ``num_workers * step_time >= batch_size * per_sample_cost``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from recipes_lib import data


class StoredTextDataset(Dataset):
    """Raw texts read one by one from (simulated) remote storage and tokenised on the fly.

    Args:
        texts: the documents.
        tokenizer: a transformers tokenizer (fast tokenizers are safe in forked workers).
        max_length: tokens kept per document.
        read_latency_s: time to fetch one document (object-store first-byte latency is tens of
            milliseconds); spent in ``time.sleep``, which, like real I/O, uses no CPU.
    """

    def __init__(self, texts: list[str], tokenizer, max_length: int, read_latency_s: float = 0.0):
        if read_latency_s < 0:
            raise ValueError(f"read_latency_s={read_latency_s}: must be >= 0")
        if not texts:
            raise ValueError("texts: empty, nothing to load")
        self.texts, self.tokenizer = list(texts), tokenizer
        self.max_length, self.read_latency_s = max_length, read_latency_s
        self.bos = data.bos_ids(tokenizer)

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        ids = self.bos + self.tokenizer.encode(self.texts[i], add_special_tokens=False)
        ids = (ids + [self.tokenizer.eos_token_id])[:self.max_length]
        return {"input_ids": ids, "labels": list(ids)}


def make_loader(
    dataset: Dataset,
    batch_size: int,
    pad_token_id: int,
    sampler: Sampler | None = None,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool = False,
    collate: Callable[[list], Any] | None = None,
) -> DataLoader:
    """A ``DataLoader`` with the knobs that matter, checked, and pinned memory only with CUDA.

    Args:
        dataset: map-style dataset of tokenised examples.
        batch_size: examples per batch on this rank.
        pad_token_id: for the default collate (``data.collate``: right padding, -100 labels).
        sampler: e.g. :func:`distributed_sampler`; None shuffles with a seeded generator.
        num_workers: loader processes (0 = load in the training process).
        prefetch_factor: batches each worker prepares ahead (needs num_workers > 0).
        pin_memory: page-locked host batches for async copies; default True iff CUDA is present.
        persistent_workers: keep workers alive across epochs (no re-fork per epoch).
        collate: batch builder; default ``data.collate``.

    Returns:
        The ``DataLoader``.

    Raises:
        ValueError: for batch_size < 1, num_workers < 0, or prefetch/persistence without workers.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r}: must be an integer >= 0")
    if num_workers == 0 and (prefetch_factor is not None or persistent_workers):
        raise ValueError("prefetch_factor / persistent_workers: need num_workers > 0")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(f"prefetch_factor={prefetch_factor}: must be >= 1")
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    kwargs = {"prefetch_factor": prefetch_factor} if num_workers > 0 else {}
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, shuffle=sampler is None,
        generator=torch.Generator().manual_seed(0) if sampler is None else None,
        num_workers=num_workers, pin_memory=pin, persistent_workers=persistent_workers,
        collate_fn=collate or partial(data.collate, pad_token_id=pad_token_id),
        drop_last=True, **kwargs)


def distributed_sampler(dataset: Dataset, rank: int | None = None, world_size: int | None = None,
                        seed: int = 0, shuffle: bool = True) -> DistributedSampler:
    """Each rank its own ``1/N`` of the indices, reshuffled per epoch (call ``set_epoch``).

    Outside a process group pass ``rank`` and ``world_size`` explicitly (as the tests do).

    Args:
        dataset: the map-style dataset.
        rank: this rank (None: the process group's).
        world_size: ranks (None: the process group's).
        seed: for the shuffle.
        shuffle: reshuffle each epoch.

    Returns:
        The ``DistributedSampler``.
    """
    from recipes_lib.distributed import world

    r, n = world()
    return DistributedSampler(dataset, num_replicas=world_size or n,
                              rank=r if rank is None else rank, shuffle=shuffle, seed=seed,
                              drop_last=True)


def epochs(loader: DataLoader) -> Iterable[Any]:
    """Endless batches from ``loader``, calling ``sampler.set_epoch`` at each new epoch.

    Args:
        loader: the ``DataLoader``.

    Yields:
        Its batches, epoch after epoch.
    """
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def pack_examples(examples: list[dict[str, list[int]]], seq_len: int
                  ) -> list[dict[str, list[int]]]:
    """Concatenate tokenised documents (each ends with eos) and cut fixed ``seq_len`` blocks.

    No padding is left; a block may span documents, separated by eos (GPT-style packing; to
    stop attention across documents use position ids with a varlen kernel). The last partial
    block is dropped.

    Args:
        examples: tokenised documents, each ending with eos.
        seq_len: tokens per block.

    Returns:
        ``{"input_ids", "labels"}`` blocks of ``seq_len`` tokens (labels equal to the ids).

    Raises:
        ValueError: for a ``seq_len`` below 2.

    Example:
        >>> pack_examples([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
        ...                {"input_ids": [4, 5], "labels": [4, 5]}], 2)
        [{'input_ids': [1, 2], 'labels': [1, 2]}, {'input_ids': [3, 4], 'labels': [3, 4]}]
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: must be >= 2")
    stream = [t for e in examples for t in e["input_ids"]]
    return [{"input_ids": stream[i:i + seq_len], "labels": stream[i:i + seq_len]}
            for i in range(0, len(stream) - seq_len + 1, seq_len)]


def padding_fraction(batches: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
                     pad_token_id: int | None = None) -> float:
    """Share of the token slots of a batch (or of several) that hold no document token.

    Padded batches say so with their ``attention_mask``. Padding-free rows
    (``packing.collate_padding_free``) have none: their filler is ``pad_token_id`` at label -100
    (labels alone would overcount: the first token of each packed document is -100 too).

    Args:
        batches: one collated batch, or a list of them.
        pad_token_id: the filler id of padding-free rows.

    Returns:
        Empty slots over all slots, in [0, 1].

    Raises:
        ValueError: for a batch without ``attention_mask`` when no ``pad_token_id`` is given.
    """
    slots = pad = 0
    for b in [batches] if isinstance(batches, dict) else batches:
        slots += b["input_ids"].numel()
        if "attention_mask" in b:
            pad += int((b["attention_mask"] == 0).sum())
        elif pad_token_id is not None:
            padded = (b["input_ids"] == pad_token_id) & (b["labels"] == data.IGNORE_INDEX)
            pad += int(padded.sum())
        else:
            raise ValueError("pad_token_id: needed for batches without an attention_mask "
                             "(padding-free rows)")
    return pad / slots if slots else 0.0


def plot_stall(runs: list[dict[str, Any]], predicted: dict[str, Callable[[float], float]]):
    """Measured stall fraction against per-sample latency, one colour per loader, with the
    predicted curve of each loader as a dashed line.

    Args:
        runs: :func:`compare_loaders`' rows (``loader``, ``read_latency_s``,
            ``stall_fraction``).
        predicted: loader name -> its predicted stall at a per-sample latency in seconds.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(5, 3.2))
    for i, name in enumerate(predicted):
        pts = sorted((r["read_latency_s"], r["stall_fraction"]) for r in runs
                     if r["loader"] == name)
        xs = [x for x, _ in pts]
        grid = [xs[0] + (xs[-1] - xs[0]) * k / 50 for k in range(51)]
        ax.plot([x * 1e3 for x in xs], [y for _, y in pts], "o", color=f"C{i}",
                label=f"{name} (measured)")
        ax.plot([x * 1e3 for x in grid], [predicted[name](x) for x in grid], "--",
                color=f"C{i}", label=f"{name} (predicted)")
    ax.set_xlabel("storage latency per sample (ms)")
    ax.set_ylabel("stall fraction")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def stall_fraction(batch_times: list[float], step_times: list[float]) -> float:
    """Time waiting for batches over total time (waiting + computing).

    Args:
        batch_times: seconds waited for each batch.
        step_times: seconds each step computed.

    Returns:
        The fraction, in [0, 1].

    Example:
        >>> stall_fraction([0.1, 0.1], [0.3, 0.3])
        0.25
    """
    wait, compute = sum(batch_times), sum(step_times)
    return wait / (wait + compute) if wait + compute > 0 else 0.0


def predicted_stall(per_sample_s: float, batch_size: int, step_s: float, num_workers: int = 0
                    ) -> float:
    """Steady-state share of time spent waiting for data.

    One batch takes ``b * c`` to prepare. Loading in the training process, every step waits for
    it: ``b c / (b c + t)``. With ``w`` workers a batch is ready every ``b c / w``; if that is no
    longer than a step ``t`` the wait vanishes, else the step waits ``b c / w - t``.

    Args:
        per_sample_s: seconds to load one sample (``c``).
        batch_size: samples per batch (``b``).
        step_s: seconds of one training step (``t``).
        num_workers: loader worker processes (``w``; 0: loading in the training process).

    Returns:
        The share of the wall-clock time spent waiting, in [0, 1).

    Raises:
        ValueError: for a negative latency or step, a batch below 1 or negative workers.

    Example:
        >>> predicted_stall(0.05, 4, 0.4)
        0.3333333333333333
        >>> predicted_stall(0.05, 4, 0.4, num_workers=2)
        0.0
    """
    if per_sample_s < 0 or batch_size < 1 or step_s <= 0 or num_workers < 0:
        raise ValueError(f"per_sample_s={per_sample_s}, batch_size={batch_size}, step_s={step_s}, "
                         f"num_workers={num_workers}: out of range")
    load = per_sample_s * batch_size
    if num_workers == 0:
        return load / (load + step_s)
    per_batch = load / num_workers
    return max(0.0, per_batch - step_s) / max(per_batch, step_s)


def measure_loader(loader: DataLoader, step: Callable[[dict[str, torch.Tensor]], Any],
                   steps: int, warmup: int = 1) -> dict[str, float]:
    """Run ``steps`` training steps fed by ``loader``; time the waits for data and the compute.

    The first ``warmup`` batches (worker start-up) are excluded for every loader alike.

    Args:
        loader: the ``DataLoader``.
        step: one training step on a batch.
        steps: timed steps.
        warmup: untimed steps first.

    Returns:
        ``{"stall_fraction", "wait_s", "compute_s", "steps"}``.

    Raises:
        ValueError: for ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    it = iter(epochs(loader))
    waits, computes = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        if i >= warmup:
            waits.append(t1 - t0)
            computes.append(t2 - t1)
    return {"stall_fraction": stall_fraction(waits, computes), "wait_s": sum(waits),
            "compute_s": sum(computes), "steps": steps}


def compare_loaders(
    model_path: str,
    loaders: dict[str, dict[str, Any]],
    steps: int = 10,
    global_batch_size: int = 8,
    seq_len: int = 128,
    read_latencies_s: tuple[float, ...] = (0.05,),
    strategy: str = "fsdp",
) -> dict[str, Any]:
    """Train with each loader configuration in turn and measure its stall fraction (every rank).

    Args:
        model_path: the model to train (sharded with FSDP, or DDP).
        loaders: name -> ``make_loader`` keyword arguments (num_workers, prefetch_factor, ...).
        steps: measured steps per loader (after one warm-up batch).
        global_batch_size: examples per step over all ranks.
        seq_len: tokens per document kept.
        read_latencies_s: simulated storage latencies per document; each loader runs at each.
        strategy: "fsdp" or "ddp" wrapper for the model.

    Returns:
        ``"runs"``: one row per (loader, latency) with this rank's ``measure_loader`` result;
        ``"samples_seen"``: the indices this rank's sampler produced in two epochs.
    """
    from recipes_lib import model as models
    from recipes_lib.distributed import check_global_batch, world
    from recipes_lib.fsdp import wrap_model
    from recipes_lib.grad_accumulation import forward_backward
    from recipes_lib.train import TrainConfig, make_optimizer, optimizer_step

    rank, world_size = world()
    micro = check_global_batch(global_batch_size, world_size)
    tok = models.load_tokenizer(model_path)
    texts = [row["text"] for row in data.load_corpus("base", "train")]
    model = wrap_model(models.load_model(model_path), strategy, "fp32")
    optimizer = make_optimizer(model, TrainConfig(lr=1e-4))

    def step(batch):
        forward_backward(model, batch)
        optimizer_step(model, optimizer, max_grad_norm=None)

    out: dict[str, Any] = {"rank": rank, "runs": []}
    for latency in read_latencies_s:
        dataset = StoredTextDataset(texts, tok, seq_len, latency)
        for name, kwargs in loaders.items():
            sampler = distributed_sampler(dataset, seed=0)
            loader = make_loader(dataset, micro, tok.pad_token_id, sampler=sampler, **kwargs)
            out["runs"].append({"loader": name, "read_latency_s": latency,
                                **measure_loader(loader, step, steps)})
            del loader
    sampler = distributed_sampler(dataset, seed=0)
    out["samples_seen"] = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        out["samples_seen"].append(list(sampler))
    return out
