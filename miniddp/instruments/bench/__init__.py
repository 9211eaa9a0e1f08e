"""Benchmarks: `python -m miniddp.bench COMMAND [options]`.

Each command is a module here with a `parse_args(argv)`, which checks every option and touches
nothing distributed, and a `main(argv)` that runs on every rank. Run plainly, the benchmark
checks the options, then relaunches itself under torchrun with two ranks (the real launcher, not
a home-made one); under torchrun it uses the ranks it was given. A bad option is refused by the
first process, once, before anything starts (`__main__.check_options`).
"""

from __future__ import annotations

import os
import sys

import torch

from miniddp.job.env import launched_by_torchrun


def relaunch_under_torchrun(argv: list[str], nproc: int = 2) -> None:
    """Replace this process with `torchrun --standalone --nproc_per_node=N -m miniddp.bench ...`."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank: the ranks share cores
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*torchrun, f"--nproc_per_node={nproc}", "-m", "miniddp.bench", *argv]
    print("+ " + " ".join(command[1:]), flush=True)
    os.execvpe(sys.executable, command, env)


def should_relaunch() -> bool:
    return not launched_by_torchrun()


def backend_for(device: str) -> str:
    """gloo on CPU. On GPUs, NCCL needs a GPU per rank; ranks that share one use gloo, which
    takes CUDA tensors too (it copies them through host memory)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    enough_gpus = device == "cuda" and torch.cuda.device_count() >= local_ranks
    return "nccl" if enough_gpus else "gloo"
