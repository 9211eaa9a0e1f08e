"""Ring attention: exact attention over a sequence split across W ranks, K/V passed round a ring.

Each rank holds its S/W queries, keys and values (sequence.py's layout). Its output rows need
every key, so the K/V blocks travel: at step i rank r holds the block of rank r-i, computes its
queries against it while the next block is already on its way from the left neighbour, and
after W steps has seen them all. Nothing of size S x S, or even S x S/W, is ever held.

The merge: attention of query q over keys split into blocks b is

    out = sum_b sum_{j in b} exp(s_j) v_j / Z,     s_j = scale q.k_j,    Z = sum_b Z_b

with Z_b = sum_{j in b} exp(s_j). Each block alone gives out_b = (sum_{j in b} exp(s_j) v_j)/Z_b
and its log-sum-exp lse_b = log Z_b (the device's flash kernel returns both: kernels.py). Then

    lse = log(Z_1 + Z_2) = logaddexp(lse_1, lse_2)
    out = (Z_1 out_1 + Z_2 out_2) / Z = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

so blocks merge two at a time, in any order, never leaving log space (exp(lse_b - lse) <= 1:
no overflow). Adding out_1 + out_2 without the weights is the classic mistake: each was
normalised by its own Z_b (tutorials/exercises/ has the merge to write).

The backward is the same ring with the global lse and out saved (FlashAttention-2's trick): the
softmax of block b is exact alone, P_b = exp(scale q K_b^T - lse), so the block's gradients

    dV_b = P_b^T dO,   dS = P_b * (dO V_b^T - rowsum(dO * out)),
    dQ  += scale dS K_b,   dK_b = scale dS^T Q

come from the flash kernel's backward given (out, lse). dQ stays home; dK_b and dV_b belong to
the rank that owns block b, so they travel after it round the ring, each rank adding its part,
and a last hop brings them home.

The causal mask uses global positions: with chunks of equal size, query chunk a against key
chunk b is whole (a > b), causal within the block (a = b, the diagonal), or skipped (a < b).
A rank counts what it computes (`count_blocks`): plain, rank r computes r + 1 of its W chunk
pairs (one diagonal), the others waiting for the last; load-balanced, every rank 2W + 1 of its
4W (two diagonal: 2W pairs' worth of scores), in step calls shaped as torch's ring's.

The bytes, per rank per call (B = 1; multiply by the batch):

    forward    (W-1) · 2 · S/W · H · D · itemsize    K and V, W-1 hops (and one number a hop,
                                                     the block owner's is_causal and
                                                     load_balance, which every rank checks)
    backward   twice that                            K and V again, then dK and dV: W-1 hops
                                                     from the first rank that adds to them
                                                     (the owner's right neighbour) back home

against an all-gather of K/V, the same bytes forward but all S keys held at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from miniddp.collectives.comm_thread import Work, submit
from miniddp.collectives.peers import Peers
from miniddp.context_parallel.kernels import kernel_for
from miniddp.context_parallel.sequence import chunks_of, group_size_and_rank
from miniddp.job.agree import gather_rows
from miniddp.job.faults import wait_for


@dataclass(frozen=True)
class Block:
    """One kernel call of one step: query slot `q` against key slots [k_start, k_stop) of the
    block held (slots: the chunks in a rank's local order), causal on the diagonal."""

    q: int
    k_start: int
    k_stop: int
    causal: bool

    @property
    def pairs(self) -> int:
        return self.k_stop - self.k_start


def step_blocks(
    rank: int, world_size: int, step: int, is_causal: bool, load_balance: bool
) -> list[Block]:
    """What rank `rank` computes at ring step `step`, holding the K/V of rank `rank - step`."""
    queries = chunks_of(rank, world_size, load_balance)
    keys = chunks_of((rank - step) % world_size, world_size, load_balance)
    blocks = []
    for slot, a in enumerate(queries):
        whole = [j for j, b in enumerate(keys) if not is_causal or b < a]
        if whole:  # contiguous: at most two slots, and b < a keeps a prefix or a suffix
            blocks.append(Block(slot, whole[0], whole[-1] + 1, causal=False))
        blocks += [Block(slot, j, j + 1, True) for j, b in enumerate(keys) if is_causal and b == a]
    return blocks


@dataclass(frozen=True)
class RingStats:
    """What one rank computed in one ring_attention forward, in chunk pairs (S/W x S/W plain,
    S/2W x S/2W load-balanced) and in query-key scores that count (masked ones left out)."""

    rank: int
    world_size: int
    load_balance: bool
    is_causal: bool
    blocks: int  # chunk pairs computed (a diagonal one counts one)
    skipped: int  # chunk pairs wholly above the diagonal, never computed
    scores: int  # q.k products kept by the mask, over B x H


def stats_for(
    rank: int, world_size: int, is_causal: bool, load_balance: bool, chunk: int = 1, bh: int = 1
) -> RingStats:
    """The counts for one rank, from the plan alone (no process group needed: the figure and the
    chapter draw every rank's)."""
    blocks = diagonal = 0
    for step in range(world_size):
        for block in step_blocks(rank, world_size, step, is_causal, load_balance):
            blocks += block.pairs
            diagonal += block.causal
    total = len(chunks_of(rank, world_size, load_balance)) ** 2 * world_size
    full = blocks - diagonal
    scores = bh * (full * chunk * chunk + diagonal * chunk * (chunk + 1) // 2)
    return RingStats(rank, world_size, load_balance, is_causal, blocks, total - blocks, scores)


def ring_bytes(
    sequence: int, kv_heads: int, head_dim: int, world_size: int, itemsize: int, batch: int = 1
) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends in one ring_attention call (the module
    docstring): K and V, S/W positions each, W-1 hops forward, each hop with one number more
    (its sender's is_causal and load_balance, which every rank checks); backward twice the
    K and V."""
    kv = (world_size - 1) * 2 * sequence // world_size * kv_heads * head_dim * itemsize * batch
    return kv + (world_size - 1) * itemsize, 2 * kv


def ring_seconds(world_size: int, block_s: float, hop_s: float) -> tuple[float, float]:
    """(ring, all-gather) seconds of one forward, with t = `block_s` a block's compute and
    m = `hop_s` a hop's transfer (chapter 15b's model): the ring sends step i + 1's block
    during step i's compute, (W-1)·max(t, m) + t; all-gathering K/V first, (W-1)·m + W·t."""
    w, t, m = world_size, block_s, hop_s
    return (w - 1) * max(t, m) + t, (w - 1) * m + w * t


_recorded: list[RingStats] | None = None


@contextmanager
def count_blocks() -> Iterator[list[RingStats]]:
    """Record a RingStats for every ring_attention forward run inside the block."""
    global _recorded
    previous, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = previous


def _post(peers: Peers, step: int, sends: list, receives: list) -> Work:
    """One ring step's messages, on MiniDDP's communication thread (so they keep their place
    among this process's other collectives): sends go right, receives come from the left."""
    right, left = (peers.rank + 1) % peers.size, (peers.rank - 1) % peers.size
    send = [(right, buffer, what) for buffer, what in sends]
    receive = [(left, buffer) for buffer in receives]
    return submit(lambda: peers.exchange(step, send, receive), [], async_op=True)


def _rows(t: torch.Tensor, chunk: int, start: int, stop: int) -> torch.Tensor:
    return t[:, :, start * chunk : stop * chunk]


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp merge of the module docstring: (out, lse) so far (None: nothing yet) and
    one more block's, for the same queries; lse has out's shape without the last dim."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    weight, block_weight = (lse - merged).exp(), (block_lse - merged).exp()
    return weight.unsqueeze(-1) * out + block_weight.unsqueeze(-1) * block_out, merged


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, group, is_causal: bool, load_balance: bool, scale):
        peers = Peers(group, "ring_attention/forward")
        rank, size = peers.rank, peers.size
        slots = len(chunks_of(rank, size, load_balance))
        chunk = q.shape[2] // slots
        merge_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        # The block carries its owner's mask settings, one number after K and V (the ring
        # agreement below): every rank sees every block, so every rank sees every setting.
        settings = _settings(is_causal, load_balance)
        kv = torch.cat([k.reshape(-1), v.reshape(-1), q.new_tensor([settings])])
        spare = torch.empty_like(kv)
        kernel = kernel_for(q.device, q.dtype)
        outs: list = [None] * slots
        lses: list = [None] * slots
        held_settings = {}  # the owner's rank in the group -> what it was called with
        for step in range(size):
            source = (rank - step) % size
            work = None
            if step < size - 1:  # the next block travels while this one is computed
                what = f"K/V of rank {peers.global_ranks[source]}"
                work = _post(peers, step + 1, [(kv, what)], [spare])
            held_settings[source] = int(kv[-1].item())
            key = kv[: k.numel()].view(k.shape)
            value = kv[k.numel() : k.numel() + v.numel()].view(v.shape)
            for b in step_blocks(rank, size, step, is_causal, load_balance):
                o, lse = kernel.forward(
                    _rows(q, chunk, b.q, b.q + 1),
                    _rows(key, chunk, b.k_start, b.k_stop),
                    _rows(value, chunk, b.k_start, b.k_stop),
                    b.causal,
                    scale,
                )
                outs[b.q], lses[b.q] = merge(outs[b.q], lses[b.q], o.to(merge_dtype), lse)
            if work is not None:
                left = peers.global_ranks[(rank - 1) % size]
                wait_for(work, f"ring attention step {step + 1}: K/V from rank {left}", group)
                kv, spare = spare, kv
        _refuse_different_settings(held_settings, peers.global_ranks)
        out, lse = torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)
        if _recorded is not None:
            _recorded.append(
                stats_for(rank, size, is_causal, load_balance, chunk, q.shape[0] * q.shape[1])
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, is_causal, load_balance, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, is_causal, load_balance, scale = ctx.args
        peers = Peers(group, "ring_attention/backward")
        rank, size = peers.rank, peers.size
        chunk = q.shape[2] // len(chunks_of(rank, size, load_balance))
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        kernel = kernel_for(q.device, q.dtype)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        spare = torch.empty_like(kv)
        own = partial = None  # this rank's own dK/dV; the travelling one it adds to and sends
        incoming = torch.empty_like(kv)
        left = peers.global_ranks[(rank - 1) % size]
        for step in range(size):
            source = (rank - step) % size
            sends, receives = [], []
            if step < size - 1:
                sends.append((kv, f"K/V of rank {peers.global_ranks[source]}"))
                receives.append(spare)
            if step >= 2:  # the dK/dV of the block the left neighbour computed last step
                sends.append((partial, f"dK/dV of rank {peers.global_ranks[(source + 1) % size]}"))
                receives.append(incoming)
            work = _post(peers, step + 1, sends, receives) if sends else None
            key, value = kv[: k.numel()].view(k.shape), kv[k.numel() :].view(v.shape)
            added = torch.zeros_like(kv)
            dkey, dvalue = added[: k.numel()].view(k.shape), added[k.numel() :].view(v.shape)
            for b in step_blocks(rank, size, step, is_causal, load_balance):
                rows, cols = (b.q, b.q + 1), (b.k_start, b.k_stop)
                dq_b, dk_b, dv_b = kernel.backward(
                    _rows(grad_out, chunk, *rows),
                    _rows(q, chunk, *rows),
                    _rows(key, chunk, *cols),
                    _rows(value, chunk, *cols),
                    _rows(out, chunk, *rows),
                    _rows(lse, chunk, *rows).contiguous(),
                    b.causal,
                    scale,
                )
                _rows(dq, chunk, *rows).add_(dq_b)
                _rows(dkey, chunk, *cols).add_(dk_b)
                _rows(dvalue, chunk, *cols).add_(dv_b)
            if work is not None:
                wait_for(work, f"ring attention backward step {step + 1}: from rank {left}", group)
            if step == 0:
                own = added
            elif step == 1:
                partial = added
            else:
                incoming.add_(added)  # now the block's dK/dV from every rank so far
                partial, incoming = incoming, partial
            if step < size - 1:
                kv, spare = spare, kv
        if size > 1:  # the last hop: each travelling dK/dV reaches its owner, the right neighbour
            what = f"dK/dV of rank {peers.global_ranks[(rank + 1) % size]}"
            work = _post(peers, size + 1, [(partial, what)], [incoming])
            wait_for(work, f"ring attention backward: dK/dV home from rank {left}", group)
            own = own + incoming
        dk, dv = own[: k.numel()].view(k.shape), own[k.numel() :].view(v.shape)
        return dq, dk, dv, None, None, None, None


def _settings(is_causal: bool, load_balance: bool) -> int:
    """The settings every rank of the ring must share, as one small number (exact in any
    floating-point dtype: it travels inside the K/V block)."""
    return int(is_causal) + 2 * int(load_balance)


def _refuse_different_settings(held: dict[int, int], global_ranks: list[int]) -> None:
    """Ring agreement: after a forward every rank has held every rank's block, and with it the
    settings its owner was called with. A rank whose is_causal or load_balance differs from the
    others' computes another attention than theirs, and each rank's output would come back
    finite and wrong; instead every rank raises here, once the ring is done (so none is left
    waiting for a block), naming each rank's settings. Costs no message: it rides on the K/V."""
    if len(set(held.values())) <= 1:
        return
    said = ", ".join(
        f"rank {global_ranks[r]}: is_causal={bool(held[r] & 1)}, load_balance={bool(held[r] & 2)}"
        for r in sorted(held)
    )
    raise ValueError(
        f"ring_attention was called with different settings on the ranks of its group ({said}): "
        "each rank computes its part of one attention, so pass the same is_causal and "
        "load_balance on every rank"
    )


def _check(q, k, v, attn_mask, is_causal: bool, load_balance: bool) -> None:
    """Refuse at once, before any message leaves, what the ranks would get wrong together."""
    if attn_mask is not None and is_causal:
        raise ValueError(
            "ring_attention got is_causal=True and an explicit attn_mask: give one or the other "
            "(as scaled_dot_product_attention requires)"
        )
    if attn_mask is not None:
        raise ValueError(
            "ring_attention takes no explicit attn_mask: its mask is built from global "
            "positions. Use is_causal=True, or scaled_dot_product_attention on the whole sequence"
        )
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(
            f"q, k and v must be [B, H, S/W, D], got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(
            f"q, k and v hold {q.shape[2]}, {k.shape[2]} and {v.shape[2]} positions: give each "
            "this rank's part of the same sequence (shard_sequence(x, dim=2) of each)"
        )
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share B and H, "
            "and q and k their head dimension"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if load_balance and q.shape[2] % 2:
        raise ValueError(
            f"load_balance=True gives each rank two equal chunks, but this rank holds "
            f"{q.shape[2]} positions: the sequence length must be a multiple of 2W. Pad the "
            "sequence, or shard it with shard_sequence(..., load_balance=True)"
        )


def _refuse_what_other_ranks_hold_differently(q, k, v, group) -> None:
    """Each rank's q, k, v can look right alone and still not be parts of one sequence: an S
    that W does not divide, cut with torch.chunk, leaves the last rank fewer positions. The
    ring's messages would then differ in size (gloo aborts one rank, and another returns a
    finite, wrong output), so every rank states its shapes and dtype in one small all-reduce
    (tens of microseconds, beside W - 1 hops of K/V) and all refuse together, naming them."""
    dtype = zlib.crc32(str(q.dtype).encode()) & 0x7FFFFFFF
    mine = [*q.shape, v.shape[3], dtype]
    rows = gather_rows(mine, "ring_attention's check that the ranks' parts match", group, q.device)
    if all(row == rows[0] for row in rows):
        return
    other = next(r for r, row in enumerate(rows) if row != rows[0])
    if rows[other][2] != rows[0][2]:
        raise ValueError(
            f"ring_attention needs S/W positions on every rank of the context-parallel group, "
            f"but rank 0 holds {rows[0][2]} positions and rank {other} holds {rows[other][2]}: "
            "the sequence length S must be a multiple of W (of 2W with load_balance=True). Pad "
            "or trim it, and cut it with shard_sequence(x, dim=2), which refuses an uneven S"
        )
    raise ValueError(
        f"ring_attention needs q, k and v of the same shape and dtype on every rank of the "
        f"context-parallel group, but rank 0's are [B, H, S/W, D] = {rows[0][:4]} (v's D "
        f"{rows[0][4]}) and rank {other}'s {rows[other][:4]} (v's D {rows[other][4]}), or their "
        "dtypes differ: give every rank its part of the same batch, in the same dtype"
    )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    load_balance: bool = False,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's part of F.scaled_dot_product_attention(Q, K, V, is_causal=is_causal) over
    the whole sequence, from this rank's parts q, k, v [B, H, S/W, D] laid out as
    shard_sequence(..., dim=2, load_balance=load_balance) lays them. Differentiable: q.grad,
    k.grad and v.grad are this rank's parts of the whole gradients. `attn_mask` is refused."""
    group_size_and_rank(group)
    _check(q, k, v, attn_mask, is_causal, load_balance)
    _refuse_what_other_ranks_hold_differently(q, k, v, group)
    return _RingAttention.apply(q, k, v, group, is_causal, load_balance, scale)
