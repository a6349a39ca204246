from dataclasses import replace
from urllib.parse import urlparse

import pytest

from recipes_lib import published
from recipes_lib.fake_memory import Stack


def test_the_table_has_enough_figures_from_independent_sources_each_with_its_address():
    figures = published.FIGURES
    assert len(figures) >= 8
    sites = {urlparse(f.source.split()[0]).netloc + urlparse(f.source.split()[0]).path.split(
        "/")[1] for f in figures}
    assert len({s.split(".")[0] if "github" not in s else s for s in sites}) >= 3, sites
    for f in figures:
        assert f.source.startswith("https://") and f.config
        assert f.published > 0 or f.kind == "max_context"  # 0: the source's "OOM"


def test_a_published_peak_stays_within_its_band():
    """litgpt's Llama 2 7B QLoRA row (A100, max_memory_allocated / 1e9) as litgpt ran it: its
    own model, bf16 adapters, a GPU's dropout mask, every linear layer 4-bit, bitsandbytes
    0.41's 4-bit layers keeping their input; measured on fake tensors here in ~5 s (its other
    stacks and models run in make bench)."""
    row = next(f for f in published.FIGURES
               if f.source == published.LITGPT and f.row.startswith("Llama-2-7B")
               and f.stack.method == "qlora")
    assert row.model == published.LitGPTModel("Llama-2-7b-hf")
    assert row.stack.gpu_dropout and row.stack.nf4_keeps_input
    assert not row.stack.autocast_adapter_dtype
    (r,) = published.predict([replace(row, alternatives=(), model_alternatives=())])
    assert r["met"] and abs(r["error"]) <= published.TOLERANCE, r
    assert r["unit"] == "GB (allocated)"


def test_a_prediction_reads_each_measurement_through_its_memo():
    """make bench keeps each measurement as it is made (results.Progress): a memo that holds a
    value stands in for the fake-tensor step and the longest-context search, so an interrupted
    run resumes without measuring again."""
    peak = next(f for f in published.FIGURES if f.source == published.LITGPT)
    longest = next(f for f in published.FIGURES if f.kind == "max_context")
    keys = []

    def kept(key, measure):
        keys.append(key)
        return 2 * 10**9 if key.startswith("peak: ") else [{"max_seq_len": 1234}]

    one, two = published.predict([replace(f, alternatives=(), model_alternatives=())
                                  for f in (peak, longest)], memo=kept)
    assert one["predicted"] == 2 * 10**9 / peak.unit_bytes and two["predicted"] == 1234.0
    assert keys[0].startswith(f"peak: {peak.model!r}, {peak.stack!r}")
    assert keys[1].startswith(f"max context: {longest.model!r}, {longest.stack!r}")


def test_litgpts_phi_row_is_litgpts_model_beside_transformers_of_the_same_config():
    """litgpt's phi-1.5 LoRA row (micro-batch 1) is measured on litgpt's own model, which keeps
    more than transformers' model of the same config (litgpt's fused qkv: attention keeps v as
    a view of the whole fused output). transformers' Phi config says gelu_new: GELU's tanh
    approximation in eight elementwise ops, which keep more for backward than litgpt's one op
    (gelu_pytorch_tanh, the same function). ~8 s for the three."""
    import torch
    from transformers.activations import ACT2FN

    x = torch.randn(4096) * 4
    torch.testing.assert_close(ACT2FN["gelu_pytorch_tanh"](x), ACT2FN["gelu_new"](x))
    row = next(f for f in published.FIGURES if f.source == published.LITGPT
               and f.row == "phi-1.5 LoRA, micro-batch 1")
    assert row.model == published.LitGPTModel("phi-1_5") and row.stack.loss == "litgpt"
    others = {name: model for name, model, _ in row.model_alternatives}
    assert others["transformers' model"]["hidden_act"] == "gelu_pytorch_tanh"
    (r,) = published.predict([row])
    assert r["met"], r
    alt = r["alternatives"]
    assert r["predicted"] > alt["transformers' model"] * 1.03
    assert alt["transformers' Phi (gelu_new: eight ops)"] > 1.1 * alt["transformers' model"]


def test_torchtunes_qlora_row_stays_within_its_band():
    """torchtune's README ablation, Llama 3.2 3B QLoRA (A100, peak active GiB): bf16 adapters,
    rank 64 on q, v, output and the MLP, checkpointing and offloading, chunked CE (~10 s; the
    row's alternative, peft's default fp32 adapters, is measured beside it by make bench)."""
    row = next(f for f in published.FIGURES if f.source == published.TORCHTUNE
               and f.stack.method == "qlora")
    assert not row.stack.autocast_adapter_dtype and row.stack.offload_activations
    assert [name for name, _ in row.alternatives] == ["peft's default: fp32 adapters"]
    (r,) = published.predict([replace(row, alternatives=())])
    assert r["met"] and r["unit"] == "GiB (allocated)", r


def test_torchtitans_selective_checkpointing_row_stays_within_its_band():
    """torchtitan's Table 1 (Llama 3.1 8B, FSDP over 8 H100s, local batch 2, selective AC by op,
    max reserved GiB): rank 0 of a fake process group, ~10 s."""
    row = next(f for f in published.FIGURES if f.source == published.TORCHTITAN_FSDP
               and f.stack.fsdp_ranks == 8)
    assert row.stack.selective_checkpointing and row.reads == "reserved"
    (r,) = published.predict([row])
    assert r["met"], r


def test_longest_context_rows_of_one_stack_share_one_search(tmp_path, small_llama, monkeypatch):
    small_llama.config.save_pretrained(tmp_path)
    calls = []
    real = published.planner.max_context

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(published.planner, "max_context", counting)
    stack = Stack(precision="fp32")
    rows = [published.Figure("https://example.org/a", f"{m} MiB", str(tmp_path), stack,
                             "max_context", 100 if m > 1 else 0, config="c", gpu_mem=f"{m}MiB")
            for m in (1, 560, 600)]
    out = published.predict(rows, step=16)
    assert calls == [["1MiB", "560MiB", "600MiB"]]
    assert out[1]["predicted"] <= out[2]["predicted"]
    assert "MISSED" in published.format_table(out) or all(r["met"] for r in out[1:])
    # the source's "out of memory": met where nothing fits here either, with no error to print
    oom = out[0]
    assert oom["predicted"] == 0 and oom["met"] and oom["error"] is None
    assert "| 1 MiB ([source](https://example.org/a); c) | OOM | OOM |  |  | met |" in (
        published.markdown_table(out))


def test_a_longest_context_figure_is_found_for_each_stack_its_source_fits():
    for stack in (published.TRL_2024_QLORA, published.HF_QLORA, published.BF16_QLORA):
        assert published.figure_for("Llama-3.1-8B", stack, "24GiB").published == 5789
    assert published.figure_for("Llama-3.1-8B", Stack(method="lora"), "24GiB") is None
    assert published.figure_for("Llama-3.1-8B", published.HF_QLORA, "20GiB") is None


def test_bad_figures_name_the_field():
    with pytest.raises(ValueError, match="kind='oom'"):
        published.Figure("https://x", "r", "Llama-2-7B", Stack(), "oom", 1, config="c")
    with pytest.raises(ValueError, match="gpu_mem"):
        published.Figure("https://x", "r", "Llama-2-7B", Stack(), "max_context", 1, config="c")
    with pytest.raises(ValueError, match="published=0: a peak figure"):
        published.Figure("https://x", "r", "Llama-2-7B", Stack(), "peak", 0, config="c",
                         seq_len=8)
    with pytest.raises(ValueError, match="published=-1"):
        published.Figure("https://x", "r", "Llama-2-7B", Stack(), "max_context", -1,
                         config="c", gpu_mem="8GiB")
    with pytest.raises(ValueError, match="model: a longest-context figure"):
        published.predict([published.Figure("https://x", "r", {"model_type": "llama"}, Stack(),
                                            "max_context", 1, config="c", gpu_mem="8GiB")])
    with pytest.raises(ValueError, match="reads='peak'"):
        published.Figure("https://x", "r", "Llama-2-7B", Stack(), "peak", 1, config="c",
                         seq_len=8, reads="peak")


def test_the_published_table_shows_each_miss_with_its_reason():
    rows = [{"source": published.UNSLOTH_README, "row": "r1", "kind": "max_context",
             "config": "c", "unit": "tokens", "published": 932, "predicted": 320,
             "error": 320 / 932 - 1, "met": False, "stack": "s",
             "alternatives": {"bf16 base": 1920.0},
             "reason": published.REASONS[published.UNSLOTH_README]},
            {"source": published.LITGPT, "row": "r2", "kind": "peak", "config": "c",
             "unit": "GB (allocated)", "published": 21.3, "predicted": 22.3, "error": 0.047,
             "met": True, "stack": "s", "alternatives": {}}]
    table = published.markdown_table(rows)
    assert "| 932 tokens | 320 | 1,920 (bf16 base) | -65.7% | MISSED: The source's" in table
    assert "| 21.30 GB (allocated) | 22.30 |  | +4.7% | met |" in table
    assert published.REASONS.keys() <= {f.source for f in published.FIGURES}
    # make bench writes it into the planner's page, which the README links to
    from recipes_lib import results
    page = results.PLANNER_DOC.read_text()
    assert "<!-- published-table:begin -->" in page and "<!-- published-table:end -->" in page
    assert "(docs/planner.md)" in results.README.read_text()


def test_a_line_fit_gives_the_memory_each_token_adds_and_the_memory_before_the_first():
    # 2 MB a token on top of 10 GB: the numbers a reader can check by hand
    line = published.fit_line([12e9, 16e9, 24e9], [1000, 3000, 7000])
    assert line["bytes_per_token"] == pytest.approx(2e6)
    assert line["fixed_bytes"] == pytest.approx(10e9)
    assert line["worst_residual"] == pytest.approx(0, abs=1e-6)
    assert published.fit_line([1, 2, 3], [1, 3, 2])["worst_residual"] > 0.1
    with pytest.raises(ValueError, match="gpu_bytes: 2 sizes"):
        published.fit_line([12e9, 16e9], [1000, 3000])
    with pytest.raises(ValueError, match="gpu_bytes: the longest context does not grow"):
        published.fit_line([12e9, 16e9, 24e9], [3000, 2000, 1000])


def test_unsloths_hf_rows_are_one_line_so_they_test_two_numbers():
    """The evidence behind the Unsloth reason: every published HF + FA2 figure sits on one line
    (1,619 tokens per 4 GB), to within a token."""
    rows = [f for f in published.FIGURES if f.source == published.UNSLOTH_README and f.published]
    line = published.fit_line([published.planner.parse_bytes(f.gpu_mem) for f in rows],
                              [f.published for f in rows])
    assert len(rows) >= published.MIN_LINE_ROWS and line["worst_residual"] < 1
    assert 2**30 / line["bytes_per_token"] == pytest.approx(1619 / 4, rel=1e-3)


def test_lines_put_ours_beside_the_sources_and_explain_the_miss_once():
    published_tokens, ours = (932, 2551, 5789), (1920, 3712, 7296)
    rows = [{"source": published.UNSLOTH_README, "row": f"r{gb}", "kind": "max_context",
             "model": "Llama-3.1-8B", "gpu_mem": f"{gb}GiB", "config": "c", "unit": "tokens",
             "published": p, "predicted": o, "error": o / p - 1, "met": False, "stack": "s",
             "alternatives": {"other": o - 500}, "reason": "why"}
            for gb, p, o in zip((12, 16, 24), published_tokens, ours)]
    (line,) = published.lines(rows)
    assert set(line["ours"]) == {"main", "other"} and line["rows"] == 3
    assert line["published_1e9"]["bytes_per_token"] == pytest.approx(
        line["published"]["bytes_per_token"] * 1e9 / 2**30)
    table = published.markdown_table(rows)
    assert table.count("MISSED: why") == 1 and table.count("MISSED: as above") == 2
    assert "| published, GB read as 10^9 bytes |" in table and "| ours, other |" in table
    summary = published.line_summary(line)
    assert "the source's 3 rows lie on one line" in summary and "other: " in summary


def test_what_each_further_sequence_adds_is_fitted_over_the_micro_batches():
    """Evidence for a reason: per source, model and stack with rows at several micro-batches,
    the slope of memory over micro-batches, the source's beside ours."""
    def row(model, b, published_gb, predicted_gb):
        return {"source": "s", "kind": "peak", "model_name": model, "stack": "st",
                "unit": "GB (allocated)", "batch_size": b, "published": published_gb,
                "predicted": predicted_gb}
    rows = [row("m", b, 4 + 2 * b, 4 + 1.5 * b) for b in (1, 2, 4)] + [row("one", 1, 3, 3)]
    (slope,) = published.batch_slopes(rows)
    assert slope["batch_sizes"] == [1, 2, 4] and slope["model"] == "m"
    assert slope["published"] == pytest.approx(2) and slope["predicted"] == pytest.approx(1.5)
    assert published.slope_summary(slope) == (
        "m (micro-batches 1, 2, 4), 2.00 GB a sequence at the source, 1.50 here (-25%).")


def test_answerais_fsdp_qlora_rows_dequantize_as_bitsandbytes_beside_torchao():
    """Answer.AI's FSDP + QLoRA rows ran bitsandbytes' NF4, whose kernel writes the dequantized
    weight directly: measured with the course's torchao NF4 dequantized into its output alone,
    torchao's own dequantization beside it (measured in make bench); its CPU-offload rows
    (FSDP's ``CPUOffload``) as FSDP2's ``CPUOffloadPolicy``."""
    rows = [f for f in published.FIGURES if f.source == published.ANSWERAI]
    fsdp_qlora = [f for f in rows if f.stack.method == "qlora" and f.stack.fsdp_ranks == 2]
    assert len(rows) >= 8 and len(fsdp_qlora) == 10
    assert {f.stack.fsdp_cpu_offload for f in fsdp_qlora} == {False, True}
    assert all(f.stack.fsdp_cpu_offload == ("CPU offload" in f.row) for f in rows)
    for f in fsdp_qlora:
        assert f.stack.chunked_dequant and f.batch_size % 2 == 0
        assert f.alternatives == (("torchao's dequantization",
                                   replace(f.stack, chunked_dequant=False)),)
    assert {f.reads for f in rows} == {"allocated", "reserved"}


def test_slopes_over_micro_batches_keep_each_sequence_length_apart():
    def row(seq, b, gib):
        return {"source": "s", "kind": "peak", "model_name": "m", "stack": "st",
                "unit": "GiB (reserved)", "batch_size": b, "seq_len": seq, "published": gib,
                "predicted": gib}
    rows = [row(512, 2, 5.0), row(2048, 2, 5.2), row(2048, 8, 11.2), row(2048, 20, 21.0)]
    (slope,) = published.batch_slopes(rows)  # the 512-token row has no second batch size
    assert slope["batch_sizes"] == [2, 8, 20]
