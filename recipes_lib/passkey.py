"""A long-context task where distance matters: passkey retrieval (Mohtashami & Jaggi, 2023).

An episode is filler text (sentences of the base corpus) with one sentence ``The pass key is 4 7
1 9. Remember it.`` hidden at a chosen *depth* (0 = start, 1 = just before the question),
followed by ``What is the pass key? The pass key is`` and the answer `` 4 7 1 9``. Only the
answer is scored (loss and exact match), so a model can only succeed by attending back to the
key, however far away it is.

Episodes are built directly at a token length, so a sequence-length curriculum asks for short
episodes early and long ones later (``PasskeyStream``); the held-out set, at fixed lengths and
depths, is written to ``data/passkey_test.jsonl``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from recipes_lib import data

QUESTION = "\nWhat is the pass key? The pass key is"
N_DIGITS = 4


def _key(rng: random.Random) -> str:
    return " " + " ".join(str(rng.randint(0, 9)) for _ in range(N_DIGITS))


def episode(tokenizer, length: int, depth: float, rng: random.Random) -> dict:
    """One episode of exactly ``length`` tokens (bos + filler + key + question + answer + eos).

    Args:
        tokenizer: the tokenizer the length is counted in.
        length: tokens in the episode.
        depth: where the key sits in the filler, in [0, 1].
        rng: draws the key and the filler.

    Returns:
        ``input_ids``, ``labels`` (the answer's), ``answer``, ``depth``, ``prompt_ids``,
        ``length`` and ``prompt`` (text).

    Raises:
        ValueError: if depth is outside [0, 1] or length leaves no room for filler.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth}: must be in [0, 1]")
    answer = _key(rng)
    needle = f" The pass key is{answer}. Remember it."
    def enc(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)

    fixed = (len(data.bos_ids(tokenizer)) + len(enc(needle)) + len(enc(QUESTION))
             + len(enc(answer)) + 1)
    room = length - fixed
    if room < 1:
        raise ValueError(f"length={length}: too short for a passkey episode (needs > {fixed})")
    filler: list[int] = []
    topic = rng.choice(data.TOPICS)
    while len(filler) < room:
        filler += enc(" " + data._sentence(rng, topic))
    filler = filler[:room]
    cut = round(depth * room)
    prompt = (data.bos_ids(tokenizer) + filler[:cut] + enc(needle) + filler[cut:]
              + enc(QUESTION))
    target = enc(answer) + [tokenizer.eos_token_id]
    return {"input_ids": prompt + target, "labels": [data.IGNORE_INDEX] * len(prompt) + target,
            "answer": answer, "depth": depth, "prompt_ids": prompt, "length": length,
            "prompt": tokenizer.decode(prompt, skip_special_tokens=True)}


TEST_SET = data.DATA_DIR / "passkey_test.jsonl"
FIELDS = ("prompt", "answer", "depth", "length")


def write_test_set(tokenizer, lengths: tuple[int, ...] = (128, 256, 512),
                   depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0), per_cell: int = 4,
                   path: Path | str = TEST_SET, seed: int = 1234) -> Path:
    """Write the held-out episodes (every length x depth, ``per_cell`` each) as JSON lines.

    Rows hold text (``prompt``, ``answer``) so any tokenizer can read them; ``length`` is the
    episode's length in tokens of the tokenizer that wrote it.

    Args:
        tokenizer: the tokenizer the lengths are counted in.
        lengths: episode lengths.
        depths: key depths.
        per_cell: episodes per (length, depth).
        path: the file to write.
        seed: for the keys and filler.

    Returns:
        ``path``.
    """
    rng = random.Random(seed)
    rows = [episode(tokenizer, n, d, rng) for n in lengths for d in depths for _ in range(per_cell)]
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({k: r[k] for k in FIELDS}) + "\n" for r in rows))
    tmp.replace(path)
    return path


def load_test_set(path: Path | str = TEST_SET) -> list[dict]:
    """The held-out episodes written by ``write_test_set`` (the default set is in ``data/``).

    Args:
        path: the JSON-lines file.

    Returns:
        One dict per episode.

    Raises:
        ValueError: naming ``path`` when the file does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"path={str(path)!r}: no passkey test set; run write_test_set first")
    return [json.loads(line) for line in path.read_text().splitlines()]


class PasskeyStream:
    """Training batches of episodes whose length follows a schedule (e.g. a curriculum).

    Args:
        tokenizer: the model's tokenizer.
        batch_size: episodes per batch.
        length_at: step -> episode length (``SeqLenCurriculum.length_at``, or a constant).
        seed: the stream is the same for the same seed.
    """

    def __init__(self, tokenizer, batch_size: int, length_at: Callable[[int], int], seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        self.tokenizer, self.batch_size, self.length_at = tokenizer, batch_size, length_at
        self.rng = random.Random(seed)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        step = 0
        while True:
            n = self.length_at(step)
            rows = [episode(self.tokenizer, n, self.rng.random(), self.rng)
                    for _ in range(self.batch_size)]
            yield data.collate(rows, self.tokenizer.pad_token_id)
            step += 1


@torch.no_grad()
def accuracy_by_depth(model: torch.nn.Module, tokenizer, rows: list[dict]) -> dict[tuple, float]:
    """Exact match of the greedy answer, per (length, depth) cell.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer.
        rows: passkey episodes (``prompt``, ``answer``, ``length``, ``depth``).

    Returns:
        ``(length, depth)`` -> the fraction answered exactly.
    """
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    cells: dict[tuple, list[int]] = {}
    for r in rows:
        prompt = data.bos_ids(tokenizer) + tokenizer.encode(r["prompt"], add_special_tokens=False)
        ids = torch.tensor([prompt], device=device)
        budget = len(tokenizer.encode(r["answer"], add_special_tokens=False)) + 1
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=budget, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        cells.setdefault((r["length"], r["depth"]), []).append(text.strip() == r["answer"].strip())
    model.train(was)
    return {k: sum(v) / len(v) for k, v in sorted(cells.items())}
