"""The caching allocator replayed under each setting users launch with, on two runs.

    .venv/bin/python bench/allocator_settings.py [LENGTH ... | rounding]

``recipes_lib.allocator`` replays a run's allocations through PyTorch's caching allocator as
it behaves by default, with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (pages mapped
into one growing segment a pool instead of a segment a request) and with
``max_split_size_mb:N`` (blocks of N MiB or more kept whole, and released first when the card
is full; 128 and 512 are the values users are most often told to try). This prints three
markdown tables:

1. The H100 session's five runs of Llama-3.2-1B at 2 x 2048 tokens (their allocations traced
   again on fake tensors, ``results/h100/raw/fake_traces_*.json.gz``): the reserved peak on an
   unlimited card under each setting, the default replay beside the card's
   ``max_memory_reserved`` (the other settings are predictions no GPU has checked yet;
   ``bench/gpu_session.py`` runs them), and the smallest card each setting fits
   (``allocator.min_capacity``: the cache released under pressure, as a full card does).
2. Unsloth's 24 GB row (Llama-3.1-8B, QLoRA r=32, batch 1, TRL's 2024 stack,
   ``published.TRL_2024_QLORA``) at each length, on the card's 24 GiB less the modelled CUDA
   context: whether the run fits under each setting (and the reserved peak there), and the
   smallest card it fits under each (the context added: what ``plan --max-context
   --replay-allocator`` searches by), beside the trace plus a fixed 15 %. Default lengths: the
   source's 5,789 tokens and 6,900-8,960.
3. ``roundup_power2_divisions`` (requests rounded up to D steps between two powers of two, so
   that requests of nearby sizes share blocks; axolotl's command line launches with
   ``expandable_segments:True,roundup_power2_divisions:16``), on what it exists for: the same
   Llama-3.1-8B QLoRA stack trained on unpacked batches of varying length (eight steps, lengths
   drawn at random between 256 and 4,096 tokens, seed 0; beside it two steps at its longest
   length alone), and on the H100's five fixed-length runs: allocated, reserved on an
   unlimited card and the smallest card, under each setting with and without the rounding.

Outside ``make bench``: about 17 s a length on a 2-core CPU (the trace 13 s; each replay < 1 s);
the varying lengths' trace about a minute.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (5789, 6900, 7040, 7168, 7296, 7424, 7552, 7808, 8064, 8320, 8576, 8832, 8960)


def settings() -> dict[str, dict]:
    """Each setting the course compares (``allocator.SETTINGS``): its name and
    ``allocator.replay``'s keywords for it."""
    from recipes_lib.allocator import SETTINGS, parse_settings

    return {name: parse_settings(conf) for name, conf in SETTINGS.items()}


def h100_table() -> None:
    from recipes_lib.allocator import load_traces, replay, smallest_cards

    raw = ROOT / "results" / "h100" / "raw"
    real = {r["stack"]: r["reserved_peak"] for r in
            json.loads((raw / "gpu_session_memory.json").read_text())["fake_vs_real"]}
    names = " / ".join(settings())
    print(f"| run | allocated | H100 reserved | reserved, unlimited card: {names} | "
          f"smallest card: {names} |")
    print("|---|---|---|---|---|")
    for path in sorted(raw.glob("fake_traces_*.json.gz")):
        for stack, events in load_traces(path).items():
            runs = [replay(events, **s) for s in settings().values()]
            print(f"| {stack} | {runs[0].peak_allocated / 2**30:.2f} | "
                  f"{real[stack] / 2**30:.2f} | "
                  + " / ".join(f"{a.peak_reserved / 2**30:.2f}" for a in runs) + " | "
                  + " / ".join(f"{card / 2**30:.2f}" for card in smallest_cards(events).values())
                  + " |", flush=True)


def on_card(events, capacity: int, setting: dict) -> str:
    from recipes_lib.allocator import fits

    a = fits(events, capacity, **setting)
    if a is None:
        return "out of memory"
    released = f", cache released {a.releases}x" if a.releases else ""
    return f"fits, {a.peak_reserved / 2**30:.2f} reserved{released}"


def unsloth_table(lengths) -> None:
    from recipes_lib import fake_memory, planner, published
    from recipes_lib.allocator import replay, smallest_cards

    budget = planner.parse_bytes("24GiB")
    capacity = int(budget - planner.CUDA_CONTEXT_BYTES)
    print(f"\n| tokens | allocated | allocated + 15 % + context (of {budget / 2**30:.0f}) | "
          + " | ".join(settings()) + f" | smallest card: {' / '.join(settings())} |")
    print("|---" * (4 + len(settings())) + "|")
    for seq_len in lengths:
        start = time.perf_counter()
        events = fake_memory.allocation_trace("Llama-3.1-8B", published.TRL_2024_QLORA, seq_len,
                                              1)
        allocated = replay(events).peak_allocated
        fixed = allocated + planner.gpu_overhead(allocated)
        print(f"| {seq_len:,} | {allocated / 2**30:.2f} | {fixed / 2**30:.2f} "
              f"({'fits' if fixed <= budget else 'out of memory'}) | "
              + " | ".join(on_card(events, capacity, s) for s in settings().values()) + " | "
              + " / ".join(f"{(card + planner.CUDA_CONTEXT_BYTES) / 2**30:.2f}"
                           for card in smallest_cards(events).values()) + " |", flush=True)
        print(f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)


# the settings with and without axolotl's rounding, a coarser one, and launch scripts' three
# together
ROUNDING = {"default": "", "roundup_power2_divisions:16": "roundup_power2_divisions:16",
            "roundup_power2_divisions:4": "roundup_power2_divisions:4",
            "expandable segments": "expandable_segments:True",
            "expandable segments, roundup_power2_divisions:16 (axolotl)":
                "expandable_segments:True,roundup_power2_divisions:16",
            "max_split_size_mb:128": "max_split_size_mb:128",
            "max_split_size_mb:128, roundup_power2_divisions:16":
                "max_split_size_mb:128,roundup_power2_divisions:16",
            "expandable segments, max_split_size_mb:128":
                "expandable_segments:True,max_split_size_mb:128",
            "expandable segments, max_split_size_mb:128, roundup_power2_divisions:16":
                "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:16"}


def varying_lengths(steps: int = 8, low: int = 256, high: int = 4096, seed: int = 0) -> list[int]:
    """Each step's length, an unpacked dataset's batches of one sequence."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(low, high + 1) for _ in range(steps)]


def rounding_table() -> None:
    from recipes_lib import fake_memory, planner, published
    from recipes_lib.allocator import load_traces, parse_settings, replay, smallest_cards

    lengths = varying_lengths()
    start = time.perf_counter()
    events = fake_memory.allocation_trace("Llama-3.1-8B", published.TRL_2024_QLORA, lengths, 1)
    longest = fake_memory.allocation_trace("Llama-3.1-8B", published.TRL_2024_QLORA,
                                           max(lengths), 1)  # two steps at the longest alone
    runs = {"8B QLoRA, varying lengths": events, "8B QLoRA, the longest alone": longest} | {
        stack: events for path in sorted((ROOT / "results" / "h100" / "raw").glob(
            "fake_traces_*.json.gz")) for stack, events in load_traces(path).items()}
    context = planner.CUDA_CONTEXT_BYTES
    print(f"\nLlama-3.1-8B QLoRA (TRL 2024), one sequence a step at {', '.join(map(str, lengths))}"
          " tokens, and its longest alone; then the H100's Llama-3.2-1B runs at 2 x 2048 (GiB:"
          " allocated / reserved on"
          " an unlimited card / smallest card, the context added):\n")
    print("| setting | " + " | ".join(runs) + " |")
    print("|---" * (1 + len(runs)) + "|")
    cards = {run: smallest_cards(trace, ROUNDING) for run, trace in runs.items()}
    for name, conf in ROUNDING.items():
        cells = []
        for run, trace in runs.items():
            a = replay(trace, **parse_settings(conf))
            cells.append(f"{a.peak_allocated / 2**30:.2f} / {a.peak_reserved / 2**30:.2f} / "
                         f"{(cards[run][name] + context) / 2**30:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)


def main(argv: list[str]) -> None:
    if argv == ["rounding"]:
        rounding_table()
        return
    h100_table()
    unsloth_table([int(a) for a in argv] or LENGTHS)
    rounding_table()


if __name__ == "__main__":
    main(sys.argv[1:])
