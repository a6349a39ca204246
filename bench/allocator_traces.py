"""The allocation traces behind the allocator replay's check against an H100.

    git worktree add /tmp/h100-loop 64663d2
    .venv/bin/python bench/allocator_traces.py /tmp/h100-loop

The H100 session of 2026-11-23 (``results/h100/raw/gpu_session_memory.json``) read
``max_memory_reserved`` for Llama-3.2-1B at 2 x 2048 tokens under five recipe stacks, each built
and stepped twice by the course's code at commit 64663d2 (the loop has changed since: it frees
its logits before backward now). This script runs that commit's own build and loop on fake
tensors, on this CPU, under ``recipes_lib.allocator.AllocationLog``: the same allocations and
frees in the same order, from the model's materialisation to the end of the second step, which
is where that session read the allocator. It writes them to
``results/h100/raw/fake_traces_64663d2.json.gz`` (about 110 kB, a few seconds a stack).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "h100" / "raw" / "fake_traces_64663d2.json.gz"


def main(old_checkout: str) -> None:
    sys.path.insert(0, old_checkout)  # that commit's recipes_lib, whose loop the H100 ran
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from recipes_lib import fake_memory as fm

    sys.path.insert(0, str(ROOT))
    allocator = _load_allocator()
    if "forward_backward" not in vars(fm) or not hasattr(fm, "_restore_buffers"):
        raise SystemExit(f"{old_checkout}: not a checkout of 64663d2 (its fake_memory differs)")
    stacks = [fm.Stack(), fm.Stack(checkpointing=True),
              fm.Stack(method="lora", checkpointing=True),
              fm.Stack(precision="fp32", checkpointing=True), fm.Stack(grad_accum_steps=2)]
    seq, batch, device = 2048, 2, "cpu"  # fake tensors on the CPU: CUDA SDPA needs a CUDA build
    traces = {}
    for stack in stacks:
        start = time.perf_counter()
        config = fm.model_config("Llama-3.2-1B")
        with torch.device("meta"):  # fake_memory.build_model at 64663d2, logged
            net = AutoModelForCausalLM.from_config(config, dtype=fm._DTYPES[stack.precision],
                                                   attn_implementation="sdpa")
        if stack.method == "lora":
            from peft import LoraConfig, get_peft_model

            net = get_peft_model(net, LoraConfig(r=stack.lora_rank, lora_alpha=2 * stack.lora_rank,
                                                 target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        log = allocator.AllocationLog(device, fake_only=True)
        with mode, log:
            net.to_empty(device=device)
            net.tie_weights()
            fm._restore_buffers(net)
        if stack.checkpointing:
            fm.enable_activation_checkpointing(net)
        net.train()
        opt = fm._optimizer(net, stack)
        with mode, fm._unpacked_rows(), log:  # measure_step at 64663d2: two steps, then the read
            ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
            for _ in range(2):
                fm.forward_backward(net, {"input_ids": ids, "labels": ids}, stack.grad_accum_steps,
                                    "fp32", num_target_tokens=batch * (seq - 1))
                fm.optimizer_step(net, opt, max_grad_norm=None)
                gc.collect()
        traces[stack.label] = list(log.events)
        print(f"{stack.label}: {len(log.events)} events, "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        del net, opt, log
        with contextlib.suppress(Exception):
            gc.collect()
    allocator.save_traces(str(OUT), traces)
    print(f"wrote {OUT.relative_to(ROOT)}")


def _load_allocator():
    """This checkout's ``recipes_lib.allocator`` (the old checkout's recipes_lib has none)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("allocator",
                                                  ROOT / "recipes_lib" / "allocator.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["allocator"] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
