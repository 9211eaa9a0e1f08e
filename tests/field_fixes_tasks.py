"""What the ranks run for tests/test_field_fixes.py: the cases a hostile user found wrong (issue
45), each beside its reference (one process, or torch's own implementation)."""

from __future__ import annotations

import contextlib

import torch

from miniddp.parallelize import parallelize
from tests.mesh_tasks import mesh_once
from tests.parallelize_tasks import build_gpt, full_tensors, windows

ACCUMULATED_STEPS = 2  # train_step() calls before each optimizer.step()


def halves(step: int, replicas: int) -> list[list[torch.Tensor]]:
    """[replica][h]: replica r's share of the step's windows, cut into ACCUMULATED_STEPS parts."""
    shares = windows(step, replicas).tensor_split(replicas)
    return [list(share.tensor_split(ACCUMULATED_STEPS)) for share in shares]


def one_process_accumulating(replicas: int, steps: int) -> dict[str, torch.Tensor]:
    """One process: for each part h, the loss over every replica's part h, backward; then the
    optimizer. What `train_step` twice, then `optimizer.step()`, promises."""
    model = build_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        parts = halves(step, replicas)
        for h in range(ACCUMULATED_STEPS):
            batch = torch.cat([parts[r][h] for r in range(replicas)])
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def parallel_accumulating(
    shape: tuple[int, int, int], data_parallel: str, steps: int
) -> dict[str, torch.Tensor]:
    mesh = mesh_once(shape, ("pp", "dp", "tp"))
    parts = parallelize(build_gpt(), mesh, n_microbatches=2, data_parallel=data_parallel)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=1e-2)
    replica = mesh["dp"].get_local_rank()
    for step in range(steps):
        for part in halves(step, shape[1])[replica]:
            parts.train_step(part)
        optimizer.step()
        optimizer.zero_grad()
    sharded = data_parallel == "fsdp" and shape[1] > 1
    return full_tensors(parts.model, mesh, sharded)


def ring_attention_with_settings_per_rank(settings: list[dict]) -> str:
    """ring_attention with `settings[rank]` as this rank's keywords: its error, or "accepted"."""
    import torch.distributed as dist

    from miniddp.context_parallel import ring_attention

    q = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        ring_attention(q, q, q, **settings[dist.get_rank()])
    except ValueError as error:
        return str(error)
    return "accepted"


class TakesAKeyword(torch.nn.Module):
    """A module whose second input comes by keyword, and meets a weight in a matmul."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        return self.first(x) * self.second(other)


def keyword_input_under_mixed_precision() -> dict[str, torch.Tensor]:
    """MiniDDP(bf16) given the second input by keyword, and the same model given it by position:
    a floating-point keyword input is cast to param_dtype as a positional one is."""
    import torch.distributed as dist

    from miniddp import MiniDDP, MixedPrecision

    g = torch.Generator().manual_seed(dist.get_rank())
    x, other = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    results = {}
    for how in ("keyword", "position"):
        model = MiniDDP(TakesAKeyword(), mixed_precision=MixedPrecision(torch.bfloat16))
        output = model(x, other=other) if how == "keyword" else model(x, other)
        output.float().square().sum().backward()
        results[f"{how} output"] = output.detach()
        results[f"{how} grad"] = model.module.second.weight.grad.clone()
    return results


def optimizer_in_backward(wrapper: str) -> list[torch.Tensor]:
    """SGD run inside backward, by post-accumulate-grad hooks on `model.parameters()` (the fp32
    masters), under bf16 mixed precision: "miniddp" (MiniDDP(mixed_precision=...)) or "torch"
    (torch's fully_shard with the same policy, whose hooks run on each reduced shard). The full
    parameters after two backwards, each rank on its own data."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from miniddp import MiniDDP, MixedPrecision

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if wrapper == "miniddp":
        run = MiniDDP(model, mixed_precision=MixedPrecision(torch.bfloat16))
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        run = fully_shard(model, mp_policy=policy)

    def step(param: torch.Tensor) -> None:
        with torch.no_grad():
            param.add_(param.grad, alpha=-0.1)
        param.grad = None

    params = list(model.parameters())
    for param in params:
        param.register_post_accumulate_grad_hook(step)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        run(torch.randn(3, 4, generator=g)).float().square().sum().backward()
    if wrapper == "torch":
        return [p.full_tensor().detach() for p in params]
    return [p.detach().clone() for p in params]


def validation_then_checkpoint(path: str) -> dict:
    """MiniDDP(bf16): 2 steps, a validation forward without no_grad, save_checkpoint, 2 steps
    more; then a fresh model loads the checkpoint and runs the same 2 steps. The saved weights'
    dtypes, and both ends' parameters."""
    import torch.distributed as dist

    from miniddp import MiniDDP, MixedPrecision
    from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint

    def build() -> tuple[MiniDDP, torch.optim.Optimizer]:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        model = MiniDDP(module, mixed_precision=MixedPrecision(torch.bfloat16))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: MiniDDP, optimizer: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            model(torch.randn(3, 4, generator=g)).float().square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    model, optimizer = build()
    train(model, optimizer, range(2))
    model(torch.randn(5, 4))  # validation, without torch.no_grad(): no backward follows
    save_checkpoint(path, model, optimizer, Progress(step=2, epoch=0, batches_done=2))
    train(model, optimizer, range(2, 4))
    resumed, resumed_optimizer = build()
    resumed(torch.randn(5, 4))  # the copies in its slots as it loads
    load_checkpoint(path, resumed, resumed_optimizer)
    train(resumed, resumed_optimizer, range(2, 4))
    saved = torch.load(path, weights_only=True)["model"]
    loaded_directly, _ = build()
    loaded_directly(torch.randn(5, 4))
    loaded_directly.module.load_state_dict(saved)  # into the masters, not the copies
    masters = dict(zip(loaded_directly.param_names, loaded_directly.params, strict=True))
    return {
        "saved dtypes": {name: tensor.dtype for name, tensor in saved.items()},
        "loaded directly": all(torch.equal(masters[n], t) for n, t in saved.items()),
        "uninterrupted": [p.detach().clone() for p in model.parameters()],
        "resumed": [p.detach().clone() for p in resumed.parameters()],
    }


def _interleaved_step(schedule_class, wrap, mesh_shape: tuple[int, int]) -> dict:
    """One step of `schedule_class` over v = 2 stages a rank, each a Linear + Tanh wrapped by
    `wrap(module, mesh)`, on a (pp, dp) mesh; each stage's parameters' gradients afterwards."""
    from miniddp.pipeline import PipelineStage

    mesh = mesh_once(mesh_shape, ("pp", "dp"))
    pp = mesh["pp"]
    ranks, rank, v = pp.size(), pp.get_local_rank(), 2
    stages = []
    for i in range(v):
        index = rank + i * ranks
        torch.manual_seed(index)
        module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        stages.append(
            PipelineStage(wrap(module, mesh), index, v * ranks, "cpu", group=pp.get_group())
        )
    schedule = schedule_class(stages, 4, lambda out, y: (out.float() - y).pow(2).mean())
    g = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    if rank == 0:
        schedule.step(x)
    elif rank == ranks - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    return {stage.stage_index: [p.grad for p in stage.submodule.parameters()] for stage in stages}


def compute_copies_under(schedule_name: str) -> dict:
    """bf16 compute copies (ComputeInCopies, parallelize's mixed precision at dp = 1) in each
    stage, under interleaved 1F1B or zero bubble: the masters' gradients."""
    from miniddp.data_parallel.compute_copies import ComputeInCopies, MixedPrecision
    from miniddp.pipeline import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    schedule_class = {
        "interleaved 1F1B": ScheduleInterleaved1F1B,
        "zero bubble": ScheduleInterleavedZeroBubble,
    }[schedule_name]
    policy = MixedPrecision(torch.bfloat16)
    return _interleaved_step(
        schedule_class, lambda module, mesh: ComputeInCopies(module, policy), (2, 1)
    )


def fully_sharded_stages_under_zero_bubble(which: str) -> dict:
    """(pp, dp) = (2, 2): each stage module fully_shard'ed over the dp axis, by MiniDDP's
    fully_shard or torch's, under zero bubble."""
    from miniddp import fully_shard
    from miniddp.pipeline import ScheduleInterleavedZeroBubble

    def shard(module: torch.nn.Module, mesh) -> torch.nn.Module:
        if which == "miniddp":
            return fully_shard(module, process_group=mesh["dp"].get_group())
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard(module, mesh=_torch_mesh((2, 2), ("pp", "dp"))["dp"])

    return _interleaved_step(ScheduleInterleavedZeroBubble, shard, (2, 2))


_TORCH_MESHES: dict = {}


def _torch_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """torch's DeviceMesh, once per worker (its groups are made collectively, and kept)."""
    from torch.distributed.device_mesh import init_device_mesh

    if (shape, names) not in _TORCH_MESHES:
        _TORCH_MESHES[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _TORCH_MESHES[shape, names]


def master_hooks_under_mixed_precision() -> dict[str, list[bool]]:
    """Post-accumulate-grad hooks on the fp32 masters, in a backward inside no_sync(), in a
    synced one, and under ComputeInCopies: for each master, whether its hook ran exactly once
    and saw the fp32 gradient the master holds when backward returns."""
    from miniddp import MiniDDP, MixedPrecision
    from miniddp.data_parallel.compute_copies import ComputeInCopies

    policy = MixedPrecision(torch.bfloat16)
    x = torch.randn(3, 4)
    found = {}
    for case in ("no_sync", "synced", "ComputeInCopies"):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        seen: dict[torch.Tensor, list[torch.Tensor]] = {p: [] for p in module.parameters()}
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, grads=seen[param]: grads.append(p.grad.clone())
            )
        if case == "ComputeInCopies":
            model = ComputeInCopies(module, policy)
        else:
            model = MiniDDP(module, mixed_precision=policy)
        with model.no_sync() if case == "no_sync" else contextlib.nullcontext():
            model(x).float().sum().backward()
        found[case] = [
            len(grads) == 1 and grads[0].dtype == torch.float32 and torch.equal(grads[0], p.grad)
            for p, grads in seen.items()
        ]
    return found
