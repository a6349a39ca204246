"""Quality metrics: eval loss (per target token) and exact-match accuracy of greedy answers."""

from __future__ import annotations

import math

import torch

from recipes_lib import data
from recipes_lib.grad_accumulation import causal_lm_loss_sum, count_target_tokens


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module,
    examples: list[dict[str, list[int]]],
    pad_token_id: int,
    batch_size: int = 32,
) -> float:
    """Mean next-token cross-entropy over every target token of ``examples``.

    Args:
        model: a causal LM.
        examples: ``input_ids`` and ``labels`` lists (``data.tokenize_examples``).
        pad_token_id: the id padded positions get.
        batch_size: examples per forward pass.

    Returns:
        The loss in nats per target token.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in
                 data.collate(examples[i:i + batch_size], pad_token_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total += float(causal_lm_loss_sum(logits, batch["labels"]))
        count += count_target_tokens(batch["labels"])
    model.train(was_training)
    return total / max(count, 1)


def perplexity(loss: float) -> float:
    """exp(loss), the usual perplexity.

    Args:
        loss: mean cross-entropy in nats per token.

    Returns:
        The perplexity.

    Example:
        >>> perplexity(0.0)
        1.0
    """
    return math.exp(loss)


@torch.no_grad()
def exact_match(
    model: torch.nn.Module,
    tokenizer,
    rows,
    max_new_tokens: int | None = None,
    batch_size: int = 32,
) -> float:
    """Fraction of rows whose greedy answer (up to eos or newline) equals ``row["answer"]``.

    Args:
        model: a causal LM with ``generate``.
        tokenizer: its tokenizer.
        rows: a dataset (or list of dicts) with "prompt" and "answer".
        max_new_tokens: generation budget per answer; default the longest answer's token count
            plus one (for eos), so no answer is cut short by the budget.
        batch_size: prompts per generate call (left-padded).

    Returns:
        The fraction of exact answers, in [0, 1].
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = list(rows)
    if max_new_tokens is None:
        max_new_tokens = 1 + max((len(tokenizer.encode(r["answer"], add_special_tokens=False))
                                  for r in rows), default=1)
    hits = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        prompts = [data.bos_ids(tokenizer) + tokenizer.encode(r["prompt"], add_special_tokens=False)
                   for r in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(prompts):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        for j, r in enumerate(chunk):
            text = tokenizer.decode(out[j, width:], skip_special_tokens=True)
            hits += text.split("\n")[0].strip() == r["answer"].strip()
    model.train(was_training)
    return hits / max(len(rows), 1)
