"""What the ranks of the test pool run for tests/test_sequence_parallel.py: one model three ways
on the same batch, every rank's result compared with the same slice of one process's.

    alone   the whole model, the whole sequence, in one process (every rank, for the reference)
    ours    miniddp.tensor_parallel with sequence_parallel=True: each rank gets its positions
            torch.chunk(x, W, 1)[rank] and returns the same positions of the output
    torch   torch's SequenceParallel, ColwiseParallel(input_layouts=Shard(1)) and
            RowwiseParallel(output_layouts=Shard(1)), on a 1-D CPU DeviceMesh

The loss is split as the sequence is: each rank's is the sum of its positions' squared errors
over the whole batch's count, so the ranks' losses add up to one process's mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miniddp import tensor_parallel as tp
from miniddp.instruments.activation_memory import SavedActivations
from tests.tensor_parallel_tasks import local, local_grad, scaled_difference, shard_dim, torch_mesh


@dataclass(frozen=True)
class SPSpec:
    model: str = "norm_mlp"  # or "rms_norm_mlp" (Llama's norm), "block"
    width: int = 8
    heads: int = 4
    batch: int = 2
    length: int = 8  # S: a multiple of W
    bias: bool = True
    fused_qkv: bool = False
    seed: int = 0


def build(spec: SPSpec) -> nn.Module:
    torch.manual_seed(spec.seed)
    if spec.model in ("norm_mlp", "rms_norm_mlp"):
        norm = nn.LayerNorm(spec.width) if spec.model == "norm_mlp" else nn.RMSNorm(spec.width)
        if isinstance(norm, nn.RMSNorm):
            nn.init.normal_(norm.weight, 1.0, 0.1)  # not all ones: a wrong gradient shows
        return nn.Sequential(norm, tp.MLP(spec.width, 4 * spec.width, spec.bias))
    return tp.TransformerBlock(spec.width, spec.heads, spec.bias, spec.fused_qkv)


def our_plan(model: nn.Module) -> dict:
    if isinstance(model, nn.Sequential):
        return {"0": tp.SequenceParallel()} | tp.plan_for(model[1], "1", sequence_parallel=True)
    return tp.plan_for(model, sequence_parallel=True)


def torch_plan(model: nn.Module) -> dict:
    """Our plan in torch's styles: SequenceParallel as it is, colwise taking Shard(1), rowwise
    giving Shard(1)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as torch_tp

    plan = {}
    for name, style in our_plan(model).items():
        if isinstance(style, tp.SequenceParallel):
            plan[name] = torch_tp.SequenceParallel()
        elif isinstance(style, tp.ColwiseParallel):
            plan[name] = torch_tp.ColwiseParallel(input_layouts=Shard(1))
        else:
            plan[name] = torch_tp.RowwiseParallel(output_layouts=Shard(1))
    return plan


def mine(t: torch.Tensor) -> torch.Tensor:
    return torch.chunk(t, dist.get_world_size(), 1)[dist.get_rank()]


def run(spec: SPSpec, kind: str) -> dict:
    model = build(spec)
    g = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, spec.length, spec.width, generator=g)
    y = torch.randn(spec.batch, spec.length, spec.width, generator=g)
    if kind == "ours":
        tp.parallelize_module(model, None, our_plan(model))
    elif kind == "torch":
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, torch_mesh(), torch_plan(model))
    if kind != "alone":
        x, y = mine(x), mine(y)
    x.requires_grad_()
    out = local(model(x))
    loss = ((out - y) ** 2).sum() / (spec.batch * spec.length * spec.width)
    loss.backward()
    grads = {n: local_grad(p).clone() for n, p in model.named_parameters()}
    return {"model": model, "out": out.detach(), "dx": x.grad, "grads": grads}


def differences(spec: SPSpec, kinds: tuple[str, ...] = ("ours", "torch")) -> dict:
    """Per kind: the largest scaled difference from one process's slice (output, input gradient,
    every parameter's gradient chunk); and the shapes of our parameters."""
    alone = run(spec, "alone")
    runs = {kind: run(spec, kind) for kind in kinds}
    ours = runs["ours"]["model"]
    report = {}
    for kind, result in runs.items():
        worst = {
            "out": scaled_difference(result["out"], mine(alone["out"])),
            "dx": scaled_difference(result["dx"], mine(alone["dx"])),
        }
        for name, grad in result["grads"].items():
            reference = alone["grads"][name]
            dim = shard_dim(ours, name)
            if dim is not None:
                reference = torch.chunk(reference, dist.get_world_size(), dim)[dist.get_rank()]
            worst[name] = scaled_difference(grad, reference)
        report[kind] = worst
    report["shapes"] = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    plain = build(spec)
    plain_plan = {n: type(s)() for n, s in our_plan(plain).items()}  # the same styles, no SP
    tp.parallelize_module(plain, None, plain_plan)
    report["plain TP shapes"] = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    return report


def without_f_on_replicated_parameters(spec: SPSpec) -> dict:
    """The planted bug: LayerNorm's parameters and the rowwise bias used without f, so their
    gradients are each rank's positions' only."""
    from unittest import mock

    from miniddp.tensor_parallel import layers

    with mock.patch.object(layers, "copy_to_tensor_parallel", lambda tensor, group: tensor):
        return differences(spec, kinds=("ours",))


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """The bytes autograd keeps for backward from `module`'s forward (distinct storages, the
    weights left out: miniddp/instruments/activation_memory.py)."""
    with SavedActivations(module) as saved:
        module(x)
    return saved.total


def norm_and_dropout_memory(width: int, length: int) -> dict[str, int]:
    """What a LayerNorm then a Dropout keep for backward: on all S positions (plain TP, every
    rank) and on this rank's S/W (sequence parallel)."""
    torch.manual_seed(dist.get_rank())  # a different dropout mask on each rank's positions
    norm_dropout = nn.Sequential(nn.LayerNorm(width), nn.Dropout(0.1))
    x = torch.randn(4, length, width, requires_grad=True)
    whole = saved_bytes(norm_dropout, x)
    tp.parallelize_module(
        norm_dropout, None, {"0": tp.SequenceParallel(), "1": tp.SequenceParallel()}
    )
    positions = mine(x).detach().clone().requires_grad_()  # its own storage, not a view of x
    return {"plain": whole, "sequence parallel": saved_bytes(norm_dropout, positions)}


def uneven_sequence(spec: SPSpec) -> str:
    """What our sequence parallelism says when W does not divide S (torch.chunk then leaves the
    last rank fewer positions), or 'accepted'."""
    try:
        run(spec, "ours")
    except ValueError as error:
        return str(error)
    return "accepted"
