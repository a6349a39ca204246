"""Checkpoint and resume for the one training loop, without losing or repeating a step.

A checkpoint is a folder ``step-000123/`` holding
- ``weights.safetensors``: the trainable parameters (the whole model, or only the adapter under
  LoRA / QLoRA: frozen weights never change, so they are not copied);
- ``state.pt``: optimizer, LR scheduler and grad scaler states, the RNG states and the step, with
  the loss history so far, read back with ``torch.load(weights_only=True)`` (no pickle code runs).

Writes are atomic: everything goes into ``step-000123.tmp/``, which is renamed to its final name
only when complete, and then ``latest`` (a one-line text file, itself replaced atomically) points
to it. A process killed mid-write leaves a ``.tmp`` folder that is never read and is removed by
the next save. The data position is the step: ``train`` replays its seeded batch stream up to it,
so a resumed run sees exactly the batches an uninterrupted one would.

Under torchrun (a process group of any size, DDP or FSDP) the weights and optimizer state go into
``shards/`` through ``torch.distributed.checkpoint``: every rank writes its own shards, nothing is
gathered. Each rank's RNG state goes into ``rng-rank<N>.pt``; rank 0 writes ``state.pt`` and, after
a barrier that waits for every rank's files, renames the folder and moves ``latest``. So a rank
killed at any moment leaves either the previous complete checkpoint or a ``.tmp`` folder, and a
``torchrun --max-restarts`` restart (``distributed.launch(max_restarts=...)``) resumes from the
last complete one.
"""

from __future__ import annotations

import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LATEST = "latest"
WEIGHTS = "weights.safetensors"
SHARDS = "shards"
STATE = "state.pt"


def _in_process_group() -> bool:
    # Any process group, even of one rank: its model may be FSDP-wrapped (DTensor parameters),
    # which only torch.distributed.checkpoint saves.
    return dist.is_available() and dist.is_initialized()


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save(checkpoint_dir: str | Path, step: int, model: torch.nn.Module, optimizer: Any,
         scheduler: Any, scaler: Any, history: dict[str, Any], keep: int = 2) -> Path:
    """Write the checkpoint after ``step`` optimizer steps, atomically; keep the newest ``keep``.

    Called by every rank in a multi-process run (the sharded layout, see the module docstring).

    Args:
        checkpoint_dir: the run's checkpoint folder.
        step: optimizer steps done.
        model: the model (its trainable parameters are saved).
        optimizer: its optimizer.
        scheduler: the learning-rate scheduler.
        scaler: fp16's gradient scaler, or None.
        history: what the run recorded so far (losses, ...).
        keep: checkpoints kept.

    Returns:
        The checkpoint's folder.
    """
    from safetensors.torch import save_file

    if _in_process_group():
        return _save_sharded(Path(checkpoint_dir), step, model, optimizer, scheduler, scaler,
                             history, keep)
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    tmp.mkdir()
    weights = {n: p.detach().to("cpu").contiguous().clone() for n, p in _trainable(model).items()}
    save_file(weights, str(tmp / WEIGHTS))
    inner = getattr(optimizer, "optimizer", optimizer)
    torch.save({"step": step, "optimizer": inner.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": _rng_state(), "history": history}, tmp / STATE)
    _publish(root, tmp, final, keep)
    return final


def _publish(root: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rename the complete ``tmp`` folder to ``final``, point ``latest`` at it, prune old ones."""
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(final.name + "\n")
    pointer.replace(root / LATEST)
    for old in sorted(root.glob("step-[0-9]*"))[:-keep] if keep > 0 else []:
        if old.is_dir() and old.suffix != ".tmp" and old != final:
            shutil.rmtree(old, ignore_errors=True)


def _save_sharded(root: Path, step: int, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                  scaler: Any, history: dict[str, Any], keep: int) -> Path:
    rank = dist.get_rank()
    final, tmp = root / f"step-{step:06d}", root / f"step-{step:06d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    save_sharded(model, getattr(optimizer, "optimizer", optimizer), tmp / SHARDS)
    torch.save({"rng": _rng_state()}, tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        torch.save({"step": step, "world_size": dist.get_world_size(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "history": history}, tmp / STATE)
    dist.barrier()  # every rank's shards and RNG file are on disk
    if rank == 0:
        _publish(root, tmp, final, keep)
    dist.barrier()  # nobody reads `latest` before it moved
    return final


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path
                 ) -> Path:
    """Each rank writes its own shards with ``torch.distributed.checkpoint`` (no gather).

    Args:
        model: the sharded model.
        optimizer: its optimizer.
        path: the checkpoint's folder.

    Returns:
        ``path``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
    return Path(path)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path
                 ) -> None:
    """Load a :func:`save_sharded` checkpoint into a model sharded the same or another way.

    Args:
        model: the sharded model.
        optimizer: its optimizer.
        path: the checkpoint's folder.

    Raises:
        FileNotFoundError: if there is no sharded checkpoint at ``path``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not Path(path).is_dir():
        raise FileNotFoundError(f"path={str(path)!r}: no sharded checkpoint there")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def latest(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder (``.tmp`` folders are never returned).

    Args:
        checkpoint_dir: the run's checkpoint folder.

    Returns:
        The folder, or None.
    """
    root = Path(checkpoint_dir)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    complete = (path / WEIGHTS).exists() or (path / SHARDS / ".metadata").exists()
    if path.suffix == ".tmp" or not complete or not (path / STATE).exists():
        return None
    return path


def step_of(path: str | Path) -> int:
    """The optimizer step a checkpoint folder holds, from its name (``step-000123`` -> 123).

    Args:
        path: a checkpoint folder (:func:`latest`).

    Returns:
        The step.

    Raises:
        ValueError: for a folder not named by :func:`save`.
    """
    name = Path(path).name
    if not re.fullmatch(r"step-\d+", name):
        raise ValueError(f"path={str(path)!r}: not a checkpoint folder (expected step-NNNNNN)")
    return int(name.split("-", 1)[1])


def load(path: str | Path, model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any
         ) -> dict[str, Any]:
    """Restore a checkpoint into the given objects.

    Args:
        path: the checkpoint's folder.
        model: the model.
        optimizer: its optimizer.
        scheduler: the learning-rate scheduler.
        scaler: fp16's gradient scaler, or None.

    Returns:
        ``{"step", "history"}``.

    Raises:
        ValueError: if the checkpoint's parameters do not match the model's trainable ones.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if (path / SHARDS).is_dir():
        return _load_sharded(path, model, optimizer, scheduler, scaler)
    weights = load_file(str(path / WEIGHTS))
    params = _trainable(model)
    if set(weights) != set(params):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(f"checkpoint_dir: {path} does not match this model's trainable "
                         f"parameters (missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.device, p.dtype))
    state = torch.load(path / STATE, weights_only=True)
    getattr(optimizer, "optimizer", optimizer).load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(state["rng"])
    return {"step": int(state["step"]), "history": state["history"]}


def _load_sharded(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                  scaler: Any) -> dict[str, Any]:
    if not _in_process_group():
        raise ValueError(f"checkpoint_dir: {path} is a sharded (multi-process) checkpoint; "
                         "resume it under torchrun, or load it with train_state.load_sharded")
    load_sharded(model, getattr(optimizer, "optimizer", optimizer), path / SHARDS)
    common = torch.load(path / STATE, weights_only=True)
    if scheduler is not None and common["scheduler"] is not None:
        scheduler.load_state_dict(common["scheduler"])
    if scaler is not None and common["scaler"] is not None:
        scaler.load_state_dict(common["scaler"])
    rng = path / f"rng-rank{dist.get_rank()}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=True)["rng"])
    else:
        warnings.warn(f"{rng.name} missing (saved with world size {common['world_size']}, now "
                      f"{dist.get_world_size()}): this rank's random state starts fresh",
                      stacklevel=2)
    return {"step": int(common["step"]), "history": common["history"]}
