"""CUDA paths, each against its CPU or library reference. Skipped (with the reason) without a GPU.

Run them on a CUDA machine with ``pytest -m gpu``; CI has no GPU, so these never gate a merge.
"""
import pytest
import torch
import torch.nn.functional as F

from recipes_lib import attention, chunked_loss, data, ptq, quantization
from recipes_lib import model as models
from recipes_lib import sparse_attention as sa

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("window, n_global", [(64, 0), (64, 8), (None, 0)])
def test_flex_attention_trains_and_equals_dense_masked_reference(window, n_global):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 512, 32, device=CUDA, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 512, 32, device=CUDA, generator=g, requires_grad=True)
            for _ in range(2))
    ref = sa.dense_masked_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                    sa.attention_mask(512, window, n_global).to(CUDA))
    out = sa.flex_attention_fn(window, n_global)(q, k, v)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_blockwise_attention_on_cuda_equals_reference():
    q, k, v = (torch.randn(1, 4, 1024, 64, device=CUDA, requires_grad=True) for _ in range(3))
    ref = sa.dense_masked_attention(q, k, v, sa.attention_mask(1024, 128, 4).to(CUDA))
    torch.testing.assert_close(sa.blockwise_attention(q, k, v, 128, 4), ref, rtol=1e-5, atol=1e-5)


def test_sdpa_flash_kernel_runs_in_bf16_and_matches_eager():
    q, k, v = (torch.randn(2, 8, 1024, 64, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    assert attention.backend_available("flash", "cuda", torch.bfloat16)
    ran = attention.sdpa_backend_used(lambda: attention.sdpa_attention(q, k, v, backend="flash"))
    assert "flash" in ran, ran
    ref = attention.eager_attention(q.float(), k.float(), v.float())
    err = (attention.sdpa_attention(q, k, v, backend="flash").float() - ref).abs().max()
    assert float(err) <= 2e-2, float(err)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_cross_entropy_on_cuda_equals_full(dtype, tol):
    hidden = torch.randn(2048, 256, device=CUDA, dtype=dtype, requires_grad=True)
    weight = (0.05 * torch.randn(32000, 256, device=CUDA, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, 32000, (2048,), device=CUDA)
    labels[::7] = -100
    full = F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100)
    got = chunked_loss.chunked_cross_entropy(hidden, weight, labels, chunk_size=256)
    g_full = torch.autograd.grad(full, (hidden, weight))
    g_got = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, full, rtol=tol, atol=tol)
    for a, b in zip(g_got, g_full):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_chunked_cross_entropy_agrees_with_liger_fused_linear_cross_entropy():
    liger = pytest.importorskip("liger_kernel.transformers", reason="Liger-Kernel not installed")
    hidden = torch.randn(4096, 512, device=CUDA, requires_grad=True)
    weight = (0.05 * torch.randn(32000, 512, device=CUDA)).requires_grad_()
    labels = torch.randint(0, 32000, (4096,), device=CUDA)
    labels[::5] = -100
    ours = chunked_loss.chunked_cross_entropy(hidden, weight, labels, chunk_size=512)
    theirs = liger.LigerFusedLinearCrossEntropyLoss(ignore_index=-100)(weight, hidden, labels)
    g_ours = torch.autograd.grad(ours, (hidden, weight))
    g_theirs = torch.autograd.grad(theirs, (hidden, weight))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_llm_int8_load_on_cuda_stays_close_to_fp16(tiny_model_path):
    pytest.importorskip("bitsandbytes")
    tok = models.load_tokenizer(tiny_model_path)
    examples = data.tokenize_examples(data.load_corpus("base", "test"), tok, 64, "lm")
    batch = data.collate(examples[:8], tok.pad_token_id)
    batch = {k: v.to(CUDA) for k, v in batch.items()}
    fp16 = models.load_model(tiny_model_path, dtype=torch.float16, device=CUDA)
    int8 = ptq.load_int8(tiny_model_path, CUDA)
    with torch.no_grad():
        l16 = fp16(**batch).loss.float()
        l8 = int8(**batch).loss.float()
    assert abs(float(l8 / l16) - 1) <= 0.02, (float(l16), float(l8))


def test_qlora_nf4_step_on_cuda(tiny_model_path):
    pytest.importorskip("bitsandbytes")
    cfg = quantization.nf4_config(double_quant=True, compute_dtype=torch.bfloat16)
    m = models.load_model(tiny_model_path, dtype=torch.bfloat16, quantization_config=cfg,
                          device=CUDA)
    m = quantization.add_lora(m, r=8, alpha=16)
    ids = torch.randint(3, 100, (4, 64), device=CUDA)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and grads and all(g is not None for g in grads)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="PyTorch's context_parallel needs NCCL "
                    "and a GPU per rank: at least 2 GPUs")
def test_pytorch_context_parallel_equals_dense_attention_on_two_gpus():
    from recipes_lib import distributed

    [per_rank] = distributed.launch([("recipes_lib.context_parallel:check_torch_context_parallel",
                                      {})], world_size=2, backend="nccl", verbose=False)
    assert all(r["output"] <= 2e-2 for r in per_rank), per_rank  # bf16, |values| ~ 1
