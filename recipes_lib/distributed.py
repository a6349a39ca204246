"""Real multi-process runs: launch ranks with torchrun, initialise them, share a global batch.

The same code runs 2 CPU ranks on a laptop (gloo) and N GPUs per node (NCCL)::

    torchrun --nproc-per-node 8 -m recipes_lib.distributed recipes_lib.fsdp:train_sharded \\
        --kwargs kwargs.json --out results/run
    # across nodes: torchrun --nnodes 2 --node-rank R --rdzv-backend c10d \\
    #     --rdzv-endpoint HOST:29500 --nproc-per-node 8 -m recipes_lib.distributed ...

From a notebook, :func:`launch` runs that command in a subprocess and returns what each rank's
function returned. Faults are loud and bounded: every rank's exception is reported, a collective
that waits for a dead or stuck rank fails after ``pg_timeout_s`` instead of hanging, and the
whole process group of the launcher is killed on timeout or interruption, so no rank outlives it.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
# Lines of torch/torchao start-up chatter that say nothing about the run.
_NOISE = ("is an Enum subclass", "Failed to load", "OMP_NUM_THREADS", "*****",
          "Loading weights")


_LOG_LINE = re.compile(r"^(\[rank\d+\]:)?[EWI]\d{4} ")
# torchrun's --tee starts each line it copies with the rank's tag, "[default0]:" (role and local
# rank), and turns tqdm's carriage returns into such lines: a tag inside a line starts a new one
_RANK_TAG = re.compile(r"\[[A-Za-z_]+\d+\]:")  # not a printed "values[0]:"
_PROGRESS_BAR = re.compile(r"\d{1,3}%\|.*\| *\d+/\d+ \[")  # tqdm's "desc:  50%|███  | 2/4 [00:01"
_STORE: dist.Store | None = None  # this rank's rendezvous store (set by init_distributed)


class DistributedRunError(RuntimeError):
    """A distributed run failed: the message says which rank raised what (or that it timed out)."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the run.

    Attributes:
        rank: its global rank.
        world_size: ranks in all.
        local_rank: its rank on this node.
        backend: "nccl" or "gloo".
        device: the device it computes on.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def default_backend(world_size: int = 1) -> str:
    """NCCL when this node has a CUDA GPU for every rank, gloo (ranks on the CPU) otherwise.

    One Colab GPU and ``world_size=2`` therefore runs two CPU ranks on gloo rather than failing:
    NCCL needs one GPU per rank.

    Args:
        world_size: ranks to start on this node.

    Returns:
        "nccl" or "gloo".
    """
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if n_gpu >= world_size else "gloo"


def check_backend(backend: str | None, world_size: int) -> str:
    """Resolve ``backend`` (None = default) and check this machine can run it.

    Args:
        backend: "nccl", "gloo" or None.
        world_size: ranks to start.

    Returns:
        The backend.

    Raises:
        ValueError: for an unknown backend, or NCCL without enough CUDA devices.
    """
    backend = backend or default_backend(world_size)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "nccl":
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpu == 0:
            raise ValueError("backend='nccl': needs CUDA GPUs and this machine has none; "
                             "use backend='gloo' (or None) on CPU")
        if world_size > n_gpu:
            raise ValueError(f"world_size={world_size}: NCCL needs one GPU per rank on a node "
                             f"and this node has {n_gpu}")
    return backend


def check_global_batch(global_batch_size: int, world_size: int) -> int:
    """Per-rank batch size.

    Args:
        global_batch_size: examples per step over all ranks.
        world_size: ranks.

    Returns:
        ``global_batch_size // world_size``.

    Raises:
        ValueError: if ``world_size`` does not divide ``global_batch_size``.

    Example:
        >>> check_global_batch(16, 2)
        8
    """
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size!r}: must be an integer >= 1")
    if global_batch_size % world_size:
        raise ValueError(f"global_batch_size={global_batch_size}: not divisible by the world "
                         f"size {world_size}; every rank must get the same number of examples")
    return global_batch_size // world_size


def init_distributed(backend: str | None = None, pg_timeout_s: float = 300.0) -> RankInfo:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, ...).

    Args:
        backend: "gloo", "nccl" or None (NCCL with a GPU per rank, else gloo).
        pg_timeout_s: how long a collective waits for the other ranks before raising.

    Returns:
        This process's :class:`RankInfo`.

    Raises:
        RuntimeError: when not started by torchrun (no RANK / WORLD_SIZE in the environment).
        ValueError: for a backend this machine cannot run.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("init_distributed: RANK/WORLD_SIZE not set; start the script with "
                           "torchrun (or recipes_lib.distributed.launch)")
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = check_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        timeout = timedelta(seconds=pg_timeout_s)
        # torchrun's workers share the agent's store, which outlives a restart. Keys are prefixed
        # with the restart count so a restarted rank never reads a dead rank's address left by
        # the previous attempt (seen: "Gloo connectFullMesh failed ... Connect timeout").
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        global _STORE
        _STORE = dist.PrefixStore(f"attempt{attempt}", store)
        dist.init_process_group(backend, store=_STORE, rank=int(os.environ["RANK"]),
                                world_size=world_size, timeout=timeout, **kwargs)
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def _leave_together(timeout_s: float) -> None:
    """Wait, on the rendezvous store rather than on gloo, until every rank has finished its last
    collective, before this one tears its process group down. A gloo rank whose peer closes the
    connection while one of its own operations is still pending aborts (SIGABRT, after both had
    written their results: seen in 1 of about 60 two-rank runs on this 2-core machine, and once
    in CI)."""
    rank, world_size = world()
    if _STORE is None or world_size == 1:
        return
    _STORE.set(f"finished/{rank}", "1")
    _STORE.wait([f"finished/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


def world() -> tuple[int, int]:
    """This process's rank and the world size.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` outside a process group.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world_size: int
               ) -> dict[str, torch.Tensor]:
    """This rank's contiguous share of a global batch that every rank drew identically.

    Args:
        batch: the global batch, every tensor with the batch as its first dimension.
        rank: this rank.
        world_size: ranks sharing the batch.

    Returns:
        The rows ``rank * b / N`` to ``(rank + 1) * b / N`` of every tensor.
    """
    per_rank = check_global_batch(int(batch["input_ids"].shape[0]), world_size)
    return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}


def all_reduce_sum(value: float | torch.Tensor, device: torch.device | None = None) -> float:
    """Sum a number (or a 0-dim tensor, read once here) over ranks; identity outside a process
    group.

    Args:
        value: this rank's number.
        device: where the all-reduce's tensor lives (default: the backend's device).

    Returns:
        The sum, as a Python float.
    """
    if world()[1] == 1:
        return float(value)
    device = device or (torch.device("cuda", torch.cuda.current_device())
                        if dist.get_backend() == "nccl" else torch.device("cpu"))
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(1).to(device, torch.float64)
    else:
        t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def resolve(target: str):
    """The function named ``"package.module:function"``.

    Args:
        target: ``"package.module:function"``.

    Returns:
        The function.

    Raises:
        ValueError: for a target not in that form.
    """
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"target={target!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def _worker_main(argv: list[str] | None = None) -> None:
    """Entry point of every rank: run each call in turn, write its result to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m recipes_lib.distributed")
    parser.add_argument("target", help="module:function, or @calls.json with a list of calls")
    parser.add_argument("--kwargs", default=None, help="JSON file with keyword arguments")
    parser.add_argument("--out", required=True, help="folder for rank<N>.json results")
    parser.add_argument("--backend", default=None, choices=BACKENDS)
    parser.add_argument("--pg-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.target.startswith("@"):
        calls = json.loads(Path(args.target[1:]).read_text())
    else:
        calls = [[args.target, json.loads(Path(args.kwargs).read_text()) if args.kwargs else {}]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        init_distributed(args.backend, args.pg_timeout)
        results = [resolve(target)(**kwargs) for target, kwargs in calls]
        tmp = out / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(results))
        os.replace(tmp, out / f"rank{rank}.json")
        _leave_together(args.pg_timeout)
    except BaseException as err:
        (out / f"rank{rank}.error.json").write_text(json.dumps({
            "rank": rank, "type": type(err).__name__, "message": str(err),
            "traceback": traceback.format_exc()}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _RankConsole:
    """Rank 0's output as a console shows it, from what torchrun's --tee copies: the rank tags
    dropped, a progress bar redrawn in place (tqdm's own "\\r" + bar, which the tee had turned into
    one tagged line per update), blank lines and start-up chatter left out, and nothing after a
    traceback starts (the error is summarised when raised)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.echo, self.bar_width = stream, True, 0  # 0: no bar on the line

    def write(self, line: str) -> None:
        """One line as torchrun wrote it (its terminator removed)."""
        for part in _RANK_TAG.split(line):
            self.echo = self.echo and "Traceback" not in part
            if (not self.echo or not part.strip() or any(n in part for n in _NOISE)
                    or _LOG_LINE.match(part)):
                continue
            text = part.rstrip()
            if _PROGRESS_BAR.search(text):  # over the last bar, padded as tqdm pads it
                self.stream.write("\r" + text.ljust(self.bar_width))
                self.bar_width = len(text)
            else:
                self.stream.write(("\n" if self.bar_width else "") + text + "\n")
                self.bar_width = 0
            self.stream.flush()

    def close(self) -> None:
        """Ends a bar left open by the last line."""
        if self.bar_width:
            self.stream.write("\n")
            self.stream.flush()
            self.bar_width = 0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's whole process group, SIGKILL what is left after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# torchrun's summary of a worker that died: "exitcode  : -6 (pid: 123)" under "rank : 1 (...)".
_EXITCODE = re.compile(r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _rank_log_tail(logs: Path, rank: int, n: int = 8) -> list[str]:
    """The last ``n`` meaningful lines rank ``rank`` wrote to stderr (torchrun's ``--tee`` files;
    the last attempt's), for a rank that died before it could write its error (a C++ abort)."""
    files = sorted(logs.glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda f: f.stat().st_mtime)
    if not files:
        return []
    text = files[-1].read_text(errors="replace").splitlines()
    keep = [ln for ln in text if ln.strip() and not any(x in ln for x in _NOISE)]
    return keep[-n:]


def _failure_message(out: Path, world_size: int, rc: int, tail: deque,
                     logs: Path | None = None,
                     headline: str = "distributed run failed") -> str:
    lines = [f"{headline} (torchrun exit code {rc}):"]
    errors = {}
    for r in range(world_size):
        f = out / f"rank{r}.error.json"
        if f.exists():
            errors[r] = json.loads(f.read_text())
    killed = {int(r): signal.Signals(-int(c)).name
              for r, c in _EXITCODE.findall("".join(tail))
              if int(c) < 0 and -int(c) != signal.SIGTERM and int(r) not in errors}
    for r in range(world_size):
        if r in errors:
            lines.append(f"  rank {r}: {errors[r]['type']}: {errors[r]['message']}")
        elif r in killed:  # a C++ abort or a signal: no Python error was written
            lines.append(f"  rank {r}: killed by {killed[r]}; its last output:")
            lines.extend(f"    {ln}" for ln in (_rank_log_tail(logs, r) if logs else []))
        elif not (out / f"rank{r}.json").exists():
            lines.append(f"  rank {r}: stopped by torchrun after another rank failed"
                         if errors or killed else f"  rank {r}: exited without a result")
    if any("Timed out" in e["message"] for e in errors.values()):
        lines.append("  (a rank did not join a collective within pg_timeout_s: it crashed, hung "
                     "or took a different code path)")
    if not errors and not killed:
        lines.append("last output:\n" + "".join(list(tail)[-40:]))
    if logs is not None:
        lines.append(f"  (every rank's output: {logs})")
    return "\n".join(lines)


def launch(
    calls: list[tuple[str, dict[str, Any]]] | dict[str, tuple[str, dict[str, Any]]],
    world_size: int = 2,
    backend: str | None = None,
    timeout_s: float = 900.0,
    pg_timeout_s: float = 120.0,
    threads_per_rank: int | None = None,
    verbose: bool = True,
    max_restarts: int = 0,
) -> list[list[Any]] | dict[str, list[Any]]:
    """Run functions on ``world_size`` real processes started by torchrun on this node.

    Each rank joins the process group, then calls every ``(target, kwargs)`` in order; a target
    is ``"package.module:function"`` and must return something JSON can hold.

    Args:
        calls: the functions to run and their keyword arguments (JSON-serialisable), as a list,
            or as a dict that names each call (one torchrun job for several pieces of work:
            each job costs seconds of process start-up and imports).
        world_size: number of ranks (processes) on this node.
        backend: "gloo", "nccl" or None (NCCL with a GPU per rank, else gloo).
        timeout_s: wall-clock limit for the whole run; past it every process is killed.
        pg_timeout_s: a collective waiting longer than this for another rank raises.
        threads_per_rank: intra-op threads per rank (default: cores // world_size).
        verbose: echo rank 0's output (progress bars included) as it comes.
        max_restarts: torchrun's ``--max-restarts``: when a rank dies, every rank is stopped and
            the job started again, up to this many times; a training call that checkpoints
            (``train_sharded(resume_dir=...)``) then resumes from its last checkpoint.

    Returns:
        ``results[i][r]``: what call ``i`` returned on rank ``r`` (``results[name][r]`` for
        named calls).

    Raises:
        ValueError: for bad arguments (world size, backend, targets) before anything starts.
        DistributedRunError: when a rank raised (each rank's error is listed) or on timeout.

    Example:
        >>> [[a, b]] = launch([("recipes_lib.comm_bench:run", {"sizes": [1024]})])  # doctest: +SKIP
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an integer >= 1")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: must be an integer >= 0")
    backend = check_backend(backend, world_size)
    if not calls:
        raise ValueError("calls: empty, nothing to run")
    if isinstance(calls, dict):
        names = list(calls)
        return dict(zip(names, launch([calls[n] for n in names], world_size, backend, timeout_s,
                                      pg_timeout_s, threads_per_rank, verbose, max_restarts),
                        strict=True))
    for target, kwargs in calls:
        resolve(target)  # fail here, not in every rank
        json.dumps(kwargs)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    work = Path(tempfile.mkdtemp(prefix="recipes-dist-"))
    (work / "calls.json").write_text(json.dumps([[t, k] for t, k in calls]))
    out = work / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world_size}", f"--max-restarts={max_restarts}",
           "--local-ranks-filter=0", f"--log-dir={work / 'logs'}", "--tee=3",
           "-m", "recipes_lib.distributed", f"@{work / 'calls.json'}", "--out", str(out),
           "--backend", backend, "--pg-timeout", str(pg_timeout_s)]
    # no blanket PYTHONWARNINGS=ignore: the ranks say their fallbacks aloud (known_warnings)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error",
               TORCH_CPP_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    tail: deque[str] = deque(maxlen=200)  # torchrun's summary: ~8 lines per failed rank
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=Path(__file__).resolve().parent.parent)

    def pump() -> None:
        console, pending = _RankConsole(sys.stdout), b""
        while chunk := os.read(proc.stdout.fileno(), 65536):
            lines = re.split(rb"\r|\n", pending + chunk)
            pending = lines.pop()
            for text in lines:
                line = text.decode(errors="replace")
                if line.strip():
                    tail.append(line + "\n")
                if verbose:
                    console.write(line)
        console.close()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        started = any((work / "logs").glob("*/attempt_*/*/stderr.log"))
        where = (f"every rank's output: {work / 'logs'}" if started else
                 "torchrun had started no rank yet: its own start-up took longer than timeout_s")
        raise DistributedRunError(f"distributed run exceeded timeout_s={timeout_s:.0f}s; all "
                                  f"{world_size} ranks were killed\n  ({where})") from None
    finally:
        if proc.poll() is None:  # interrupted (KeyboardInterrupt): leave no rank behind
            _kill_group(proc)
        reader.join(timeout=5)
    finished = all((out / f"rank{r}.json").exists() for r in range(world_size))
    if rc != 0 and not finished:
        raise DistributedRunError(_failure_message(out, world_size, rc, tail, work / "logs"))
    if rc != 0:  # every rank wrote its whole result, then one died tearing down: say it aloud
        print(_failure_message(out, world_size, rc, tail, work / "logs", headline=(
            "every rank finished its work, then a rank failed while shutting down")),
            file=sys.stderr)
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    if rc == 0:
        shutil.rmtree(work, ignore_errors=True)  # kept when a rank failed: its logs are named
    if verbose:
        print(f"[{world_size} ranks, {backend}, {time.monotonic() - start:.0f} s]")
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(calls))]


def kill_rank_after(rank: int, step: int):
    """A step callback (``train(on_step=...)``) that SIGKILLs ``rank`` right after optimizer step
    ``step``, in the first attempt only: a worker restarted by torchrun
    (``TORCHELASTIC_RESTART_COUNT`` > 0) runs on. What a crashed node looks like to the others.

    Args:
        rank: the rank to kill.
        step: the optimizer step after which it dies.

    Returns:
        The callback, ``on_step(done, result)``.
    """
    def on_step(done: int, _result: Any) -> None:
        if (done == step and world()[0] == rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)
    return on_step


def fail_on_rank(rank: int, mode: str = "raise") -> dict:
    """A deliberately faulty call, to show what a failed run looks like.

    ``mode="raise"``: ``rank`` raises before any collective. ``mode="hang"``: ``rank`` never joins
    the all-reduce the others wait in, so they fail after the process-group timeout.
    ``mode="abort"``: ``rank`` prints a line to stderr and aborts the process (SIGABRT), as a C++
    library does on an uncaught exception: no Python error is left behind.
    ``mode="abort_at_exit"``: ``rank`` does its work, then aborts while the process exits.

    Args:
        rank: the rank that fails.
        mode: "raise", "hang", "abort" or "abort_at_exit".

    Returns:
        On the ranks that do not fail: ``{"rank", "sum"}`` of their all-reduce.

    Raises:
        ValueError: for an unknown mode.
        RuntimeError: on ``rank``, with ``mode="raise"``: on purpose.
    """
    me, _ = world()
    modes = ("raise", "hang", "abort", "abort_at_exit")
    if mode not in modes:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(modes)}")
    if me == rank:
        if mode == "abort_at_exit":
            atexit.register(os.abort)
        if mode == "raise":
            raise RuntimeError(f"rank {rank} failed on purpose")
        if mode == "abort":
            print(f"rank {rank} aborts on purpose", file=sys.stderr, flush=True)
            os.abort()
        if mode == "hang":
            time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"rank": me, "sum": float(t.item())}


if __name__ == "__main__":
    _worker_main()
