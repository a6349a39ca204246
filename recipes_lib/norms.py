"""LayerNorm -> RMSNorm: model surgery, and what the swap buys per kernel.

LayerNorm (Ba et al., 2016): ``y = (x - mean(x)) / sqrt(var(x) + eps) * g + b``, two reductions
(mean, then variance) and a bias. RMSNorm (Zhang & Sennrich, 2019) drops the centring and the
bias: ``y = x / sqrt(mean(x^2) + eps) * g``, one reduction. Both read x and write y once, so both
are memory-bound: the saving is arithmetic and a bias, not bytes of the activation. A win needs a
*fused* kernel (one pass over x). Eager ``torch.nn.RMSNorm`` on the CPU runs ~5 separate
element-wise ops (pow, mean, add, rsqrt, mul, mul), each a full pass over x: torch 2.13 routes it
to ``aten::_fused_rms_norm``, which is a kernel on CUDA but a CompositeImplicitAutograd
decomposition on the CPU (``torch._C._dispatch_dump("aten::_fused_rms_norm")`` shows it), while
LayerNorm has had a fused CPU kernel for years; ``torch.compile`` fuses RMSNorm into one pass.
"""

from __future__ import annotations

import torch


def swap_layernorm_for_rmsnorm(model: torch.nn.Module) -> dict[str, float]:
    """Replace every ``torch.nn.LayerNorm`` in ``model`` by ``torch.nn.RMSNorm``, in place.

    The learned scale is kept; the bias and the centring are dropped, which is why quality falls
    right after the swap and needs a short fine-tune to recover.

    Args:
        model: a model with LayerNorm modules, changed in place.

    Returns:
        ``{"swapped": count, "max_abs_bias": largest |bias| dropped}``.

    Raises:
        ValueError: if the model has no LayerNorm (e.g. a Llama model already uses RMSNorm).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> swap_layernorm_for_rmsnorm(m)["swapped"], type(m[1]).__name__
        (1, 'RMSNorm')
    """
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    if not targets:
        raise ValueError("model: has no torch.nn.LayerNorm to swap (does it already use RMSNorm?)")
    max_bias = 0.0
    for name, ln in targets:
        rms = torch.nn.RMSNorm(ln.normalized_shape, eps=ln.eps,
                               elementwise_affine=ln.elementwise_affine)
        if ln.elementwise_affine:
            rms.weight = torch.nn.Parameter(ln.weight.detach().clone(),
                                            requires_grad=ln.weight.requires_grad)
        if ln.bias is not None:
            max_bias = max(max_bias, float(ln.bias.detach().abs().max()))
        rms.to(device=ln.weight.device if ln.weight is not None else None)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, rms)
    return {"swapped": len(targets), "max_abs_bias": max_bias}


def count_norms(model: torch.nn.Module) -> dict[str, int]:
    """How many LayerNorm and RMSNorm modules (torch's or a model's own ``*RMSNorm``) it has.

    Args:
        model: any module.

    Returns:
        ``{"LayerNorm": n, "RMSNorm": m}``.

    Example:
        >>> count_norms(torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.RMSNorm(4)))
        {'LayerNorm': 1, 'RMSNorm': 1}
    """
    out = {"LayerNorm": 0, "RMSNorm": 0}
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            out["LayerNorm"] += 1
        elif type(m).__name__.endswith("RMSNorm"):
            out["RMSNorm"] += 1
    return out


def norm_sweep(hidden_sizes: list[int], tokens: int = 2048, compile_rmsnorm: bool = False,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               repeats: int = 5):
    """Where RMSNorm starts to beat LayerNorm, forward + backward over the hidden size at
    ``tokens`` rows, timed in alternation (``sweep.run_sweep``); RMSNorm compiled beside it with
    ``compile_rmsnorm`` (compiled before timing). Work per call: a few FLOPs per value; bytes:
    the input read twice, the output and both gradients written or read once (``5 * t * h``
    values), so memory-bound once the rows leave the caches.

    Args:
        hidden_sizes: the widths, at least three, growing.
        tokens: rows normalised per call.
        compile_rmsnorm: time a compiled RMSNorm too.
        dtype: the input's dtype.
        device: where it runs.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "rmsnorm", dimension "hidden").

    Raises:
        ValueError: for sizes a sweep cannot use, or compilation where it cannot run.
    """
    from recipes_lib.sweep import run_sweep

    device = torch.device(device)
    if compile_rmsnorm:
        from recipes_lib.compiling import require_compile

        require_compile(device)
    size = torch.empty((), dtype=dtype).element_size()

    def make(h: int):
        x = torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, h, device=device, dtype=dtype)
        norms = {"baseline": torch.nn.LayerNorm(h, device=device, dtype=dtype),
                 "recipe": torch.nn.RMSNorm(h, eps=1e-5, device=device, dtype=dtype)}
        if compile_rmsnorm:
            norms["RMSNorm (compiled)"] = torch.compile(norms["recipe"], dynamic=False)

        def step(fn):
            fn(x).backward(grad)
            x.grad = None
        return {name: (lambda fn=fn: step(fn)) for name, fn in norms.items()}

    def work(h: int) -> tuple[float, float]:
        return 10.0 * tokens * h, 5.0 * tokens * h * size
    return run_sweep("rmsnorm", "hidden", hidden_sizes, make, work, device, repeats=repeats,
                     progress=False, dtype=dtype)
