"""Every parallelism against torch's own, as small checks of one rank's device: what
scripts/gpu_check.sh runs on a GPU node (scripts/run_checks.py runs them on the ranks).

Each check is a small function of the rank's device that runs MiniDDP's implementation and
torch's (or, where torch has none, one process) on the same seeds and returns the largest
difference and the bound it must stay within: 0 where the two do the same operations in the same
order (bitwise), a rounding bound otherwise. The models, batches and plans are the test suite's
(tests/*_tasks.py), built on the CPU from a seed and moved to the device, so both sides start
from the same bits.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this clone's miniddp and tests, before any installed copy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


@dataclass(frozen=True)
class Measured:
    """The largest difference between ours and the reference; the check passes when it is at
    most `bound` (0: bitwise). `note` says what ran (a kernel's name, a mesh's shape)."""

    difference: float
    bound: float = 0.0
    note: str = ""


@dataclass(frozen=True)
class Check:
    name: str
    parallelism: str  # DDP, ZeRO, FSDP, HSDP, TP, PP, CP, EP, 3-D, 4-D, 5-D, collectives
    run: Callable[[torch.device], Measured]
    # torch's side sends device tensors by gloo's send/recv, which read host memory only (ours
    # go through a host copy there: collectives/peers.py, on_the_wire)
    torch_sends: bool


CHECKS: dict[str, Check] = {}


def check(parallelism: str, variants: dict[str, dict], torch_sends: bool = False):
    """Register the decorated function as one check per variant: `variants` maps each check's
    name to the options bound to the function for it, in the table's order."""

    def register(function: Callable[..., Measured]) -> Callable[..., Measured]:
        for name, options in variants.items():
            CHECKS[name] = Check(name, parallelism, partial(function, **options), torch_sends)
        return function

    return register


def largest_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    if len(ours) != len(theirs):
        raise AssertionError(f"{len(ours)} tensors against {len(theirs)}")
    return max(
        (float((a.double() - b.double()).abs().max()) for a, b in zip(ours, theirs) if a.numel()),
        default=0.0,
    )


def scaled_error(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """max |mine - reference| / (1 + max |reference|): rounding error in the tensor's units."""
    reference = reference.double()
    return float((mine.double() - reference).abs().max() / (1 + reference.abs().max()))


def sgd_steps(model: nn.Module, batches, device: torch.device, optimizer=None) -> list:
    """Train on `batches` ((x, y) pairs, moved to `device`) with MSE; every step's gradients and
    parameters, as CPU copies, in order."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for x, y in batches:
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        seen += [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad()
        seen += [p.detach().cpu() for p in model.parameters()]
    return seen


@check("DDP", {"MiniDDP vs DistributedDataParallel": {}})
def ddp(device: torch.device) -> Measured:
    from torch.nn.parallel import DistributedDataParallel

    from miniddp import MiniDDP
    from tests.sharding_tasks import ShardSpec, batch, build_model

    spec = ShardSpec(widths=(8, 32, 32, 4))
    batches = [batch(spec, dist.get_rank(), step) for step in range(3)]
    ids = [device] if device.type == "cuda" else None
    ours = MiniDDP(build_model(spec).to(device), bucket_cap_mb=0.001)
    theirs = DistributedDataParallel(build_model(spec).to(device), ids, bucket_cap_mb=0.001)
    return Measured(
        largest_difference(sgd_steps(ours, batches, device), sgd_steps(theirs, batches, device))
    )


@check("ZeRO", {"ZeroRedundancyOptimizer vs torch's (AdamW)": {}})
def zero1(device: torch.device) -> Measured:
    from miniddp import MiniDDP
    from tests.sharding_tasks import ShardSpec, batch, build_model, make_optimizer

    spec = ShardSpec(widths=(8, 16, 16, 4), groups=2)
    batches = [batch(spec, dist.get_rank(), step) for step in range(3)]
    runs = []
    for kind in ("ours", "torch"):
        model = build_model(spec).to(device)
        optimizer = make_optimizer(kind, model, spec)
        runs.append(sgd_steps(MiniDDP(model), batches, device, optimizer))
    return Measured(largest_difference(*runs))


def fsdp_params(kind: str, device: torch.device, policy: dict | None) -> list[torch.Tensor]:
    """The FSDP test's model, every Linear then the root sharded by `kind` ("ours", "torch"),
    three AdamW steps; the full parameters after each."""
    from tests import sharding_fsdp_tasks as fsdp
    from tests import sharding_mixed_precision_tasks as mixed

    spec = fsdp.FsdpSpec(widths=(8, 16, 12, 4))
    model = fsdp.build_model(spec).to(device)
    model = mixed.shard(kind, model, policy) if policy else fsdp.shard(kind, model, spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    seen = []
    for step in range(3):
        x, y = fsdp.batch(spec, dist.get_rank(), step, 0)
        # The loss in float32: under the bf16 policy the output is bf16, and CUDA's mse_loss
        # backward refuses a bf16 input against a float32 target (the CPU's promotes).
        F.mse_loss(model(x.to(device)).float(), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen += [t.cpu() for t in fsdp.full_parameters(kind, model)]
    return seen


BF16_POLICY = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


@check(
    "FSDP",
    {
        "fully_shard vs torch's (fp32)": {"policy": None},
        "fully_shard vs torch's (bf16 compute, fp32 reduce)": {"policy": BF16_POLICY},
    },
)
def fsdp(device: torch.device, policy: dict | None) -> Measured:
    ours, theirs = (fsdp_params(kind, device, policy) for kind in ("ours", "torch"))
    return Measured(largest_difference(ours, theirs))


_TORCH_MESHES: dict[tuple, object] = {}


def torch_mesh(device: torch.device):
    """One torch DeviceMesh over every rank per process: each would build new groups."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, dist.get_world_size())
    if key not in _TORCH_MESHES:
        _TORCH_MESHES[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _TORCH_MESHES[key]


@check("TP", {"parallelize_module vs torch's (Colwise/Rowwise)": {}})
def tensor_parallel(device: torch.device) -> Measured:
    """Bitwise without biases (tests/test_tensor_parallel.py says why): outputs, every gradient
    shard and every parameter shard after each step."""
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from miniddp import tensor_parallel as tp
    from tests import tensor_parallel_tasks as tasks

    world = dist.get_world_size()
    spec = tasks.TPSpec(model="block", bias=False, heads=world, width=2 * world, steps=3)
    runs = []
    for kind in ("ours", "torch"):
        model = tasks.build(spec).to(device)
        if kind == "ours":
            model = tp.parallelize_module(model, None, tp.plan_for(model))
        else:
            model = torch_parallelize(model, torch_mesh(device), tasks.torch_plan(model))
        # One tensor at a time, as on the CPU: on a GPU the optimizers default to foreach, which
        # refuses torch's mix of DTensor (sharded) and plain (the norms') parameters.
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9, foreach=False)
        seen = []
        for step in range(spec.steps):
            x, y = (t.to(device) for t in tasks.batch(spec, step))
            out = model(x)
            seen.append(tasks.local(out).detach().cpu())
            F.mse_loss(out, y).backward()
            seen += [tasks.local_grad(p).cpu() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            seen += [tasks.local(p).detach().cpu() for p in model.parameters()]
        runs.append(seen)
    return Measured(largest_difference(*runs))


@check(
    "PP",
    {
        "Schedule1F1B vs torch's (W stages)": {"kind": "1f1b"},
        "ScheduleInterleaved1F1B vs torch's (2W stages)": {"kind": "interleaved"},
    },
    torch_sends=True,
)
def pipeline(device: torch.device, kind: str) -> Measured:
    """Every stage's gradients and parameters after each step, bitwise, against torch's
    pipelining given each microbatch's share of the loss (tests/test_pipeline.py)."""
    from torch.distributed import pipelining

    from miniddp import pipeline as ours
    from tests.test_pipeline import PipeSpec, batch, build_model, mean_share, mse

    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 1 if kind == "1f1b" else 2
    m = 2 * world
    spec = PipeSpec(widths=tuple(range(3 + per_rank * world, 2, -1)), n_microbatches=m)
    runs = []
    for library in ("ours", "torch"):
        model = build_model(spec).to(device)
        indices = [rank + i * world for i in range(per_rank)]
        if library == "ours":
            stages = [ours.PipelineStage(model[s], s, spec.stages, device) for s in indices]
            make = ours.Schedule1F1B if kind == "1f1b" else ours.ScheduleInterleaved1F1B
            schedule = make(stages[0] if kind == "1f1b" else stages, m, mse)
        else:
            stages = [pipelining.PipelineStage(model[s], s, spec.stages, device) for s in indices]
            make = pipelining.Schedule1F1B if kind == "1f1b" else pipelining.ScheduleInterleaved1F1B
            loss = partial(mean_share, m=m)
            schedule = make(stages[0] if kind == "1f1b" else stages, m, loss, scale_grads=False)
        blocks = [model[s] for s in indices]
        optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=spec.lr)
        seen = []
        for step in range(spec.steps):
            x, y = (t.to(device) for t in batch(spec, step))
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            seen += [p.grad.cpu() for b in blocks for p in b.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            seen += [p.detach().cpu() for b in blocks for p in b.parameters()]
        runs.append(seen)
    return Measured(largest_difference(*runs))


@check(
    "CP",
    {
        "ring_attention vs SDPA, fp32 (causal, balanced)": {"dtype": torch.float32},
        "ring_attention vs SDPA, bf16 (causal, balanced)": {"dtype": torch.bfloat16},
    },
)
def ring(device: torch.device, dtype: torch.dtype) -> Measured:
    """Forward and backward of this rank's part, against F.scaled_dot_product_attention over
    the whole sequence in one process. Both are measured against float64: ring attention's
    error may be at most a few times SDPA's own in `dtype` (its merge rounds once more per
    block), which is the bound whatever kernel each device picks."""
    from miniddp.context_parallel import ring_attention, shard_sequence
    from miniddp.context_parallel.kernels import kernel_for
    from tests.context_parallel_tasks import AttentionSpec, whole

    world = dist.get_world_size()
    spec = AttentionSpec(batch=2, heads=4, length=32 * world, head_dim=16, is_causal=True)
    inputs = [t.to(device) for t in whole(spec)]  # float64: Q, K, V and dO

    def attend(q, k, v, grad, attention) -> list[torch.Tensor]:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = attention(q, k, v)
        out.backward(grad)
        return [out.detach(), q.grad, k.grad, v.grad]

    sdpa = partial(F.scaled_dot_product_attention, is_causal=True)
    exact = [shard_sequence(t, 2, load_balance=True) for t in attend(*inputs, sdpa)]
    low = [t.to(dtype) for t in inputs]
    theirs = [shard_sequence(t, 2, load_balance=True) for t in attend(*low, sdpa)]
    parts = [shard_sequence(t, 2, load_balance=True) for t in low]
    ours = attend(*parts, partial(ring_attention, is_causal=True, load_balance=True))
    ours_error = max(scaled_error(a, b) for a, b in zip(ours, exact))
    sdpa_error = max(scaled_error(a, b) for a, b in zip(theirs, exact))
    bound = 3 * sdpa_error + 2 * torch.finfo(dtype).eps
    return Measured(ours_error, bound, kernel_for(device, dtype).name)


def mesh_shape(world: int) -> tuple[int, int, int]:
    """(pp, dp, tp) for `world` ranks: a factor 2 to dp first (so MiniDDP and fully_shard
    differ), then to tp, then to pp, the rest to dp: 2 -> (1, 2, 1), 8 -> (2, 2, 2)."""
    sizes = {"dp": 1, "tp": 1, "pp": 1}
    rest = world
    for axis in sizes:
        if rest % 2 == 0:
            sizes[axis], rest = 2, rest // 2
    return sizes["pp"], sizes["dp"] * rest, sizes["tp"]


@check(
    "3-D",
    {
        "parallelize(GPT) vs one process, MiniDDP on dp": {"dp": "ddp"},
        "parallelize(GPT) vs one process, fully_shard on dp": {"dp": "fsdp"},
    },
)
def three_d(device: torch.device, dp: str) -> Measured:
    """Chapter 12's GPT in float64 (tests/parallelize_tasks.py): the losses and every full
    parameter after AdamW steps, within rounding of one process on the replicas' whole batch."""
    from miniddp.parallelize import AXES

    sizes = dict(zip(("pp", "dp", "tp"), mesh_shape(dist.get_world_size())))
    return against_one_process(device, AXES, sizes, dp)


@check("4-D", {"parallelize(GPT) with cp vs one process, MiniDDP": {}})
def four_d(device: torch.device) -> Measured:
    """The same, with the sequence cut over a "cp" axis of 2 (ring attention on the device's
    kernel) and the rest of the ranks laid out as the 3-D check lays them."""
    from miniddp.parallelize import CP_AXES

    sizes = dict(zip(("pp", "dp", "tp"), mesh_shape(dist.get_world_size() // 2)), cp=2)
    return against_one_process(device, CP_AXES, sizes, "ddp")


def against_one_process(device: torch.device, axes: tuple, sizes: dict, dp: str) -> Measured:
    """parallelize over a mesh of `axes` with `sizes` (any other axis 1) against one process:
    every step's loss (each last-stage rank's, averaged over dp and cp) and, at the end, every
    full parameter, in float64 units of rounding."""
    from miniddp.mesh import init_device_mesh
    from miniddp.parallelize import parallelize
    from tests import parallelize_tasks as tasks

    shape = tuple(sizes.get(axis, 1) for axis in axes)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=axes)
    replicas, replica = sizes["dp"], mesh["dp"].get_local_rank()
    averaged_over = [mesh[axis] for axis in ("dp", "cp") if axis in axes]

    reference = tasks.build_gpt().to(device)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    parts = parallelize(tasks.build_gpt().to(device), mesh, n_microbatches=2, data_parallel=dp)
    parallel_optimizer = torch.optim.AdamW(parts.parameters(), lr=1e-2)
    difference = 0.0
    for step in range(tasks.STEPS):
        windows = tasks.windows(step, replicas).to(device)
        logits = reference(windows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mine = parts.train_step(windows.tensor_split(replicas)[replica])
        parallel_optimizer.step()
        parallel_optimizer.zero_grad()
        if mine is not None:  # the last stage's loss, this rank's mean
            mine = mine.detach().clone()
            for axis in averaged_over:
                dist.all_reduce(mine, group=axis.get_group())
                mine /= axis.size()
            difference = max(difference, abs(mine.item() - loss.item()))
    sharded = dp == "fsdp" and math.prod(axis.size() for axis in averaged_over) > 1
    full = tasks.full_tensors(parts.model, mesh, sharded=sharded)
    expected = dict(reference.named_parameters())
    for name, tensor in full.items():
        name = "token.weight" if name == "head.weight" else name  # the last stage's tied copy
        difference = max(difference, scaled_error(tensor, expected[name].detach()))
    return Measured(difference, 1e-10, f"({', '.join(axes)}) = {shape}")


@check("5-D", {"parallelize(GPT) with ep vs one process, MiniDDP": {}})
def five_d(device: torch.device) -> Measured:
    """Chapter 12's GPT with 4 experts in its second block (tests/parallelize_ep_tasks.py),
    float64, its experts cut over an "ep" axis of 2, the rest laid out as the 3-D check lays
    them: every batch's loss (the replicas' mean) and every full parameter after AdamW steps,
    within rounding of one process running the same microbatches, aux loss included."""
    from miniddp.mesh import init_device_mesh
    from miniddp.parallelize import parallelize
    from miniddp.parallelize_experts import EP_AXES
    from tests import parallelize_ep_tasks as tasks

    pp, dp, tp = mesh_shape(dist.get_world_size() // 2)
    scenario = tasks.Scenario((pp, dp, 2, tp))
    reference = tasks.one_process(scenario)  # on the CPU, float64
    mesh = init_device_mesh(device.type, scenario.shape, mesh_dim_names=EP_AXES)
    gpt = tasks.build_gpt("fp64").to(device)
    parts = parallelize(gpt, mesh, n_microbatches=tasks.MICROBATCHES)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=tasks.LR)
    difference = 0.0
    for step in range(tasks.STEPS):
        windows = tasks.batches(step, 1, parts.replicas)[0].to(device)
        mine = parts.train_step(windows.tensor_split(parts.replicas)[parts.replica])
        optimizer.step()
        optimizer.zero_grad()
        if mine is not None:  # the last stage's loss: the replicas' mean (tp ranks alike)
            group = mesh["dp", "ep"]._flatten("dp_ep").get_group()
            dist.all_reduce(mine, group=group)
            mine = mine.item() / parts.replicas
            difference = max(difference, abs(mine - reference["losses"][step]))
    for name, tensor in tasks.full_parameters(parts, sharded=False).items():
        name = "token.weight" if name == "head.weight" else name  # the last stage's tied copy
        difference = max(difference, scaled_error(tensor.cpu(), reference["params"][name]))
    return Measured(difference, 1e-10, f"({', '.join(EP_AXES)}) = {scenario.shape}")


@check("HSDP", {"fully_shard over (replicate, shard) vs torch's": {}})
def hsdp(device: torch.device) -> Measured:
    """HSDP, torch's meaning: every Linear, then the root, sharded over a 2-D mesh (2, W / 2),
    replicated down its first axis; three AdamW steps; every full parameter, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh as torchs_mesh
    from torch.distributed.fsdp import fully_shard as torchs_fully_shard

    from miniddp import fully_shard
    from miniddp.mesh import init_device_mesh
    from tests import sharding_fsdp_tasks as tasks

    shape, names = (2, dist.get_world_size() // 2), ("replicate", "shard")
    spec = tasks.FsdpSpec(widths=(8, 16, 12, 4))
    runs = []
    for kind, apply, make_mesh in (
        ("ours", fully_shard, init_device_mesh),
        ("torch", torchs_fully_shard, torchs_mesh),
    ):
        mesh = make_mesh(device.type, shape, mesh_dim_names=names)
        model = tasks.build_model(spec).to(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                apply(layer, mesh=mesh)
        model = apply(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        seen = []
        for step in range(3):
            x, y = tasks.batch(spec, dist.get_rank(), step, 0)
            F.mse_loss(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
            seen += [t.cpu() for t in tasks.full_parameters(kind, model)]
        runs.append(seen)
    return Measured(largest_difference(*runs), note=f"(replicate, shard) = {shape}")


@check("EP", {"all_to_all_single vs torch's (uneven, zeros)": {}})
def all_to_all(device: torch.device) -> Measured:
    """Rank r sends (r + d) % 3 rows to rank d, some of them none: ours, on send/recv,
    against torch.distributed.all_to_all_single on the same rows, bitwise (rows only move)."""
    from miniddp.collectives import all_to_all_single

    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [(rank + d) % 3 for d in range(world)]
    arrives = [(source + rank) % 3 for source in range(world)]
    rows = (torch.arange(sum(sends) * 4, dtype=torch.float32).view(-1, 4) + 1000 * rank).to(device)
    mine = torch.full((sum(arrives), 4), -1.0, device=device)
    theirs = mine.clone()
    all_to_all_single(mine, rows, arrives, sends)
    dist.all_to_all_single(theirs, rows.clone(), arrives, sends)
    return Measured(largest_difference([mine], [theirs]), note=f"rows out: {sum(sends)}")


@check("EP", {"MoE + ExpertParallel vs one process (dropless)": {}})
def expert_parallel(device: torch.device) -> Measured:
    """2W experts, top 2, each rank its own 12 tokens (tests/expert_parallel_tasks.py): the
    output and every expert's gradient bitwise one process's on the whole batch on the CPU
    (each expert sees the same rows in the same order); the router's gradient, summed over
    ranks, within rounding (a sum in another order). On a GPU the experts too are within
    rounding: cuBLAS picks its kernel by the operands' shapes and alignment, and an expert's
    rows sit elsewhere in a batch of 12 tokens than in one of 12 W (measured on an H200:
    2.4e-07, so not bitwise)."""
    from miniddp.expert_parallel import ExpertParallel
    from miniddp.tensor_parallel import parallelize_module
    from tests.expert_parallel_tasks import Spec, build, run

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = Spec(num_experts=2 * world)
    moe, x, dy, _ = build(spec)
    moe, x, dy = moe.to(device), x.to(device), dy.to(device)
    reference = run(moe, x, dy, 1.0)
    moe.zero_grad()
    parallelize_module(moe.experts, dist.group.WORLD, ExpertParallel())
    mine = slice(rank * spec.tokens, (rank + 1) * spec.tokens)
    ours = run(moe, x[mine], dy[mine], 1.0)
    experts = [f"experts.{w}" for w in ("w1", "w2", "w3")]
    pairs = [(ours["y"], reference["y"][mine])]
    pairs += [(ours[name], reference[name].chunk(world)[rank]) for name in experts]
    if device.type == "cpu":
        exact = largest_difference(*zip(*pairs))
        if exact > 0:
            return Measured(exact, note="the output or an expert's gradient is not bitwise")
    else:
        error = max(scaled_error(a, b) for a, b in pairs)
        if error > 1e-6:
            return Measured(error, 1e-6, "the output or an expert's gradient beyond rounding")
    router = ours["router.gate.weight"]
    dist.all_reduce(router)
    error = scaled_error(router, reference["router.gate.weight"])
    exact = "bitwise" if device.type == "cpu" else "within rounding"
    return Measured(error, 1e-6, f"output, experts {exact}; router within rounding")


@check(
    "collectives",
    {
        "miniddp.collectives vs torch.distributed, 4 KB": {"large": False},
        "miniddp.collectives vs torch.distributed, 64 MiB": {"large": True},
    },
)
def collectives(device: torch.device, large: bool) -> Measured:
    """Every send/recv algorithm on device tensors, against torch.distributed's collective on
    the same tensors. Integer-valued floats: every order of addition is exact, so bitwise.

    The large round (64 MiB; 4 MiB on the CPU, where it is only proof that the check runs) is
    larger than NCCL's buffers (4 MiB by default): a pair of ranks that both send before they
    receive, as the doubling and ring algorithms post them, deadlocks if the backend runs a
    pair's send and receive one after the other. It would show here as HUNG."""
    from miniddp import collectives as ours

    rank, world = dist.get_rank(), dist.get_world_size()
    numel = 1000 if not large else (1 << 24 if device.type == "cuda" else 1 << 20)
    values = (torch.arange(numel, dtype=torch.float32) % 251 * (rank + 1)).to(device)
    pairs = []
    for algorithm in ours.BROADCAST_ALGORITHMS:
        mine, theirs = values.clone(), values.clone()
        ours.broadcast(mine, 0, algorithm=algorithm)
        dist.broadcast(theirs, 0)
        pairs.append((mine, theirs))
    for algorithm in ours.REDUCE_ALGORITHMS:
        mine, theirs = values.clone(), values.clone()
        ours.reduce(mine, 0, algorithm=algorithm)
        dist.reduce(theirs, 0)
        if rank == 0:  # only the root's result is defined
            pairs.append((mine, theirs))
    for algorithm in ours.ALL_REDUCE_ALGORITHMS:
        mine, theirs = values.clone(), values.clone()
        ours.all_reduce(mine, algorithm=algorithm)
        dist.all_reduce(theirs)
        pairs.append((mine, theirs))
    pieces = values.repeat(world)
    mine, theirs = torch.zeros_like(values), torch.zeros_like(values)
    ours.reduce_scatter_tensor(mine, pieces)
    dist.reduce_scatter_tensor(theirs, pieces.clone())
    pairs.append((mine, theirs))
    mine, theirs = torch.zeros_like(pieces), torch.zeros_like(pieces)
    ours.all_gather_into_tensor(mine, values)
    dist.all_gather_into_tensor(theirs, values.clone())
    pairs.append((mine, theirs))
    size = f"{numel * 4 / 2**20:g} MiB" if large else f"{numel * 4} B"
    return Measured(largest_difference(*zip(*pairs)), note=f"{len(pairs)} algorithms, {size}")
