"""FSDP2: shard every transformer block and the root, bf16 mixed precision, sharded checkpoints.

``fully_shard`` turns each parameter into a DTensor sharded on dim 0 across ranks. Before a
block's forward (and again in backward) its parameters are all-gathered, then freed; gradients
are reduce-scattered, so each rank keeps ``1/N`` of the parameters, gradients and optimizer state.
Per rank, full sharding costs ``16 * P / N`` bytes of training state for mixed-precision AdamW
(``4 + 4 + 8`` with fp32 sharded parameters) against ``16 * P`` for DDP, which replicates it all.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recipes_lib import data, train_state
from recipes_lib.architectures import decoder_layers, transformers_progress_bars
from recipes_lib.memory import tensor_bytes

STRATEGIES = ("single", "ddp", "fsdp")
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(precision: str = "fp32"):
    """FSDP2's ``MixedPrecisionPolicy``: parameters all-gathered and computed in ``precision``,
    gradients reduced in fp32 (so the sharded fp32 master weights get full-precision updates).

    Args:
        precision: "fp32", "bf16" or "fp16".

    Returns:
        The policy.

    Raises:
        ValueError: for a precision other than "fp32", "bf16" or "fp16".
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {tuple(_DTYPES)}")
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, precision: str = "fp32",
                reshard_after_forward: bool = True, device_type: str | None = None,
                mesh: Any = None, cpu_offload: bool = False) -> torch.nn.Module:
    """Apply ``fully_shard`` to every transformer block, then to the root (in place).

    FSDP2 casts, gathers and reduces one dtype per group, and refuses a group whose trainable
    parameters differ ("FSDP expects uniform original parameter dtype"); a module transformers
    keeps in fp32 in a 16-bit model (``_keep_in_fp32_modules``: DeepSeek-V3's and GLM-4.5's
    routers) is sharded as a group of its own first.

    Args:
        model: a transformers / peft model on this rank's device, inside a process group.
        precision: compute precision of the mixed-precision policy ("fp32", "bf16", "fp16").
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); False keeps them
            until backward (ZeRO-2-like: less communication, more memory).
        device_type: the mesh's device type (default: the model's; a model built on the meta
            device to be materialised afterwards, as ``fake_memory`` does, names its target).
        mesh: the device mesh (default: one of every rank on ``device_type``); a model of fake
            tensors is sharded inside fake mode with a mesh made outside it.
        cpu_offload: FSDP2's ``CPUOffloadPolicy``: the shards, their gradients and the
            optimizer's states stay in host memory (the optimizer steps there), and each group's
            shards are copied to the device for its all-gather; the model must be on the CPU
            (or meta, materialised there). Host memory is pinned where the mesh is a GPU's.

    Returns:
        The same model, now an ``FSDPModule``.

    Raises:
        RuntimeError: outside a process group.
        TypeError: ``cpu_offload`` not a bool.

    Example:
        >>> model = shard_model(load_model(path), precision="bf16")  # doctest: +SKIP
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if not isinstance(cpu_offload, bool):
        raise TypeError(f"cpu_offload={cpu_offload!r}: True keeps the shards, their gradients "
                        "and the optimizer's states in host memory (FSDP2's CPUOffloadPolicy)")
    if not dist.is_initialized():
        raise RuntimeError("shard_model: no process group; call distributed.init_distributed() "
                           "first (or run under distributed.launch / torchrun)")
    from torch.distributed.device_mesh import init_device_mesh

    policy = mixed_precision_policy(precision)
    # The mesh follows the model's device. fully_shard's default mesh takes the accelerator
    # when one exists, so gloo ranks on the CPU of a GPU machine (one GPU, two ranks) would
    # otherwise shard onto CUDA through a CPU-only process group (seen: SIGSEGV on both ranks).
    if mesh is None:
        device_type = device_type or next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    offload = (CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload
               else OffloadPolicy())
    blocks = decoder_layers(model)
    in_blocks = {id(m) for layer in blocks for m in layer.modules()}
    for unit in [*blocks, model]:
        inside = ([m for m in unit.modules() if id(m) not in in_blocks] if unit is model
                  else list(unit.modules()))
        for module in [*_other_dtype_modules(inside), unit]:
            fully_shard(module, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward, offload_policy=offload)
    return model


def _other_dtype_modules(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Those of ``modules`` whose own trainable parameters are not of the dtype most of the
    others' are (by count of values): each needs an FSDP group of its own (``shard_model``)."""
    def own(m: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in m.parameters(recurse=False) if p.requires_grad]

    values: dict[torch.dtype, int] = {}
    for m in modules:
        for p in own(m):
            values[p.dtype] = values.get(p.dtype, 0) + p.numel()
    if len(values) < 2:
        return []
    main = max(values, key=values.get)
    return [m for m in modules if any(p.dtype != main for p in own(m))]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if hasattr(t, "to_local") else t


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                      ) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (its shards only).

    Counted from the tensors' storages (each once, ``memory.tensor_bytes``), so DDP's replicas
    and FSDP's shards are measured the same way; NF4 weights count their inner tensors.

    Args:
        model: the (sharded or replicated) model.
        optimizer: its optimizer, after a step.

    Returns:
        ``{"parameters", "gradients", "optimizer", "total"}`` in bytes.
    """
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    states = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    out = {"parameters": tensor_bytes(params), "gradients": tensor_bytes(grads),
           "optimizer": tensor_bytes(states)}
    out["total"] = sum(out.values())
    return out


def export_pretrained(model: torch.nn.Module, path: str | Path, tokenizer=None) -> Path:
    """Gather the full state dict on rank 0 (in CPU memory) and ``save_pretrained`` it there:
    a plain transformers folder that ``from_pretrained`` loads on one device.

    Args:
        model: the sharded model (every rank calls this).
        path: the folder to write.
        tokenizer: saved beside it when given.

    Returns:
        ``path``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with transformers_progress_bars(tensor_bytes(state.values())):
            model.save_pretrained(path, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return Path(path)


def _runnable(precision: str) -> str:
    """bf16 on a CUDA GPU without it (T4, V100) becomes fp16, said aloud. On CPU bf16 is kept:
    without AVX512-BF16/AMX it is emulated (slow), but it stores the same bytes."""
    import warnings

    from recipes_lib.device import supports_bf16

    if precision == "bf16" and torch.cuda.is_available() and not supports_bf16(
            torch.device("cuda", torch.cuda.current_device())):
        warnings.warn("precision='bf16': this GPU has no bf16; using fp16 with a "
                      "ShardedGradScaler", stacklevel=3)
        return "fp16"
    return precision


def wrap_model(model: torch.nn.Module, strategy: str, precision: str) -> torch.nn.Module:
    """Wrap ``model`` for a data-parallel ``strategy``: "fsdp" (:func:`shard_model`), "ddp"
    (``DistributedDataParallel``, fp32 only) or "single" (unchanged).

    Args:
        model: the model on this rank's device.
        strategy: "fsdp", "ddp" or "single".
        precision: "fp32", "bf16" or "fp16".

    Returns:
        The wrapped model.

    Raises:
        ValueError: for mixed precision without FSDP.
    """
    if strategy == "fsdp":
        return shard_model(model, precision)
    if precision != "fp32":
        raise ValueError(f"precision={precision!r}: mixed precision here is FSDP's policy; use "
                         "strategy='fsdp'")
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model


def train_sharded(
    model_path: str,
    strategy: str = "fsdp",
    precision: str = "fp32",
    steps: int = 20,
    global_batch_size: int = 8,
    seq_len: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    checkpoint_dir: str | None = None,
    export_dir: str | None = None,
    resume_dir: str | None = None,
    checkpoint_every: int = 0,
    measure_repeats: int = 2,
    on_step: tuple[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train the model at ``model_path`` on the base corpus with DDP, FSDP or a single process.

    Runs on every rank (see ``distributed.launch``). Every rank draws the same global batches and
    trains on its slice, so the loss curve is comparable with ``strategy="single"``. After
    training, one more step is measured: per-rank training state, peak memory by category, time.

    Args:
        model_path: a folder ``from_pretrained`` loads (e.g. ``model.build_tiny_model()``).
        strategy: "fsdp", "ddp" or "single" (no wrapper; run it on one process as the reference).
        precision: FSDP's mixed-precision policy: "fp32", "bf16" or "fp16".
        steps: optimizer steps.
        global_batch_size: examples per step over all ranks; the world size must divide it.
        seq_len: tokens per example.
        lr: AdamW learning rate (constant, no clipping: nothing to hide differences).
        seed: data order and initialisation.
        checkpoint_dir: when given, save a sharded checkpoint there, reload it into a freshly
            sharded model and report whether parameters and optimizer state round-trip.
        export_dir: when given, export a full ``from_pretrained`` folder there (rank 0 writes).
        resume_dir: the training loop's own sharded checkpoints (``train_state``): saved every
            ``checkpoint_every`` steps and at the end, and resumed from when one is there, e.g.
            after a rank died and ``torchrun --max-restarts`` restarted the job.
        checkpoint_every: steps between those checkpoints (0: only at the end).
        measure_repeats: timed runs of the measured step after training (each a full step: keep
            it small where a step is slow, e.g. emulated bf16 on a CPU); 0 measures memory only
            (``step_time_s`` is None).
        on_step: a step callback for the training loop, built in each rank as
            ``factory(**kwargs)`` from ``("package.module:factory", kwargs)`` (JSON crosses the
            process boundary, a function does not), e.g.
            ``("recipes_lib.distributed:kill_rank_after", {"rank": 1, "step": 2})``.

    Returns:
        JSON-ready dict: losses, step_time_s, state_bytes, peak_bytes, peak_by_category,
        world_size, resumed_from (step), restart_count (torchrun's), and the checkpoint checks
        when asked.

    Raises:
        ValueError: for an unknown strategy/precision or a global batch the world size does not
            divide (on every rank, before any collective).
    """
    from recipes_lib import model as models
    from recipes_lib.compare import measure_training_step
    from recipes_lib.distributed import check_global_batch, rank_slice, resolve, world
    from recipes_lib.grad_accumulation import forward_backward
    from recipes_lib.train import TrainConfig, make_optimizer, train

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    mixed_precision_policy(precision)  # validates
    precision = _runnable(precision)
    rank, world_size = world()
    micro = check_global_batch(global_batch_size, world_size)
    tok = models.load_tokenizer(model_path)
    examples = data.tokenize_examples(data.load_corpus("base", "train"), tok, seq_len, "lm")
    torch.manual_seed(seed)
    model = wrap_model(models.load_model(model_path), strategy, precision)
    # fp16 needs the (sharded) loss scaler, which the training loop adds for precision="fp16".
    config = TrainConfig(steps=steps, micro_batch_size=micro, lr=lr,
                         schedule="constant_with_warmup", max_grad_norm=None, seed=seed,
                         desc=f"{strategy} {precision}",
                         precision="fp16" if precision == "fp16" else "fp32",
                         checkpoint_dir=resume_dir, checkpoint_every=checkpoint_every)
    optimizer = make_optimizer(model, config)
    callback = resolve(on_step[0])(**on_step[1]) if on_step is not None else None
    run = train(model, examples, tok.pad_token_id, config, optimizer=optimizer, on_step=callback)
    out = {"strategy": strategy, "precision": precision, "world_size": world_size,
           "rank": rank, "losses": run.losses, "resumed_from": run.resumed_from,
           "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    # Checkpoints hold the trained weights, before the measurement steps below change them.
    if checkpoint_dir is not None:
        out["checkpoint"] = _checkpoint_round_trip(model, optimizer, model_path, strategy,
                                                   precision, checkpoint_dir, config)
    if export_dir is not None:
        export_pretrained(model, export_dir, tok)
        out["export_dir"] = str(export_dir)

    batch = rank_slice(next(data.batches(examples, global_batch_size, tok.pad_token_id,
                                         seed=seed + 1)), rank, world_size)
    forward_backward(model, batch)
    out["state_bytes"] = local_state_bytes(model, optimizer)  # gradients alive, before the step
    optimizer.zero_grad(set_to_none=True)
    # the model has trained, so optimizer states exist: no warm-up step needed
    step = measure_training_step(model, batch, optimizer, repeats=measure_repeats, warmup=False)
    out.update(step_time_s=step.timing.median_s if step.timing is not None else None,
               peak_bytes=step.memory.peak_bytes,
               peak_by_category=step.memory.by_category)
    return out


def _checkpoint_round_trip(model, optimizer, model_path, strategy, precision, path, config
                           ) -> dict[str, Any]:
    """Save sharded, load into a fresh model + optimizer, compare every local shard."""
    from recipes_lib import model as models
    from recipes_lib.train import make_optimizer

    t0 = time.perf_counter()
    train_state.save_sharded(model, optimizer, path)
    save_s = time.perf_counter() - t0
    fresh = wrap_model(models.load_model(model_path), strategy, precision)
    fresh_opt = make_optimizer(fresh, config)
    # AdamW creates its state lazily; one zero-gradient step creates it, then the load overwrites.
    for p in fresh.parameters():
        p.grad = torch.zeros_like(p)
    fresh_opt.step()
    fresh_opt.zero_grad(set_to_none=True)
    train_state.load_sharded(fresh, fresh_opt, path)
    param_diff = max(float((_local(a) - _local(b)).detach().abs().max())
                     for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    state_diff = 0.0
    for pa, pb in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, va in optimizer.state[pa].items():
            vb = fresh_opt.state[pb][key]
            state_diff = max(state_diff, float((_local(va).float() - _local(vb).float())
                                               .abs().max()))
    files = [p for p in Path(path).iterdir() if p.is_file()]
    return {"param_max_abs_diff": param_diff, "optimizer_max_abs_diff": state_diff,
            "save_s": save_s, "files": len(files),
            "bytes_on_disk": sum(p.stat().st_size for p in files)}
