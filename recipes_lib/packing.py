"""Padding-free packing: several documents per row, each attending only to itself.

A batch of documents padded to its longest spends compute and memory on pad tokens: with the
long-tailed lengths of real fine-tuning data, often half the slots. Concatenating documents into
full rows (``data_loading.pack_examples``) removes the padding but lets every token attend to the
documents before it in the row. Padding-free packing keeps both wins: documents are packed whole
into rows, ``position_ids`` restart at 0 at each document, and the first label of each document
is -100 (the previous document's last token must not predict it). transformers reads restarting
position ids, when no ``attention_mask`` is passed, as packed documents: SDPA and eager attention
get a block-diagonal causal mask, flash-attention-2 a variable-length call over the documents
(it needs the whole batch flattened into one row: ``collate_padding_free(..., flatten=True)``).
This is what transformers' ``DataCollatorWithFlattening`` and TRL's ``padding_free=True`` feed a
model; rows here are built with that collator.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from recipes_lib import data
from recipes_lib.data_loading import pack_examples, padding_fraction
from recipes_lib.grad_accumulation import count_target_tokens, forward_backward
from recipes_lib.memory import measure_memory
from recipes_lib.numerics import collect_gradients, max_abs_diff
from recipes_lib.timing import time_interleaved
from recipes_lib.train import TrainConfig, make_optimizer, optimizer_step

IGNORE_INDEX = data.IGNORE_INDEX
LAYOUTS = ("padded", "concatenated", "padding-free")


def long_tailed_documents(examples: list[dict[str, list[int]]], n: int, max_len: int,
                          median_len: int, sigma: float = 0.8, min_len: int = 8, seed: int = 0
                          ) -> list[dict[str, list[int]]]:
    """``n`` documents with log-normal lengths, cut in order from the examples' token stream.

    Fine-tuning and web corpora have long-tailed lengths (many short documents, a few long ones),
    which is what makes padding costly; the tiny corpus's paragraphs are all of similar length,
    so this draws lengths from a log-normal (median ``median_len``, shape ``sigma``) clipped to
    ``[min_len, max_len]`` and cuts each document from the tokens of ``examples``.

    Args:
        examples: tokenised examples, the token stream documents are cut from.
        n: documents to make.
        max_len: the longest length.
        median_len: the log-normal's median.
        sigma: the log-normal's shape (larger: a longer tail).
        min_len: the shortest length.
        seed: for the lengths.

    Returns:
        ``n`` documents (``input_ids`` and ``labels``), each ending with eos.

    Raises:
        ValueError: for bad sizes, or too few tokens in ``examples`` for ``n`` documents.

    Example:
        >>> docs = long_tailed_documents(examples, 64, 256, 48)  # doctest: +SKIP
    """
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    if not 2 <= min_len <= median_len <= max_len:
        raise ValueError(f"min_len={min_len}, median_len={median_len}, max_len={max_len}: "
                         "need 2 <= min_len <= median_len <= max_len")
    if sigma <= 0:
        raise ValueError(f"sigma={sigma}: must be > 0")
    rng = random.Random(seed)
    lengths = [min(max_len, max(min_len, round(rng.lognormvariate(0.0, sigma) * median_len)))
               for _ in range(n)]
    stream = [t for e in examples for t in e["input_ids"]]
    if sum(lengths) > len(stream):
        raise ValueError(f"n={n}: {sum(lengths)} tokens needed, the examples hold {len(stream)}")
    docs, at = [], 0
    for n_tok in lengths:
        ids = stream[at:at + n_tok]
        docs.append({"input_ids": ids, "labels": list(ids)})
        at += n_tok
    return docs


def pack_documents(examples: Sequence[dict[str, list[int]]], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: group whole documents into rows of at most ``seq_len`` tokens.

    Documents are placed longest first, each into the fullest row it still fits (TRL's "bfd"
    packing strategy); no document is split, so none loses its beginning.

    Args:
        examples: tokenised documents.
        seq_len: the most tokens a row holds.

    Returns:
        The rows, each a list of document indices into ``examples``.

    Raises:
        ValueError: for ``seq_len`` < 2, no documents, or a document longer than ``seq_len``
            (a row holds whole documents: raise ``seq_len`` or truncate the documents).

    Example:
        >>> pack_documents([{"input_ids": [1] * 3}, {"input_ids": [2] * 2},
        ...                 {"input_ids": [3] * 1}], 4)
        [[0, 2], [1]]
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: must be an integer >= 2")
    if not examples:
        raise ValueError("examples: empty, nothing to pack")
    lengths = [len(e["input_ids"]) for e in examples]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"seq_len={seq_len}: document {i} has {n} tokens ({len(too_long)} "
                         "documents are longer than a row); a padding-free row holds whole "
                         "documents: raise seq_len or truncate them (data.tokenize_examples's "
                         "max_length)")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        fits = [r for r, room in enumerate(free) if room >= lengths[i]]
        if fits:
            best = min(fits, key=lambda r: free[r])
            rows[best].append(i)
            free[best] -= lengths[i]
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def collate_padding_free(rows: Sequence[Sequence[dict[str, list[int]]]], pad_token_id: int,
                         width: int | None = None, flatten: bool = False
                         ) -> dict[str, torch.Tensor]:
    """A batch of packed rows: ``input_ids``, ``labels`` and ``position_ids``, no attention mask.

    Each row is built by transformers' ``DataCollatorWithFlattening`` (positions restart at 0 at
    each document; each document's first label is -100). Rows shorter than ``width`` are filled
    with pad tokens that form a document of their own (positions from 0, labels -100): no real
    token attends to them and they carry no loss.

    Args:
        rows: the documents of each row (e.g. from :func:`pack_documents`).
        pad_token_id: token for the filler.
        width: row length (default: the longest row).
        flatten: one row of every document, no filler, as ``DataCollatorWithFlattening`` makes
            for a whole batch: what flash-attention-2's variable-length path in transformers
            needs (it detects packing only with a batch of one row).

    Returns:
        ``{"input_ids", "labels", "position_ids"}``, each ``(rows, width)`` (one row with
        ``flatten``).

    Raises:
        ValueError: for no rows, an empty row, or a row longer than ``width``.
    """
    from transformers import DataCollatorWithFlattening

    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("rows: need at least one row, each with at least one document")
    collator = DataCollatorWithFlattening(return_tensors="pt")
    if flatten:
        return dict(collator([d for r in rows for d in r]))
    built = [collator(list(r)) for r in rows]
    longest = max(b["input_ids"].shape[1] for b in built)
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"width={width}: a row holds {longest} tokens")
    out = {k: torch.empty((len(built), width), dtype=torch.long)
           for k in ("input_ids", "labels", "position_ids")}
    for i, b in enumerate(built):
        n = b["input_ids"].shape[1]
        fill = torch.arange(width - n)
        out["input_ids"][i] = torch.cat([b["input_ids"][0], fill.new_full(fill.shape,
                                                                          pad_token_id)])
        out["labels"][i] = torch.cat([b["labels"][0], fill.new_full(fill.shape, IGNORE_INDEX)])
        out["position_ids"][i] = torch.cat([b["position_ids"][0], fill])
    return out


def layouts(docs: list[dict[str, list[int]]], seq_len: int, rows_per_batch: int,
            pad_token_id: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The same documents in the three layouts, as lists of batches of ``rows_per_batch`` rows.

    - ``padded``: one document per row, each batch padded to its longest (``data.collate``,
      as ``DataCollatorWithPadding``);
    - ``concatenated``: documents joined into full rows of ``seq_len`` (``pack_examples``):
      no padding, but attention crosses documents and documents are split;
    - ``padding-free``: whole documents packed into rows of ``seq_len`` (:func:`pack_documents`),
      each attending only to itself (:func:`collate_padding_free`).

    A batch never holds more than ``rows_per_batch * seq_len`` token slots in any layout; the
    last incomplete batch of a layout is kept, so each layout covers all its rows.

    Args:
        docs: tokenised documents.
        seq_len: tokens per row.
        rows_per_batch: rows per batch.
        pad_token_id: the tokenizer's padding id.

    Returns:
        ``{"padded", "concatenated", "padding-free"}`` -> that layout's batches.

    Raises:
        ValueError: for ``rows_per_batch`` < 1 (and what :func:`pack_documents` refuses).
    """
    if not isinstance(rows_per_batch, int) or rows_per_batch < 1:
        raise ValueError(f"rows_per_batch={rows_per_batch!r}: must be an integer >= 1")
    bins = pack_documents(docs, seq_len)

    def chunks(items: list) -> list[list]:
        return [items[i:i + rows_per_batch] for i in range(0, len(items), rows_per_batch)]

    return {
        "padded": [data.collate(c, pad_token_id) for c in chunks(docs)],
        "concatenated": [data.collate(c, pad_token_id)
                         for c in chunks(pack_examples(docs, seq_len))],
        "padding-free": [collate_padding_free([[docs[i] for i in b] for b in c], pad_token_id,
                                              width=seq_len) for c in chunks(bins)],
    }


def check_against_one_by_one(model: torch.nn.Module, docs: list[dict[str, list[int]]],
                             pad_token_id: int) -> dict[str, float]:
    """Loss and gradients of one padding-free row against the same documents run one by one.

    Both are the mean next-token loss over the same target tokens (the first token of each
    document has no predecessor in either), so they are equal up to float rounding when no
    attention crosses documents. The same row with positions 0..n-1 (naive concatenation: one
    long document to the model) is run too, to show what the mask prevents.

    Args:
        model: a causal LM.
        docs: tokenised documents that fit one row together.
        pad_token_id: the tokenizer's padding id.

    Returns:
        ``loss_max_diff``, ``grad_max_diff`` (padding-free vs one by one, absolute) and
        ``concatenated_loss_diff`` (naive concatenation vs one by one).

    Raises:
        ValueError: for fewer than two documents.
    """
    if len(docs) < 2:
        raise ValueError(f"docs: {len(docs)} given, packing needs at least two documents")
    row = collate_padding_free([docs], pad_token_id)
    n_targets = count_target_tokens(row["labels"])

    def grads_of(run: Callable[[], torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = float(run())
        grads = collect_gradients(model)
        model.zero_grad(set_to_none=True)
        return loss, grads

    ref_loss, ref_grads = grads_of(lambda: sum(
        forward_backward(model, data.collate([d], pad_token_id, 1), num_target_tokens=n_targets)
        for d in docs))
    packed_loss, packed_grads = grads_of(lambda: forward_backward(model, row))
    naive = {k: v for k, v in row.items() if k != "position_ids"}
    naive_loss, _ = grads_of(lambda: forward_backward(model, naive))
    return {"loss_max_diff": abs(packed_loss - ref_loss),
            "grad_max_diff": max_abs_diff(packed_grads, ref_grads),
            "concatenated_loss_diff": abs(naive_loss - ref_loss)}


def compare_layouts(model: torch.nn.Module, docs: list[dict[str, list[int]]], seq_len: int,
                    rows_per_batch: int, pad_token_id: int, repeats: int = 3,
                    lr: float = 1e-4) -> dict[str, dict[str, Any]]:
    """Train one pass over the same documents in each layout: tokens/s, padding, peak memory.

    The passes are timed in alternation (``timing.time_interleaved``: padded, concatenated,
    padding-free, padded, ...), each a forward, backward and AdamW step per batch; the peak is
    the memory meter's over one step of each layout's widest batch. Throughput counts document
    tokens only, so padding is work that earns nothing.

    Args:
        model: the model trained (its weights change).
        docs: tokenised documents.
        seq_len: tokens per row.
        rows_per_batch: rows per batch.
        pad_token_id: the tokenizer's padding id.
        repeats: timed passes of each layout, in alternation.
        lr: AdamW's learning rate.

    Returns:
        Per layout: ``tokens_per_s``, ``pass_s`` (median), ``spread``, ``steps``,
        ``document_tokens``, ``padding_fraction``, ``peak_bytes``.

    Raises:
        ValueError: for ``repeats`` < 1 (and what :func:`layouts` refuses).
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be an integer >= 1")
    per_layout = layouts(docs, seq_len, rows_per_batch, pad_token_id)
    optimizer = make_optimizer(model, TrainConfig(lr=lr))

    def step(batch: dict[str, torch.Tensor]) -> None:
        forward_backward(model, batch)
        optimizer_step(model, optimizer, max_grad_norm=None)

    def one_pass(batches: list[dict[str, torch.Tensor]]) -> Callable[[], None]:
        return lambda: [step(b) for b in batches]

    timings = time_interleaved({name: one_pass(b) for name, b in per_layout.items()},
                               warmup=1, repeats=repeats,
                               device=next(model.parameters()).device)
    out: dict[str, dict[str, Any]] = {}
    for name, batches in per_layout.items():
        n_doc = (sum(int(b["attention_mask"].sum()) for b in batches) if name == "padded"
                 else sum(b["input_ids"].numel() for b in batches) if name == "concatenated"
                 else sum(len(d["input_ids"]) for d in docs))
        widest = max(batches, key=lambda b: b["input_ids"].numel())
        peak = measure_memory(lambda w=widest: step(w), model, optimizer).peak_bytes
        t = timings[name]
        out[name] = {"tokens_per_s": n_doc / t.median_s, "pass_s": t.median_s,
                     "spread": t.spread, "steps": len(batches), "document_tokens": n_doc,
                     "padding_fraction": padding_fraction(batches, pad_token_id),
                     "peak_bytes": peak}
    return out
