"""Small deterministic corpora, written to ``data/`` and loaded with ``datasets``.

Two corpora:
- ``base``: paragraphs of plain sentences about a few topics, to pretrain the tiny base model.
- ``topic``: a fine-tuning task, ``"Text: <sentences>\\nTopic:"`` -> ``" <topic>"``, scored by exact
  match on the generated answer. The base model never sees the ``Topic:`` format, so it starts
  near 0 % and fine-tuning has something measurable to teach.

Files are JSON lines, loaded with ``datasets.load_dataset("json", ...)``: the same API and objects
as a hub dataset.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
IGNORE_INDEX = -100

# Each topic has its own subjects, verbs, objects and places; a sentence draws from one topic,
# with shared function words, so the topic is learnable but not a single fixed keyword.
_TOPICS: dict[str, dict[str, list[str]]] = {
    "sports": {
        "subj": ["the striker", "the coach", "the goalkeeper", "our team", "the runner",
                 "the captain", "the referee", "the swimmer"],
        "verb": ["kicked", "passed", "caught", "trained with", "threw", "won", "chased",
                 "defended"],
        "obj": ["the ball", "the trophy", "the final match", "a long race", "the medal",
                "the net", "the whistle", "a fast lap"],
        "place": ["at the stadium", "on the field", "near the goal", "in the gym",
                  "on the track", "at the pool"],
    },
    "cooking": {
        "subj": ["the chef", "my aunt", "the baker", "the cook", "our neighbour",
                 "the waiter", "the student", "grandma"],
        "verb": ["baked", "stirred", "chopped", "tasted", "roasted", "boiled", "served",
                 "seasoned"],
        "obj": ["the bread", "a warm soup", "the onions", "fresh pasta", "the cake",
                "a spicy sauce", "the vegetables", "sweet rice"],
        "place": ["in the kitchen", "at the bakery", "by the oven", "at the market",
                  "in the restaurant", "near the stove"],
    },
    "weather": {
        "subj": ["the storm", "a cold wind", "the rain", "the sun", "heavy snow",
                 "the fog", "a warm breeze", "the thunder"],
        "verb": ["covered", "soaked", "warmed", "froze", "shook", "cooled", "darkened",
                 "flooded"],
        "obj": ["the valley", "the rooftops", "the old bridge", "the fields", "the coast",
                "the quiet streets", "the mountains", "the harbour"],
        "place": ["all night", "this morning", "in the north", "before dawn",
                  "during the winter", "after the clouds came"],
    },
    "music": {
        "subj": ["the pianist", "the band", "the singer", "the drummer", "the choir",
                 "the violinist", "the conductor", "a young guitarist"],
        "verb": ["played", "recorded", "practised", "performed", "tuned", "composed",
                 "sang", "rehearsed"],
        "obj": ["a slow song", "the melody", "the old piano", "a loud chorus", "the album",
                "the symphony", "a new tune", "the rhythm"],
        "place": ["on the stage", "in the studio", "at the concert", "in the hall",
                  "at the festival", "in the church"],
    },
    "travel": {
        "subj": ["the tourist", "my brother", "the pilot", "the sailor", "a tired traveller",
                 "the driver", "the guide", "our family"],
        "verb": ["visited", "booked", "packed", "crossed", "explored", "boarded", "missed",
                 "photographed"],
        "obj": ["the train", "a cheap flight", "the suitcase", "the border", "the old city",
                "the ferry", "a small hotel", "the map"],
        "place": ["at the airport", "in the station", "near the beach", "on the highway",
                  "at the hotel", "across the island"],
    },
}
TOPICS = tuple(_TOPICS)
_CONNECT = ["then", "later", "again", "quickly", "slowly", "once more", "happily", "finally"]


def _sentence(rng: random.Random, topic: str) -> str:
    t = _TOPICS[topic]
    s = f"{rng.choice(t['subj'])} {rng.choice(t['verb'])} {rng.choice(t['obj'])}"
    if rng.random() < 0.7:
        s += f" {rng.choice(t['place'])}"
    if rng.random() < 0.3:
        s += f" and {rng.choice(_CONNECT)} {rng.choice(t['verb'])} {rng.choice(t['obj'])}"
    return s[0].upper() + s[1:] + "."


def _paragraph(rng: random.Random, topic: str, n_sentences: int) -> str:
    return " ".join(_sentence(rng, topic) for _ in range(n_sentences))


def generate_corpora(out_dir: Path | str = DATA_DIR, seed: int = 0) -> dict[str, Path]:
    """Write the base corpus and the topic task to ``out_dir`` deterministically.

    Args:
        out_dir: folder for the JSON-lines files.
        seed: the generator's seed; the same seed gives byte-identical files.

    Returns:
        Mapping "<corpus>_<split>" -> path of the file written.

    Example:
        >>> paths = generate_corpora("/tmp/data")  # doctest: +SKIP
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sizes = {("base", "train"): 4000, ("base", "test"): 200,
             ("topic", "train"): 600, ("topic", "test"): 200}
    paths: dict[str, Path] = {}
    for (corpus, split), n in sizes.items():
        rows = []
        for _ in range(n):
            topic = rng.choice(TOPICS)
            if corpus == "base":
                rows.append({"text": _paragraph(rng, topic, rng.randint(3, 7))})
            else:
                text = _paragraph(rng, topic, rng.randint(1, 2))
                rows.append({"prompt": f"Text: {text}\nTopic:", "answer": f" {topic}"})
        path = out / f"{corpus}_{split}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
        paths[f"{corpus}_{split}"] = path
    return paths


def load_corpus(name: str, split: str = "train", data_dir: Path | str = DATA_DIR):
    """Load a corpus as a ``datasets.Dataset`` from local JSON lines (generated if missing).

    Args:
        name: "base" or "topic".
        split: "train" or "test".
        data_dir: where the files live.

    Raises:
        ValueError: for an unknown corpus or split.
    """
    import datasets

    if name not in ("base", "topic"):
        raise ValueError(f"name={name!r}: expected 'base' or 'topic'")
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: expected 'train' or 'test'")
    path = Path(data_dir) / f"{name}_{split}.jsonl"
    if not path.exists():
        generate_corpora(data_dir)
    datasets.disable_progress_bars()
    return datasets.load_dataset("json", data_files=str(path), split="train")


def bos_ids(tokenizer) -> list[int]:
    """The ids to put before a prompt: ``[bos_token_id]``, or ``[]`` for tokenizers without one
    (e.g. Qwen's).

    Args:
        tokenizer: a transformers tokenizer.

    Returns:
        A list of zero or one token id.
    """
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def tokenize_examples(dataset, tokenizer, max_length: int, kind: str) -> list[dict[str, list[int]]]:
    """Tokenize rows into ``input_ids`` and ``labels`` (prompt tokens masked with -100).

    Args:
        dataset: rows with "text" or "prompt"/"answer" (kind="lm" reads prompt + answer as
            one text), or "prompt"/"answer" (kind="sft").
        tokenizer: a transformers tokenizer with bos and eos tokens.
        max_length: longest sequence kept; longer ones are truncated (lm) or rejected (sft).
        kind: "lm" (every token is a target) or "sft" (only the answer and eos are targets).

    Returns:
        One ``{"input_ids", "labels"}`` dict of token lists per row.

    Raises:
        ValueError: if max_length exceeds the tokenizer's model_max_length, or an sft example
            does not fit in max_length.
    """
    if kind not in ("lm", "sft"):
        raise ValueError(f"kind={kind!r}: expected 'lm' or 'sft'")
    if max_length <= 1:
        raise ValueError(f"max_length={max_length}: must be at least 2")
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is not None and limit < 10**9 and max_length > limit:
        raise ValueError(
            f"max_length={max_length}: longer than the model's max positions ({limit})"
        )
    bos = bos_ids(tokenizer)
    out = []
    for row in dataset:
        if kind == "lm":
            text = row["text"] if "text" in row else row["prompt"] + row["answer"]
            ids = bos + tokenizer.encode(text, add_special_tokens=False)
            ids = (ids + [tokenizer.eos_token_id])[:max_length]
            out.append({"input_ids": ids, "labels": list(ids)})
        elif kind == "sft":
            p = bos + tokenizer.encode(row["prompt"], add_special_tokens=False)
            a = tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
            if len(p) + len(a) > max_length:
                raise ValueError(
                    f"max_length={max_length}: an example needs {len(p) + len(a)} tokens"
                )
            out.append({"input_ids": p + a, "labels": [IGNORE_INDEX] * len(p) + a})
        else:
            raise ValueError(f"kind={kind!r}: expected 'lm' or 'sft'")
    return out


def collate(examples: list[dict[str, list[int]]], pad_token_id: int, pad_to_multiple_of: int = 8
            ) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into a batch with attention_mask; padded labels are -100.

    The width is rounded up to ``pad_to_multiple_of`` (8 by default, as transformers'
    ``DataCollatorWithPadding(pad_to_multiple_of=8)``): tensor cores want multiples of 8, and
    CUDA's memory-efficient SDPA kernel rejects a padding mask whose row stride is not aligned
    ("attn_bias is not correctly aligned"). Padded positions carry no loss, so losses are unchanged.

    Args:
        examples: ``input_ids`` and ``labels`` lists, as :func:`tokenize_examples` makes them.
        pad_token_id: the id padded positions get.
        pad_to_multiple_of: the width is rounded up to a multiple of this.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``, each ``(len(examples), width)``.

    Raises:
        ValueError: for no examples or ``pad_to_multiple_of`` < 1.
    """
    if not examples:
        raise ValueError("examples: empty list, nothing to collate")
    if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r}: must be an integer >= 1")
    width = max(len(e["input_ids"]) for e in examples)
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(
    examples: list[dict[str, Any]],
    batch_size: int,
    pad_token_id: int,
    seed: int = 0,
    shuffle: bool = True,
) -> Iterator[dict[str, torch.Tensor]]:
    """An endless, seeded stream of padded batches (reshuffled every epoch).

    Args:
        examples: tokenised examples.
        batch_size: examples per batch.
        pad_token_id: the id padded positions get.
        seed: for the order.
        shuffle: shuffle (else the examples' order, repeated).

    Yields:
        Collated batches (:func:`collate`).

    Raises:
        ValueError: if batch_size < 1 or larger than the number of examples.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if batch_size > len(examples):
        raise ValueError(f"batch_size={batch_size}: larger than the {len(examples)} examples")
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(examples), generator=g) if shuffle else range(len(examples))
        order = list(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield collate([examples[j] for j in order[i:i + batch_size]], pad_token_id)
