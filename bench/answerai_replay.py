"""Answer.AI's reserved rows without CPU offload, replayed through CUDA's caching allocator.

    .venv/bin/python bench/answerai_replay.py

``make bench`` sets each of Answer.AI's rows (``published.FIGURES``) beside the fake trace plus
a fixed 15 % (``planner.allocator_reserve``). This prints, for its rows that read
``max_memory_reserved`` and keep the shards on the GPU, the same run replayed through the
allocator's rules instead (``fake_memory.replay_allocator``: the weights' materialisation and
two steps; FSDP's collectives as if on the step's own stream, ``fsdp_one_stream=True``, an
estimate below what their streams' own pools take), as a markdown table. The offloaded rows
cannot be replayed on a CPU (the host's shards share its device). Outside ``make bench``: about
20 s a 7 B row and 50 s a 34 B row on a 2-core CPU. "allocated" is the replay's peak in the
allocator's 512-byte blocks, a little above the meter's trace that ``make bench`` adds 15 % to
(up to 1.3 %: the default rules hand a large block out whole, and count it whole, when 1 MiB or
less would remain; with ``expandable_segments=True``, which splits any remainder of 512 bytes,
Yi 34B's allocated peak equals the trace).
"""

from __future__ import annotations

import time


def main() -> None:
    from recipes_lib import fake_memory, planner, published

    rows = [f for f in published.FIGURES if f.source == published.ANSWERAI and f.kind == "peak"
            and f.reads == "reserved" and not f.stack.fsdp_cpu_offload]
    print("| row | allocated | allocated + 15 % | replayed | source | replayed vs source | "
          "allocated + 15 % vs source |")
    print("|---|---|---|---|---|---|---|")
    for f in rows:
        start = time.perf_counter()
        a = fake_memory.replay_allocator(f.model, f.stack, f.seq_len, f.batch_size,
                                         fsdp_one_stream=True)
        trace = a.peak_allocated
        fixed = trace + planner.allocator_reserve(trace)
        gib = f.published * f.unit_bytes / 2**30
        print(f"| {f.row} | {trace / 2**30:.2f} | {fixed / 2**30:.2f} | "
              f"{a.peak_reserved / 2**30:.2f} | {gib:.2f} | "
              f"{a.peak_reserved / 2**30 / gib - 1:+.1%} | {fixed / 2**30 / gib - 1:+.1%} |",
              flush=True)
        print(f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
