"""recipes_lib: the library behind the course notebooks, in three layers.

Core (every notebook uses these; they never import a recipe or a tooling module):
    device, timing, memory, allocator, results, checks, sweep, data, numerics, calc,
    grad_accumulation, distributed, train_state, train, evaluation, model, architectures,
    compare, known_warnings, scale.
Recipes (one module per idea; may import core and other recipes, never tooling):
    quantization, checkpointing, offload, optim8bit, fsdp, fsdp_qlora, data_loading, comm_bench,
    ptq, latency, distillation, chunked_loss, attention, norms, kv_cache, gemm_bench,
    sparse_attention, curriculum, max_context, passkey, fp8, fake_memory, packing,
    context_parallel, trainers, compiling, litgpt_memory.
Tooling (the command line and what it drives; may import anything):
    __main__, notebooks, report, colab, planner, calc_validation, published, fit_form.

``tests/test_layers.py`` parses every module, function-local imports included, and fails on an
import cycle or an import against these layers.
"""

from recipes_lib.known_warnings import silence_known_noise

silence_known_noise()
