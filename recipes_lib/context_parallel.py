"""Context parallelism: the sequence itself split across ranks, attention computed in a ring.

Every layer except attention treats tokens independently, so with ``N`` ranks each rank can hold
``s / N`` of the tokens and run embeddings, norms, MLPs and the loss on them alone; its
activations shrink by ``N``. Attention needs every earlier key: in **ring attention** each rank
keeps its queries while the key/value blocks travel around the ranks, one hop per step (rank
``r`` sends to ``r + 1`` and receives from ``r - 1``, the next block in flight while the current
one is computed). Each step's partial result is merged with the online-softmax rescaling that
flash attention uses inside one device: with ``(o_1, l_1)`` and ``(o_2, l_2)`` the outputs and
log-sum-exps of two key blocks, ``l = log(e^{l_1} + e^{l_2})`` and
``o = e^{l_1 - l} o_1 + e^{l_2 - l} o_2``, exactly dense attention once all blocks are in. The
backward pass sends the blocks around again with their gradient accumulators, which arrive back
at their owner after a full turn.

**Causal load balance.** Cut naively, rank 0's queries see one block and rank ``N - 1``'s see
all of them. The sequence is cut into ``2N`` chunks and rank ``r`` takes chunks ``r`` and
``2N - 1 - r`` (one early, one late), so every rank does the same work at every step.

PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` implements this over NCCL
only; this module is the CPU (gloo) implementation the course teaches with, checked against
dense attention, and plugs into a transformers model as an attention implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recipes_lib.architectures import padding_mask_only
from recipes_lib.max_context import max_seq_len
from recipes_lib.memory import measure_memory
from recipes_lib.model import small_llama
from recipes_lib.numerics import collect_gradients, max_abs_diff

ATTN_NAME = "ring_attention"


@dataclass
class RingStats:
    """Bytes this rank sent around the ring (forward and backward), for the calculator check.

    Attributes:
        forward_bytes: sent in forward passes.
        backward_bytes: sent in backward passes.
    """

    forward_bytes: int = 0
    backward_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def check_split(seq_len: int, world_size: int) -> int:
    """The chunk length: ``seq_len`` cut into ``2 * world_size`` equal chunks.

    Args:
        seq_len: tokens per sequence, over all ranks.
        world_size: ranks sharing the sequence.

    Returns:
        Tokens per chunk; each rank holds two chunks (load-balanced causal attention).

    Raises:
        ValueError: for fewer than 2 ranks, or a length the ``2N`` chunks do not divide.

    Example:
        >>> check_split(4096, 4)
        512
    """
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size={world_size!r}: context parallelism splits the sequence "
                         "over at least 2 ranks (launch with world_size >= 2)")
    if not isinstance(seq_len, int) or seq_len < 1 or seq_len % (2 * world_size):
        raise ValueError(f"seq_len={seq_len!r}: must be a multiple of 2 x world_size = "
                         f"{2 * world_size} (two equal chunks per rank, for causal load balance)")
    return seq_len // (2 * world_size)


def chunk_ids(rank: int, world_size: int) -> tuple[int, int]:
    """The two chunks rank ``rank`` holds: one from each end of the sequence.

    Args:
        rank: this rank.
        world_size: ranks sharing the sequence (``N``; ``2N`` chunks).

    Returns:
        ``(rank, 2N - 1 - rank)``.

    Example:
        >>> chunk_ids(0, 4)
        (0, 7)
    """
    return rank, 2 * world_size - 1 - rank


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim``: chunks ``r`` and ``2N - 1 - r`` of ``2N``.

    Args:
        x: the full sequence's tensor.
        rank: this rank (``r``).
        world_size: ranks sharing the sequence (``N``).
        dim: the sequence dimension.

    Returns:
        The two chunks, concatenated along ``dim``.

    Example:
        >>> shard(torch.arange(8)[None], 0, 2).tolist()
        [[0, 1, 6, 7]]
    """
    check_split(x.shape[dim], world_size)
    chunks = x.chunk(2 * world_size, dim=dim)
    a, b = chunk_ids(rank, world_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's :func:`shard` (rank order), the inverse of it.

    Args:
        parts: each rank's shard, in rank order.
        dim: the sequence dimension.

    Returns:
        The full sequence's tensor.

    Example:
        >>> x = torch.arange(8)[None]
        >>> unshard([shard(x, r, 2) for r in range(2)]).tolist()
        [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    world_size = len(parts)
    chunks: list[Any] = [None] * (2 * world_size)
    for r, part in enumerate(parts):
        a, b = chunk_ids(r, world_size)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _expand_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _fold_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Sum the gradients of the query heads that share a key/value head (grouped-query)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n_rep, n_rep, s, d).sum(2)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query block ``q`` over one key/value block: (output, log-sum-exp per query).

    With ``kernel`` (default: on CPU) PyTorch's fused CPU flash kernel returns both in O(block)
    memory; otherwise the scores are written out: the readable reference (on GPUs PyTorch's own
    ``context_parallel`` is the path).

    Args:
        q: the query block, (batch, heads, tokens, head_dim).
        k: the key block (heads repeated to match ``q``).
        v: the value block, as ``k``.
        causal: the diagonal block (causal mask inside) rather than a block wholly in the past.
        scale: the scores' scale.
        kernel: use the fused CPU kernel (None: on a CPU).

    Returns:
        ``(output, lse)``: the block's output and its fp32 log-sum-exp per query.
    """
    if (q.device.type == "cpu") if kernel is None else kernel:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1),
                                    float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *merged* output and log-sum-exp of its queries.

    With ``P = exp(S - lse)`` (the block's share of the full softmax) and
    ``D = rowsum(dout * out)``: ``dV = P^T dout``, ``dS = P (dout V^T - D)``,
    ``dQ = dS K * scale``, ``dK = dS^T Q * scale``; summed over blocks, the dense gradients.
    ``kernel`` as in :func:`block_forward`.

    Args:
        dout: the gradient of the merged output.
        q: the query block.
        k: the key block.
        v: the value block.
        out: the merged output of the queries.
        lse: their merged log-sum-exp.
        causal: as in :func:`block_forward`.
        scale: the scores' scale.
        kernel: as in :func:`block_forward`.

    Returns:
        ``(dq, dk, dv)`` of this block.
    """
    if (q.device.type == "cpu") if kernel is None else kernel:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1),
                                    float("-inf"))
    p = torch.exp(scores - lse[..., None])
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of a block's (out, lse) into the running (out, lse)."""
    if acc is None:
        return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out, lse
    o, l_acc = acc
    new = torch.logaddexp(l_acc, lse)
    return (o * torch.exp(l_acc - new)[..., None] + out * torch.exp(lse - new)[..., None], new)


def _pairs(rank: int, src: int, world_size: int) -> list[tuple[int, int, bool]]:
    """Which (query half, key half) pairs of ranks ``rank`` and ``src`` interact: causal on the
    diagonal chunk, full when the key chunk comes earlier, none when it comes later."""
    out = []
    for qi, qc in enumerate(chunk_ids(rank, world_size)):
        for ki, kc in enumerate(chunk_ids(src, world_size)):
            if kc <= qc:
                out.append((qi, ki, kc == qc))
    return out


class _Ring:
    """One hop around the ring, started before the local block is computed (overlap)."""

    def __init__(self, tensor: torch.Tensor, group: Any):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.buffer = torch.empty_like(tensor)
        nxt = dist.get_global_rank(group, (rank + 1) % world_size) if group else \
            (rank + 1) % world_size
        prv = dist.get_global_rank(group, (rank - 1) % world_size) if group else \
            (rank - 1) % world_size
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor.contiguous(), nxt, group),
            dist.P2POp(dist.irecv, self.buffer, prv, group)])

    def wait(self) -> torch.Tensor:
        for req in self.requests:
            req.wait()
        return self.buffer


class RingAttention(torch.autograd.Function):
    """Causal ring attention over the load-balanced shards of every rank of ``group``.

    Called as ``RingAttention.apply(q, k, v, scale, group, stats)``; returns this rank's output.

    Args:
        q: this rank's queries (``shard``'s layout), (batch, heads, tokens, head_dim).
        k: its keys (fewer heads with GQA).
        v: its values, as ``k``.
        scale: the scores' scale.
        group: the process group (None: the default one).
        stats: a :class:`RingStats` counting the bytes sent, or None.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, group, stats):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        n_rep = q.shape[1] // k.shape[1]
        qs = q.chunk(2, dim=2)
        acc: list[Any] = [None, None]
        kv = torch.stack([k, v])
        for step in range(world_size):
            src = (rank - step) % world_size
            hop = _Ring(kv, group) if step < world_size - 1 else None
            if hop is not None and stats is not None:
                stats.forward_bytes += kv.numel() * kv.element_size()
            ks, vs = (_expand_heads(t, n_rep).chunk(2, dim=2) for t in kv)
            for qi, ki, causal in _pairs(rank, src, world_size):
                acc[qi] = _merge(acc[qi], *block_forward(qs[qi], ks[ki], vs[ki], causal, scale))
            if hop is not None:
                kv = hop.wait()
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
        lse = torch.cat([a[1] for a in acc], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group, ctx.stats = scale, group, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, stats, scale = ctx.group, ctx.stats, ctx.scale
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        n_rep = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        qs, outs, lses, douts = (t.chunk(2, dim=2) for t in (q, out, lse, dout))
        dq = [torch.zeros_like(h) for h in qs]
        # the travelling block: its keys and values, and the gradients accumulated for them
        travel = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for step in range(world_size):
            src = (rank - step) % world_size
            kk, vv = (_expand_heads(t, n_rep) for t in travel[:2])
            ks, vs = kk.chunk(2, dim=2), vv.chunk(2, dim=2)
            dk = torch.zeros_like(kk)
            dv = torch.zeros_like(vv)
            dks, dvs = dk.chunk(2, dim=2), dv.chunk(2, dim=2)
            for qi, ki, causal in _pairs(rank, src, world_size):
                gq, gk, gv = block_backward(douts[qi], qs[qi], ks[ki], vs[ki], outs[qi],
                                            lses[qi], causal, scale)
                dq[qi] += gq
                dks[ki].add_(gk)
                dvs[ki].add_(gv)
            travel[2] += _fold_heads(dk, n_rep)
            travel[3] += _fold_heads(dv, n_rep)
            # pass everything on; after the last step only the gradients still have to travel
            send = travel if step < world_size - 1 else travel[2:]
            if stats is not None:
                stats.backward_bytes += send.numel() * send.element_size()
            received = _Ring(send, group).wait()
            if step < world_size - 1:
                travel = received
            else:
                dk_own, dv_own = received  # this rank's keys' gradients, back from a full turn
        return torch.cat(dq, dim=2), dk_own, dv_own, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   group: Any = None, stats: RingStats | None = None) -> torch.Tensor:
    """Causal attention over a sequence split across the ranks of ``group``.

    Args:
        q: this rank's queries, ``(batch, heads, s / N, head_dim)``, tokens as :func:`shard`
            lays them out.
        k, v: this rank's keys and values, ``(batch, kv_heads, s / N, head_dim)`` (grouped-query
            heads travel unexpanded).
        scale: softmax scale (default ``head_dim ** -0.5``).
        group: the process group (default: every rank).
        stats: counts the bytes this rank sends.

    Returns:
        This rank's attention output, ``(batch, heads, s / N, head_dim)``: equal to the dense
        causal attention's output at these tokens.

    Raises:
        ValueError: outside a process group, with one rank, or for shapes that do not match.

    Example:
        >>> q_r, k_r, v_r = (shard(t, r, n, 2) for t in (q, k, v))  # doctest: +SKIP
        >>> out = ring_attention(q_r, k_r, v_r)  # doctest: +SKIP
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ring_attention: needs a process group (start the ranks with "
                         "distributed.launch or torchrun)")
    world_size = dist.get_world_size(group)
    check_split(q.shape[2] * world_size, world_size)
    if q.shape[2] % 2 or k.shape != v.shape or k.shape[2] != q.shape[2] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "(batch, heads, tokens, head_dim) with an even number of local tokens, "
                         "k and v alike, and heads a multiple of kv_heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, scale, group, stats)


def register_with_transformers(stats: RingStats | None = None, group: Any = None) -> str:
    """Register ring attention as a transformers attention implementation; returns its name.

    The model then runs on this rank's shard of the tokens (``input_ids`` and ``position_ids``
    from :func:`shard`; RoPE reads the global positions), with no attention mask: the ring
    knows which chunks are causal. Use ``model.set_attn_implementation(name)``.

    Args:
        stats: counts the bytes sent (None: not counted).
        group: the process group (None: the default one).

    Returns:
        The implementation's name.

    Raises:
        ValueError: (from the registered function) for a padded batch.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask: ring attention takes whole, unpadded sequences "
                             "(each rank holds a shard of every one); padding is not supported")
        out = ring_attention(query, key, value, scaling, group, stats)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTN_NAME, attention)
    AttentionMaskInterface.register(ATTN_NAME, padding_mask_only)  # so padding is seen
    return ATTN_NAME


# ---- on every rank, under distributed.launch ---------------------------------------------------

def check_against_dense(seq_len: int = 256, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                        dtypes: tuple[str, ...] = ("float64", "float32"), seed: int = 0
                        ) -> dict[str, dict[str, float]]:
    """Ring attention's output and gradients against dense causal SDPA on the full sequence.

    Every rank draws the same full ``q, k, v`` (seeded), runs the ring on its shard, and
    compares its share of the output and of the gradients with the dense reference's.

    Args:
        seq_len: tokens of the full sequence.
        heads: query heads.
        kv_heads: key/value heads.
        head_dim: width of each head.
        dtypes: the dtypes compared in.
        seed: for ``q, k, v``.

    Returns:
        dtype -> ``{"output": max abs error, "grad": max abs error over dq, dk, dv}``
        on this rank.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_split(seq_len, world_size)
    out: dict[str, dict[str, float]] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, heads, seq_len, head_dim, generator=g, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, seq_len, head_dim, generator=g, dtype=dtype,
                            requires_grad=True) for _ in range(2))
        dout = torch.randn(1, heads, seq_len, head_dim, generator=g, dtype=dtype)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
        local = [shard(t.detach(), rank, world_size, 2).requires_grad_() for t in (q, k, v)]
        ring = ring_attention(*local)
        grads = torch.autograd.grad(ring, local, shard(dout, rank, world_size, 2))
        # dK and dV of this rank's keys are complete here (every query's share came around)
        out[name] = {
            "output": float((ring.detach() - shard(ref.detach(), rank, world_size, 2)).abs().max()),
            "grad": max(float((a - shard(b, rank, world_size, 2)).abs().max())
                        for a, b in zip(grads, ref_grads, strict=True))}
    return out


def _shifted_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets aligned with the inputs (the last position has none): the shift is
    done on the full sequence, before sharding, so no rank needs its neighbour's first token."""
    return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), -100)], dim=1)


def training_step(model: torch.nn.Module, ids: torch.Tensor, parallel: bool) -> torch.Tensor:
    """Forward and backward of one sequence; with ``parallel`` on this rank's shard through the
    ring (gradients all-reduced, as the replicated parameters need), else whole on this rank.

    Args:
        model: the model, its attention registered as the ring's when ``parallel``.
        ids: the whole sequence, (1, seq_len).
        parallel: run through the ring.

    Returns:
        The mean next-token loss over the whole sequence (detached).
    """
    targets = _shifted_targets(ids)
    n_targets = int((targets != -100).sum())
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    if parallel:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        ids, targets, positions = (shard(t, rank, world_size) for t in (ids, targets, positions))
        model.set_attn_implementation(ATTN_NAME)
    else:
        model.set_attn_implementation("sdpa")
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                 ignore_index=-100, reduction="sum")
    (loss_sum / n_targets).backward()
    loss = loss_sum.detach() / n_targets
    if parallel:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        dist.all_reduce(loss)
    return loss


def compare_with_one_rank(seq_len: int = 1024, budget_mib: float = 48.0,
                          search_limit: int = 16384, hidden_size: int = 64,
                          num_hidden_layers: int = 2, vocab_size: int = 512, seed: int = 0
                          ) -> dict[str, Any]:
    """A small Llama trained with context parallelism over every rank vs on one rank alone.

    On every rank (the ranks stay in step; each also runs the one-rank reference itself):

    - **equality**: loss and gradients of one step at ``seq_len`` tokens, ring vs whole (fp32);
    - **memory**: the memory meter's per-rank peak and activation bytes of that step, both ways;
    - **communication**: bytes this rank sent around the ring, to set beside
      ``calc.ring_attention_bytes``;
    - **longest sequence** whose per-rank peak fits ``budget_mib``, both ways: doubling from
      ``seq_len``, then bisecting to a multiple of ``16 x world size`` tokens
      (``max_context.max_seq_len``; a lower bound when it reaches ``search_limit``).

    Args:
        seq_len: tokens of the equality, memory and communication checks.
        budget_mib: the per-rank memory the longest-sequence search fits.
        search_limit: the longest sequence it tries.
        hidden_size: the model's width.
        num_hidden_layers: its depth.
        vocab_size: its vocabulary.
        seed: for the model and the tokens.

    Returns:
        This rank's figures: losses and gradient difference, peaks and activation bytes both
        ways, bytes sent, and the longest sequence both ways.

    Raises:
        ValueError: for one rank, or a ``seq_len`` / ``search_limit`` the ``2N`` chunks do not
            divide.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_split(seq_len, world_size)
    check_split(search_limit, world_size)
    stats = RingStats()
    register_with_transformers(stats)
    model = small_llama(None, max_positions=search_limit, vocab_size=vocab_size,
                        hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, seed=seed)

    def batch(n: int) -> torch.Tensor:
        return torch.randint(3, vocab_size, (1, n), generator=torch.Generator().manual_seed(n))

    def step_grads(parallel: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = float(training_step(model, batch(seq_len), parallel))
        grads = collect_gradients(model)
        model.zero_grad(set_to_none=True)
        return loss, grads

    loss_one, grads_one = step_grads(False)
    stats.forward_bytes = stats.backward_bytes = 0
    loss_ring, grads_ring = step_grads(True)
    sent = {"forward": stats.forward_bytes, "backward": stats.backward_bytes}

    def peak(n: int, parallel: bool) -> tuple[int, int]:
        report = measure_memory(lambda: training_step(model, batch(n), parallel), model)
        model.zero_grad(set_to_none=True)
        worst = torch.tensor([report.peak_bytes, report.activation_bytes], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        return int(worst[0]), int(worst[1])

    def longest(parallel: bool) -> dict[str, Any]:
        found = max_seq_len(lambda n: peak(n, parallel)[0], budget_mib * 2**20, start=seq_len,
                            limit=search_limit, multiple_of=16 * world_size)
        return {"max_seq_len": found["seq_len"], "at_limit": found["seq_len"] >= search_limit,
                "probes": len(found["probes"])}

    one_peak, one_act = peak(seq_len, False)
    ring_peak, ring_act = peak(seq_len, True)
    return {
        "rank": rank, "world_size": world_size, "seq_len": seq_len,
        "loss_one_rank": loss_one, "loss_ring": loss_ring,
        "loss_abs_diff": abs(loss_ring - loss_one),
        "grad_max_abs_diff": max_abs_diff(grads_ring, grads_one),
        "peak_bytes": {"one rank": one_peak, "ring": ring_peak},
        "activation_bytes": {"one rank": one_act, "ring": ring_act},
        "sent_bytes": sent,
        "config": {"vocab_size": vocab_size, "hidden_size": hidden_size,
                   "intermediate_size": 3 * hidden_size, "num_hidden_layers": num_hidden_layers,
                   "num_attention_heads": model.config.num_attention_heads,
                   "num_key_value_heads": model.config.num_key_value_heads},
        "longest": {"one rank": longest(False), "ring": longest(True)},
    }


def summarize(attention: list[dict[str, dict[str, float]]], model: dict[str, Any],
              predicted_bytes: int) -> dict[str, Any]:
    """The figures of one launch of :func:`check_against_dense` and :func:`compare_with_one_rank`.

    Args:
        attention: every rank's :func:`check_against_dense` result.
        model: rank 0's :func:`compare_with_one_rank` result.
        predicted_bytes: ``calc.ring_attention_bytes(...)["total"]`` for the same model and length.

    Returns:
        ``max_error`` per dtype (worst over ranks, output and gradients), ``activation_ratio``
        (ring / one rank), ``max_seq_gain``, ``traffic_ratio`` (sent / predicted), ``errors``
        (rank -> "dtype what" -> error) and ``table`` (per-rank peak, activations and longest
        sequence, one rank vs the ring).
    """
    errors = {f"rank {r}": {f"{dt} {what}": e[dt][what] for dt in e for what in e[dt]}
              for r, e in enumerate(attention)}
    ring = f"ring, {model['world_size']} ranks"
    return {
        "max_error": {dt: max(e[dt][w] for e in attention for w in e[dt]) for dt in attention[0]},
        "activation_ratio": (model["activation_bytes"]["ring"]
                             / model["activation_bytes"]["one rank"]),
        "max_seq_gain": (model["longest"]["ring"]["max_seq_len"]
                         / model["longest"]["one rank"]["max_seq_len"]),
        "traffic_ratio": sum(model["sent_bytes"].values()) / predicted_bytes,
        "errors": errors,
        "table": {name: {f"peak MiB/rank, s={model['seq_len']}": model["peak_bytes"][key] / 2**20,
                         "activations MiB/rank": model["activation_bytes"][key] / 2**20,
                         "longest sequence": model["longest"][key]["max_seq_len"]}
                  for name, key in (("one rank", "one rank"), (ring, "ring"))},
    }


def check_torch_context_parallel(seq_len: int = 4096, heads: int = 8, head_dim: int = 64,
                                 seed: int = 0) -> dict[str, float]:
    """PyTorch's own ``context_parallel`` (NCCL, one GPU per rank) against dense SDPA, forward.

    The GPU path of the recipe: inside the context manager SDPA runs as ring attention over the
    load-balanced shards PyTorch makes of the buffers, in place. Not run on CPU ranks (gloo):
    PyTorch implements it on NCCL only.

    Args:
        seq_len: tokens of the full sequence.
        heads: attention heads.
        head_dim: width of each head.
        seed: for ``q, k, v``.

    Returns:
        ``{"output": max abs error of this rank's shard}`` (bf16).

    Raises:
        ValueError: without CUDA and NCCL.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    if not torch.cuda.is_available() or dist.get_backend() != "nccl":
        raise ValueError("check_torch_context_parallel: PyTorch's context_parallel needs NCCL "
                         "ranks on CUDA GPUs (distributed.launch(..., backend='nccl'))")
    world_size = dist.get_world_size()
    check_split(seq_len, world_size)
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device).manual_seed(seed)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, generator=g, device=device,
                           dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    mesh = init_device_mesh("cuda", (world_size,))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    (full,) = context_parallel_unshard(mesh, [out], [2])
    return {"output": float((full.float() - ref.float()).abs().max())}
