"""The one size setting of every notebook (``SCALE``): its table against the notebooks."""

from dataclasses import asdict

import pytest

from recipes_lib import calc, notebooks, scale, sweep


@pytest.mark.parametrize("stem", sorted(scale.SIZES))
def test_ci_column_is_the_parameters_cell_and_every_name_is_declared(stem):
    declared = notebooks.notebook_parameters(notebooks.NOTEBOOKS / f"{stem}.ipynb")
    assert declared["SCALE"] == '"ci"'
    for name, by_scale in scale.SIZES[stem].items():
        assert name in declared, (stem, name)
        assert set(by_scale) <= set(scale.SCALES) and "ci" in by_scale, (stem, name)
        assert notebooks.parse_value(declared[name]) == by_scale["ci"], (stem, name)


def test_every_course_notebook_has_a_scale_table():
    assert {p.stem for p in notebooks.course_notebooks()} == set(scale.SIZES)


def test_ci_changes_nothing_and_other_scales_set_their_sizes():
    stem = "03_optimizing_inference_speed"
    ci = {name: by_scale["ci"] for name, by_scale in scale.SIZES[stem].items()}
    ns = dict(ci)
    assert scale.apply(stem, "ci", ns) == ci and ns == ci
    scale.apply(stem, "reference", ns)
    assert ns["ATTN_SEQ_LENS"] == (256, 512, 1024, 2048, 4096) and ns["COMPILE_INT8"] is True
    assert ns["NORM_TOKENS"] == 2048  # not scaled at "reference": keeps the CI value
    # the results table's compile sweep: 2-layer models, as before the CI size took 1
    assert ci["COMPILE_LAYERS"] == 1 and ns["COMPILE_LAYERS"] == 2
    ns = dict(ci)
    scale.apply(stem, "gpu", ns)
    assert ns["ATTN_SEQ_LENS"][-1] == 16384 and ns["NORM_TOKENS"] == 16384


def test_a_value_set_on_purpose_is_kept_and_said(capsys):
    stem = "03_optimizing_inference_speed"
    ns = {name: by_scale["ci"] for name, by_scale in scale.SIZES[stem].items()}
    ns["ATTN_SEQ_LENS"] = [128, 256, 512]  # papermill hands tuples over as lists
    ns["KV_SWEEP_TOKENS"] = [4, 16, 64]    # the CI default, as a list: still the default
    out = scale.apply(stem, "gpu", ns)
    assert out["ATTN_SEQ_LENS"] == [128, 256, 512]
    assert ns["KV_SWEEP_TOKENS"] == scale.SIZES[stem]["KV_SWEEP_TOKENS"]["gpu"]
    assert "kept the values you set for ATTN_SEQ_LENS" in capsys.readouterr().out


def test_bad_scale_and_notebook_are_named():
    with pytest.raises(ValueError, match="SCALE='tpu'.*'ci', 'reference', 'gpu'"):
        scale.apply("01_large_models_limited_hardware", "tpu", {})
    with pytest.raises(ValueError, match="notebook='05'"):
        scale.sizes("05", "ci")
    with pytest.raises(ValueError, match="SCALE=.*not defined"):
        scale.apply("01_large_models_limited_hardware", "gpu", {})
    with pytest.raises(ValueError, match="SCALE='big'"):
        scale.model_spec("big")


def test_model_specs():
    assert scale.model_spec("ci") == scale.model_spec("reference") == scale.TinyModelSpec()
    gpu = asdict(scale.model_spec("gpu"))
    shape = calc.ModelShape(**{k: gpu[k] for k in ("vocab_size", "hidden_size",
                                                   "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads")})
    # "a few hundred million parameters", multiples of 64 so NF4's blocks tile every weight
    assert 3e8 < calc.param_count(shape)["total"] < 5e8
    assert gpu["hidden_size"] % 64 == 0 and gpu["intermediate_size"] % 64 == 0
    assert gpu["hidden_size"] % gpu["num_attention_heads"] == 0


# The parameters each notebook hands to a size sweep (``sweep.check_sizes``: at least three
# sizes, strictly growing). Checked at every scale, since the "gpu" column only runs on a GPU.
SWEEP_PARAMETERS = {
    "01_large_models_limited_hardware": ("CKPT_SWEEP_WIDTHS", "CKPT_SWEEP_TOKENS"),
    "02_multi_gpu_training": ("BF16_SWEEP",),
    "03_optimizing_inference_speed": ("ATTN_SEQ_LENS", "ATTN_HEADS", "INT8_DECODE_HIDDEN",
                                      "INT8_PREFILL_ROWS", "KD_SWEEP_WIDTHS", "KD_SWEEP_LAYERS",
                                      "NORM_HIDDEN_SIZES", "KV_SWEEP_TOKENS", "COMPILE_WIDTHS",
                                      "GEN_COMPILE_WIDTHS"),
    "04_training_long_sequences": ("TIME_SEQ_LENS", "CE_SWEEP_TOKENS", "CE_SWEEP_VOCAB"),
}
SKIPPED_WHEN_EMPTY = {"GEN_COMPILE_WIDTHS"}  # the notebook says it skips the sweep


@pytest.mark.parametrize("scale_name", scale.SCALES)
def test_every_scale_gives_each_sweep_sizes_it_can_run(scale_name):
    for stem, names in SWEEP_PARAMETERS.items():
        chosen = scale.sizes(stem, scale_name)
        for name in names:
            if name in SKIPPED_WHEN_EMPTY and not chosen[name]:
                continue
            sweep.check_sizes(list(chosen[name]), name)  # raises, naming the parameter
