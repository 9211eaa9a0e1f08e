"""The ranks' side of scripts/gpu_check.sh: scripts/parallelism_checks.py's checks, run once
under torchrun, one rank per GPU (or two ranks on the CPU, `--cpu`).

A failing check must not stop the others, nor hang them. Every rank runs each check inside a
try/except, then the ranks agree on the outcome over a gloo group of their own (gloo: it runs
whatever the checks' backend is, and it has a timeout). A check that raised on some rank may have
left the checks' group out of step (one rank waiting in a collective the other never joins), so
after it the ranks stop, with exit status RESTART, and scripts/gpu_check.py starts them again on
the checks not yet run. The process-group timeout bounds the wait for a collective that never
completes; the agreement's is longer, so a rank that timed out still reports.

    torchrun --nproc-per-node W scripts/run_checks.py --device cuda --out DIR [CHECK ...]

Each rank appends one JSON line per concluded check to DIR/rank<r>.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallelism_checks import CHECKS, Check  # noqa: E402

CHECK_TIMEOUT_S = 60  # a collective that never completes raises after this
AGREEMENT_TIMEOUT_S = 90  # longer: a rank whose collective timed out still reports
RESTART = 3  # exit status: a check raised, the checks' group may be out of step
STOPPING = ("ERROR", "HUNG")  # the statuses after which the ranks stop


def rank_device(kind: str) -> torch.device:
    """cpu, or this node's GPU local_rank mod the GPU count (two ranks share one GPU)."""
    if kind == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def attempt(chosen: Check, device: torch.device) -> dict:
    """This rank's outcome of one check: passed or not, or what it raised."""
    start = time.perf_counter()
    try:
        measured = chosen.run(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        status = "ok" if measured.difference <= measured.bound else "FAIL"
        outcome = {
            "status": status,
            "difference": measured.difference,
            "bound": measured.bound,
            "note": measured.note,
        }
    except Exception as error:
        outcome = {
            "status": "ERROR",
            "note": f"{type(error).__name__}: {error}".splitlines()[0],
            "traceback": traceback.format_exc(),
            "raised_at": time.time(),
        }
    return outcome | {"seconds": time.perf_counter() - start}


def agree(name: str, parallelism: str, outcomes: list[dict]) -> dict:
    """One row from every rank's outcome: the worst status, the largest difference, and of the
    errors the first raised (the others are often its echo: a peer's collective timing out)."""
    errors = [
        (o["raised_at"], rank, o) for rank, o in enumerate(outcomes) if o["status"] == "ERROR"
    ]
    failed = [o for o in outcomes if o["status"] == "FAIL"]
    measured = [o for o in outcomes if "difference" in o]
    row = {
        "check": name,
        "parallelism": parallelism,
        "status": "ok",
        "seconds": max(o["seconds"] for o in outcomes),
    }
    if measured:
        worst = max(measured, key=lambda o: o["difference"])
        row |= {k: worst[k] for k in ("difference", "bound", "note")}
    if errors:
        _, rank, first = min(errors, key=lambda error: error[:2])
        row |= {
            "status": "ERROR",
            "note": f"rank {rank}: {first['note']}",
            "traceback": first["traceback"],
        }
    elif failed:
        row["status"] = "FAIL"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="*", help="names from CHECKS (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = rank_device(args.device)
    timeout = timedelta(seconds=CHECK_TIMEOUT_S)
    pinned = {"device_id": device} if args.backend == "nccl" else {}  # NCCL: this rank's GPU
    dist.init_process_group(args.backend, timeout=timeout, **pinned)
    agreement = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREEMENT_TIMEOUT_S))
    rank = dist.get_rank()
    log = (args.out / f"rank{rank}.jsonl").open("a")
    for name in args.checks or list(CHECKS):
        chosen = CHECKS[name]
        mine = attempt(chosen, device)
        outcomes: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(outcomes, mine, group=agreement)
            row = agree(name, chosen.parallelism, outcomes)
        except RuntimeError:  # a peer never reported: hung, or dead
            row = agree(name, chosen.parallelism, [mine]) | {
                "status": "HUNG",
                "note": (
                    f"a rank did not report within {AGREEMENT_TIMEOUT_S} s; rank {rank}: "
                    f"{mine['status']} {mine.get('note', '')}"
                ),
            }
        log.write(json.dumps(row) + "\n")
        log.flush()
        if row["status"] in STOPPING:
            return RESTART  # the checks' group may be out of step: start afresh
    dist.barrier(group=agreement)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
