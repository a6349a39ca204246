"""Activation checkpointing: keep only each decoder layer's input, recompute the rest in backward.

Without it a layer keeps every intermediate tensor for backward (Korthikanti et al. count
``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit per layer); with it only the layer input (``2*s*b*h``
bytes) stays, at the cost of one extra forward per layer (training FLOPs 6N -> 8N per token).
*Selective* checkpointing sits between the two: inside each layer it keeps the outputs of the
expensive ops (every other matmul, attention) and recomputes the cheap element-wise rest.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# The ops whose outputs selective checkpointing keeps (the policy torchtitan applies per block
# with selective_ac_option="op", written out here): matmuls (every other one) and the fused
# attention kernels, whose recomputation costs the most FLOPs per byte kept, and ``max``, which
# float8 scaling reads. Element-wise ops, norms and activations are recomputed.
SELECTIVE_SAVE_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in (
        "mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "max")
    if hasattr(torch.ops.aten, name))


def _selective_policy(counts: dict[str, int], ctx, func, *args, **kwargs) -> CheckpointPolicy:
    # matmuls are counted apart in forward and in the recomputation, so both pass the same
    # verdict to the same matmul: the odd-numbered ones are kept, the even ones recomputed
    mode = "recompute" if ctx.is_recompute else "forward"
    if func is torch.ops.aten.mm.default:
        counts[mode] += 1
        keep = counts[mode] % 2 == 1
    else:
        keep = func in SELECTIVE_SAVE_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: per
    checkpointed call, keep the outputs of every other matmul and of the attention kernels
    (``SELECTIVE_SAVE_OPS``), recompute the rest.

    Example:
        >>> out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False,
        ...                                         context_fn=selective_context)  # doctest: +SKIP
    """
    return create_selective_checkpoint_contexts(
        functools.partial(_selective_policy, defaultdict(int)))


def enable_activation_checkpointing(model: torch.nn.Module, every_n_layers: int = 1,
                                    selective: bool = False) -> torch.nn.Module:
    """Checkpoint every decoder layer of a transformers (or peft) model, non-reentrant.

    Non-reentrant checkpointing (``use_reentrant=False``) is PyTorch's recommended mode: it works
    when the inputs do not require grad (frozen embeddings under LoRA) and with keyword arguments.

    Args:
        model: a transformers model, or a peft model wrapping one.
        every_n_layers: checkpoint every n-th decoder layer only (transformers >= 5.16), trading
            memory back for speed; 1 checkpoints every layer.
        selective: inside each checkpointed layer, keep what :func:`selective_context` keeps
            (every other matmul's output, attention's) and recompute only the rest: more memory
            than full checkpointing, less recomputation.

    transformers 5.23 renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable`` (the old name stays, deprecated, until v6); 5.16 added
    ``every_n_layers`` to it. Whichever the installed version has is called.

    Returns:
        ``model`` itself, checkpointed.

    Raises:
        ValueError: if the model does not support gradient checkpointing, every_n_layers < 1, or
            every_n_layers > 1 before transformers 5.16.
        TypeError: if selective is not a bool.
    """
    if not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(f"every_n_layers={every_n_layers!r}: must be an integer >= 1")
    if not isinstance(selective, bool):
        raise TypeError(f"selective={selective!r}: True or False")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"model: {type(base).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = selective_context
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.23
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs,
                                             every_n_layers=every_n_layers)
    elif "every_n_layers" in inspect.signature(base.gradient_checkpointing_enable).parameters:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs,  # 5.16 to 5.22
                                           every_n_layers=every_n_layers)
    elif every_n_layers == 1:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"every_n_layers={every_n_layers}: needs transformers >= 5.16")
    base.config.use_cache = False
    return model


def disable_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``enable_activation_checkpointing``.

    Args:
        model: the checkpointed model.

    Returns:
        ``model`` itself, without checkpointing.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    else:
        base.gradient_checkpointing_disable()
    return model


def offload_activations(device: torch.device | str | None = None):
    """A context in which tensors saved for backward are moved to CPU memory and brought back.

    The other way to shrink activation memory on a GPU (``torch.autograd.graph.save_on_cpu``):
    no recomputation, but every saved tensor crosses PCIe twice, so it helps when the step is
    long enough to hide the copies (long sequences, large layers). With checkpointing only the
    layer inputs are saved, so the two combine: checkpoint, and offload what is kept. On a CPU the
    activations already live in CPU memory: the context changes nothing, which it says.

    Args:
        device: the device the model runs on (None: CUDA if present, else the CPU).

    Example:
        >>> with offload_activations("cuda"):  # doctest: +SKIP
        ...     loss = model(**batch).loss
        >>> loss.backward()  # doctest: +SKIP
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        import contextlib
        import warnings

        warnings.warn("offload_activations: activations are already in CPU memory; nothing to "
                      "offload on a CPU", stacklevel=2)
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def width_sweep(hidden_sizes: list[int], seq_len: int = 1024, batch_size: int = 1,
                num_layers: int = 2, vocab_size: int = 32000, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", repeats: int = 5):
    """What checkpointing costs in step time as the model widens: a Llama-shaped model (random
    init, ``num_layers`` layers, head dim 64, MLP 8/3 x hidden) trained one step plain and
    checkpointed, timed in alternation at each width.

    The "speed-up" here is plain time / checkpointed time, below 1: a cost. Once the step is
    compute-bound it should approach the FLOP ratio 6N / 8N = 0.75 (one extra forward); at small
    widths launch and Python overhead make it worse.

    Args:
        hidden_sizes: the widths, at least three, growing.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        num_layers: decoder layers.
        vocab_size: the model's vocabulary.
        dtype: the model's dtype.
        device: where it trains.
        repeats: timed steps of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "activation_checkpointing", dimension "hidden").

    Raises:
        ValueError: for sizes a sweep cannot use.
    """
    return _cost_sweep("hidden", hidden_sizes, lambda h: (h, seq_len), batch_size, num_layers,
                       vocab_size, dtype, device, repeats)


def tokens_sweep(seq_lens: list[int], hidden_size: int = 256, batch_size: int = 1,
                 num_layers: int = 2, vocab_size: int = 32000, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", repeats: int = 5):
    """What checkpointing costs in step time as the tokens per step grow, at one width: the
    model of :func:`width_sweep`, one step of ``batch_size`` sequences of each length, plain
    and checkpointed, timed in alternation.

    More tokens make each matmul larger at a fixed number of kernel launches, so the cost
    should fall towards the FLOP ratio 8N / 6N = 1.33x as the step leaves the overhead-bound
    regime; attention's s^2 share grows too, and it is recomputed as well (the FLOP count of
    the work column leaves it out, as 6N does).

    Args:
        seq_lens: tokens per sequence, at least three, growing.
        hidden_size: the model's width.
        batch_size, num_layers, vocab_size, dtype, device, repeats: as in :func:`width_sweep`.

    Returns:
        A ``sweep.Sweep`` (recipe "activation_checkpointing", dimension "tokens": tokens per
        sequence, times ``batch_size`` per step).

    Raises:
        ValueError: for sizes a sweep cannot use.

    Example:
        >>> s = tokens_sweep([16, 32, 64], hidden_size=32, vocab_size=64, repeats=1)
        >>> s.dimension
        'tokens'
    """
    return _cost_sweep("tokens", seq_lens, lambda s: (hidden_size, s), batch_size, num_layers,
                       vocab_size, dtype, device, repeats)


def _cost_sweep(dimension: str, sizes: list[int], shape, batch_size: int, num_layers: int,
                vocab_size: int, dtype: torch.dtype, device: torch.device | str, repeats: int):
    """Plain vs checkpointed training step over ``sizes``; ``shape(size)`` gives the model's
    (hidden size, sequence length) at that size."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from recipes_lib.sweep import run_sweep

    device = torch.device(device)

    def make(size: int):
        h, seq_len = shape(size)
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=h,
                             intermediate_size=int(8 * h / 3) // 64 * 64,
                             num_hidden_layers=num_layers, num_attention_heads=max(1, h // 64),
                             num_key_value_heads=max(1, h // 64),
                             max_position_embeddings=max(seq_len, 128))
        models = {}
        for name in ("baseline", "recipe"):
            torch.manual_seed(0)
            m = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="sdpa").to(device)
            if name == "recipe":
                enable_activation_checkpointing(m)
            models[name] = m.train()
        ids = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)

        def step(m):
            m(input_ids=ids, labels=ids).loss.backward()
            m.zero_grad(set_to_none=True)
        return {name: (lambda m=m: step(m)) for name, m in models.items()}

    def work(size: int) -> tuple[float, float]:
        h, seq_len = shape(size)
        n = num_layers * 12 * h * h + 2 * vocab_size * h
        nbytes = torch.empty((), dtype=dtype).element_size()
        return 6.0 * n * batch_size * seq_len, 3.0 * n * nbytes
    return run_sweep("activation_checkpointing", dimension, sizes, make, work, device,
                     repeats=repeats, progress=False, dtype=dtype)
