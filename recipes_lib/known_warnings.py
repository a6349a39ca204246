"""Known third-party noise, silenced by module and message; every other warning is shown.

The library says its fallbacks aloud (bf16 -> fp16 or fp32, a missing optional backend) with
``warnings.warn``; ignoring every UserWarning would hide them too. What is silenced here is only
what third-party packages print on every import or call and that a reader can do nothing about.
Installed once, when ``recipes_lib`` is imported.
"""

from __future__ import annotations

import logging
import warnings

# (logger, text in the message): printed through the logging module
LOG_NOISE = (
    # torchao's optional CUDA extensions (mxfp8, CUTLASS) that a CPU build cannot load
    ("torchao", "Failed to load"),
    # torchao registers Enums with pytree, which torch now supports natively
    ("torch.utils._pytree", "is an Enum subclass"),
    # bitsandbytes looks for an optional fused CPU 4-bit kernel package; the course keeps 4-bit
    # layers on the plain dequantize + matmul path anyway (model.keep_4bit_compute_dtype)
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)
# (module regex, message regex, category): raised through the warnings module
WARNING_NOISE = (
    # peft asks transformers for the old name of the checkpointing flag
    (r"transformers\.modeling_utils", r"`is_gradient_checkpointing` is deprecated",
     FutureWarning),
    # torch.ao's dynamic int8 builds its weights with quantize_per_channel; ptq says why it
    # keeps that path (its module docstring), so the notice would only repeat it
    (r"torch\.ao\.nn\.quantized", r"torch\.quantize_per_tensor, torch\.quantize_per_channel",
     UserWarning),
    # peft's conversion of transformers' fused mixture-of-experts weights sets rank and alpha
    # patterns for gate_up_proj (2r, 2 alpha: gate and up in one), which do apply to that
    # parameter's adapter (tests/test_quantization.py), but its check of unmatched patterns
    # looks at module names only, not the target parameters' (no pattern of ours)
    (r"peft\.tuners\.tuners_utils",
     (r"The following (rank|alpha)_pattern keys did not match any targeted module and were "
      r"ignored. \['\.\*\\\\\.gate_up_proj'\]"), RuntimeWarning),
    # torchao's int8 tensor subclass under torch.compile: a caching hint for torchao's authors
    (r"torch\._functorch", r"Int8Tensor does not implement _stable_hash_for_caching",
     UserWarning),
    # torchao's NF4 under FSDP2 checks that a reused all-gather buffer is the output's by
    # comparing storages' data pointers; on fake tensors (fake_memory's FSDP + QLoRA) they are
    # all 0, so the check holds, and torch notes that fake tensors have none
    (r"torchao\.quantization\.quantize_\.workflows\.nf4\.nf4_tensor",
     r"Accessing the data pointer of FakeTensor is deprecated", UserWarning),
    # MemTracker's module tracker, once per measured step of a Llama-family model: transformers
    # wraps RoPE in one `kernels` "Func" module that every layer's attention calls, which the
    # tracker reads as a module re-entered. The course's meter counts by category (parameters,
    # gradients, optimizer, activations), not by module, and its fake steps equal real ones to
    # the byte (tests/test_fake_memory.py)
    (r"torch\.distributed\._tools\.mod_tracker",
     r"The module hierarchy tracking maybe be messed up", UserWarning),
)


class _DropMessages(logging.Filter):
    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(text in message for text in self.texts)


def silence_known_noise() -> None:
    """Install the filters above (idempotent)."""
    for name in {name for name, _ in LOG_NOISE}:
        logger = logging.getLogger(name)
        texts = tuple(text for n, text in LOG_NOISE if n == name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(texts))
    for module, message, category in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
