"""One setting for every notebook's sizes: ``SCALE = "ci"``, ``"reference"`` or ``"gpu"``.

Each notebook's ``parameters`` cell holds the CI size (every claim checked, within the test
suite's budget) and a ``SCALE`` setting; the cell after it calls :func:`apply`, which sets the
sizes the chosen scale needs:

- ``"ci"``: the parameters cell as written (``make test``; any laptop).
- ``"reference"``: what ``make run`` and ``make bench`` use on the reference CPU: more timed
  repeats, one more (or a longer) point in each sweep, the compiled kernels, the real-size
  models measured on fake tensors (seconds each), notebook 03's compiled decode, and the
  longer training runs the results table was established on (the curriculum, notebook 02's
  float8 check, notebook 03's LayerNorm model). Correctness and memory claims are the same as
  at ``"ci"``, which runs that training shorter under the same asserts.
- ``"gpu"``: the sizes at which the speed recipes are meant to pay on a GPU (a base model of
  about 0.4 B parameters built from a config and pretrained on the accelerator, sweeps out to
  16k tokens and 8k-wide layers). Minutes on one GPU; hours on a CPU.

A name the user set to something other than its CI default (``papermill -p``, or an edit in the
cell) is kept, whatever the scale: :func:`apply` says which.
"""

from __future__ import annotations

from typing import Any

from recipes_lib.model import TinyModelSpec

SCALES = ("ci", "reference", "gpu")

# The base model each scale builds when MODEL_ID is None. "gpu": ~0.4 B parameters (16 layers of
# 1536, grouped-query attention), the size the issue names for speed claims; pretrained on the
# notebook's device.
MODEL_SPECS: dict[str, TinyModelSpec] = {
    "ci": TinyModelSpec(),
    "reference": TinyModelSpec(),
    "gpu": TinyModelSpec(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                         num_attention_heads=12, num_key_value_heads=4,
                         max_position_embeddings=2048, pretrain_steps=300, pretrain_lr=1e-3),
}

# notebook -> parameter -> scale -> value. The "ci" value is the parameters cell's default
# (a test keeps them equal); a scale a parameter does not list keeps the CI value.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "01_large_models_limited_hardware": {
        "TIME_REPEATS": {"ci": 3, "reference": 5, "gpu": 5},
        "MEASURE_BATCH": {"ci": 8, "reference": 16, "gpu": 16},
        "CKPT_SWEEP_WIDTHS": {"ci": (64, 256, 512), "reference": (64, 256, 512, 1024),
                              "gpu": (512, 1024, 2048, 4096)},
        "CKPT_SWEEP_TOKENS": {"ci": (128, 512, 2048), "reference": (128, 512, 2048, 4096),
                              "gpu": (512, 2048, 8192, 16384)},
        "CKPT_TOKENS_WIDTH": {"ci": 256, "gpu": 2048},
        "REAL_ESCALATION": {"ci": False, "reference": True, "gpu": True},
        "REAL_MODEL": {"ci": "Llama-3.2-1B", "gpu": "Llama-3.1-8B"},
    },
    "02_multi_gpu_training": {
        "LOADER_STEPS": {"ci": 4, "reference": 6, "gpu": 6},
        "LATENCY_SWEEP_MS": {"ci": (), "reference": (50,), "gpu": (50,)},
        "PACK_REPEATS": {"ci": 2, "reference": 3, "gpu": 3},
        # emulated bf16 on an AVX2 CPU: a 1024-wide matmul runs at 0.01x fp32 (8 s of the CI run)
        "BF16_SWEEP": {"ci": (128, 256, 512), "reference": (256, 512, 1024),
                       "gpu": (1024, 2048, 4096, 8192)},
        "FSDP_FAKE_MODELS": {"ci": (), "reference": ("Llama-3.1-8B", "Llama-3.1-70B"),
                             "gpu": ("Llama-3.1-8B", "Llama-3.1-70B")},
        "FSDP_FAKE_SEQ": {"ci": 128, "reference": 4096, "gpu": 4096},
        "FP8_STEPS": {"ci": 4, "reference": 8, "gpu": 8},
    },
    "03_optimizing_inference_speed": {
        "LATENCY_REPEATS": {"ci": 5, "reference": 15, "gpu": 15},
        "COMPILE_RMSNORM": {"ci": False, "reference": True, "gpu": True},
        "LN_PRETRAIN_STEPS": {"ci": 40, "reference": 80, "gpu": 80},
        "COMPILE_GENERATION": {"ci": False, "reference": True, "gpu": True},
        "ATTN_SEQ_LENS": {"ci": (256, 512, 1024, 2048), "reference": (256, 512, 1024, 2048, 4096),
                          "gpu": (512, 1024, 2048, 4096, 8192, 16384)},
        "ATTN_HEADS": {"ci": (2, 4, 8, 16), "reference": (2, 4, 8, 16, 32), "gpu": (8, 16, 32, 64)},
        # the bf16 decode at 2048 wide took 18 s of the CI run on the AVX2 reference (emulated)
        "INT8_DECODE_HIDDEN": {"ci": (256, 512, 1024), "reference": (256, 1024, 2048, 4096),
                               "gpu": (1024, 2048, 4096, 8192)},
        "COMPILE_INT8": {"ci": False, "reference": True, "gpu": True},
        "INT8_PREFILL_ROWS": {"ci": (1, 16, 256, 2048), "gpu": (16, 256, 2048, 16384)},
        "KD_SWEEP_WIDTHS": {"ci": (64, 256, 512), "reference": (64, 256, 512, 1024),
                            "gpu": (256, 512, 1024, 2048)},
        "KD_SWEEP_LAYERS": {"ci": (3, 6, 12), "reference": (3, 6, 12, 24),
                            "gpu": (6, 12, 24, 48)},
        "KD_DEPTH_WIDTH": {"ci": 256, "gpu": 1024},
        "NORM_HIDDEN_SIZES": {"ci": (256, 1024, 4096), "gpu": (1024, 4096, 8192)},
        "NORM_TOKENS": {"ci": 2048, "gpu": 16384},
        "KV_SWEEP_TOKENS": {"ci": (4, 16, 64), "reference": (4, 16, 64, 128),
                            "gpu": (16, 64, 256, 1024)},
        "COMPILE_WIDTHS": {"ci": (64, 256, 512), "reference": (64, 256, 512, 1024),
                           "gpu": (256, 1024, 2048)},
        # a second layer adds ~2.4 s to each width's cold compile on a 2-core CPU (CI: one)
        "COMPILE_LAYERS": {"ci": 1, "reference": 2, "gpu": 2},
        "GEN_COMPILE_WIDTHS": {"ci": (), "reference": (64, 256, 512, 1024),
                               "gpu": (64, 256, 512, 1024)},
    },
    "04_training_long_sequences": {
        "TIME_SEQ_LENS": {"ci": (512, 1024, 2048, 4096), "reference": (1024, 2048, 4096, 8192),
                          "gpu": (2048, 4096, 8192, 16384, 32768)},
        "CURRICULUM_TOKENS": {"ci": 300_000, "reference": 400_000, "gpu": 400_000},
        "CE_SWEEP_TOKENS": {"ci": (256, 512, 1024), "reference": (256, 1024, 2048, 8192),
                            "gpu": (1024, 4096, 16384)},
        "CE_SWEEP_COMPILED": {"ci": False, "reference": True, "gpu": True},
        "CE_SWEEP_VOCAB": {"ci": (2048, 8192, 32768), "reference": (2048, 8192, 32768, 131072),
                           "gpu": (8192, 32768, 131072, 262144)},
        "CE_VOCAB_TOKENS": {"ci": 512, "reference": 2048, "gpu": 8192},
        "CONTEXT_LIMIT": {"ci": 4096, "reference": 8192, "gpu": 8192},
        "REAL_CONTEXT_MODEL": {"ci": None, "reference": "Llama-3.1-8B", "gpu": "Llama-3.1-8B"},
        "REAL_CONTEXT_GPUS": {"ci": ("0.75GiB", "1GiB"), "reference": ("24GiB", "80GiB"),
                              "gpu": ("24GiB", "80GiB")},
    },
}


def check_scale(scale: str) -> str:
    """Check a scale's name.

    Args:
        scale: "ci", "reference" or "gpu".

    Returns:
        ``scale`` itself.

    Raises:
        ValueError: naming ``SCALE`` and the choices, for another name.
    """
    if scale not in SCALES:
        raise ValueError(f"SCALE={scale!r}: expected one of {', '.join(map(repr, SCALES))}")
    return scale


def sizes(notebook: str, scale: str) -> dict[str, Any]:
    """The parameters ``scale`` sets in ``notebook``.

    Args:
        notebook: a notebook's file stem.
        scale: "ci", "reference" or "gpu".

    Returns:
        name -> value.

    Raises:
        ValueError: for an unknown scale (naming ``SCALE``) or notebook.

    Example:
        >>> sizes("02_multi_gpu_training", "reference")["LOADER_STEPS"]
        6
    """
    check_scale(scale)
    if notebook not in SIZES:
        raise ValueError(f"notebook={notebook!r}: expected one of {', '.join(SIZES)}")
    return {name: by_scale.get(scale, by_scale["ci"])
            for name, by_scale in SIZES[notebook].items()}


def _same(a: Any, b: Any) -> bool:
    # papermill hands a tuple parameter to the notebook as a list
    norm = (lambda v: list(v) if isinstance(v, (tuple, list)) else v)
    return norm(a) == norm(b)


def apply(notebook: str, scale: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Set ``scale``'s sizes for ``notebook`` in ``namespace`` (the notebook's ``globals()``).

    A parameter whose value is no longer its CI default was set on purpose and is kept (and
    reported as kept).

    Args:
        notebook: the notebook's file stem.
        scale: "ci", "reference" or "gpu".
        namespace: the notebook's ``globals()``, changed in place.

    Returns:
        name -> value for every scaled parameter, as it now stands.

    Raises:
        ValueError: an unknown scale (naming ``SCALE``) or notebook.
    """
    chosen = sizes(notebook, scale)
    kept = []
    for name, value in chosen.items():
        if name not in namespace:
            raise ValueError(f"SCALE={scale!r}: parameter {name} of {notebook} is not defined; "
                             "run the parameters cell first")
        if _same(namespace[name], SIZES[notebook][name]["ci"]):
            namespace[name] = value
        elif not _same(namespace[name], value):
            kept.append(name)
    if scale != "ci":
        print(f"SCALE={scale!r} sets " + ", ".join(f"{k}={v}" for k, v in chosen.items()
                                                   if k not in kept))
    if kept:
        print(f"SCALE={scale!r}: kept the values you set for {', '.join(kept)}")
    return {name: namespace[name] for name in chosen}


def model_spec(scale: str) -> TinyModelSpec:
    """The base model ``scale`` builds when the notebook is given no ``MODEL_ID``.

    Args:
        scale: "ci", "reference" or "gpu".

    Returns:
        The ``model.TinyModelSpec`` to build.

    Raises:
        ValueError: for an unknown scale, naming ``SCALE``.
    """
    return MODEL_SPECS[check_scale(scale)]
