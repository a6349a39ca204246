import logging
import warnings

import pytest
import torch

from recipes_lib import device, known_warnings


def test_known_noise_is_dropped_and_the_rest_is_kept(caplog):
    known_warnings.silence_known_noise()
    known_warnings.silence_known_noise()  # idempotent
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: no CUDA")
        logging.getLogger("torchao").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_the_library_fallbacks_are_said_aloud():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        known_warnings.silence_known_noise()
        precision = device.resolve_precision("fp16", torch.device("cpu"))
    assert precision == "fp32"
    assert any("fp32" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize("silenced", [False, True])
def test_memtrackers_module_hierarchy_notice_is_dropped(silenced):
    """transformers wraps RoPE in one module every layer's attention calls, which torch's module
    tracker reports once per measured step; the meter counts by category, not by module."""
    from transformers import LlamaConfig

    from recipes_lib import fake_memory

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if silenced:
            known_warnings.silence_known_noise()
        fake_memory.measure_step(cfg, fake_memory.Stack(precision="fp32"), 16, 1)
    shown = [w for w in caught if "module hierarchy" in str(w.message)]
    assert bool(shown) != silenced, [str(w.message) for w in caught]


@pytest.mark.parametrize("path", ["notebooks", "recipes_lib"])
def test_no_blanket_silencing(path):
    from pathlib import Path

    root = Path(known_warnings.__file__).parent.parent / path
    for f in list(root.glob("*.py")) + list(root.glob("*.ipynb")):
        text = f.read_text()
        assert 'PYTHONWARNINGS="ignore"' not in text, f
        assert 'filterwarnings(\\"ignore\\", category=UserWarning)' not in text, f
        assert 'filterwarnings("ignore", category=UserWarning)' not in text, f
