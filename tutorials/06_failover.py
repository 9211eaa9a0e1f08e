"""Chapter 06: failover. A rank dies, torchrun restarts everyone, training resumes bit for bit.

    torchrun --standalone --nproc_per_node=2 --max-restarts=2 tutorials/06_failover.py \\
        --crash-at-step 7
    torchrun --standalone --nproc_per_node=2 tutorials/06_failover.py      (no crash)

One dead rank stops the whole job: every step ends in an all-reduce that needs all ranks, so the
survivors' next collective fails. torchrun's answer is blunt. With `--max-restarts=N` it stops
every worker and starts them all again with the same arguments, up to N times; nothing in memory
survives, so the script must resume from its own checkpoint. This chapter trains a small model
with dropout on shuffled data, checkpoints every `--checkpoint-every` steps into
`--checkpoint-dir` and resumes from whatever it finds there. `--crash-at-step S` makes the last
rank `os._exit` after step S, on the first attempt only. The claim, checked at the end: the run
that crashed and resumed ends with the same parameters, bit for bit, as a run that never stopped.
The last line prints their SHA-256, so two runs can be compared from outside too.

Why a checkpoint must hold more than the model (the mistakes of well-known tutorials):
- `torch.save(model.state_dict())` alone: the optimizer's momentum restarts at zero.
- `ddp.state_dict()`: every key gains a "module." prefix and loads only into a wrapped model.
- The epoch but not the position within it: the resumed epoch replays batches already trained on.
- No RNG states, or only rank 0's: dropout masks (and any random augmentation) change.
- Every rank writing the same file at once, or writing it in place: a crash mid-write destroys the
  only checkpoint. Rank 0 writes, into a temporary file renamed over the old one.
- `torch.load` without `map_location`: every rank loads onto the GPU that saved the tensors.
- With 3 or more ranks, even MiniDDP's bucket layout: gloo's sums depend on where each gradient
  sits in its bucket, and a fresh wrapper starts again from its first-step layout (chapter 03e).

Why ranks may change across restarts: each attempt is a new rendezvous. torchrun documents that
RANK is not stable between restarts (nodes are ranked by sorting their descriptors in each round,
so a replaced or added node shifts the others), and an elastic job (`--nnodes=1:4`) can come back
with another world size. Nothing may be keyed by host or process: the checkpoint keeps RNG states
by rank, because the rank is what decides which data a worker reads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from common import end_chapter, make_dataset, say, say_all_ranks, say_prose, section
from torch import nn
from torch.utils.data import TensorDataset

from miniddp import DistributedSampler, MiniDDP
from miniddp.checkpoint import (
    Progress,
    load_checkpoint,
    read_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from miniddp.checkpoint.file import rng_path
from miniddp.job.env import DistEnv, init_distributed

SEED = 0
SAMPLES_PER_RANK = 48
BATCH = 8  # per rank: 6 batches per epoch
LEARNING_RATE = 0.02
MOMENTUM = 0.9
Data = tuple[DistributedSampler, TensorDataset]
# Saved with each checkpoint: a run with other settings must not continue from it.
SETTINGS = {
    "seed": SEED,
    "samples_per_rank": SAMPLES_PER_RANK,
    "batch": BATCH,
    "learning_rate": LEARNING_RATE,
    "momentum": MOMENTUM,
}


def build_model() -> nn.Module:
    """8 -> 32 -> 32 -> 1 with dropout: its masks come from the global RNG, so RNG state matters."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return nn.Sequential(
            *(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2)),
            *(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.2)),
            nn.Linear(32, 1),
        )


def fresh_training(env: DistEnv) -> tuple[MiniDDP, torch.optim.Optimizer]:
    """Model, wrapper and optimizer as a brand-new process makes them, RNG seeded per rank."""
    torch.manual_seed(SEED + env.rank)  # each rank its own dropout masks
    model = build_model().to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    return MiniDDP(model), optimizer


def batches(
    sampler: DistributedSampler, dataset: TensorDataset, epoch: int, skip: int
) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """This rank's batches of `epoch` after the first `skip`, each with its number in the epoch.

    Indexing the sampler's list makes skipping free. A DataLoader would have to load and discard
    the skipped batches, and it also draws a seed from the global RNG each time it is iterated,
    so an extra `iter(loader)` on resume would shift every later dropout mask: give it its own
    `generator=` (torchdata's StatefulDataLoader saves its position for you).
    """
    sampler.set_epoch(epoch)
    mine = list(sampler)
    for number in range(skip + 1, len(mine) // BATCH + 1):
        yield number, dataset[mine[(number - 1) * BATCH : number * BATCH]]


def train(
    ddp: MiniDDP,
    optimizer: torch.optim.Optimizer,
    data: Data,
    progress: Progress,
    until_step: int,
    after_step: Callable[[Progress, float], None] | None = None,
) -> Progress:
    """Train from `progress` until `until_step` optimizer steps are done; return the progress."""
    epoch, skip = progress.epoch, progress.batches_done
    while progress.step < until_step:
        for number, (inputs, targets) in batches(*data, epoch, skip):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            progress = Progress(progress.step + 1, epoch, number)
            if after_step is not None:
                after_step(progress, loss.item())
            if progress.step == until_step:
                return progress
        epoch, skip = epoch + 1, 0
    return progress


def params_sha256(model: nn.Module) -> str:
    """A fingerprint of the exact bits of every parameter, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(bytes(tensor.detach().cpu().contiguous().view(torch.uint8).flatten()))
    return digest.hexdigest()


def write_event(directory: Path, name: str, **fields) -> None:
    """Leave a timestamped note for the next attempt, which reports the failover timeline."""
    (directory / f"failover-{name}.json").write_text(json.dumps({"time": time.time(), **fields}))


def read_events(directory: Path) -> dict[str, dict]:
    notes = directory.glob("failover-*.json")
    return {note.stem.removeprefix("failover-"): json.loads(note.read_text()) for note in notes}


def report_failover(directory: Path, marks: dict[str, float], resumed_from: int | None) -> None:
    """Rank 0 of a restarted attempt: how long detection and restart took, from the notes that
    the dying rank and the survivors left (one machine, so their clocks agree)."""
    events = read_events(directory)
    crash = events.get("crash")
    if crash is None:
        say("No crash note found: this restart was not caused by --crash-at-step.")
        return
    died = crash["time"]
    say(f"Seconds after rank {crash['rank']} died (after step {crash['step']}):")
    noticed = {name: event for name, event in sorted(events.items()) if name != "crash"}
    for name, event in noticed.items():
        who = name.removeprefix("noticed-")
        say(f"  +{event['time'] - died:7.3f}  {who}'s collective failed: {event['error']}")
    if not noticed:
        say("  (no survivor noted an error: torchrun stopped them first)")
    say(
        f"  +{marks['start'] - died:7.3f}  this attempt's main() began: torchrun saw the exit, "
        "stopped the others, started\n            new workers, and they imported torch\n"
        f"  +{marks['group'] - died:7.3f}  process group ready\n"
        f"  +{marks['built'] - died:7.3f}  model and optimizer built (the first optimizer imports "
        "torch._dynamo)\n"
        f"  +{marks['loaded'] - died:7.3f}  checkpoint loaded\n"
        f"  +{marks['first_step'] - died:7.3f}  first step done"
    )
    if resumed_from is not None:
        say(f"Work lost: steps {resumed_from + 1}..{crash['step']}, done again.")


def compare_resumes(
    env: DistEnv, data: Data, steps: int, directory: Path
) -> tuple[str, dict[str, bool]]:
    """Train uninterrupted in memory, checkpointing once mid-epoch; then resume from that
    checkpoint restoring everything, and again forgetting one piece at a time. Returns the
    uninterrupted run's fingerprint and, per way of resuming, whether it ended identical."""
    batches_per_epoch = len(data[0]) // BATCH
    middle = steps // 2 if (steps // 2) % batches_per_epoch else steps // 2 - 1
    path = directory / f"demo-step{middle}.pt"

    def save_at_middle(progress: Progress, loss: float) -> None:
        if progress.step == middle:
            save_checkpoint(path, ddp, optimizer, progress, extra=SETTINGS)

    ddp, optimizer = fresh_training(env)
    train(ddp, optimizer, data, Progress(0, 0, 0), steps, save_at_middle)
    uninterrupted = params_sha256(ddp.module)
    saved = read_checkpoint(path, map_location=env.device)
    say_prose(f"""\
        Uninterrupted run in memory, checkpoint at step {middle} (epoch
        {saved["progress"]["epoch"]}, batch {saved["progress"]["batches_done"]} of
        {batches_per_epoch} done); then resumed from it to step {steps}:""")
    variants = {
        "everything (load_checkpoint)": None,
        "model only, no optimizer state": {"position", "rng"},
        "epoch but not the position in it": {"optimizer", "rng"},
        "no RNG states (fresh seed)": {"optimizer", "position"},
        "rank 0's RNG state on every rank": {"optimizer", "position", "rank0_rng"},
    }
    identical = {}
    for label, parts in variants.items():
        ddp, optimizer = fresh_training(env)
        if parts is None:
            progress = load_checkpoint(path, ddp, optimizer).progress
        else:
            ddp.module.load_state_dict(saved["model"])
            if "optimizer" in parts:
                optimizer.load_state_dict(saved["optimizer"])
            if "rng" in parts:
                restore_rng_state(saved["rng"][env.rank])
            if "rank0_rng" in parts:
                restore_rng_state(saved["rng"][0])
            progress = Progress(**saved["progress"])
            if "position" not in parts:
                progress = Progress(progress.step, progress.epoch, 0)
        train(ddp, optimizer, data, progress, steps)
        identical[label] = params_sha256(ddp.module) == uninterrupted
        say(f"  {label:<34} bit-identical: {identical[label]}")
    dist.barrier()  # everyone has read the demo checkpoint
    if env.is_main:  # the demo checkpoint, and the folder of the other ranks' RNG states
        path.unlink(missing_ok=True)
        shutil.rmtree(rng_path(path, 1).parent, ignore_errors=True)
    return uninterrupted, identical


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 06: failover with checkpoints.")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    parser.add_argument("--checkpoint-every", type=int, default=5, metavar="K")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="where checkpoints go and are resumed from "
        "(default: ./checkpoints/06_failover-<world size>ranks-<steps>steps)",
    )
    parser.add_argument(
        "--crash-at-step",
        type=int,
        metavar="S",
        help="the last rank exits abruptly after step S, on torchrun's first attempt only",
    )
    args = parser.parse_args()
    if args.steps < 4 or args.checkpoint_every < 1:
        parser.error("--steps must be at least 4 and --checkpoint-every at least 1")
    marks = {"start": time.time()}  # wall clock: the next attempt compares it with ours
    env = init_distributed()
    marks["group"] = time.time()
    # Keyed by what shapes the run, so runs with other settings never resume each other.
    directory = args.checkpoint_dir or Path(
        "checkpoints", f"06_failover-{env.world_size}ranks-{args.steps}steps"
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "checkpoint.pt"
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    say(
        f"Chapter 06: failover on {env.world_size} ranks, backend {env.backend}; torchrun "
        f"attempt {env.restart_count} (restarts allowed: {max_restarts})"
    )

    section("1. Resume from whatever the checkpoint folder holds")
    samples = make_dataset(n=SAMPLES_PER_RANK * env.world_size, dtype=torch.float32).tensors
    dataset = TensorDataset(*(tensor.to(env.device) for tensor in samples))
    data = (DistributedSampler(dataset, shuffle=True, seed=SEED), dataset)
    batches_per_epoch = len(data[0]) // BATCH
    ddp, optimizer = fresh_training(env)
    marks["built"] = time.time()
    progress, resumed_from = Progress(0, 0, 0), None
    if path.exists():
        loaded = load_checkpoint(path, ddp, optimizer)
        if loaded.extra != SETTINGS:
            raise ValueError(
                f"{path} was written with settings {loaded.extra}, not {SETTINGS}: its run "
                "cannot be continued. Pass another --checkpoint-dir or delete that one."
            )
        progress, resumed_from = loaded.progress, loaded.progress.step
        if progress.step > args.steps:
            raise ValueError(f"{path} is at step {progress.step}, past --steps {args.steps}.")
        say_prose(f"""\
            Resumed from step {progress.step} (epoch {progress.epoch}, {progress.batches_done}
            of its {batches_per_epoch} batches done): model, optimizer and each rank's RNG
            states from {path}""")
    else:
        say(f"No checkpoint in {directory}: starting at step 0.")
    marks["loaded"] = time.time()
    if env.is_main and env.restart_count == 0:
        for stale in directory.glob("failover-*.json"):
            stale.unlink()  # notes from an earlier run
    crash_planned = args.crash_at_step is not None and env.restart_count == 0
    if crash_planned and args.crash_at_step <= progress.step:
        say_prose(f"""\
            --crash-at-step {args.crash_at_step} is behind the checkpoint: no crash this time
            (delete {directory} to start over).""")

    section("2. Train, checkpointing every few steps")
    say_prose(f"""\
        {args.steps} steps of {BATCH} samples per rank, {batches_per_epoch} per epoch; dropout,
        shuffled data, SGD with momentum; a checkpoint every {args.checkpoint_every} steps.""")

    def after_step(done: Progress, loss: float) -> None:
        marks.setdefault("first_step", time.time())
        last_rank = env.rank == env.world_size - 1
        if crash_planned and done.step == args.crash_at_step and last_rank:
            print(f"[rank {env.rank}] exits abruptly after step {done.step}", flush=True)
            if max_restarts == 0:
                print(
                    "torchrun has no --max-restarts, so the job ends here. Run it again (without "
                    "--crash-at-step) to resume from the last checkpoint, or launch with "
                    "torchrun --max-restarts=2 to see the restart.",
                    flush=True,
                )
            write_event(directory, "crash", rank=env.rank, step=done.step)
            # os._exit: no cleanup and no exception, like a segfault or the OOM killer.
            os._exit(1)
        if done.step % args.checkpoint_every == 0 or done.step == args.steps:
            started = time.perf_counter()
            save_checkpoint(path, ddp, optimizer, done, extra=SETTINGS)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            say(f"step {done.step:3d}  loss {loss:.4f}  checkpoint saved ({elapsed_ms:.1f} ms)")

    try:
        progress = train(ddp, optimizer, data, progress, args.steps, after_step)
    except RuntimeError as error:
        # A peer died and our collective failed. Note when, for the next attempt's report, and
        # leave at once: os._exit, because a normal exit can abort in gloo's threads.
        problem = str(error).strip().splitlines()[0][:120]
        write_event(directory, f"noticed-rank{env.rank}", error=problem)
        print(f"[rank {env.rank}] a collective failed: {problem}", flush=True)
        if not crash_planned:
            traceback.print_exc()
        os._exit(1)
    if resumed_from == args.steps:
        say(f"The checkpoint was already at step {args.steps}: nothing left to train.")

    if env.restart_count > 0 and "first_step" in marks:
        section("Failover timeline")
        report_failover(directory, marks, resumed_from)

    section("3. What a checkpoint must hold")
    final_sha = params_sha256(ddp.module)
    uninterrupted_sha, identical = compare_resumes(env, data, args.steps, directory)
    say(
        textwrap.dedent("""\
        Only the full checkpoint reproduces the uninterrupted run.
        Momentum, the batches already seen in the epoch, and every rank's own dropout masks all
        steer the parameters, so each is state.""")
    )

    section("Final check")
    history = "never interrupted" if resumed_from is None else f"resumed from step {resumed_from}"
    say_all_ranks(f"final parameters {final_sha[:16]}... ({history})")
    say(f"An uninterrupted run ends at  {uninterrupted_sha[:16]}...")
    assert final_sha == uninterrupted_sha, "this run's parameters differ from an uninterrupted run"
    assert identical["everything (load_checkpoint)"], "resuming from a checkpoint changed bits"
    assert not identical["model only, no optimizer state"]
    assert not identical["no RNG states (fresh seed)"]
    if batches_per_epoch > 1:
        assert not identical["epoch but not the position in it"]
    if env.world_size > 1:
        assert not identical["rank 0's RNG state on every rank"]
    dist.barrier()  # every rank has passed its own checks
    say_prose(f"""\
        Verified on {env.world_size} ranks: this run (torchrun attempt {env.restart_count},
        {history}) ends bit-identical to an uninterrupted run, and leaving any piece out of the
        checkpoint does not.""")
    say("The picture: docs/figures/06_failover.png (the crash, the restart, the resume)")
    say(f"final-params-sha256: {final_sha}")
    end_chapter()


if __name__ == "__main__":
    main()
