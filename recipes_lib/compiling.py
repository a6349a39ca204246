"""torch.compile as a recipe: what it fuses, what it costs to compile, and when it pays back.

``torch.compile`` traces a model into a graph (Dynamo) and generates fused kernels for it
(Inductor: C++/OpenMP on a CPU, Triton on a GPU). The gain is the launches and memory round
trips it removes: every elementwise op between two matmuls (RMSNorm's square, mean, rsqrt and
scale; SiLU times the up projection; rotary embeddings; residual adds) becomes one loop that
reads its inputs once. So it pays most where those ops are a large share of the time: small
widths, short sequences, batch-1 decode; and least where the time is in large matmuls that are
already one library call. Its cost is the compilation, paid again for every new input shape
(unless marked dynamic): the break-even point is ``compile_s / (eager_s - compiled_s)`` calls.
"""

from __future__ import annotations

import functools
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from recipes_lib.device import has_module
from recipes_lib.timing import Timing, time_interleaved


def compile_available(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether ``torch.compile``'s default backend can generate code for ``device``, and why.

    Inductor needs a C++ compiler for CPU kernels and Triton for CUDA ones.

    Args:
        device: where the compiled code would run.

    Returns:
        ``(available, reason)``: the reason names the compiler found or what is missing.

    Example:
        >>> compile_available("cpu")[1]  # doctest: +ELLIPSIS
        'Inductor generates C++/OpenMP kernels (...)'
    """
    device = torch.device(device)
    if device.type == "cuda":
        if has_module("triton"):
            return True, "Inductor generates Triton kernels"
        return False, "Inductor needs Triton for CUDA kernels (pip install triton)"
    if device.type == "cpu":
        for cxx in ("g++", "c++", "clang++"):
            if shutil.which(cxx):
                return True, f"Inductor generates C++/OpenMP kernels ({cxx})"
        return False, ("Inductor needs a C++ compiler for CPU kernels and none of g++, c++, "
                       "clang++ is on PATH")
    return False, f"device={device.type!r}: not tried by the course"


def require_compile(device: torch.device | str = "cpu") -> None:
    """Raise a clear error where ``torch.compile`` cannot run on ``device``.

    Args:
        device: where the compiled code would run.

    Raises:
        ValueError: naming the device and what is missing.
    """
    ok, why = compile_available(device)
    if not ok:
        raise ValueError(f"device={str(device)!r}: torch.compile is not available here: {why}")


def cold_compile():
    """A context in which ``torch.compile`` compiles from scratch, as on a machine that never
    compiled this graph: a new, empty Inductor cache folder (``torch._inductor.utils.fresh_cache``,
    what PyTorch's own compile-time benchmarks use; deleted on exit, also when the call raised,
    the kernels already loaded stay usable) with Inductor's and AOTAutograd's graph caches off.

    Turning the graph caches off alone is not enough: Inductor also keeps every generated C++
    kernel, compiled by the system compiler, in its cache folder, keyed by source. With that
    folder warm from an earlier run, a width-256 training step "compiled from scratch" here in
    5.5-6.3 s against 13.4 s in a fresh folder: the compile time and break-even reported would
    have been half a first run's."""
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.utils as inductor_utils

    # fresh_cache keeps its folder when the compiled call raises (a decode step that recompiles
    # at every token, below): it is made inside one of ours, removed whatever happens
    parent = tempfile.mkdtemp(prefix="cold-compile-")
    stack = contextlib.ExitStack()
    stack.callback(shutil.rmtree, parent, ignore_errors=True)
    stack.enter_context(inductor_utils.fresh_cache(dir=parent))
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    if hasattr(functorch_config, "enable_autograd_cache"):
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def _warm_up_graph(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


@functools.cache
def warm_up(device_type: str = "cpu") -> float:
    """Pay, once per process and outside any timing, what only a process's first compilation
    costs: on a CPU, Inductor's probe of the instruction sets (it compiles and runs a small
    program per candidate, ATen's vector headers included), and for any device the compiler's
    modules and its pool of compile workers, started by compiling a two-op function in the
    default cache. Without it the first width of a sweep carried these: on a 2-core AMD EPYC
    (Zen 4, one thread) a width-64 training step compiled in 17.5 s as a process's first
    compilation and in 8.6 s as its second, each in a new cache folder (10.5 s first after the
    probe alone, 9.9 s after this).

    Args:
        device_type: "cpu" or "cuda".

    Returns:
        Its seconds (the same, cached, after the first call for that device type; 0 where
        ``torch.compile`` cannot run: the compilation then timed raises its own clear error).
    """
    if not compile_available(device_type)[0]:
        return 0.0
    t0 = time.perf_counter()
    if device_type == "cpu":
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
    torch.compile(_warm_up_graph)(torch.ones(8, device=device_type))
    return time.perf_counter() - t0


def first_call(compiled: Callable[[], Any],
               device: torch.device | str = "cpu") -> tuple[Any, float]:
    """Make the first call of a freshly ``torch.compile``d callable as a first run would, and
    time it: the process's one-time costs paid beforehand (:func:`warm_up`), Dynamo's
    in-process state reset (``torch._dynamo.reset()``), then the call inside
    :func:`cold_compile`. Dynamo keys what it has seen on the code object, so an earlier
    compilation of the same model class at other shapes (another width, a compiled
    ``generate``) would otherwise make this one a recompile with dynamic shapes, several times
    slower here and with different kernels.

    Args:
        compiled: the compiled callable's first call, wrapped (no arguments).
        device: where it runs (what :func:`warm_up` prepares).

    Returns:
        The call's output and its seconds (tracing, code generation and the C++ compiler).
    """
    warm_up(torch.device(device).type)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    with cold_compile():
        out = compiled()
    return out, time.perf_counter() - t0


def break_even_calls(eager_s: float, compiled_s: float, compile_s: float) -> float:
    """Calls after which compiling has paid for itself: ``compile_s / (eager_s - compiled_s)``;
    ``inf`` when the compiled call is not faster.

    Args:
        eager_s: seconds per eager call.
        compiled_s: seconds per compiled call.
        compile_s: seconds the compilation took.

    Returns:
        The calls, or ``math.inf``.

    Example:
        >>> break_even_calls(0.010, 0.006, 2.0)
        500.0
    """
    gain = eager_s - compiled_s
    return compile_s / gain if gain > 0 else math.inf


@dataclass
class CompileComparison:
    """Eager against compiled: the median seconds per call, the first compiled call's seconds
    (tracing and code generation), the largest output difference.

    Attributes:
        eager: the eager calls' ``Timing``.
        compiled: the compiled calls' ``Timing``.
        compile_s: seconds of the first compiled call.
        max_abs_diff: the largest output difference from eager.
    """

    eager: Timing
    compiled: Timing
    compile_s: float
    max_abs_diff: float

    @property
    def eager_s(self) -> float:
        return self.eager.median_s

    @property
    def compiled_s(self) -> float:
        return self.compiled.median_s

    @property
    def spread(self) -> float:
        from recipes_lib.checks import spread_of

        return spread_of(self.eager, self.compiled)

    @property
    def speedup(self) -> float:
        return self.eager_s / self.compiled_s

    @property
    def break_even(self) -> float:
        return break_even_calls(self.eager_s, self.compiled_s, self.compile_s)

    def record(self, results: Any, recipe: str, per: str = "steps", calls: float = 1.0,
               suffix: str = "", speedup_unit: str | None = None) -> None:
        """Add the figures to ``results`` (a ``results.Results``) under ``recipe``:
        ``compile_s{suffix}``, ``break_even_{per}{suffix}`` (``calls`` of ``per`` per compared
        call; -1 when the compiled call is not faster, so it never repays) and, given
        ``speedup_unit``, ``speedup{suffix}``."""
        if speedup_unit is not None:
            results.add(recipe, f"speedup{suffix}", self.speedup, baseline=1.0, unit=speedup_unit)
        results.add(recipe, f"compile_s{suffix}", self.compile_s, unit="s, first call")
        even = self.break_even * calls
        results.add(recipe, f"break_even_{per}{suffix}", even if even < math.inf else -1.0,
                    unit=f"{per} to repay the compilation (-1: never, the compiled call is "
                         "not faster)")

    def summary(self, per: str = "steps", calls: float = 1.0) -> str:
        """One line: throughput in ``per`` per second (``calls`` of them per compared call),
        speed-up, compile time, break-even and the largest output difference."""
        even = self.break_even * calls
        repaid = f"repaid after {even:,.0f} {per}" if even < math.inf else "never repaid"
        return (f"eager {calls / self.eager_s:,.0f} {per}/s, "
                f"compiled {calls / self.compiled_s:,.0f} {per}/s ({self.speedup:.2f}x); "
                f"compile {self.compile_s:.1f} s, {repaid}; "
                f"largest output difference {self.max_abs_diff:.1e}")


def compare(eager: Callable[[], torch.Tensor], compiled: Callable[[], torch.Tensor],
            repeats: int = 5, device: torch.device | str = "cpu") -> CompileComparison:
    """Time ``compiled``'s first call (the compilation, from scratch: :func:`first_call`),
    compare its output with ``eager``'s, then time both in alternation (the one timer).

    Both callables return a tensor (a loss, logits); it is compared after the first calls.

    Args:
        eager: the plain call.
        compiled: the same call through the compiled callable, not yet called.
        repeats: timed calls of each, in alternation.
        device: where they run.

    Returns:
        The :class:`CompileComparison`.
    """
    ref = eager()
    out, compile_s = first_call(compiled, device)
    diff = float((out.detach().float() - ref.detach().float()).abs().max())
    t = time_interleaved({"eager": eager, "compiled": compiled}, warmup=1, repeats=repeats,
                         device=torch.device(device))
    return CompileComparison(t["eager"], t["compiled"], compile_s, diff)


def training_step(make_model: Callable[[], torch.nn.Module], batch: dict[str, torch.Tensor],
                  repeats: int = 5, mode: str | None = None) -> CompileComparison:
    """One training step's forward and backward, eager against ``torch.compile``d, on two copies
    of the same model (the optimizer step is left out: it is the same in both). The output
    compared is the loss.

    Args:
        make_model: returns a fresh copy of the same model (called twice).
        batch: ``input_ids`` and ``labels``.
        repeats: timed steps of each, in alternation.
        mode: ``torch.compile``'s mode (None, "max-autotune", "reduce-overhead" on CUDA).

    Returns:
        The :class:`CompileComparison` (the output compared is the loss).

    Raises:
        ValueError: where ``torch.compile`` cannot run on the model's device.
    """
    eager_model, compiled_model = make_model().train(), make_model().train()
    device = next(eager_model.parameters()).device
    require_compile(device)
    compiled_fwd = torch.compile(compiled_model, mode=mode)

    def step(m: Any) -> torch.Tensor:
        loss = m(**batch).loss
        loss.backward()
        return loss

    def eager() -> torch.Tensor:
        eager_model.zero_grad(set_to_none=True)
        return step(eager_model)

    def compiled() -> torch.Tensor:
        compiled_model.zero_grad(set_to_none=True)
        return step(compiled_fwd)

    return compare(eager, compiled, repeats, device)


def width_sweep(hidden_sizes: list[int], seq_len: int = 256, batch_size: int = 4,
                vocab_size: int = 512, repeats: int = 5,
                num_hidden_layers: int = 2) -> tuple[Any, list[CompileComparison]]:
    """Where compiling a training step pays, over model width: a small Llama-shaped model
    (``model.small_llama``, 2 layers by default) at each width, eager against compiled forward +
    backward, timed in alternation after compilation.

    Each width compiles from scratch (most of it the C++ compiler), a little longer with each
    layer (their kernels are alike, so they are generated again but mostly compiled once): the
    width-256 step at 128 x 4 tokens compiled in 11.0 s with 1 layer and 13.4 s with 2 on an
    idle 2-core AMD EPYC (Zen 4), each in a new process after :func:`warm_up` (25 and 51 ms an
    eager step).

    Work per step (for the regime): ``6 N`` FLOPs per token; bytes: the fp32 weights read in
    forward and backward and their gradients written, ``3 * 4 N``.

    Args:
        hidden_sizes: the widths, at least three, growing.
        seq_len: tokens per sequence.
        batch_size: sequences per step.
        vocab_size: the models' vocabulary.
        repeats: timed steps of each, in alternation.
        num_hidden_layers: the models' depth (at least 1).

    Returns:
        A ``sweep.Sweep`` (recipe "torch_compile", dimension "hidden") and each width's
        :class:`CompileComparison` (compile seconds, break-even steps, loss difference).

    Raises:
        ValueError: for sizes a sweep cannot use, num_hidden_layers < 1, or no compiler.
    """
    from recipes_lib.model import small_llama

    if num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers={num_hidden_layers}: must be >= 1")

    def measure(h: int) -> tuple[CompileComparison, float, float]:
        def make():
            return small_llama(vocab_size=vocab_size, hidden_size=h, max_positions=seq_len,
                               num_hidden_layers=num_hidden_layers)
        g = torch.Generator().manual_seed(h)
        ids = torch.randint(3, vocab_size, (batch_size, seq_len), generator=g)
        run = training_step(make, {"input_ids": ids, "labels": ids}, repeats=repeats)
        n = sum(p.numel() for p in make().parameters())
        return run, 6.0 * n * batch_size * seq_len, 3 * 4.0 * n
    return _over_widths("torch_compile", hidden_sizes, measure)


def generation(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int = 32,
               repeats: int = 5) -> CompileComparison:
    """Greedy generation with a static KV cache, eager against the decode step compiled.

    The compiled path is transformers' own: ``generate`` with ``cache_implementation="static"``
    and a ``CompileConfig`` compiles the one-token decode step (fixed shapes: the static cache is
    preallocated to prompt + ``new_tokens``) and runs the prefill eagerly. transformers does this
    by itself on CUDA; on a CPU it has to be asked (``CompileConfig._compile_all_devices``,
    a private switch, set here and said aloud). The output compared is every step's logits, so
    ``max_abs_diff`` also covers the tokens chosen. Break-even is in calls of ``new_tokens``.

    Args:
        model: a transformers causal LM.
        input_ids: the prompt, one row.
        new_tokens: tokens generated per call.
        repeats: timed calls of each, in alternation.

    Returns:
        A :class:`CompileComparison`: eager and compiled timings, compile seconds, the largest
        logit difference.

    Raises:
        ValueError: for ``new_tokens`` < 1, where ``torch.compile`` cannot run, or where the
            decode step recompiles at every token (Gemma-2's sliding-window cache layers).
    """
    from transformers import CompileConfig

    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens}: must be >= 1")
    device = next(model.parameters()).device
    require_compile(device)
    ids = input_ids.to(device)
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = device.type not in ("cuda", "xpu")
    model.eval()

    def run(**extra: Any) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=model.config.pad_token_id,
                                     cache_implementation="static", output_logits=True,
                                     return_dict_in_generate=True, **extra)
            return torch.stack(out.logits)
        return call

    try:
        return compare(run(), run(compile_config=config), repeats, device)
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        torch._dynamo.reset()
        kinds = sorted(set(getattr(model.config, "layer_types", None) or ()))
        raise ValueError(
            f"model: {type(model).__name__}'s decode step recompiles at every generated token "
            f"(layer types {kinds}: the static cache's sliding-window layers guard on how full "
            "they are), so it never settles into one compiled graph in this transformers "
            "version") from err


def generation_sweep(hidden_sizes: list[int], new_tokens: int = 32, prompt_len: int = 16,
                     vocab_size: int = 512, repeats: int = 5
                     ) -> tuple[Any, list[CompileComparison]]:
    """Where compiling batch-1 decode pays, over model width: a 2-layer Llama-shaped model
    (``model.small_llama``) at each width, :func:`generation` eager against compiled.

    Work per generated token (for the regime): ``2 N`` FLOPs, and the fp32 weights read once,
    ``4 N`` bytes: decode is memory-bound at any width, so what compiling removes is the
    per-op overhead, large at small widths.

    Args:
        hidden_sizes: the widths, at least three, growing.
        new_tokens: tokens generated per call.
        prompt_len: tokens of the random prompt.
        vocab_size: the models' vocabulary.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "compiled_generation", dimension "hidden") and each width's
        :class:`CompileComparison`.

    Raises:
        ValueError: for sizes a sweep cannot use, or no compiler.
    """
    from recipes_lib.model import small_llama

    def measure(h: int) -> tuple[CompileComparison, float, float]:
        model = small_llama(vocab_size=vocab_size, hidden_size=h,
                            max_positions=prompt_len + new_tokens)
        g = torch.Generator().manual_seed(h)
        ids = torch.randint(3, vocab_size, (1, prompt_len), generator=g)
        run = generation(model, ids, new_tokens, repeats)
        n = sum(p.numel() for p in model.parameters())
        return run, 2.0 * n * new_tokens, 4.0 * n * new_tokens
    return _over_widths("compiled_generation", hidden_sizes, measure)


def _over_widths(recipe: str, hidden_sizes: list[int],
                 measure: Callable[[int], tuple[CompileComparison, float, float]]
                 ) -> tuple[Any, list[CompileComparison]]:
    """The width sweeps' common part: sizes and compiler checked first, then ``measure(h)``
    (the comparison and the baseline's FLOPs and bytes) at each width, as a ``sweep.Sweep``."""
    from recipes_lib.sweep import Sweep, check_sizes, machine_peaks

    sizes = check_sizes(hidden_sizes, "hidden_sizes")
    require_compile("cpu")
    runs, flops, nbytes = [], [], []
    for h in sizes:
        run, f, b = measure(h)
        runs.append(run)
        flops.append(f)
        nbytes.append(b)
    sweep = Sweep(recipe, "hidden", sizes, [r.eager for r in runs], [r.compiled for r in runs],
                  flops, nbytes, machine_peaks("cpu"))
    return sweep, runs
