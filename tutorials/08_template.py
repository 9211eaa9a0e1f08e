"""Chapter 08: the template. A training script to copy, on torch's own DistributedDataParallel.

    torchrun --standalone --nproc_per_node=2 tutorials/08_template.py           CPU: 2 processes
    torchrun --standalone --nproc_per_node=8 tutorials/08_template.py           8 GPUs: one each
    torchrun --standalone --nproc_per_node=2 tutorials/08_template.py --epochs 6   resumes

Chapters 00-07 rebuilt DDP to show how it works; this one is what a training script looks like
once you use the real thing. It imports nothing from MiniDDP or the other chapters: copy it,
replace `build_dataset`, `build_model` and `loss_fn` with yours, and it runs unchanged on CPUs
(gloo) and GPUs (NCCL), on one machine or many (docs/cluster.md has the launch files).

What it does, and where the course explains each line (the full side-by-side: docs/template.md):
- `init_process_group` from torchrun's environment, one process per GPU (chapters 02, 07);
- `DistributedSampler` with `set_epoch`, the same seed on every rank (chapter 02);
- gradient accumulation with `no_sync`, the loss divided by the micro-steps (chapters 00, 05);
- only rank 0 logs, after an all-reduce of the loss (chapter 01);
- an atomic checkpoint at every epoch end, and a resume from it (chapter 06);
- a final check that every replica holds the same weights, then `destroy_process_group`.

It resumes at epoch boundaries, which is enough when an epoch is short. A resume in mid-epoch, or
one bit-identical to an uninterrupted run (RNG states, the sampler's position), is chapter 06's.
With `torchrun --max-restarts=N`, also set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, a
restarted process group can find the dead attempt's addresses in torchrun's store (pytorch#135712).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

DEFAULT_CHECKPOINT = os.path.join(tempfile.gettempdir(), "ddp_template", "checkpoint.pt")


def build_dataset() -> Dataset:
    """Yours here. A noisy linear regression, identical on every rank (seeded)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator)
    return TensorDataset(inputs, targets + 0.1 * torch.randn(512, 1, generator=generator))


def build_model() -> nn.Module:
    """Yours here. DDP copies rank 0's weights to the others, so the seed is a convenience."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, targets)  # a mean: see chapter 00 before a sum


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Chapter 08: a DDP training template.")
    parser.add_argument("--epochs", type=int, default=3, help="train until this many are done")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank, per micro-step")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-steps per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0, help="the sampler's; same on all ranks")
    parser.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="file to resume from")
    return parser.parse_args()


def setup() -> torch.device:
    """Join the job torchrun started; return this process's device.

    torchrun sets RANK (global), LOCAL_RANK (on this machine), WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT; `init_process_group` reads them. LOCAL_RANK picks the GPU.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def log(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def save_checkpoint(path: str, state: dict) -> None:
    """Rank 0 writes a temporary file, flushes it to disk, then renames it over the old one:
    a crash at any moment leaves the old checkpoint or the new one, never half of one."""
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = f"{path}.tmp"
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    dist.barrier()  # nobody runs ahead of (or reads) a checkpoint still being written


def load_checkpoint(path: str, model: nn.Module, optimizer, device: torch.device) -> int:
    """Restore model and optimizer from `path` if it exists; return the epochs already done.

    Every rank reads the file, so every rank must see it: one machine, or shared storage. Ranks
    that disagree (a node that sees no file, or an older one) would train different epochs and
    hang in the first collective that only some of them reach: refuse instead.
    """
    done = 0
    if os.path.exists(path):
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        done = state["epochs_done"]
    extremes = torch.tensor([done, -done], device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    newest, oldest = extremes[0].item(), -extremes[1].item()
    if newest != oldest:
        raise RuntimeError(
            f"Ranks found checkpoints of different epochs ({oldest} to {newest}) at {path}: "
            "every rank must read the same file. Put it on storage all nodes share, or copy the "
            "newest one to every node before restarting."
        )
    return done


def train_one_epoch(model, loader, optimizer, accumulation: int, device: torch.device) -> float:
    """One pass over this rank's shard; returns the mean loss over every rank's samples."""
    model.train()
    totals = torch.zeros(2, device=device)  # (sum of sample losses, samples) on this rank
    for index, (inputs, targets) in enumerate(loader):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device)
        first = index - index % accumulation  # this optimizer step's first micro-batch
        micro_steps = min(accumulation, len(loader) - first)  # fewer at the epoch's end
        stepping = index == first + micro_steps - 1
        # Off the last micro-step, no_sync keeps DDP from all-reducing: gradients add up in
        # .grad, and the last backward averages the sum over ranks. Forward AND backward go
        # inside: DDP decides at forward time whether the backward will communicate.
        with nullcontext() if stepping else model.no_sync():
            loss = loss_fn(model(inputs), targets)
            (loss / micro_steps).backward()  # DDP divides by the ranks, never by micro-steps
        if stepping:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        totals[0] += loss.detach() * len(inputs)  # no .item(): it would wait for the GPU
        totals[1] += len(inputs)
    dist.all_reduce(totals)  # every rank's sums: the loss of the whole epoch, not rank 0's shard
    return (totals[0] / totals[1]).item()


def check_replicas_match(model: nn.Module) -> None:
    """DDP's promise: the same weights on every rank. Elementwise MAX == MIN over ranks."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    if not torch.equal(highest, lowest):
        raise RuntimeError("replicas differ: some rank trained on something the others did not")


def main() -> None:
    args = parse_args()
    device = setup()
    dataset = build_dataset()
    # Every rank must shuffle with the same seed: each takes every W-th index of one shared
    # permutation, so the shards are disjoint only if the permutation is the same everywhere.
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type == "cuda"
    )
    module = build_model().to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr)
    epochs_done = load_checkpoint(args.checkpoint, module, optimizer, device)
    # Wrapping broadcasts rank 0's weights and buffers, and registers the gradient hooks.
    model = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
    world_size = dist.get_world_size()
    start = f"resumed after epoch {epochs_done} from {args.checkpoint}" if epochs_done else "fresh"
    log(
        f"{world_size} ranks on {dist.get_backend()}, global batch {args.batch_size} (per rank) "
        f"x {args.accumulation} (micro-steps) x {world_size} (ranks); {start}"
    )
    for epoch in range(epochs_done, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it, every epoch is the same
        loss = train_one_epoch(model, loader, optimizer, args.accumulation, device)
        state = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
        save_checkpoint(args.checkpoint, {**state, "epochs_done": epoch + 1})
        log(f"epoch {epoch + 1}/{args.epochs}: loss {loss:.4f}, checkpoint {args.checkpoint}")
    check_replicas_match(model)
    log(f"done: {args.epochs} epochs, replicas identical on {world_size} ranks")
    dist.barrier()  # no rank tears down its connections while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch's DDP keeps a reference to the process group even after destroy_process_group, so
    # gloo's threads live on into Python's shutdown, where now and then (about 1 run in 20 on
    # a 2-core machine) they abort the finished process: "terminate called without an active
    # exception" (pytorch#179291). Everything is done and saved: leave without that shutdown.
    sys.stdout.flush()
    os._exit(0)
