"""Activation checkpointing: keep only each decoder layer's input, recompute the rest in backward.

Without it a layer keeps every intermediate tensor for backward (Korthikanti et al. count
``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit per layer); with it only the layer input (``2*s*b*h``
bytes) stays, at the cost of one extra forward per layer (training FLOPs 6N -> 8N per token).
"""

from __future__ import annotations

import torch


def enable_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Checkpoint every decoder layer of a transformers (or peft) model, non-reentrant.

    Non-reentrant checkpointing (``use_reentrant=False``) is PyTorch's recommended mode: it works
    when the inputs do not require grad (frozen embeddings under LoRA) and with keyword arguments.

    Raises:
        ValueError: if the model does not support gradient checkpointing.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"model: {type(base).__name__} does not support gradient checkpointing")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False
    return model


def disable_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``enable_activation_checkpointing``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_disable()
    return model
