"""The GPU path: MiniDDP, its send/recv collectives and the step benchmark on CUDA tensors.

The README promises that nothing changes on GPUs: `init_distributed()` picks NCCL, MiniDDP builds
its buckets on the module's device. These tests check it on one GPU, which is all a single
machine may have: MiniDDP over NCCL at W = 1, and over gloo with CUDA tensors at W = 2, both ranks
on the same GPU (NCCL refuses two ranks on one GPU). Each scenario also runs on CPU, unmarked, so
its own code is checked on every machine. The CUDA runs carry the `cuda` marker and are skipped
without a GPU:

    python -m pytest -m cuda tests/test_cuda.py     (or scripts/gpu_check.sh, one summary line)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests import cuda_tasks
from tests.harness.pool import RankPool
from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()
ON_GPU = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(NO_CUDA, reason="no CUDA device")]
)
DEVICES = ["cpu", ON_GPU]


@pytest.mark.parametrize("device", DEVICES)
def test_miniddp_on_one_rank_over_the_devices_backend_matches_torch_ddp(
    rank_pools: Callable[[int], RankPool], device: str
) -> None:
    """W = 1 over NCCL on a GPU (gloo on CPU): a group of that backend, buckets on the device."""
    backend = "nccl" if device == "cuda" else "gloo"
    [result] = rank_pools(1).run(cuda_tasks.miniddp_and_torch_ddp, device, backend, timeout=60)
    assert result["backend"] == backend and result["device"].startswith(device)
    assert result["equal"], "MiniDDP's gradients or weights differ from torch's DDP"


@pytest.mark.parametrize("device", DEVICES)
def test_miniddp_on_two_ranks_over_gloo_matches_torch_ddp(pool2: RankPool, device: str) -> None:
    """W = 2 over gloo; on a GPU both ranks' tensors live on it (gloo copies through the host)."""
    results = pool2.run(cuda_tasks.miniddp_and_torch_ddp, device, None, timeout=60)
    for rank, result in enumerate(results):
        assert result["backend"] == "gloo" and result["device"].startswith(device), rank
        assert result["equal"], f"rank {rank}: MiniDDP differs from torch's DDP"


@pytest.mark.parametrize("device", DEVICES)
def test_send_recv_collectives_match_torch(pool2: RankPool, device: str) -> None:
    """Every algorithm built from isend/irecv, on `device` tensors, against torch.distributed."""
    for rank, results in enumerate(pool2.run(cuda_tasks.collectives_against_torch, device)):
        wrong = [name for name, same in results.items() if not same]
        assert not wrong, f"rank {rank}: {wrong} differ from torch.distributed"


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_step_benchmark_runs_on_cuda(tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "miniddp.bench", "step", "--device=cuda", "--models=mlp",
        "--variants=miniddp,torch", "--iters=5", "--trace-iters=1", f"--json={report}",
    ]  # fmt: skip
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
