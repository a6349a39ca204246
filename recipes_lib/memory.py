"""The one memory meter: peak bytes by category, measured on every device, CPU included.

On every device the breakdown comes from PyTorch's own dispatch-level tracker
(``torch.distributed._tools.mem_tracker.MemTracker``): it sees each tensor storage as it is
created and freed, and labels it parameter / buffer / gradient / optimizer state / activation /
temporary. A model sharded with FSDP2 gets its FSDP-aware subclass (``FSDPMemTracker``), which
also tells the rank's shards from the all-gathered copies and the communication buffers. On CUDA
the allocator's own peak (``torch.cuda.max_memory_allocated``) is recorded beside it as a
cross-check.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer", "activations", "communication",
              "other")
_FROM_TRACKER = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
                 "Optstate": "optimizer", "Activation": "activations", "Temp": "activations",
                 "Other": "other",
                 # FSDP2's tracker: sharded (at rest) and unsharded (all-gathered) copies
                 "Sharded Param": "parameters", "Unsharded Param": "parameters",
                 "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
                 "OptState": "optimizer", "Inputs": "activations",
                 "All Gather": "communication", "Reduce Scatter": "communication"}


@dataclass
class MemoryReport:
    """Peak memory of one call, split by category at the moment of the peak.

    Attributes:
        peak_bytes: the device's peak.
        by_category: category (parameters, gradients, optimizer, activations, temporaries...)
            -> bytes at that peak.
        device: the device measured.
        allocator_peak_bytes: CUDA's ``max_memory_allocated`` over the call, where measured.
        allocator_reserved_bytes: CUDA's caching allocator's reserved peak.
        host_by_category: other devices' peaks by category (offloaded states: the host).
    """

    peak_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    allocator_peak_bytes: int | None = None
    allocator_reserved_bytes: int | None = None  # CUDA: the caching allocator's reserved peak
    host_by_category: dict[str, int] = field(default_factory=dict)  # other devices' peaks

    @property
    def host_bytes(self) -> int:
        """Bytes at the peak on devices other than ``device`` (offloaded states: the host)."""
        return sum(self.host_by_category.values())

    @property
    def activation_bytes(self) -> int:
        """Activations and temporaries alive at the peak."""
        return self.by_category.get("activations", 0)

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state at the peak."""
        return sum(self.by_category.get(k, 0) for k in ("parameters", "gradients", "optimizer"))


def _update_global_peak(tracker, peak_state) -> None:
    """A tracker's ``_update_peak_stats`` for the global peak alone: MemTracker (and
    FSDPMemTracker) also update every active module's peak by walking all the modules at every
    allocation (most of their time on a 1 B model), and no per-module peak is read here."""
    for dev, snap in tracker._curr_mem_snap.items():
        if tracker._peak_mem.get(dev, 0) < snap["Total"]:
            tracker._peak_mem[dev] = snap["Total"]
            tracker._peak_mem_snap[dev] = dict(snap)


# What FSDP2's CPUOffloadPolicy keeps in host memory: the shards, their gradients and the
# optimizer's states (the optimizer steps there: what it allocates is labelled with them)
_OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


def _update_offloaded_peak(tracker, peak_state) -> None:
    """:func:`_update_global_peak` for a trace of FSDP's CPU offload on one device (the CPU):
    the device's bytes leave out what the policy keeps on the host (``_OFFLOADED``), whose own
    peak is kept apart (``tracker.host_peak_snap``)."""
    for dev, snap in tracker._curr_mem_snap.items():
        host = {k: v for k, v in snap.items() if getattr(k, "value", k) in _OFFLOADED}
        held = sum(host.values())
        on_device = snap["Total"] - held
        if tracker._peak_mem.get(dev, 0) < on_device:
            tracker._peak_mem[dev] = on_device
            tracker._peak_mem_snap[dev] = {k: v for k, v in snap.items() if k not in host
                                           } | {"Total": on_device}
        if sum(tracker.host_peak_snap.values()) < held:
            tracker.host_peak_snap = host


def _offloads_to_host(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards some of ``model``'s parameters with ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
                return True
    return False


def _step_tracker():
    """A MemTracker that accepts several forward calls of the root module in one measurement.

    MemTracker refuses a second forward of the root (gradient accumulation does exactly that)
    because its *per-module* statistics would mix iterations. Only the global peak is used here,
    which per-module resets do not touch, so the per-module stats are reset and the call retried.
    It also hooks every parameter's gradient, which raises on frozen parameters (a LoRA base):
    those are marked as already hooked. And it keeps no per-module peaks
    (:func:`_update_global_peak`).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class _NoHook:
        def remove(self) -> None:
            pass

    class StepTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        _update_peak_stats = _update_global_peak

        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        # A module gone before its backward runs (seen in the mixture-of-experts stacks) has no
        # per-module snapshot to take, and none is read here: skipped as MemTracker skips it,
        # without its warning at every step.
        def _pre_bw_hook(self, module, args):
            if module is not None:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module, args):
            if module is not None:
                super()._post_bw_hook(module, args)

    return StepTracker()


def measure_memory(
    fn: Callable[[], Any],
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | None = None,
) -> MemoryReport:
    """Run ``fn`` once and return its peak memory on ``device``, split by category.

    Parameters, gradients and optimizer states that already exist when ``fn`` starts are counted
    (they occupy memory during the call); so are tensors ``fn`` allocates.

    A model sharded by FSDP2 with ``CPUOffloadPolicy`` (``fsdp.shard_model(cpu_offload=True)``)
    and measured on the CPU keeps its host memory and its device's on the same device: there the
    shards, their gradients and the optimizer's states (and what its step allocates) are the
    host's (``host_by_category``, at the host's own peak) and the rest the device's. That
    leaves out the copies a GPU makes on the way in and out (each group's shards before its
    all-gather, its reduced gradients before they go to the host), each one group's shard
    held for one collective.

    Args:
        fn: the work to measure, e.g. one training step.
        model: its parameters, buffers and gradients are labelled as such.
        optimizer: its states are labelled "optimizer".
        device: the device whose peak is reported (default: the model's, else CPU).

    Returns:
        MemoryReport with ``peak_bytes`` and ``by_category``.

    Example:
        >>> report = measure_memory(lambda: step(batch), model, opt)  # doctest: +SKIP
        >>> report.activation_bytes  # doctest: +SKIP
    """
    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    from torch.distributed.fsdp import FSDPModule

    split = False  # FSDP's CPU offload traced on the CPU: host and device told apart by label
    if isinstance(model, FSDPModule):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        split = device.type == "cpu" and _offloads_to_host(model)

        class GlobalPeakFSDPTracker(FSDPMemTracker):
            _update_peak_stats = _update_offloaded_peak if split else _update_global_peak

            def __enter__(self):
                super().__enter__()
                if split and self._depth == 1:  # the peaks it starts from, split the same way
                    self._peak_mem, self._peak_mem_snap, self.host_peak_snap = {}, {}, {}
                    _update_offloaded_peak(self, None)
                return self

        tracker = GlobalPeakFSDPTracker(model, optimizer)
    else:
        tracker = _step_tracker()
        externals = [x for x in (model, optimizer) if x is not None]
        inner_opt = getattr(optimizer, "optimizer", None)  # wrappers such as CPUOffloadOptimizer
        if isinstance(inner_opt, torch.optim.Optimizer):
            externals.append(inner_opt)
        masters = getattr(optimizer, "master", None)  # and their host copies of the weights
        if isinstance(masters, torch.nn.Module):
            externals.append(masters)
        externals = [x for x in externals
                     if isinstance(x, (torch.nn.Module, torch.optim.Optimizer))]
        if externals:
            tracker.track_external(*externals)
    if device.type == "cuda":
        gc.collect()  # tensors an earlier tracked run left in reference cycles are not this call's
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    allocator_reserved = None
    with tracker:
        fn()
    allocator_peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        allocator_peak = torch.cuda.max_memory_allocated(device)
        allocator_reserved = torch.cuda.max_memory_reserved(device)
    snap = tracker.get_tracker_snapshot("peak")
    dev_snap = next((v for k, v in snap.items() if torch.device(k).type == device.type), {})
    host = dict.fromkeys(CATEGORIES, 0)
    for k, v in snap.items():
        if torch.device(k).type != device.type:
            for cat, value in _categories(v).items():
                host[cat] += value
    if split:
        for cat, value in _categories(tracker.host_peak_snap).items():
            host[cat] += value
    by_cat = _categories(dev_snap)
    return MemoryReport(peak_bytes=int(dev_snap.get("Total", sum(by_cat.values()))),
                        by_category=by_cat, device=str(device),
                        allocator_peak_bytes=allocator_peak,
                        allocator_reserved_bytes=allocator_reserved,
                        host_by_category={k: v for k, v in host.items() if v})


def _categories(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot of one device in the meter's categories."""
    by_cat = dict.fromkeys(CATEGORIES, 0)
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name in _FROM_TRACKER:
            by_cat[_FROM_TRACKER[name]] += int(value)
    return by_cat


def allocator_peak(fn: Callable[[], Any], device: torch.device | str) -> tuple[int, int]:
    """CUDA's caching allocator: peak bytes allocated and reserved while ``fn`` runs, with no
    tracker attached (a tracker's hooks form reference cycles that keep tensors alive until the
    garbage collector runs, so a tracked run is not the one to read the allocator from).

    Args:
        fn: the call to measure.
        device: a CUDA device.

    Returns:
        ``(max_memory_allocated, max_memory_reserved)`` over the call, in bytes.

    Raises:
        ValueError: on a device that is not CUDA.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device!s}: the allocator's counters exist on CUDA only; "
                         "use measure_memory elsewhere")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s bytes.

    Args:
        t: a tensor or parameter.

    Returns:
        ``t`` itself (a parameter's data), or a wrapper subclass's inner tensors (e.g.
        torchao's NF4Tensor: packed data, quantized scales, ...), looked into recursively.
    """
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    if type(data) is not torch.Tensor and hasattr(data, "__tensor_flatten__"):
        names, _ = data.__tensor_flatten__()
        return [x for n in names for x in plain_tensors(getattr(data, n))]
    return [data]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors``, counting each underlying storage once (the inner tensors of
    wrapper subclasses such as NF4 are counted, not the wrapper).

    Args:
        tensors: any tensors.

    Returns:
        Their bytes.

    Example:
        >>> w = torch.zeros(4, 4)
        >>> tensor_bytes([w, w, w[0]])  # one storage of 16 fp32 values
        64
    """
    seen: set[tuple[int, str]] = set()
    total = 0
    plain = [p for t in tensors if isinstance(t, torch.Tensor) for p in plain_tensors(t)]
    for t in plain:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def saved_tensor_bytes(fn: Callable[[], Any]) -> dict[str, int]:
    """Bytes autograd saves for backward while ``fn`` runs (typically a forward), by dtype.

    Shows *why* an activation figure is what it is: e.g. the fp32 copies that RMSNorm and the
    loss keep even when the model computes in bf16. Storages are counted once.

    Args:
        fn: the call to watch, typically a forward pass.

    Returns:
        dtype name -> bytes saved.

    Example:
        >>> saved_tensor_bytes(lambda: model(**batch).loss)  # doctest: +SKIP
        {'torch.bfloat16': 31457280, 'torch.float32': 8388608, 'torch.int64': 4096}
    """
    seen: set[int] = set()
    by_dtype: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # not parameters, not views of them (a Linear saves weight.t()), not wrapper subclasses
        if type(t) is torch.Tensor and not isinstance(t._base, torch.nn.Parameter):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                by_dtype[str(t.dtype)] = by_dtype.get(str(t.dtype), 0) + storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return by_dtype


def format_bytes(n: float) -> str:
    """Bytes in binary units.

    Args:
        n: bytes.

    Returns:
        The text, e.g. '1.50 KiB'.

    Example:
        >>> format_bytes(1536)
        '1.50 KiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"
