import pytest
import torch

from recipes_lib import attention, checkpointing, chunked_loss, device, sparse_attention, sweep
from recipes_lib.results import Results, load_results
from recipes_lib.sweep import OutOfMemory, Peaks, Sweep, check_sizes, run_sweep, until_out_of_memory
from recipes_lib.timing import Timing


def _sweep(base_ms, recipe_ms, sizes=(1, 2, 4, 8), **kw):
    t = [Timing(ms / 1e3, [ms / 1e3]) for ms in base_ms]
    r = [Timing(ms / 1e3, [ms / 1e3]) for ms in recipe_ms]
    return Sweep("demo", "n", list(sizes), t, r, **kw)


def test_crossover_is_interpolated_in_log_size_and_log_speedup():
    s = _sweep([1, 1, 1, 1], [2, 2, 0.5, 0.5])  # 0.5x at 2, 2x at 4: crosses at sqrt(8)
    assert s.crossover() == pytest.approx(8 ** 0.5)
    assert "pays above n ~ 3" in s.verdict()


def test_crossover_after_a_dip_is_the_last_one_and_none_when_it_never_pays_or_always_does():
    assert _sweep([1] * 4, [0.5, 2, 0.5, 0.5]).crossover() == pytest.approx(8 ** 0.5)
    never = _sweep([1] * 4, [2, 2, 2, 1.5])
    assert never.crossover() is None and "wins at no n" in never.verdict()
    always = _sweep([1] * 4, [0.5] * 4)
    assert always.crossover() is None and "wins at every n" in always.verdict()


def test_a_recipe_that_stops_paying_crosses_going_down():
    """torch.compile's shape on a CPU: fusion pays on narrow layers, not once matmuls dominate
    (it was reported as winning nowhere)."""
    s = _sweep([1] * 4, [0.5, 0.5, 2, 2])  # 2x at 2, 0.5x at 4: crosses at sqrt(8), going down
    assert s.crossover() == pytest.approx(8 ** 0.5) and not s.pays_above()
    assert "pays below n ~ 3 (2.00x at 1, 0.50x at 8)" in s.verdict()
    up = _sweep([1] * 4, [2, 2, 0.5, 0.5])
    assert up.pays_above() and "pays above n ~ 3" in up.verdict()
    middle = _sweep([1] * 4, [2, 0.5, 2, 2])  # wins at 2 only: said, not "pays below"
    assert middle.crossover() == pytest.approx(8 ** 0.5)
    assert "wins only at n 2 of 1..8 (last crosses 1 going down at ~3" in middle.verdict()


def test_a_speedup_within_its_timings_spread_of_one_is_said_to_be():
    """Near 1x the side is noise: torch.compile at width 1024 read 0.9995x in one run, 1.025x in
    the next."""
    def t(ms, spread):
        m = ms / 1e3
        return Timing(m, [m * (1 - spread / 2), m, m * (1 + spread / 2)])
    s = Sweep("demo", "n", [1, 2, 4], [t(10, 0.05), t(10, 0.05), t(10, 0.05)],
              [t(5, 0.05), t(9.9, 0.05), t(10.3, 0.02)])  # 2x, 1.01x, 0.97x
    assert s.within_noise() == [2, 4]
    assert s.verdict().endswith("; within the timings' spread of 1x at n 2, 4")
    assert _sweep([1] * 4, [0.5] * 4).within_noise() == []  # one run each: no spread


def test_two_variants_raced_by_ratio_with_their_spread_and_a_missing_one_named():
    def t(ms, spread):
        return Timing(ms / 1e3, [ms / 1e3 * (1 - spread), ms / 1e3, ms / 1e3 * (1 + spread)])
    s = Sweep("demo", "n", [1, 2, 4], [t(10, 0)] * 3, [t(5, 0)] * 3,
              extra={"a": [t(8, 0.1), t(6, 0.1), t(4, 0.1)], "b": [t(4, 0.3), t(6, 0), t(8, 0)]})
    ratios, spreads = s.ratio("a", "b")
    assert ratios == pytest.approx([2.0, 1.0, 0.5]) and spreads == pytest.approx([0.6, 0.2, 0.2])
    assert s.ratio("baseline", "recipe")[0] == pytest.approx(s.speedups)
    assert s.times("recipe") is s.candidate
    with pytest.raises(ValueError, match="name='c': not timed in this sweep .*'a', 'b'"):
        s.ratio("c", "a")


def test_a_race_is_printed_by_size_recorded_at_the_largest_and_claimed_when_asked(tmp_path, capsys):
    s = Sweep("demo", "n", [1, 2, 4], [Timing(0.01, [0.01])] * 3, [Timing(0.005, [0.005])] * 3,
              extra={"a": [Timing(t, [t * 0.9, t, t * 1.1]) for t in (0.008, 0.006, 0.004)],
                     "b": [Timing(0.005, [0.005])] * 3})
    r = Results("sweep_test", "cpu", tmp_path)
    assert s.record_ratio(r, "a", "b", "a_over_b", "x b") == pytest.approx([1.6, 1.2, 0.8])
    fig = r.get("demo", "a_over_b_at_n_4")
    assert fig.value == pytest.approx(0.8) and fig.baseline == 1.0 and fig.unit == "x b"
    assert "demo: a time over b's: 1.60x at 1, 1.20x at 2, 0.80x at 4" in capsys.readouterr().out
    assert r.claims == []
    s.record_ratio(r, "a", "b", "a_over_b", "x b", claim="b at least as fast as a", strict=False)
    (claim,) = r.claims
    assert not claim.met and claim.value == pytest.approx(0.8)
    assert claim.spread == pytest.approx(0.2)
    with pytest.raises(AssertionError, match="speed claim not met"):
        s.record_ratio(r, "a", "b", "a_over_b", "x b", claim="b at least as fast as a", strict=True)


def test_record_writes_the_crossover_figure_and_the_last_speedup(tmp_path):
    r = Results("sweep_test", "cpu", tmp_path)
    _sweep([1] * 4, [2, 2, 0.5, 0.5]).record(r)
    assert r.get("demo", "crossover_n").value == pytest.approx(8 ** 0.5)
    assert r.get("demo", "crossover_n").unit == "pays above n ~ 3 (0.50x at 1, 2.00x at 8)"
    assert r.get("demo", "speedup_at_n_8").value == pytest.approx(2.0)
    _sweep([1] * 4, [0.5, 0.5, 2, 2]).record(r, unit="demo over baseline")
    assert r.get("demo", "crossover_n").unit == ("demo over baseline: pays below n ~ 3 "
                                                 "(2.00x at 1, 0.50x at 8)")
    r2 = Results("sweep_test2", "cpu", tmp_path)
    _sweep([1] * 4, [2] * 4).record(r2)
    assert r2.get("demo", "crossover_n").value == -1.0  # at none
    _sweep([1] * 4, [0.5] * 4).record(r2)
    assert r2.get("demo", "crossover_n").value == 0.0  # at every size


def test_regimes_from_achieved_rates_against_the_peaks():
    peaks = Peaks(flops_per_s=1e12, bytes_per_s=1e11, dtype="fp32", device="cpu")
    # 1 ms each: 1e9 FLOP -> 1e12 FLOP/s (compute); 1e8 B -> 1e11 B/s (memory); tiny: overhead
    s = _sweep([1, 1, 1], [1, 1, 1], sizes=(1, 2, 3), flops=[1e9, 1e6, 1e5],
               bytes=[1e3, 1e8, 1e3], peaks=peaks)
    assert s.regimes() == ["compute", "memory", "overhead"]
    assert _sweep([1] * 3, [1] * 3, sizes=(1, 2, 3)).regimes() == ["unknown"] * 3


def test_the_machines_ceilings_are_recorded_beside_its_description(monkeypatch, tmp_path):
    measured = Peaks(flops_per_s=64e9, bytes_per_s=11e9, dtype="torch.float32", device="cpu",
                     matmul_size=1024, copy_bytes=128 * 2**20, repeats=5)
    monkeypatch.setattr(sweep, "machine_peaks", lambda d: measured)
    path = sweep.record_machine_peaks(["cpu"], tmp_path)
    saved = load_results(tmp_path)["machine"]
    assert path == tmp_path / "machine.json"
    assert saved["device"] == device.describe_device(torch.device("cpu"))
    assert {f["metric"]: f["value"] for f in saved["figures"]} == {
        "cpu: fp32 matmul": 64.0, "cpu: copy": 11.0}
    assert [f["unit"] for f in saved["figures"]] == [
        "GFLOP/s, one 1024 x 1024 matmul, median of 5",
        "GB/s read + written, one 128 MiB tensor copied, median of 5"]


@pytest.mark.parametrize("sizes", [[1, 2], [4, 2, 8], [0, 1, 2], [1, 1, 2]])
def test_bad_sizes_are_refused_with_the_parameter_named(sizes):
    with pytest.raises(ValueError, match="sizes="):
        check_sizes(sizes)


def test_run_sweep_times_every_variant_and_refuses_a_maker_without_both():
    s = run_sweep("sum", "n", [10, 100, 1000], lambda n: {
        "baseline": lambda: sum(range(n)), "recipe": lambda: sum(range(n)),
        "other": lambda: sum(range(n))}, repeats=2, progress=False)
    assert len(s.speedups) == 3 and len(s.extra["other"]) == 3
    with pytest.raises(ValueError, match="baseline"):
        run_sweep("x", "n", [1, 2, 3], lambda n: {"recipe": lambda: None}, progress=False)


def test_recipe_sweeps_run_at_tiny_sizes_on_cpu():
    a = attention.seq_len_sweep([16, 32, 64], num_heads=2, head_dim=16, repeats=1)
    c = chunked_loss.tokens_sweep([16, 32, 64], vocab_size=50, hidden_size=16, chunk_size=8,
                                  repeats=1)
    k = checkpointing.width_sweep([32, 64, 128], seq_len=16, vocab_size=64, repeats=1)
    kt = checkpointing.tokens_sweep([16, 32, 64], hidden_size=32, vocab_size=64, repeats=1)
    for s in (a, c, k, kt):
        assert len(s.rows()) == 3 and all(x > 0 for x in s.speedups)
        assert set(s.regimes()) <= {"overhead", "memory", "compute"}
    assert (a.dimension, c.dimension, k.dimension) == ("seq_len", "tokens", "hidden")
    assert (kt.recipe, kt.dimension, kt.sizes) == ("activation_checkpointing", "tokens",
                                                   [16, 32, 64])
    # a tokens sweep holds the width: its work grows with the tokens alone
    assert kt.flops[2] == 4 * kt.flops[0] and kt.bytes[2] == kt.bytes[0]
    heads = attention.heads_sweep([1, 2, 4], seq_len=32, head_dim=16, repeats=1)
    vocab = chunked_loss.vocab_sweep([32, 64, 128], tokens=32, hidden_size=16, chunk_size=8,
                                     repeats=1)
    assert (heads.recipe, heads.dimension, heads.sizes) == ("flash_attention", "heads", [1, 2, 4])
    assert (vocab.recipe, vocab.dimension) == ("chunked_ce", "vocab")
    # the work each point counts grows with the swept dimension alone
    assert heads.flops[1] == 2 * heads.flops[0] and vocab.flops[2] == 4 * vocab.flops[0]
    with pytest.raises(ValueError, match="sizes="):
        attention.seq_len_sweep([64, 32, 16])


def _oom_above(limit, fn):
    """``fn`` that raises as CUDA does once its size exceeds ``limit``."""
    def call(size, *args, **kwargs):
        if size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} GiB.\n"
                                         "See documentation for Memory Management")
        return fn(size, *args, **kwargs)
    return call


def test_a_size_out_of_memory_stops_there_keeps_what_fit_and_says_so():
    tried = []
    fn = _oom_above(2, lambda n: tried.append(n) or n)
    with pytest.warns(UserWarning, match="demo: out of cpu memory at 4 .*keeping the 2 sizes"):
        done, stop = until_out_of_memory([1, 2, 4, 8], fn, what="demo")
    assert done == [1, 2] and tried == [1, 2]  # 8 is not tried: it would not fit either
    assert stop == OutOfMemory(4, "CUDA out of memory. Tried to allocate 4 GiB.")
    assert until_out_of_memory([1, 2], lambda n: n) == ([1, 2], None)
    with pytest.raises(torch.OutOfMemoryError, match="sizes: demo ran out .* smallest size, 1"):
        until_out_of_memory([1, 2], _oom_above(0, lambda n: n), what="demo")
    with pytest.raises(ValueError, match="other errors pass"):  # only out-of-memory is caught
        until_out_of_memory([1], lambda n: (_ for _ in ()).throw(ValueError("other errors pass")))


def test_a_sweep_that_runs_out_of_memory_records_plots_and_says_where(tmp_path):
    def make(n):
        if n > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")
        return {"baseline": lambda: sum(range(n)), "recipe": lambda: sum(range(n))}
    with pytest.warns(UserWarning, match="sum over n: out of cpu memory at 1000"):
        s = run_sweep("sum", "n", [10, 100, 1000, 10000], make, lambda n: (n, n), repeats=1,
                      progress=False)
    assert s.sizes == [10, 100] and len(s.speedups) == len(s.regimes()) == 2
    assert s.out_of_memory == OutOfMemory(1000, "CUDA out of memory. Tried to allocate 12.00 GiB")
    assert s.verdict().endswith("; out of memory at n 1000")
    r = Results("sweep_oom", "cpu", tmp_path)
    s.record(r)
    assert r.get("sum", "out_of_memory_n").value == 1000
    assert "12.00 GiB" in r.get("sum", "out_of_memory_n").unit
    assert r.get("sum", "speedup_at_n_100") is not None
    labels = s.plot().axes[0].get_legend_handles_labels()[1]
    assert "out of memory at 1000" in labels
    assert _sweep([1] * 4, [1] * 4).out_of_memory is None  # a sweep that fit says nothing


def test_the_attention_benchmarks_keep_the_lengths_that_fit(monkeypatch):
    eager = attention.eager_attention
    monkeypatch.setattr(attention, "eager_attention", lambda q, *a, **k: _oom_above(
        64, lambda s: eager(q, *a, **k))(q.shape[-2]))
    with pytest.warns(UserWarning,
                      match="attention benchmark over seq_len: out of cpu memory at 128"):
        rows = attention.benchmark_attention([32, 64, 128, 256], ["eager", "sdpa"], num_heads=2,
                                             head_dim=16, repeats=1, progress=False)
    assert sorted({(r["impl"], r["seq_len"]) for r in rows}) == [
        ("eager", 32), ("eager", 64), ("sdpa", 32), ("sdpa", 64)]
    blockwise = sparse_attention.blockwise_attention
    monkeypatch.setattr(sparse_attention, "blockwise_attention", lambda q, *a, **k: _oom_above(
        64, lambda s: blockwise(q, *a, **k))(q.shape[-2]))
    with pytest.warns(UserWarning,
                      match="attention patterns over seq_len: out of cpu memory at 128"):
        rows = sparse_attention.benchmark([48, 64, 128], 16, 4, num_heads=2, head_dim=16,
                                          repeats=1, progress=False)
    assert {r["seq_len"] for r in rows} == {48, 64} and len(rows) == 6
