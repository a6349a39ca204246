import pytest
import torch
import torch.nn.functional as F

from recipes_lib import distillation


def _torch_reference(s, t, y, temperature, alpha):
    """Hinton's loss written with torch's own KL (F.kl_div) and cross-entropy."""
    keep = y != -100
    s, t, y = s[keep], t[keep], y[keep]
    kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1),
                  log_target=True, reduction="batchmean")
    return alpha * temperature**2 * kl + (1 - alpha) * F.cross_entropy(s, y)


@pytest.mark.parametrize("temperature, alpha", [(1.0, 0.5), (2.0, 0.9), (4.0, 0.0), (1.5, 1.0)])
def test_kd_loss_matches_torch_kl(temperature, alpha):
    s, t = torch.randn(40, 30, dtype=torch.float64), torch.randn(40, 30, dtype=torch.float64)
    y = torch.randint(0, 30, (40,))
    y[:5] = -100
    got = distillation.kd_loss(s, t, y, temperature, alpha)
    torch.testing.assert_close(got, _torch_reference(s, t, y, temperature, alpha))


def test_chunked_distillation_loss_equals_the_full_logit_reference(small_llama, varlen_batch):
    teacher = small_llama
    student = distillation.make_student(teacher, 0.5, 0.5)
    loss_fn = distillation.DistillationLoss(teacher, temperature=2.0, alpha=0.7, chunk_size=13)
    got = loss_fn(student, varlen_batch)
    got.backward()
    g_got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()

    s_logits = student(**{k: varlen_batch[k] for k in ("input_ids", "attention_mask")}).logits
    with torch.no_grad():
        t_logits = teacher(**{k: varlen_batch[k] for k in ("input_ids", "attention_mask")}).logits
    labels = varlen_batch["labels"][:, 1:]
    n = (labels != -100).sum()
    ref = distillation.kd_loss(s_logits[:, :-1], t_logits[:, :-1], labels, 2.0, 0.7) * n
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    for name, p in student.named_parameters():
        torch.testing.assert_close(g_got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_rows_distil_each_document_alone(small_llama):
    # padding-free rows carry position_ids and no attention mask (packing.collate_padding_free):
    # both models see each document alone, as their own forward does
    from recipes_lib.packing import collate_padding_free

    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(3, 128, (n,), generator=g).tolist()} for n in (9, 14, 6)]
    batch = collate_padding_free([docs[:2], docs[2:]], pad_token_id=0)
    teacher, student = small_llama, distillation.make_student(small_llama, 0.5, 0.5)
    got = distillation.DistillationLoss(teacher, temperature=2.0, alpha=0.7)(student, batch)
    packed = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
              "use_cache": False}
    labels = batch["labels"][:, 1:]
    with torch.no_grad():
        ref = distillation.kd_loss(student(**packed).logits[:, :-1],
                                   teacher(**packed).logits[:, :-1], labels, 2.0, 0.7)
    torch.testing.assert_close(got, ref * (labels != -100).sum(), rtol=1e-5, atol=1e-4)


def test_plugs_into_the_training_loop(small_llama, varlen_batch):
    from recipes_lib import train

    student = distillation.make_student(small_llama, 0.5, 0.5)
    examples = [{"input_ids": ids[m.bool()].tolist(), "labels": lab[m.bool()].tolist()}
                for ids, lab, m in zip(varlen_batch["input_ids"], varlen_batch["labels"],
                                       varlen_batch["attention_mask"])]
    result = train.train(student, examples, 0, train.TrainConfig(steps=3, micro_batch_size=4,
                                                                 progress=False),
                         loss_fn=distillation.DistillationLoss(small_llama))
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))


def test_make_student_is_smaller_with_the_same_vocabulary(small_llama):
    student = distillation.make_student(small_llama, 0.5, 0.5)
    assert student.config.vocab_size == small_llama.config.vocab_size
    assert student.config.num_hidden_layers == 1 and student.config.hidden_size == 32
    assert distillation.param_ratio(student, small_llama) < 0.5


def test_mismatched_vocabulary_is_refused(small_llama, varlen_batch):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    with pytest.raises(ValueError, match="vocabulary"):
        distillation.DistillationLoss(small_llama)(other, varlen_batch)
    with pytest.raises(ValueError, match="teacher_logits"):
        distillation.kd_loss(torch.randn(3, 10), torch.randn(3, 11), torch.zeros(3, dtype=int))


@pytest.mark.parametrize("kwargs, match", [({"temperature": 0}, "temperature"),
                                           ({"alpha": 1.5}, "alpha"),
                                           ({"chunk_size": 0}, "chunk_size")])
def test_bad_settings_name_the_parameter(small_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        distillation.DistillationLoss(small_llama, **kwargs)


def test_bad_student_factors(small_llama):
    with pytest.raises(ValueError, match="width_factor"):
        distillation.make_student(small_llama, width_factor=0)
    with pytest.raises(ValueError, match="width_factor"):
        distillation.make_student(small_llama, width_factor=0.1)  # no head left


def test_latency_sweep_times_teacher_against_student_by_width():
    s = distillation.latency_sweep([64, 128, 256], num_hidden_layers=3, new_tokens=4, repeats=1)
    assert (s.recipe, s.dimension, s.sizes) == ("distillation", "teacher_hidden", [64, 128, 256])


def test_depth_sweep_times_teacher_against_student_by_depth():
    s = distillation.depth_sweep([3, 6, 9], hidden_size=64, new_tokens=4, repeats=1)
    assert (s.recipe, s.dimension, s.sizes) == ("distillation", "teacher_layers", [3, 6, 9])
    # the teacher's work grows by the same number of layers at each step, at one width
    assert s.flops[2] - s.flops[1] == pytest.approx(s.flops[1] - s.flops[0])
    with pytest.raises(ValueError, match="sizes="):
        distillation.depth_sweep([6, 3, 9])


def test_a_student_of_a_wide_head_teacher_is_narrower_too():
    # Qwen3 / Gemma: head_dim wider than hidden / heads; the student's residual stream must
    # shrink with its heads, not become heads x head_dim (here that is the teacher's own width)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    teacher = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=32))
    student = distillation.make_student(teacher, 0.5, 0.5)
    assert (student.config.hidden_size, student.config.num_attention_heads,
            student.config.head_dim) == (32, 2, 32)
    assert distillation.param_ratio(student, teacher) < 0.5
