"""What the ranks of the test pool run for tests/test_context_parallel.py: the whole sequence's
attention in one process (every rank computes it, for the reference), then the same attention
split over the ranks, by MiniDDP's ring_attention and by torch's private
_templated_ring_attention, each rank's part compared with the reference's slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn import functional as F

from miniddp.collectives import traffic
from miniddp.context_parallel import attention as ring_module
from miniddp.context_parallel import (
    chunks_of,
    count_blocks,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)


@dataclass(frozen=True)
class AttentionSpec:
    batch: int = 2
    heads: int = 3
    length: int = 16  # S, the whole sequence
    head_dim: int = 4
    is_causal: bool = False
    load_balance: bool = False
    dtype: torch.dtype = torch.float64
    seed: int = 0
    scale: float | None = None


def whole(spec: AttentionSpec) -> tuple[torch.Tensor, ...]:
    """Q, K, V and the output's gradient dO, the same on every rank."""
    g = torch.Generator().manual_seed(spec.seed)
    shape = (spec.batch, spec.heads, spec.length, spec.head_dim)
    return tuple(torch.randn(shape, generator=g, dtype=spec.dtype) for _ in range(4))


def one_process(spec: AttentionSpec) -> dict[str, torch.Tensor]:
    q, k, v, grad = (t.clone().requires_grad_(i < 3) for i, t in enumerate(whole(spec)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=spec.is_causal, scale=spec.scale)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def ours(spec: AttentionSpec) -> dict[str, torch.Tensor]:
    parts = [shard_sequence(t, 2, load_balance=spec.load_balance) for t in whole(spec)]
    q, k, v = (t.requires_grad_() for t in parts[:3])
    out = ring_attention(
        q, k, v, is_causal=spec.is_causal, load_balance=spec.load_balance, scale=spec.scale
    )
    out.backward(parts[3])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def torchs(spec: AttentionSpec) -> dict[str, torch.Tensor]:
    """torch's ring on the same parts: its forward and backward templates with the CPU flash
    kernel, as its context_parallel dispatches them (its load balancing is a global option)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    parts = [shard_sequence(t, 2, load_balance=spec.load_balance) for t in whole(spec)]
    q, k, v, grad = parts
    group = dist.group.WORLD
    # Without a mask the order of the keys is immaterial: torch refuses load balancing there,
    # and its plain ring on the balanced parts is the same attention.
    balanced = spec.load_balance and spec.is_causal
    options = cp._cp_options  # and merge in q's dtype, as ours does (its default: float32)
    with (
        mock.patch.object(options, "enable_load_balance", balanced),
        mock.patch.object(options, "convert_to_f32", False),
    ):
        out, lse = cp._templated_ring_attention(
            group,
            2,
            aten._scaled_dot_product_flash_attention_for_cpu,
            q,
            k,
            v,
            is_causal=spec.is_causal,
            dropout_p=0.0,
            scale=spec.scale,
        )[:2]
        dq, dk, dv = cp._templated_ring_attention_backward(
            group,
            2,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
            grad,
            "grad_out",
            q,
            k,
            v,
            out,
            lse,
            spec.is_causal,
            dropout_p=0.0,
            scale=spec.scale,
        )[:3]
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def differences(spec: AttentionSpec, with_torch: bool = False) -> dict[str, dict[str, float]]:
    """Largest |difference| of this rank's parts from the reference's slices: ours, and torch's."""
    reference = {
        name: shard_sequence(t, 2, load_balance=spec.load_balance)
        for name, t in one_process(spec).items()
    }
    runs = {"ours": ours(spec)} | ({"torch": torchs(spec)} if with_torch else {})
    result = {
        kind: {n: float((got[n] - reference[n]).abs().max()) for n in reference}
        for kind, got in runs.items()
    }
    if with_torch:
        result["ours vs torch"] = {
            n: float((runs["ours"][n] - runs["torch"][n]).abs().max()) for n in reference
        }
    return result


def with_a_wrong_causal_offset(spec: AttentionSpec) -> dict[str, dict[str, float]]:
    """The planted bug: the mask built from local positions, as if the block held had this
    rank's own chunks (the offset of the source rank forgotten)."""
    right = ring_module.step_blocks

    def local_positions(rank, world_size, step, is_causal, load_balance):
        return right(rank, world_size, 0, is_causal, load_balance)

    with mock.patch.object(ring_module, "step_blocks", local_positions):
        return differences(spec)


def blocks_and_bytes(spec: AttentionSpec) -> dict[str, object]:
    """The chunk pairs this rank computed, and the bytes it sent forward and backward."""
    parts = [shard_sequence(t, 2, load_balance=spec.load_balance) for t in whole(spec)]
    q, k, v = (t.requires_grad_() for t in parts[:3])
    traffic.reset()
    with count_blocks() as recorded:
        out = ring_attention(q, k, v, is_causal=spec.is_causal, load_balance=spec.load_balance)
    forward = traffic.bytes_sent
    traffic.reset()
    out.backward(parts[3])
    return {"stats": recorded, "forward": forward, "backward": traffic.bytes_sent}


def round_trip(shape: tuple[int, ...], dim: int, load_balance: bool) -> dict[str, object]:
    """shard_sequence against its definition; unshard_sequence back, and its gradient."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(float(torch.Size(shape).numel())).view(shape)
    local = shard_sequence(x, dim, load_balance=load_balance)
    pieces = torch.chunk(x, (2 if load_balance else 1) * world_size, dim)
    expected = torch.cat([pieces[c] for c in chunks_of(rank, world_size, load_balance)], dim)
    leaf = local.clone().requires_grad_()
    back = unshard_sequence(leaf, dim, load_balance=load_balance)
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    (back * weights).sum().backward()
    return {
        "sharded": torch.equal(local, expected),
        "unsharded": torch.equal(back.detach(), x),
        "gradient": torch.equal(leaf.grad, shard_sequence(weights, dim, load_balance=load_balance)),
    }


def refusals() -> dict[str, str]:
    """Each bad input's message, or 'accepted' where one was not refused."""
    q = torch.randn(1, 2, 6, 4)
    odd = torch.randn(1, 2, 3, 4)
    cases = {
        "S not divisible by W": lambda: shard_sequence(torch.randn(1, 2, 5, 4), 2),
        "S not divisible by 2W": lambda: shard_sequence(q, 2, load_balance=True),
        "odd local length": lambda: ring_attention(odd, odd, odd, load_balance=True),
        "different lengths": lambda: ring_attention(q, q[:, :, :4], q),
        "causal and a mask": lambda: ring_attention(
            q, q, q, is_causal=True, attn_mask=torch.ones(6, 6, dtype=torch.bool)
        ),
    }
    alone = dist.new_group([0])  # collective: every rank makes it; only rank 0 is in it
    cases["a group without this rank"] = lambda: ring_attention(q, q, q, group=alone)
    found = {}
    for name, call in cases.items():
        try:
            call()
            found[name] = "accepted"
        except ValueError as error:
            found[name] = str(error)
    return found


def lengths_differ_across_ranks() -> dict[str, object]:
    """Rank r holds 6 - 2r positions (torch.chunk of an S that W does not divide does this):
    what ring_attention said, and the bytes this rank sent before saying it."""
    length = 6 - 2 * dist.get_rank()
    q = torch.randn(1, 2, length, 4, dtype=torch.float64)
    traffic.reset()
    try:
        ring_attention(q, q, q)
        said = "accepted"
    except ValueError as error:
        said = str(error)
    return {"said": said, "bytes": traffic.bytes_sent}


@dataclass(frozen=True)
class GPTRun:
    """A few AdamW steps of a small float64 GPT on a (dp, cp) mesh, against one process on the
    global batch. `averaged_over`: the group DDP averages over, "dp x cp" (right) or "dp" (the
    trap: each CP rank's gradient is only its part)."""

    mesh_shape: tuple[int, int] = (1, 2)  # (dp, cp)
    load_balance: bool = True
    averaged_over: str = "dp x cp"
    steps: int = 3
    batch: int = 2  # windows per DP replica
    length: int = 16  # T, the whole window the CP ranks share


def gpt_and_windows(run: GPTRun) -> tuple[torch.nn.Module, torch.Tensor]:
    from miniddp.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, context=run.length, width=16, layers=2, heads=2, dropout=0)
    model = GPT(config).double()
    dp = run.mesh_shape[0]
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 11, (run.steps, dp * run.batch, run.length + 1), generator=g)
    return model, windows


def one_process_gpt(run: GPTRun) -> dict[str, list]:
    model, windows = gpt_and_windows(run)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step_windows in windows:
        logits = model(step_windows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), step_windows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach() for p in model.parameters()]}


def dp_times_cp_gpt(run: GPTRun) -> dict[str, object]:
    """This rank trains its DP replica's windows, its CP part of each: local tokens, targets and
    their global positions, attention on the ring, MiniDDP over the chosen group. Returns the
    largest differences from one process: the global loss per step, the parameters after."""
    from miniddp import MiniDDP
    from miniddp.context_parallel import positions_of, sdpa_on_the_ring
    from miniddp.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", run.mesh_shape, mesh_dim_names=("dp", "cp"))
    cp, lb = mesh["cp"].get_group(), run.load_balance
    group = None if run.averaged_over == "dp x cp" else mesh["dp"].get_group()
    model, windows = gpt_and_windows(run)
    ddp = MiniDDP(model, process_group=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine = slice(mesh.get_local_rank("dp") * run.batch, (mesh.get_local_rank("dp") + 1) * run.batch)
    positions = positions_of(run.length, cp, lb)
    losses = []
    for step_windows in windows[:, mine]:
        inputs, targets = (
            shard_sequence(t, 1, cp, lb) for t in (step_windows[:, :-1], step_windows[:, 1:])
        )
        with sdpa_on_the_ring(cp, load_balance=lb):
            logits = ddp(inputs, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # this rank's mean
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)  # equal parts: the global mean is the mean of the ranks' means
        losses.append(whole.item() / dist.get_world_size())
    reference = one_process_gpt(run)
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, reference["losses"])),
        "params": max(
            float((p.detach() - q).abs().max())
            for p, q in zip(model.parameters(), reference["params"])
        ),
    }
