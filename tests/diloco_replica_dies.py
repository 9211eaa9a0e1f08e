"""A DiLoCo run in which one replica dies, as real processes (not the shared pool: a death
leaves its process group unusable for collectives), and the run it must equal.

    death      W replicas; `victim` calls os._exit between syncs 1 and 2 (no goodbye, no note);
               the others notice at sync 2, agree on who is left and go on to the end
    reference  the run that never had the victim from sync 2 on: W replicas up to sync 1,
               then the others alone, over a group without it, resumed from DiLoCo's state

Each surviving rank saves its parameters to OUT/rank<r>.pt, or its error to OUT/rank<r>.txt.
tests/test_local_sgd.py starts it:

    python tests/diloco_replica_dies.py --mode death --rank R --world-size W --store S --out D
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VICTIM = 2
DIES_AFTER_STEP = 4  # an inner step between sync 1 (after step 3) and sync 2 (after step 6)
DEADLINE_S = 120.0
SLOW_S = 0.5  # a slow replica's extra time per step


def launch(
    mode: str, world_size: int, tmp: Path, victim: int = VICTIM, slow: int = -1
) -> tuple[dict[int, object], dict[int, str]]:
    """Run every rank; return each survivor's parameters (a list) or error (a str), and how
    each survivor heard of the death."""
    import torch

    out = tmp / mode
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    common = [sys.executable, __file__, "--mode", mode, "--world-size", str(world_size)]
    common += ["--store", str(tmp / f"{mode}-store"), "--out", str(out)]
    common += ["--victim", str(victim), "--slow", str(slow)]
    processes = [
        subprocess.Popen([*common, "--rank", str(r)], env=env, start_new_session=True)
        for r in range(world_size)
    ]
    deadline = time.monotonic() + DEADLINE_S
    try:
        for process in processes:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    results: dict[int, object] = {}
    for rank in range(world_size):
        if (out / f"rank{rank}.pt").exists():
            results[rank] = torch.load(out / f"rank{rank}.pt")
        elif (out / f"rank{rank}.txt").exists():
            results[rank] = (out / f"rank{rank}.txt").read_text()
    named = {
        r: (out / f"rank{r}.named").read_text()
        for r in range(world_size)
        if (out / f"rank{r}.named").exists()
    }
    return results, named


def main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from miniddp.local_sgd import DiLoCo
    from tests import local_sgd_tasks
    from tests.local_sgd_tasks import Spec, build_model, inner_optimizer, outer_optimizer

    def train(spec, model, inner, replica, steps) -> None:
        for step in steps:  # the slow rank lags: it must not be taken for dead
            if args.rank == args.slow:
                time.sleep(SLOW_S)
            local_sgd_tasks.train(spec, model, inner, replica, range(step, step + 1))

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(args.store, args.world_size),
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=20),
    )
    spec = Spec(replicas=args.world_size, sync_every=3, outer_steps=3)
    out = Path(args.out)
    model = build_model(spec)
    inner = inner_optimizer(spec, model.parameters())
    outer = outer_optimizer(spec, model.parameters())
    run = DiLoCo(model, inner, outer, spec.sync_every)
    first = range(spec.sync_every)
    rest = range(spec.sync_every, spec.inner_steps)
    try:
        if args.mode == "death":
            with run:
                train(spec, model, inner, args.rank, first)
                if args.rank == args.victim:
                    train(spec, model, inner, args.rank, range(spec.sync_every, DIES_AFTER_STEP))
                    os._exit(1)
                train(spec, model, inner, args.rank, rest)
        else:
            with run:
                train(spec, model, inner, args.rank, first)
            survivors = [r for r in range(args.world_size) if r != args.victim]
            group = dist.new_group(survivors)  # every rank makes it, the victim too
            if args.rank == args.victim:
                os._exit(0)
            state = run.state_dict()
            run = DiLoCo(model, inner, outer, spec.sync_every, process_group=group)
            run.load_state_dict(state)
            with run:
                train(spec, model, inner, args.rank, rest)
        torch.save([p.detach().clone() for p in model.parameters()], out / f"rank{args.rank}.pt")
        if run.exchange.failure is not None:
            named = f"survivors {run.exchange.survivors}\n{run.exchange.failure}"
            (out / f"rank{args.rank}.named").write_text(named)
    except Exception as error:
        (out / f"rank{args.rank}.txt").write_text(f"{type(error).__name__}: {error}")
    os._exit(0)  # the dead replica's group cannot be shut down cleanly


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One rank of a DiLoCo run with a death.")
    parser.add_argument("--mode", choices=("death", "reference"), required=True)
    for name in ("--rank", "--world-size", "--victim", "--slow"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--store", "--out"):
        parser.add_argument(name, required=True)
    main(parser.parse_args())
