"""A training run in its own process, for the kill-and-resume tests (not collected by pytest).

Usage: python tests/resume_worker.py CHECKPOINT_DIR OUT_JSON STEPS
"""

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recipes_lib import train


def run(ckpt: str, out: str, steps: int) -> dict:
    """Train the tiny model with a checkpoint every step; write and return the losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels in every process, so losses compare bit for bit
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    g = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(64):
        ids = torch.randint(3, 128, (int(torch.randint(8, 48, (1,), generator=g)),),
                            generator=g).tolist()
        examples.append({"input_ids": ids, "labels": ids})
    try:
        result = train.train(model, examples, 0, train.TrainConfig(
            steps=steps, micro_batch_size=8, lr=3e-3, warmup_steps=2, progress=False,
            checkpoint_dir=ckpt, checkpoint_every=1))
    finally:
        torch.set_num_threads(threads)
    summary = {"losses": result.losses, "target_tokens": result.target_tokens}
    with open(out, "w") as f:
        json.dump(summary, f)
    return summary


def main() -> None:
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))


if __name__ == "__main__":
    main()
