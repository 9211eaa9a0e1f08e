"""What the ranks of the test pool run: random models trained with MiniDDP and torch's DDP.

Everything here is deterministic from a `TrainSpec`, so the test process can rebuild the same
model and the same data to train a single-process reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.data_parallel.bucket import Bucket


@dataclass(frozen=True)
class ModelSpec:
    seed: int = 0
    in_features: int = 5
    widths: tuple[int, ...] = (8,)
    out_features: int = 3
    frozen: tuple[int, ...] = ()  # hidden layers whose parameters do not require grad
    tied: bool = False  # two square layers share one weight
    unused: str = "none"  # "none", "all_ranks" (a layer never used) or "some_ranks"
    batchnorm: bool = False
    dtype: str = "float32"  # "float32", "float64" or "mixed" (one float64 layer)
    # Two layers of one shape side by side, summed: odd ranks run them in the other order, so
    # their gradients come ready in another order there (autograd readies the later one first).
    twins: bool = False


@dataclass(frozen=True)
class TrainSpec:
    model: ModelSpec = ModelSpec()
    bucket_cap_mb: float | None = None
    accumulation: int = 1
    steps: int = 2
    micro_batch: int = 4
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    data_seed: int = 0
    lr: float = 0.05
    comm_hook: str | None = None  # a key of comm_hooks()
    # Which DDP is tested, as "module:Class" or "path/to/file.py:Class" (a learner's own).
    implementation: str = "miniddp.data_parallel.ddp:MiniDDP"
    # Accumulate inside no_sync(); False synchronizes every micro-step (for a DDP without
    # no_sync, and torch's DDP then does the same).
    accumulate_with_no_sync: bool = True
    # Each rank builds its model from seed + rank: DDP's construction must copy rank 0's.
    seed_by_rank: bool = False
    # MiniDDP's Bucket.small_gradient_numel: below it, gradients are copied in batches. The
    # models here are tiny, so the default would always take the batched path.
    small_gradient_numel: int = Bucket.small_gradient_numel
    set_grads_to_none: bool = True  # False keeps .grad tensors (bucket views, with the option)
    training_step: str | None = None  # "module:function": a loop from tutorials/mistakes/


def comm_hooks() -> dict:
    """Hooks with torch's signature: torch's own, and MiniDDP's send/recv all-reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from miniddp.data_parallel.default_hooks import all_reduce_hook

    return {
        "allreduce": default_hooks.allreduce_hook,
        "fp16_compress": default_hooks.fp16_compress_hook,
        "ring": all_reduce_hook("ring"),
        "reduce_broadcast": all_reduce_hook("reduce_broadcast"),
    }


class RandomNet(nn.Module):
    """An MLP with the awkward parts DDP must handle: frozen, tied and unused parameters,
    BatchNorm buffers, a float64 layer among float32 ones, and twins whose gradients come ready
    in an order that depends on the rank."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        torch.manual_seed(spec.seed)
        dims = [spec.in_features, *spec.widths]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        for index in spec.frozen:
            for p in self.hidden[index].parameters():
                p.requires_grad_(False)
        width = dims[-1]
        self.norm = nn.BatchNorm1d(width) if spec.batchnorm else None
        self.square = self.tied_square = None
        if spec.tied:
            self.square = nn.Linear(width, width)
            self.tied_square = nn.Linear(width, width)
            self.tied_square.weight = self.square.weight
        self.twins = (
            nn.ModuleList(nn.Linear(width, width) for _ in range(2)) if spec.twins else None
        )
        self.wide = nn.Linear(width, width).double() if spec.dtype == "mixed" else None
        self.head = nn.Linear(width, spec.out_features)
        self.extra_head = nn.Linear(width, spec.out_features) if spec.unused != "none" else None
        if spec.dtype == "float64":
            self.double()

    def forward(
        self, x: torch.Tensor, use_extra: bool = False, twins_swapped: bool = False
    ) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        if self.norm is not None:
            x = self.norm(x)
        if self.square is not None:
            x = torch.tanh(self.tied_square(torch.tanh(self.square(x))))
        if self.twins is not None:
            # The same sum either way (the same bits): only the order of computing changes.
            outputs = {}
            for index in (1, 0) if twins_swapped else (0, 1):
                outputs[index] = self.twins[index](x)
            x = torch.tanh(outputs[0] + outputs[1])
        if self.wide is not None:
            x = torch.tanh(self.wide(x.double())).to(x.dtype)
        out = self.head(x)
        if use_extra and self.extra_head is not None:
            out = out + self.extra_head(x)
        return out


def uses_extra(spec: ModelSpec, rank: int) -> bool:
    return spec.unused == "some_ranks" and rank % 2 == 0


def swaps_twins(spec: ModelSpec, rank: int) -> bool:
    return spec.twins and rank % 2 == 1


def model_dtype(spec: ModelSpec) -> torch.dtype:
    return torch.float64 if spec.dtype == "float64" else torch.float32


def micro_batch(spec: TrainSpec, rank: int, step: int, micro: int) -> tuple[torch.Tensor, ...]:
    """The data rank `rank` sees in one micro-step; any process can regenerate it."""
    seed = spec.data_seed * 1_000_003 + rank * 10_007 + step * 101 + micro
    g = torch.Generator().manual_seed(seed)
    dtype = model_dtype(spec.model)
    x = torch.randn(spec.micro_batch, spec.model.in_features, generator=g, dtype=dtype)
    y = torch.randn(spec.micro_batch, spec.model.out_features, generator=g, dtype=dtype)
    return x, y


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def state_of(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers (BatchNorm statistics)."""
    return [t.detach().clone() for t in model.state_dict().values()]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def load_implementation(implementation: str) -> type[nn.Module]:
    """The DDP class named by "module:Class" or "path/to/file.py:Class"."""
    where, _, name = implementation.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def claims_of(implementation: str) -> frozenset[str]:
    """What a DDP class says it supports (see miniddp.steps.CLAIMS); none if it says nothing."""
    return getattr(load_implementation(implementation), "claims", frozenset())


def wrap(net: nn.Module, spec: TrainSpec, use_torch: bool) -> nn.Module:
    """torch's DDP with every option of the spec, or ours with the keywords it teaches."""
    options = {
        "broadcast_buffers": spec.broadcast_buffers,
        "find_unused_parameters": spec.find_unused_parameters,
        "gradient_as_bucket_view": spec.gradient_as_bucket_view,
    }
    if use_torch:
        return DistributedDataParallel(net, bucket_cap_mb=spec.bucket_cap_mb, **options)
    ours = load_implementation(spec.implementation)
    claimed = getattr(ours, "claims", frozenset())
    taken = {option: OPTION_CLAIMS[option] in claimed for option in options}
    for option, value in options.items():
        assert taken[option] or value == OPTION_DEFAULTS[option], f"{option} is not claimed"
    options = {option: value for option, value in options.items() if taken[option]}
    return ours(net, bucket_cap_mb=spec.bucket_cap_mb, **options)


# torch's keyword options, and the claim (miniddp.steps.CLAIMS) of a DDP that takes each
OPTION_CLAIMS = {
    "broadcast_buffers": "no-sync",
    "find_unused_parameters": "find-unused-parameters",
    "gradient_as_bucket_view": "gradient-as-bucket-view",
}
OPTION_DEFAULTS = {
    "broadcast_buffers": True,
    "find_unused_parameters": False,
    "gradient_as_bucket_view": False,
}


def train(spec: TrainSpec, use_torch: bool) -> dict:
    """Train one replica on this rank; record gradients and state after every step.

    Ours is driven by the rung protocol: `finish_gradient_synchronization()` after each
    synchronized backward (a no-op for DDPs whose backward already waited)."""
    with small_gradients_below(spec.small_gradient_numel):
        return _train(spec, use_torch)


@contextlib.contextmanager
def small_gradients_below(numel: int) -> Iterator[None]:
    default, Bucket.small_gradient_numel = Bucket.small_gradient_numel, numel
    try:
        yield
    finally:
        Bucket.small_gradient_numel = default


def _train(spec: TrainSpec, use_torch: bool) -> dict:
    rank = dist.get_rank()
    seed = spec.model.seed + (rank if spec.seed_by_rank else 0)
    net = RandomNet(dataclasses.replace(spec.model, seed=seed))
    model = wrap(net, spec, use_torch)
    if spec.comm_hook is not None:
        model.register_comm_hook(None, comm_hooks()[spec.comm_hook])
    optimizer = torch.optim.SGD(net.parameters(), lr=spec.lr, momentum=0.5)
    grads, states, params = [], [], []
    for step in range(spec.steps):
        if spec.training_step is None:
            for micro in range(spec.accumulation):
                x, y = micro_batch(spec, rank, step, micro)
                synced = micro == spec.accumulation - 1 or not spec.accumulate_with_no_sync
                with contextlib.nullcontext() if synced else model.no_sync():
                    out = model(
                        x,
                        use_extra=uses_extra(spec.model, rank),
                        twins_swapped=swaps_twins(spec.model, rank),
                    )
                    loss = nn.functional.mse_loss(out, y) / spec.accumulation
                    loss.backward()
                if synced and not use_torch:
                    model.finish_gradient_synchronization()
            grads.append(grads_of(net))
            optimizer.step()
        else:  # function(model, optimizer, micro_batches), a loop that also steps the optimizer
            batches = [micro_batch(spec, rank, step, m) for m in range(spec.accumulation)]
            load_implementation(spec.training_step)(model, optimizer, batches)
            grads.append(grads_of(net))  # SGD's step leaves .grad as it was
        optimizer.zero_grad(set_to_none=spec.set_grads_to_none)
        states.append(state_of(net))
        params.append(params_of(net))
    layout = bucket_layout(model, net)
    names = [name for name, _ in net.named_parameters()]
    buffers = [name for name, _ in net.named_buffers()]
    return {
        "grads": grads,
        "states": states,
        "params": params,
        "layout": layout,
        "names": names,
        "state_names": list(net.state_dict()),
        "buffer_names": buffers,
        "all_reduces": getattr(model, "all_reduce_count", None),
    }


def bucket_layout(model: nn.Module, net: nn.Module) -> list[list[str]]:
    """The bucket layout in launch order, as parameter names: torch's, MiniDDP's (BucketInfo),
    or a rung's (buckets holding indices into its parameters: `param_indices` from rung 3 on, as
    MiniDDP's, or `params` in a learner's own); None for a DDP that claims no torch layout."""
    if not isinstance(model, DistributedDataParallel):
        if "torch-layout" not in getattr(model, "claims", ()):
            return None
        if isinstance(model, MiniDDP):
            return [list(info.param_names) for info in model.buckets]
        indices = [getattr(b, "param_indices", b.params) for b in model.buckets]
        return [[model.param_names[i] for i in bucket] for bucket in indices]
    name_of = {id(p): n for n, p in net.named_parameters()}
    return [
        [name_of[id(p)] for p in bucket.parameters()]
        for bucket in model.reducer._get_zeros_like_grad_buckets()
    ]


def train_both(spec: TrainSpec) -> dict:
    """MiniDDP and torch's DDP on the same data, one after the other, on every rank."""
    return {"ours": train(spec, use_torch=False), "torch": train(spec, use_torch=True)}


def train_ours_with_hook_and_torch_without(spec: TrainSpec) -> dict:
    """MiniDDP over one of our own all-reduces, against torch's DDP over gloo's."""
    torch_spec = dataclasses.replace(spec, comm_hook=None)
    return {"ours": train(spec, use_torch=False), "torch": train(torch_spec, use_torch=True)}


def reference_training(spec: TrainSpec, world_size: int) -> dict:
    """Single-process training on the global batch, with the same gradient accumulation.

    DDP's gradient is the mean over ranks of each rank's accumulated gradient. One process gets
    the same by treating the W micro-batches of a micro-step as one global micro-batch. BatchNorm
    statistics and rank-dependent branches are per rank in DDP, so then each rank's share is
    run separately and the losses averaged.
    """
    net = RandomNet(spec.model)
    optimizer = torch.optim.SGD(net.parameters(), lr=spec.lr, momentum=0.5)
    per_rank = spec.model.batchnorm or spec.model.unused == "some_ranks"
    grads, params = [], []
    for step in range(spec.steps):
        for micro in range(spec.accumulation):
            batches = [micro_batch(spec, r, step, micro) for r in range(world_size)]
            if per_rank:
                losses = [
                    nn.functional.mse_loss(net(x, use_extra=uses_extra(spec.model, r)), y)
                    for r, (x, y) in enumerate(batches)
                ]
                loss = torch.stack(losses).mean()
            else:
                x = torch.cat([b[0] for b in batches])
                y = torch.cat([b[1] for b in batches])
                loss = nn.functional.mse_loss(net(x), y)
            (loss / spec.accumulation).backward()
        grads.append(grads_of(net))
        optimizer.step()
        optimizer.zero_grad()
        params.append(params_of(net))
    return {"grads": grads, "params": params}
