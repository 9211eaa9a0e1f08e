"""The GPU path: MiniDDP, its send/recv collectives and the step benchmark on CUDA tensors.

The README promises that nothing changes on GPUs: `init_distributed()` picks NCCL, MiniDDP builds
its buckets on the module's device. These tests check it on one GPU, which is all a single
machine may have: MiniDDP over NCCL at W = 1, and over gloo with CUDA tensors at W = 2, both ranks
on the same GPU (NCCL refuses two ranks on one GPU). Each scenario also runs on CPU, unmarked, so
its own code is checked on every machine. The CUDA runs carry the `cuda` marker and are skipped
without a GPU:

    python -m pytest -m cuda tests/test_cuda.py     (or scripts/gpu_check.sh: these and more)

Each scenario the ranks run is a module-level function next to its test (the pool's workers
import `tests.test_cuda`). It builds its tensors on `device` ("cpu", or "cuda": rank r on GPU
r mod the GPU count, so two ranks share one GPU when there is only one) and compares with a
reference computed by torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP, collectives
from tests.harness.pool import RankPool
from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()
ON_GPU = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(NO_CUDA, reason="no CUDA device")]
)
DEVICES = ["cpu", ON_GPU]
STEPS = 3


def rank_device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    index = dist.get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def small_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)]
    return nn.Sequential(*layers).to(device)


def train_a_few_steps(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """A few SGD steps on this rank's own batches; returns the last gradients, then the weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        optimizer.zero_grad()
        inputs = torch.randn(16, 8, generator=generator).to(device)
        model(inputs).square().mean().backward()
        optimizer.step()
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    return grads + [p.detach().cpu() for p in model.parameters()]


def miniddp_and_torch_ddp(kind: str, backend: str | None) -> dict[str, object]:
    """Train MiniDDP and torch's DDP side by side over a group of `backend` (None: the pool's
    own gloo group); return where they ran and whether every gradient and weight is equal."""
    device = rank_device(kind)
    group = dist.new_group(backend=backend) if backend else None
    try:
        ours = train_a_few_steps(
            MiniDDP(small_model(device), process_group=group, bucket_cap_mb=0.001), device
        )
        device_ids = [device] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            small_model(device), device_ids=device_ids, process_group=group, bucket_cap_mb=0.001
        )
        theirs = train_a_few_steps(wrapped, device)
        backend_used = dist.get_backend(group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return {
        "device": str(device),
        "backend": backend_used,
        "equal": all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_miniddp_on_one_rank_over_the_devices_backend_matches_torch_ddp(
    rank_pools: Callable[[int], RankPool], device: str
) -> None:
    """W = 1 over NCCL on a GPU (gloo on CPU): a group of that backend, buckets on the device."""
    backend = "nccl" if device == "cuda" else "gloo"
    [result] = rank_pools(1).run(miniddp_and_torch_ddp, device, backend, timeout=60)
    assert result["backend"] == backend and result["device"].startswith(device)
    assert result["equal"], "MiniDDP's gradients or weights differ from torch's DDP"


@pytest.mark.parametrize("device", DEVICES)
def test_miniddp_on_two_ranks_over_gloo_matches_torch_ddp(pool2: RankPool, device: str) -> None:
    """W = 2 over gloo; on a GPU both ranks' tensors live on it (gloo copies through the host)."""
    results = pool2.run(miniddp_and_torch_ddp, device, None, timeout=60)
    for rank, result in enumerate(results):
        assert result["backend"] == "gloo" and result["device"].startswith(device), rank
        assert result["equal"], f"rank {rank}: MiniDDP differs from torch's DDP"


def collectives_against_torch(kind: str, numel: int = 1000) -> dict[str, bool]:
    """Every send/recv algorithm of miniddp.collectives on `kind` tensors, against
    torch.distributed on CPU copies. Integer-valued floats: every order of addition is exact."""
    device, rank, world_size = rank_device(kind), dist.get_rank(), dist.get_world_size()
    values = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    results = {}
    for algorithm in collectives.BROADCAST_ALGORITHMS:
        ours, theirs = values.to(device), values.clone()
        collectives.broadcast(ours, 0, algorithm=algorithm)
        dist.broadcast(theirs, 0)
        results[f"broadcast {algorithm}"] = torch.equal(ours.cpu(), theirs)
    for algorithm in collectives.REDUCE_ALGORITHMS:
        ours, theirs = values.to(device), values.clone()
        collectives.reduce(ours, 0, algorithm=algorithm)
        dist.reduce(theirs, 0)
        results[f"reduce {algorithm}"] = rank != 0 or torch.equal(ours.cpu(), theirs)  # root's
    for algorithm in collectives.ALL_REDUCE_ALGORITHMS:
        ours, theirs = values.to(device), values.clone()
        collectives.all_reduce(ours, algorithm=algorithm)
        dist.all_reduce(theirs)
        results[f"all_reduce {algorithm}"] = torch.equal(ours.cpu(), theirs)
    pieces = values.repeat(world_size)
    ours, theirs = torch.zeros(numel, device=device), torch.zeros(numel)
    collectives.reduce_scatter_tensor(ours, pieces.to(device))
    dist.reduce_scatter(theirs, list(pieces.clone().chunk(world_size)))
    results["reduce_scatter ring"] = torch.equal(ours.cpu(), theirs)
    ours, theirs = torch.zeros(world_size * numel, device=device), torch.zeros(world_size * numel)
    collectives.all_gather_into_tensor(ours, values.to(device))
    dist.all_gather(list(theirs.chunk(world_size)), values.clone())
    results["all_gather ring"] = torch.equal(ours.cpu(), theirs)
    return results


@pytest.mark.parametrize("device", DEVICES)
def test_send_recv_collectives_match_torch(pool2: RankPool, device: str) -> None:
    """Every algorithm built from isend/irecv, on `device` tensors, against torch.distributed.
    On CUDA over gloo, whose send/recv read host memory only, each message goes through a host
    copy (collectives/peers.py, on_the_wire)."""
    for rank, results in enumerate(pool2.run(collectives_against_torch, device)):
        wrong = [name for name, same in results.items() if not same]
        assert not wrong, f"rank {rank}: {wrong} differ from torch.distributed"


def pipeline_gradients(kind: str) -> list[torch.Tensor]:
    """One Schedule1F1B step of a 2-stage MLP, a stage a rank: this stage's gradients."""
    from miniddp import pipeline
    from tests.test_pipeline import PipeSpec, batch, build_model, mse

    device, rank = rank_device(kind), dist.get_rank()
    spec = PipeSpec(widths=(6, 5, 3), n_microbatches=4)
    block = build_model(spec)[rank].to(device)
    stage = pipeline.PipelineStage(block, rank, spec.stages, device)
    schedule = pipeline.Schedule1F1B(stage, spec.n_microbatches, mse)
    x, y = (t.to(device) for t in batch(spec, 0))
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
    return [p.grad.cpu() for p in block.parameters()]


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_the_pipeline_sends_cuda_tensors_over_gloo(pool2: RankPool) -> None:
    """Activations and gradients between stages on CUDA over gloo go through a host copy
    (pipeline/p2p.py): the gradients are the CPU run's, to the GPU's rounding."""
    on_gpu, on_cpu = pool2.run(pipeline_gradients, "cuda"), pool2.run(pipeline_gradients, "cpu")
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        for a, b in zip(gpu, cpu, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_step_benchmark_runs_on_cuda(tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    command = [
        sys.executable,
        "-m",
        "miniddp.bench",
        "step",
        "--device=cuda",
        "--models=mlp",
        "--variants=miniddp,torch",
        "--iters=5",
        "--trace-iters=1",
        f"--json={report}",
    ]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=300)
    assert returncode == 0, tail(output)
    figures = json.loads(report.read_text())
    assert figures["device"] == "cuda"
    assert set(figures["results"][0]["wall_s"]) == {"miniddp", "torch"}


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")
def test_gpu_check_without_cuda_says_so_and_fails() -> None:
    result = subprocess.run(
        ["scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert result.stderr.startswith("gpu_check: no CUDA device:"), result.stderr
