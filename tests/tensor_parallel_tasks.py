"""What the ranks of the test pool run for tests/test_tensor_parallel.py: one model trained three
ways on the same global batch, and every difference measured against one process.

    alone   the whole model in one process (every rank computes it, for the reference)
    ours    miniddp.tensor_parallel.parallelize_module, on the default group
    torch   torch.distributed.tensor.parallel.parallelize_module, on a 1-D CPU DeviceMesh

The optimizer is SGD with momentum, not Adam: k's bias has a zero gradient in exact arithmetic
(softmax is unchanged when every key's score moves by the same q.b_k), so its float gradient is
rounding noise, and Adam's first step, about lr * g / |g|, would turn that noise into +-lr.

A rank's shard of a parameter is compared with the same chunk of one process's tensor: the
chunk `ours` keeps (its module type says which dim), and that torch's DTensor keeps (to_local).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from miniddp import tensor_parallel as tp
from miniddp.tensor_parallel import layers
from tests.mesh_tasks import mesh_once

MODELS = ("mlp", "attention", "block", "gpt")
LEARNERS_F_AND_G = "MINIDDP_TP_FG"  # a file with a learner's f and g (tutorials/exercises/)


# Where the layers look f and g up: the one place a learner's code enters.
SEAMS = (
    (layers, "copy_to_tensor_parallel"),
    (layers, "reduce_from_tensor_parallel"),
)


def install_f_and_g(path: str) -> list:
    """Build colwise and rowwise layers with the f and g of the file at `path` (functions named
    as in miniddp/tensor_parallel/layers.py); return what they replaced."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    replaced = [getattr(owner, name) for owner, name in SEAMS]
    for owner, name in SEAMS:
        setattr(owner, name, getattr(module, name))
    return replaced


@contextmanager
def learners_f_and_g(path: str) -> Iterator[None]:
    replaced = install_f_and_g(path)
    try:
        yield
    finally:
        for (owner, name), original in zip(SEAMS, replaced, strict=True):
            setattr(owner, name, original)


if os.environ.get(LEARNERS_F_AND_G):  # the learner's command: every task here uses theirs
    install_f_and_g(os.environ[LEARNERS_F_AND_G])


def with_f_and_g(path: str, task, *args):
    """Run `task(*args)` with the f and g of the file at `path`."""
    with learners_f_and_g(path):
        return task(*args)


@dataclass(frozen=True)
class TPSpec:
    model: str = "block"
    seed: int = 0
    width: int = 8  # heads x head_dim
    heads: int = 4
    vocab: int = 16
    batch: int = 2
    length: int = 3
    steps: int = 3
    lr: float = 0.01
    bias: bool = True
    fused_qkv: bool = False


def build(spec: TPSpec) -> nn.Module:
    torch.manual_seed(spec.seed)
    if spec.model == "mlp":
        return tp.MLP(spec.width, 4 * spec.width, spec.bias)
    if spec.model == "attention":
        return tp.CausalSelfAttention(spec.width, spec.heads, spec.bias, spec.fused_qkv)
    if spec.model == "block":
        return tp.TransformerBlock(spec.width, spec.heads, spec.bias, spec.fused_qkv)
    return tp.TinyGPT(
        spec.vocab, spec.width, spec.heads, layers=2, length=spec.length, bias=spec.bias
    )


def batch(spec: TPSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank: tensor parallelism splits the model, not the data."""
    g = torch.Generator().manual_seed(spec.seed * 7919 + step)
    if spec.model == "gpt":
        tokens = torch.randint(spec.vocab, (spec.batch, spec.length + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    shape = (spec.batch, spec.length, spec.width)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def loss_of(spec: TPSpec, kind: str, model: nn.Module, x, y, group=None) -> torch.Tensor:
    out = model(x)
    if spec.model == "gpt" and kind != "alone":  # logits sharded by vocabulary over `group`
        return tp.vocab_parallel_cross_entropy(out, y, group)
    if spec.model == "gpt":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


_MESH = None


def torch_mesh():
    global _MESH
    if _MESH is None:  # one mesh per pool: each init_device_mesh would build new groups
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH


def torch_plan(model: nn.Module) -> dict:
    """tp.plan_for's plan in torch's styles; torch's vocabulary embedding is told that its input
    (token ids) is replicated, where its RowwiseParallel otherwise expects a sharded one."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import parallel as torch_tp

    plan = {}
    for name, style in tp.plan_for(model).items():
        if isinstance(style, tp.ColwiseParallel):
            plan[name] = torch_tp.ColwiseParallel()
        elif name.endswith("embed"):
            plan[name] = torch_tp.RowwiseParallel(input_layouts=Replicate())
        else:
            plan[name] = torch_tp.RowwiseParallel()
    return plan


def shard_dim(model: nn.Module, name: str) -> int | None:
    """Along which dim our split model keeps a chunk of parameter `name` (None: whole)."""
    owner_name, _, param_name = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(owner, (tp.ColwiseLinear, tp.VocabParallelEmbedding)):
        return 0
    if isinstance(owner, tp.ColwiseEmbedding) or (
        isinstance(owner, tp.RowwiseLinear) and param_name == "weight"
    ):
        return 1
    return None


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's chunk of a gradient. torch leaves a vocabulary embedding's gradient in another
    layout than its weight (not sharded by rows): bring it to the weight's first."""
    grad = param.grad
    if hasattr(grad, "placements") and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def train(spec: TPSpec, kind: str) -> dict:
    """Outputs of the first step, and each step's gradients and parameters (this rank's chunks
    for the split models; whole tensors for one process)."""
    model = build(spec)
    if kind == "ours":
        model = tp.parallelize_module(model, None, tp.plan_for(model))
    elif kind == "torch":
        from torch.distributed.tensor.parallel import parallelize_module

        model = parallelize_module(model, torch_mesh(), torch_plan(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
    grads, params, outputs = [], [], None
    for step in range(spec.steps):
        x, y = batch(spec, step)
        if outputs is None:
            outputs = local(model(x)).detach()
        loss_of(spec, kind, model, x, y).backward()
        grads.append({n: local_grad(p).clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        params.append({n: local(p).detach().clone() for n, p in model.named_parameters()})
    return {"model": model, "outputs": outputs, "grads": grads, "params": params}


def scaled_difference(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """max |mine - reference| / (1 + max |reference|): rounding error, in units of the tensor's
    size (a gradient of 30 rounds 30 times coarser than one of 1)."""
    return float((mine - reference).abs().max() / (1 + reference.abs().max()))


def chunk_of(full: torch.Tensor, dim: int | None) -> torch.Tensor:
    if dim is None:
        return full
    return torch.chunk(full, dist.get_world_size(), dim)[dist.get_rank()]


def largest_differences(spec: TPSpec, kinds: tuple[str, ...] = ("ours", "torch")) -> dict:
    """For each kind, the largest scaled difference from one process (same chunk) of the outputs,
    the gradients and the parameters over all steps; and where ours and torch's are not bitwise."""
    alone = train(spec, "alone")
    runs = {kind: train(spec, kind) for kind in kinds}
    ours = runs["ours"]["model"]
    dims = {name: shard_dim(ours, name) for name, _ in ours.named_parameters()}
    out_dim = -1 if spec.model == "gpt" else None  # logits stay sharded by vocabulary
    report = {}
    for kind, run in runs.items():
        worst = {"outputs": scaled_difference(run["outputs"], chunk_of(alone["outputs"], out_dim))}
        for what in ("grads", "params"):
            worst[what] = max(
                scaled_difference(mine[n], chunk_of(reference[n], dims[n]))
                for mine, reference in zip(run[what], alone[what], strict=True)
                for n in dims
            )
        report[kind] = {what: float(value) for what, value in worst.items()}
    if "torch" in runs:
        theirs = runs["torch"]
        report["bitwise"] = {
            "outputs": torch.equal(runs["ours"]["outputs"], theirs["outputs"]),
            **{
                what: [
                    n
                    for mine, other in zip(runs["ours"][what], theirs[what], strict=True)
                    for n in dims
                    if not torch.equal(mine[n], other[n])
                ]
                for what in ("grads", "params")
            },
        }
    report["shapes"] = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    report["types"] = {
        "parameters": sorted({type(p).__name__ for p in ours.parameters()}),
        "output": type(ours(batch(spec, 0)[0])).__name__,
    }
    return report


def dp_tp_against_one_process(spec: TPSpec, dp: int, tp_size: int) -> dict:
    """A dp x tp mesh: TP inside each row, MiniDDP across each column, each row fed its share
    of the global batch; the largest differences from one process on the whole global batch."""
    from miniddp import MiniDDP

    mesh = mesh_once((dp, tp_size), ("dp", "tp"))
    tp_group, dp_rank = mesh["tp"].get_group(), mesh["dp"].get_local_rank()
    alone, split = build(spec), build(spec)
    tp.parallelize_module(split, mesh["tp"], tp.plan_for(split))
    ddp = MiniDDP(split, process_group=mesh["dp"].get_group())
    optimizers = [torch.optim.SGD(m.parameters(), lr=spec.lr, momentum=0.9) for m in (alone, split)]
    worst = {"grads": 0.0, "params": 0.0}
    for step in range(spec.steps):
        x, y = batch(spec, step)  # the global batch; this replica takes its 1/dp of the rows
        share = len(x) // dp
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        loss_of(spec, "alone", alone, x, y).backward()
        loss_of(spec, "ours", ddp, x[rows], y[rows], tp_group).backward()
        grads = shard_difference(split, alone, tp_group, lambda p: p.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        params = shard_difference(split, alone, tp_group, lambda p: p.detach())
        worst = {"grads": max(worst["grads"], grads), "params": max(worst["params"], params)}
    return worst | {"dp_rank": dp_rank, "tp_rank": mesh["tp"].get_local_rank()}


def shard_difference(
    split: nn.Module, alone: nn.Module, tp_group: dist.ProcessGroup, read
) -> float:
    """The largest |read(shard) - the same chunk of read(whole)| over all parameters."""
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    whole = dict(alone.named_parameters())
    worst = 0.0
    for name, mine in split.named_parameters():
        dim, reference = shard_dim(split, name), read(whole[name])
        if dim is not None:
            reference = torch.chunk(reference, tp_size, dim)[tp_rank]
        worst = max(worst, scaled_difference(read(mine), reference))
    return worst


def all_reduces_of_one_step(spec: TPSpec) -> dict:
    """The sizes of the all-reduces of one forward and one backward of the split model."""
    model = build(spec)
    tp.parallelize_module(model, None, tp.plan_for(model))
    x, y = batch(spec, 0)
    sizes: dict[str, list[int]] = {"forward": [], "backward": []}
    original = dist.all_reduce
    phase = "forward"

    def counting(tensor, *args, **kwargs):
        sizes[phase].append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        loss = loss_of(spec, "ours", model, x, y)
        phase = "backward"
        loss.backward()
    finally:
        dist.all_reduce = original
    return sizes


def cross_entropy_against_one_process(seed: int, tokens: int, vocab: int) -> dict:
    """vocab_parallel_cross_entropy on this rank's slice of the logits, against F.cross_entropy
    on all of them (one process) and against torch's `loss_parallel` on the same slice: the
    loss, the logits' gradient (this rank's slice), and the numbers each all-reduce sent."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    g = torch.Generator().manual_seed(seed)
    logits = (10 * torch.randn(tokens, vocab, generator=g)).requires_grad_()  # wide: exp(z) large
    target = torch.randint(vocab, (tokens,), generator=g)
    mine = chunk_of(logits.detach(), -1).clone().requires_grad_()
    theirs = mine.detach().clone().requires_grad_()
    sent, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        ours = tp.vocab_parallel_cross_entropy(mine, target)
    finally:
        dist.all_reduce = original
    ours.backward()
    reference = F.cross_entropy(logits, target)
    reference.backward()
    with loss_parallel():
        torchs = F.cross_entropy(DTensor.from_local(theirs, torch_mesh(), [Shard(-1)]), target)
        torchs.backward()
    return {
        "loss": scaled_difference(ours.detach(), reference.detach()),
        "grad": scaled_difference(mine.grad, chunk_of(logits.grad, -1)),
        "torch loss bitwise": torch.equal(ours.detach(), local(torchs).detach()),
        "torch grad bitwise": torch.equal(mine.grad, theirs.grad),
        "sent": sent,
    }


def cross_entropy_with_ignored_targets(reduction: str) -> dict:
    """Some targets are ignore_index (-100, padding): the loss and this rank's slice of the
    logits' gradient, against one process's F.cross_entropy with the same ignore_index."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 5, 12, generator=g, dtype=torch.float64).requires_grad_()
    target = torch.randint(12, (2, 5), generator=g)
    target[0, 1] = target[1, 3] = target[1, 4] = -100
    mine = chunk_of(logits.detach(), -1).clone().requires_grad_()
    ours = tp.vocab_parallel_cross_entropy(mine, target, reduction=reduction)
    reference = F.cross_entropy(logits.transpose(1, 2), target, reduction=reduction)
    weights = torch.randn(ours.shape, generator=g, dtype=torch.float64)  # "none": any gradient
    (ours * weights).sum().backward()
    (reference * weights).sum().backward()
    return {
        "loss": (ours - reference).abs().max().item(),
        "grad": (mine.grad - chunk_of(logits.grad, -1)).abs().max().item(),
        "ignored rows": mine.grad[target == -100].abs().max().item(),
    }


def split_over_a_group_without_this_rank() -> str:
    """Rank 1 splits a Linear over a group of rank 0 alone."""
    group = dist.new_group([0])  # every rank creates it; rank 1 is not in it
    try:
        tp.parallelize_module(nn.Linear(4, 4), group, tp.ColwiseParallel())
    except ValueError as error:
        return str(error)
    return "no error"


def refusals() -> dict[str, str]:
    """What each misuse raises, as 'TypeName: message'."""

    def outcome(attempt) -> str:
        try:
            attempt()
        except Exception as error:  # noqa: BLE001 - the message is the result
            return f"{type(error).__name__}: {error}"
        return "nothing raised"

    odd = nn.Sequential(nn.Linear(4, 6), nn.Linear(4, 5))
    three_heads = tp.CausalSelfAttention(width=6, heads=3)
    gpt = tp.TinyGPT(vocab=8, width=4, heads=2, layers=1, length=2)
    tp.parallelize_module(gpt, None, tp.plan_for(gpt))
    return {
        "unchanged after": outcome(
            lambda: tp.parallelize_module(
                odd, None, {"0": tp.ColwiseParallel(), "1": tp.ColwiseParallel()}
            )
        )
        + f" / {type(odd[0]).__name__}",
        "token id": outcome(lambda: gpt(torch.tensor([[0, 8]]))),
        "target": outcome(
            lambda: tp.vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.tensor([3, 9]))
        ),
        "odd size": outcome(lambda: tp.parallelize_module(odd, None, {"1": tp.ColwiseParallel()})),
        "unknown name": outcome(
            lambda: tp.parallelize_module(odd, None, {"2": tp.ColwiseParallel()})
        ),
        "not a linear": outcome(
            lambda: tp.parallelize_module(
                nn.Sequential(nn.ReLU()), None, {"0": tp.RowwiseParallel()}
            )
        ),
        "heads": outcome(
            lambda: tp.parallelize_module(three_heads, None, tp.plan_for(three_heads))(
                torch.randn(1, 2, 6)
            )
        ),
    }
