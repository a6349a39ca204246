"""The caching allocator replayed with and without expandable segments, on two runs.

    .venv/bin/python bench/expandable_replay.py [LENGTH ...]

``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` maps pages into one growing segment a pool
instead of taking a segment a request (``recipes_lib.allocator``). This prints two markdown
tables:

1. The H100 session's five runs of Llama-3.2-1B at 2 x 2048 tokens (their allocations traced
   again on fake tensors, ``results/h100/raw/fake_traces_*.json.gz``): the default replay beside
   the card's ``max_memory_reserved``, and the expandable replay, a prediction no GPU has
   checked yet (``bench/gpu_session.py`` runs three of them with expandable segments).
2. Unsloth's 24 GB row (Llama-3.1-8B, QLoRA r=32, batch 1, TRL's 2024 stack,
   ``published.TRL_2024_QLORA``) at each length, on the card's 24 GiB less the modelled CUDA
   context: whether the run fits under each setting (and the reserved peak there), and the
   smallest card it fits under each (``allocator.min_capacity``, the context added: what
   ``plan --max-context --replay-allocator`` searches by), beside the trace plus a fixed 15 %.
   Default lengths: the source's 5,789 tokens and 6,900-8,960.

Outside ``make bench``: about 13 s a length on a 2-core CPU (the trace; each replay < 1 s).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (5789, 6900, 7040, 7168, 7296, 7424, 7552, 7808, 8064, 8320, 8576, 8832, 8960)


def h100_table() -> None:
    from recipes_lib.allocator import load_traces, replay

    raw = ROOT / "results" / "h100" / "raw"
    real = {r["stack"]: r["reserved_peak"] for r in
            json.loads((raw / "gpu_session_memory.json").read_text())["fake_vs_real"]}
    print("| run | allocated | default replay | H100 reserved | expandable replay |")
    print("|---|---|---|---|---|")
    for path in sorted(raw.glob("fake_traces_*.json.gz")):
        for stack, events in load_traces(path).items():
            default, grown = replay(events), replay(events, expandable_segments=True)
            print(f"| {stack} | {default.peak_allocated / 2**30:.2f} | "
                  f"{default.peak_reserved / 2**30:.2f} | {real[stack] / 2**30:.2f} | "
                  f"{grown.peak_reserved / 2**30:.2f} |")


def on_card(events, capacity: int, expandable: bool) -> str:
    from recipes_lib.allocator import fits

    a = fits(events, capacity, expandable)
    if a is None:
        return "out of memory"
    released = f", cache released {a.releases}x" if a.releases else ""
    return f"fits, {a.peak_reserved / 2**30:.2f} reserved{released}"


def unsloth_table(lengths) -> None:
    from recipes_lib import fake_memory, planner, published
    from recipes_lib.allocator import min_capacity, replay

    budget = planner.parse_bytes("24GiB")
    capacity = int(budget - planner.CUDA_CONTEXT_BYTES)
    print(f"\n| tokens | allocated | allocated + 15 % + context (of {budget / 2**30:.0f}) | "
          "default allocator | expandable segments | smallest card: default, expandable |")
    print("|---|---|---|---|---|---|")
    for seq_len in lengths:
        start = time.perf_counter()
        events = fake_memory.allocation_trace("Llama-3.1-8B", published.TRL_2024_QLORA, seq_len,
                                              1)
        allocated = replay(events).peak_allocated
        fixed = allocated + planner.gpu_overhead(allocated)
        print(f"| {seq_len:,} | {allocated / 2**30:.2f} | {fixed / 2**30:.2f} "
              f"({'fits' if fixed <= budget else 'out of memory'}) | "
              f"{on_card(events, capacity, False)} | {on_card(events, capacity, True)} | "
              + ", ".join(f"{(min_capacity(events, e) + planner.CUDA_CONTEXT_BYTES) / 2**30:.2f}"
                          for e in (False, True)) + " |", flush=True)
        print(f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)


def main(argv: list[str]) -> None:
    h100_table()
    unsloth_table([int(a) for a in argv] or LENGTHS)


if __name__ == "__main__":
    main(sys.argv[1:])
