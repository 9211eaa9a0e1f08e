"""What the ranks of the test pool run for tests/test_ddp_mixed_precision.py: MiniDDP with
MixedPrecision, against a reference written out by hand and against torch's fully_shard with
the same policy; the dtypes a module holds when; ZeRO-1/2 under it, and their bytes.

Everything is deterministic from an `MpSpec`: every rank builds the same model, and each rank
draws its own data from its rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP, MixedPrecision, ZeroRedundancyOptimizer
from miniddp.sharding import ddp_buckets, ddp_compute_copies, measure_memory, reduce_scatter_hook

BF16 = torch.bfloat16


@dataclass(frozen=True)
class MpSpec:
    seed: int = 0
    widths: tuple[int, ...] = (6, 16, 16, 3)  # input, hidden..., output
    steps: int = 3
    accumulation: int = 1  # microbatches per step; all but the last inside no_sync()
    batch: int = 4
    lr: float = 0.01
    reduce_dtype: torch.dtype = torch.float32
    fused: bool = False  # torch's fused AdamW: it writes the masters without a version bump


def build_model(spec: MpSpec) -> nn.Sequential:
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = []
    for a, b in zip(spec.widths, spec.widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(spec: MpSpec, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed * 7919 + dist.get_rank() * 101 + step * 13 + micro)
    x = torch.randn(spec.batch, spec.widths[0], generator=g)
    return x, torch.randn(spec.batch, spec.widths[-1], generator=g)


def loss_of(output: torch.Tensor, y: torch.Tensor, spec: MpSpec) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), y) / spec.accumulation


def wrap(spec: MpSpec, **options) -> tuple[nn.Module, MiniDDP]:
    model = build_model(spec)
    policy = MixedPrecision(param_dtype=BF16, reduce_dtype=spec.reduce_dtype)
    return model, MiniDDP(model, mixed_precision=policy, **options)


def train_miniddp(spec: MpSpec, optimizer_kind: str = "plain") -> dict:
    """MiniDDP with MixedPrecision(bf16, spec.reduce_dtype); `optimizer_kind` "plain" (AdamW),
    "zero1" or "zero2" (ZeRO-1 plus the reduce-scatter hook). The outputs, the masters'
    gradients and the parameters of every step, and the memory before the last step."""
    model, ddp = wrap(spec)
    if optimizer_kind == "plain":
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, fused=spec.fused)
    else:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=spec.lr)
    if optimizer_kind == "zero2":
        ddp.register_comm_hook(optimizer, reduce_scatter_hook)
    outputs, grads, params = [], [], []
    for step in range(spec.steps):
        for micro in range(spec.accumulation):
            x, y = batch(spec, step, micro)
            if micro < spec.accumulation - 1:
                with ddp.no_sync():
                    output = ddp(x)
                    loss_of(output, y, spec).backward()
            else:
                output = ddp(x)
                loss_of(output, y, spec).backward()
            outputs.append(output.detach().clone())
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        memory = measure_memory(
            model.parameters(), optimizer, ddp_buckets(ddp), ddp_compute_copies(ddp)
        )
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    owned = _owned(model, optimizer)
    return {"outputs": outputs, "grads": grads, "params": params, "memory": memory, "owned": owned}


def _owned(model: nn.Module, optimizer) -> dict:
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return {}
    mask = [optimizer.owner_of(p) == optimizer.rank for p in model.parameters()]
    mine = [p for p, owned in zip(model.parameters(), mask) if owned]
    return {"elements": sum(p.numel() for p in mine), "tensors": len(mine), "mask": mask}


def train_by_hand(spec: MpSpec) -> dict:
    """The reference, written out: fp32 masters and AdamW; each step a bf16 copy of the masters
    computes every microbatch; its bf16 gradients are summed in fp32 on each rank, gathered,
    cast to reduce_dtype, summed over the ranks in rank order, divided by W, and written into
    the masters' fp32 .grad. Nothing of MiniDDP's is used but the initial weights' source."""
    masters = build_model(spec)
    for p in masters.parameters():  # rank 0's weights, as MiniDDP starts from
        dist.broadcast(p.data, src=0)
    optimizer = torch.optim.AdamW(masters.parameters(), lr=spec.lr, fused=spec.fused)
    world = dist.get_world_size()
    outputs, grads, params = [], [], []
    for step in range(spec.steps):
        compute = copy.deepcopy(masters).to(BF16)
        accumulated = [torch.zeros_like(p) for p in masters.parameters()]
        for micro in range(spec.accumulation):
            x, y = batch(spec, step, micro)
            output = compute(x.to(BF16))
            loss_of(output, y, spec).backward()
            outputs.append(output.detach().clone())
            for total, p in zip(accumulated, compute.parameters()):
                total += p.grad.float()  # what no_sync accumulates: fp32
                p.grad = None
        for master, total in zip(masters.parameters(), accumulated):
            every = [torch.empty_like(total) for _ in range(world)]
            dist.all_gather(every, total)
            summed = every[0].to(spec.reduce_dtype)
            for other in every[1:]:
                summed = summed + other.to(spec.reduce_dtype)
            master.grad = (summed / world).float()
        grads.append([p.grad.clone() for p in masters.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in masters.parameters()])
    return {"outputs": outputs, "grads": grads, "params": params}


def against_the_hand_written_reference(spec: MpSpec) -> dict:
    return {"ours": train_miniddp(spec), "reference": train_by_hand(spec)}


def train_torch_fully_shard(spec: MpSpec) -> dict:
    """torch's FSDP2, every Linear and the root, MixedPrecisionPolicy(bf16, reduce_dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # slow import

    model = build_model(spec)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=spec.reduce_dtype)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    outputs, grads, params = [], [], []
    for step in range(spec.steps):
        for micro in range(spec.accumulation):
            model.set_requires_gradient_sync(micro == spec.accumulation - 1)
            x, y = batch(spec, step, micro)
            output = model(x)
            loss_of(output, y, spec).backward()
            outputs.append(output.detach().clone())
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.full_tensor().detach().clone() for p in model.parameters()])
    return {"outputs": outputs, "grads": grads, "params": params}


def against_torch_fully_shard(spec: MpSpec) -> dict:
    return {"ours": train_miniddp(spec), "torch": train_torch_fully_shard(spec)}


def float16_with_a_loss_scaler(spec: MpSpec) -> dict:
    """MiniDDP with MixedPrecision(torch.float16) and torch's fully_shard with the same fp16
    policy, each with torch.amp.GradScaler(init_scale=2^16, growth_interval=1) and AdamW: per
    step the scale, the unscaled full gradients and the full parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # slow import

    runs = {}
    for kind in ("ours", "torch"):
        model = build_model(spec)
        if kind == "ours":
            module = MiniDDP(model, mixed_precision=MixedPrecision(torch.float16))
        else:
            policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mp_policy=policy)
            module = fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
        full = (lambda t: t.full_tensor()) if kind == "torch" else (lambda t: t)
        scales, grads, params = [], [], []
        for step in range(spec.steps):
            x, y = batch(spec, step, 0)
            scaler.scale(loss_of(module(x), y, spec)).backward()
            scaler.unscale_(optimizer)
            scales.append(scaler.get_scale())
            grads.append([full(p.grad).clone() for p in model.parameters()])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            params.append([full(p).detach().clone() for p in model.parameters()])
        runs[kind] = {"scales": scales, "grads": grads, "params": params}
    return runs


def average_at_w3(spec: MpSpec) -> dict:
    """One synced step at W = 3: our masters' gradients; gloo's own fp32 sum of the same bf16
    gradients divided by 3 (sum, then divide, as torch's DDP mixed precision does); and each
    gradient times fl(1/3), then summed (what MiniDDP does without mixed precision)."""
    model, ddp = wrap(spec)
    compute = copy.deepcopy(model).to(BF16)
    x, y = batch(spec, 0, 0)
    loss_of(ddp(x), y, spec).backward()
    loss_of(compute(x.to(BF16)), y, spec).backward()
    divided, scaled = [], []
    for p in compute.parameters():
        total, each = p.grad.float(), p.grad.float() * (1.0 / 3)
        dist.all_reduce(total)
        dist.all_reduce(each)
        divided.append(total / 3)
        scaled.append(each)
    return {"ours": [p.grad for p in model.parameters()], "divided": divided, "scaled": scaled}


class Records(nn.Module):
    """A Linear and a buffer that note, during forward and backward, what the module holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("shift", torch.ones(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.seen: dict[str, list] = {}

    def note(self, when: str, x: torch.Tensor) -> None:
        self.seen[when] = [p.dtype for p in self.parameters()] + [x.dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.note("forward", x)
        hidden = self.linear(x)
        if hidden.requires_grad:  # runs inside backward, once the frozen layer's is done
            hidden.register_hook(lambda grad: self.note("backward", grad))
        return self.frozen(hidden) + self.shift.to(x.dtype)


def dtypes_inside_and_outside() -> dict:
    """What the module holds before, inside forward, inside backward, after; and under
    torch.no_grad(), right after the forward."""
    module = Records()
    masters = list(module.parameters())
    ddp = MiniDDP(module, mixed_precision=MixedPrecision(BF16, buffer_dtype=torch.float64))
    before = list(module.parameters())
    ddp(torch.randn(2, 4)).float().sum().backward()
    after = list(module.parameters())
    with torch.no_grad():
        ddp(torch.randn(2, 4))
    return {
        "seen": module.seen,
        "masters_before": all(a is b for a, b in zip(before, masters, strict=True)),
        "masters_after": all(a is b for a, b in zip(after, masters, strict=True)),
        "masters_after_no_grad": all(
            a is b for a, b in zip(module.parameters(), masters, strict=True)
        ),
        "after": [(p.dtype, None if p.grad is None else p.grad.dtype) for p in after],
        "copies_grads": [c.grad for c in ddp_compute_copies(ddp)],
        "buffers": [b.dtype for b in module.buffers()],
    }


def bucket_view_with_a_bf16_bucket() -> None:
    model = build_model(MpSpec())
    policy = MixedPrecision(BF16, reduce_dtype=BF16)
    MiniDDP(model, mixed_precision=policy, gradient_as_bucket_view=True)


def policies_differ_across_ranks() -> None:
    reduce_dtype = torch.float32 if dist.get_rank() == 0 else BF16
    MiniDDP(build_model(MpSpec()), mixed_precision=MixedPrecision(BF16, reduce_dtype))


def memory_under_mixed_precision(spec: MpSpec, bucket_view: bool = False) -> dict:
    """The bytes before the last step under DDP, ZeRO-1 and ZeRO-2, and what this rank owns."""
    if bucket_view:
        model, ddp = wrap(spec, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        for step in range(spec.steps):
            x, y = batch(spec, step, 0)
            loss_of(ddp(x), y, spec).backward()
            memory = measure_memory(
                model.parameters(), optimizer, ddp_buckets(ddp), ddp_compute_copies(ddp)
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return {"ddp": memory}
    runs = {kind: train_miniddp(spec, kind) for kind in ("plain", "zero1", "zero2")}
    return {kind: {"memory": run["memory"], **run["owned"]} for kind, run in runs.items()}


def zero_against_plain(spec: MpSpec) -> dict:
    """ZeRO-1 and ZeRO-2 under mixed precision, and MiniDDP + AdamW under it."""
    return {kind: train_miniddp(spec, kind) for kind in ("plain", "zero1", "zero2")}


def averaged_by_hand(compute: nn.Module) -> list[torch.Tensor]:
    """Each parameter's bf16 gradient, summed over the ranks in fp32 and divided by W."""
    averages = []
    for p in compute.parameters():
        every = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(every, p.grad)
        averages.append(sum(g.float() for g in every) / len(every))
    return averages


class OneBranchUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def with_an_unused_branch(static_graph: bool) -> dict:
    """find_unused_parameters (or static_graph) finds the unused branch in the copies' graph:
    the used branch gets the hand-written average, the unused one keeps .grad None."""
    module = OneBranchUnused()
    compute = copy.deepcopy(module).to(BF16)
    options = {"static_graph": True} if static_graph else {"find_unused_parameters": True}
    ddp = MiniDDP(module, mixed_precision=MixedPrecision(BF16), **options)
    for step in range(2):  # static_graph's first backward only counts; the second trusts it
        x = batch(MpSpec(widths=(4, 4)), step, 0)[0]
        ddp(x).float().sum().backward()
        compute(x.to(BF16)).float().sum().backward()
        expected = averaged_by_hand(compute.used)
        ours = [p.grad for p in module.used.parameters()]
        for p in [*module.parameters(), *compute.parameters()]:
            p.grad = None
    return {
        "ours": ours,
        "expected": expected,
        "unused": [p.grad for p in module.unused.parameters()],
    }


def joined_early() -> dict:
    """Rank 1 has one batch, rank 0 two, under Join with a bf16 reduction: in the second step
    rank 1's shadow buckets (bf16 zeros) meet rank 0's, which gets its own gradient over 2."""
    module = OneBranchUnused().used
    compute = copy.deepcopy(module).to(BF16)
    ddp = MiniDDP(module, mixed_precision=MixedPrecision(BF16, reduce_dtype=BF16))
    batches = 2 if dist.get_rank() == 0 else 1
    with ddp.join():
        for step in range(batches):
            x = batch(MpSpec(widths=(4, 4)), step, 0)[0]
            module.zero_grad()
            ddp(x).float().sum().backward()
    if dist.get_rank() == 1:
        return {}
    compute(x.to(BF16)).float().sum().backward()
    return {
        "ours": [p.grad for p in module.parameters()],
        "expected": [(p.grad / 2).float() for p in compute.parameters()],
    }
