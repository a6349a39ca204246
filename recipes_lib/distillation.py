"""Knowledge distillation: a small student learns from a large teacher's output distribution.

Hinton et al. (2015): the student minimises ``alpha * T^2 * KL(p_T || q_T) + (1 - alpha) * CE``,
where ``p_T = softmax(teacher_logits / T)``, ``q_T = softmax(student_logits / T)`` and CE is the
usual next-token loss on the labels. ``T > 1`` softens both distributions so the teacher's
ranking of wrong tokens ("dark knowledge") carries signal; ``T^2`` keeps the KL gradient's scale
independent of T. As in torchtune's KD recipe, both terms are taken at the positions that have
a label.

``kd_loss`` is the plain reference on full logits; ``DistillationLoss`` computes the same thing
from the final hidden states in chunks of tokens (``chunked_loss``), so neither the student's
nor the teacher's tokens x vocab logits are ever materialised. It plugs into ``train.train`` as
``loss_fn``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from recipes_lib.architectures import (
    final_hidden_states,
    final_logit_softcap,
    lm_head_weight,
    softcap,
)
from recipes_lib.chunked_loss import IGNORE_INDEX, chunked_linear_loss, upcast


def _check_kd_args(temperature: float, alpha: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: must be in [0, 1]")


def _token_kd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
              temperature: float, alpha: float) -> torch.Tensor:
    """Per-token ``alpha * T^2 * KL + (1 - alpha) * CE``, at least fp32 (0 where no label)."""
    s, t = upcast(student_logits), upcast(teacher_logits)
    log_p = F.log_softmax(t / temperature, dim=-1)
    log_q = F.log_softmax(s / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    ce = F.cross_entropy(s, labels, ignore_index=IGNORE_INDEX, reduction="none")
    keep = labels != IGNORE_INDEX
    return torch.where(keep, alpha * temperature**2 * kl + (1 - alpha) * ce, 0.0)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 2.0,
    alpha: float = 0.5,
) -> torch.Tensor:
    """Distillation loss on full logits, averaged over labelled tokens (the reference).

    Args:
        student_logits: (..., vocab) student logits at the positions that predict ``labels``.
        teacher_logits: same shape, from the teacher.
        labels: (...) next-token ids, ``-100`` where there is no target.
        temperature: softmax temperature T (> 0).
        alpha: weight of the KL term; ``1 - alpha`` weighs the hard-label CE.

    Returns:
        The scalar loss: ``alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE``.

    Raises:
        ValueError: for T <= 0, alpha outside [0, 1] or mismatched vocabularies.

    Example:
        >>> s, t, y = torch.randn(4, 10), torch.randn(4, 10), torch.tensor([1, 2, -100, 3])
        >>> kd_loss(s, s, y, alpha=1.0).item()  # identical distributions: KL = 0
        0.0
    """
    _check_kd_args(temperature, alpha)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"teacher_logits: shape {tuple(teacher_logits.shape)} != student's "
                         f"{tuple(student_logits.shape)} (vocabularies must match)")
    v = student_logits.shape[-1]
    per_token = _token_kd(student_logits.reshape(-1, v), teacher_logits.reshape(-1, v),
                          labels.reshape(-1), temperature, alpha)
    return per_token.sum() / (labels != IGNORE_INDEX).sum()


class DistillationLoss:
    """``loss_fn`` for ``train.train``: KD + CE summed over target tokens, logits never whole.

    Args:
        teacher: the trained causal LM (frozen, eval mode, same vocabulary as the student).
        temperature: softmax temperature T.
        alpha: weight of the KL term (``1 - alpha`` for the hard-label CE).
        chunk_size: tokens per chunk of logits.

    Raises:
        ValueError: for bad temperature / alpha / chunk_size, or (on the first call) a student
            whose vocabulary differs from the teacher's.

    Example:
        >>> loss_fn = DistillationLoss(teacher, temperature=2.0, alpha=0.5)  # doctest: +SKIP
        >>> train.train(student, examples, pad_id, config, loss_fn=loss_fn)  # doctest: +SKIP
    """

    # it calls the decoder and reads the head itself, not the model's forward: a loop runs it
    # as that forward where a wrapper needs its own to run (architectures.through_wrappers)
    bypasses_forward = True

    def __init__(self, teacher: torch.nn.Module, temperature: float = 2.0, alpha: float = 0.5,
                 chunk_size: int = 1024):
        _check_kd_args(temperature, alpha)
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an integer > 0")
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.alpha, self.chunk_size = temperature, alpha, chunk_size
        self.teacher_weight = lm_head_weight(teacher)

    def __call__(self, student: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        w_s = lm_head_weight(student)
        if w_s.shape[0] != self.teacher_weight.shape[0]:
            raise ValueError(f"student: vocabulary of {w_s.shape[0]} tokens != the teacher's "
                             f"{self.teacher_weight.shape[0]}; distillation on logits needs the "
                             "same tokenizer")
        # position t predicts token t + 1: the labels shift (the last position gets none, as in
        # transformers' loss), so only the labelled rows of the hidden states are ever copied
        labels = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        keep = labels != IGNORE_INDEX
        h_s = final_hidden_states(student, batch).reshape(-1, w_s.shape[1])[keep]
        with torch.no_grad():
            h_t = final_hidden_states(self.teacher, batch)
            h_t = h_t.reshape(-1, h_t.shape[-1])[keep]
        w_t, temperature, alpha = self.teacher_weight, self.temperature, self.alpha
        # Gemma-2 soft-caps its final logits: both sides as their own forward would make them
        cap_s, cap_t = final_logit_softcap(student), final_logit_softcap(self.teacher)

        def chunk_loss(s_logits: torch.Tensor, t_hidden: torch.Tensor, y: torch.Tensor):
            return _token_kd(softcap(s_logits, cap_s), softcap(t_hidden @ w_t.T, cap_t), y,
                             temperature, alpha).sum()

        return chunked_linear_loss(h_s, w_s, chunk_loss, self.chunk_size, h_t, labels[keep])


def make_student(teacher: torch.nn.Module, width_factor: float = 0.5, depth_factor: float = 1 / 3,
                 seed: int = 0) -> torch.nn.Module:
    """A freshly initialised, smaller model of the teacher's architecture and vocabulary.

    Hidden and MLP widths are scaled by ``width_factor`` (head size kept, so fewer heads: the
    hidden width follows the head count), the number of layers by ``depth_factor`` (at least 1).

    Args:
        teacher: a transformers causal LM.
        width_factor: in (0, 1].
        depth_factor: in (0, 1].
        seed: initialisation seed.

    Returns:
        The student, on the teacher's device.

    Raises:
        ValueError: for factors outside (0, 1] or a width that leaves no attention head.

    Example:
        >>> student = make_student(teacher, 0.5, 1 / 3)  # doctest: +SKIP
    """
    for name, f in (("width_factor", width_factor), ("depth_factor", depth_factor)):
        if not 0 < f <= 1:
            raise ValueError(f"{name}={f}: must be in (0, 1]")
    cfg = copy.deepcopy(teacher.config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads = int(cfg.num_attention_heads * width_factor)
    if heads < 1:
        raise ValueError(f"width_factor={width_factor}: leaves no attention head of size "
                         f"{head_dim}")
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv is not None:
        cfg.num_key_value_heads = max(1, min(heads, int(kv * width_factor)))
        while heads % cfg.num_key_value_heads:
            cfg.num_key_value_heads -= 1
    # the residual stream shrinks with the heads; it is heads x head_dim only where the teacher's
    # is (Qwen3 and Gemma make their heads wider than hidden / heads)
    cfg.hidden_size = round(cfg.hidden_size * heads / cfg.num_attention_heads)
    cfg.num_attention_heads = heads
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = head_dim
    cfg.intermediate_size = max(1, int(cfg.intermediate_size * width_factor))
    cfg.num_hidden_layers = max(1, round(cfg.num_hidden_layers * depth_factor))
    for attr in ("layer_types",):  # per-layer lists must match the new depth
        if getattr(cfg, attr, None) is not None:
            setattr(cfg, attr, list(getattr(cfg, attr))[:cfg.num_hidden_layers])
    torch.manual_seed(seed)
    student = type(teacher)(cfg)
    return student.to(next(teacher.parameters()).device)


def param_ratio(student: torch.nn.Module, teacher: torch.nn.Module) -> float:
    """Student parameters / teacher parameters.

    Args:
        student: the smaller model.
        teacher: the model it learns from.

    Returns:
        The ratio of their parameter counts.
    """
    return (sum(p.numel() for p in student.parameters())
            / sum(p.numel() for p in teacher.parameters()))


def latency_sweep(hidden_sizes: list[int], num_hidden_layers: int = 6, new_tokens: int = 32,
                  vocab_size: int = 512, width_factor: float = 0.5, depth_factor: float = 1 / 3,
                  repeats: int = 3):
    """Where a smaller student's generation latency approaches its size ratio: at batch 1,
    teachers of growing width (``model.small_llama``, untrained: latency does not depend on the
    weights) against their students (``make_student``), ``new_tokens`` greedy tokens each,
    timed in alternation (``sweep.run_sweep``). A small model's decode step is bound by per-op
    overhead, the same for both, so the student's gain grows with the width. Work per call (the
    teacher's): ``2 N`` FLOPs per token; bytes: its weights, read once per token.

    Args:
        hidden_sizes: the teachers' widths, at least three, growing.
        num_hidden_layers: the teachers' depth.
        new_tokens: tokens generated per call.
        vocab_size: the models' vocabulary.
        width_factor: the student's width over the teacher's.
        depth_factor: the student's depth over the teacher's.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "distillation", dimension "teacher_hidden").

    Raises:
        ValueError: for sizes a sweep cannot use.
    """
    return _latency_sweep("teacher_hidden", hidden_sizes, lambda h: (h, num_hidden_layers),
                          new_tokens, vocab_size, width_factor, depth_factor, repeats)


def depth_sweep(layer_counts: list[int], hidden_size: int = 256, new_tokens: int = 32,
                vocab_size: int = 512, width_factor: float = 0.5, depth_factor: float = 1 / 3,
                repeats: int = 3):
    """The student's generation speed-up as the teacher deepens, at one width and batch 1:
    teachers of ``layer_counts`` layers against students of ``depth_factor`` of them (at least
    one) and ``width_factor`` of the width, as :func:`latency_sweep` times them. Per-token work
    that does not scale with depth (sampling, the embedding and the head, ``generate``'s Python)
    is the same for both, so the gain grows with depth towards the per-layer ratio.

    Args:
        layer_counts: the teachers' depths, at least three, growing.
        hidden_size: the teachers' width.
        new_tokens: tokens generated per call.
        vocab_size: the models' vocabulary.
        width_factor: the student's width over the teacher's.
        depth_factor: the student's depth over the teacher's.
        repeats: timed calls of each, in alternation.

    Returns:
        A ``sweep.Sweep`` (recipe "distillation", dimension "teacher_layers").

    Raises:
        ValueError: for sizes a sweep cannot use.

    Example:
        >>> s = depth_sweep([3, 6, 9], hidden_size=64, new_tokens=2, repeats=1)
        >>> s.sizes
        [3, 6, 9]
    """
    return _latency_sweep("teacher_layers", layer_counts, lambda n: (hidden_size, n),
                          new_tokens, vocab_size, width_factor, depth_factor, repeats)


def _latency_sweep(dimension: str, sizes: list[int], shape, new_tokens: int, vocab_size: int,
                   width_factor: float, depth_factor: float, repeats: int):
    """Teacher vs student generation over ``sizes``; ``shape(size)`` gives the teacher's
    (hidden size, layers) at that size."""
    from recipes_lib.model import small_llama
    from recipes_lib.sweep import run_sweep

    prompt = torch.randint(3, vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    params: dict[int, int] = {}

    def make(size: int):
        h, layers = shape(size)
        teacher = small_llama(vocab_size=vocab_size, hidden_size=h,
                              num_hidden_layers=layers).eval()
        student = make_student(teacher, width_factor, depth_factor).eval()
        params[size] = sum(p.numel() for p in teacher.parameters())

        def run(m):
            with torch.inference_mode():
                m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
        return {"baseline": lambda: run(teacher), "recipe": lambda: run(student)}

    def work(size: int) -> tuple[float, float]:
        return 2.0 * params[size] * new_tokens, 4.0 * params[size] * new_tokens
    return run_sweep("distillation", dimension, sizes, make, work, "cpu",
                     repeats=repeats, progress=False)
