"""Comparing a recipe's numbers with its reference: gradients, parameters, outputs."""

from __future__ import annotations

import torch


def collect_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of every trainable parameter's gradient, by name.

    Args:
        model: the model, after backward.

    Returns:
        name -> gradient copy (parameters without a gradient are left out).
    """
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def collect_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of every trainable parameter, by name.

    Args:
        model: the model.

    Returns:
        name -> copy.
    """
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def _check_same_keys(a: dict, b: dict) -> None:
    if a.keys() != b.keys():
        raise ValueError(f"a, b: different tensors ({sorted(a.keys() ^ b.keys())[:3]})")
    if not a:
        raise ValueError("a, b: nothing to compare")


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute elementwise difference over matching tensors.

    Args:
        a: name -> tensor.
        b: name -> tensor, the same names and shapes.

    Returns:
        The largest ``|a - b|`` over every tensor.

    Example:
        >>> max_abs_diff({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 2.5])})
        0.5
    """
    _check_same_keys(a, b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def max_rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor relative error ``||a - b|| / ||b||`` (b is the reference).

    Args:
        a: name -> tensor.
        b: name -> reference tensor, the same names and shapes.

    Returns:
        The largest relative error over the tensors.

    Example:
        >>> a, b = {"w": torch.tensor([3.0, 4.5])}, {"w": torch.tensor([3.0, 4.0])}
        >>> round(max_rel_error(a, b), 6)
        0.1
    """
    _check_same_keys(a, b)
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)
