"""Chapter 09b: the template for a large model. Chapter 12's GPT on torch's own FSDP2 + TP.

    torchrun --standalone --nproc_per_node=4 tutorials/09b_large_model_template.py   (dp, tp) = (2, 2)
    torchrun --standalone --nproc_per_node=2 tutorials/09b_large_model_template.py   (1, 2)
    ... --tp 1                                   (2, 1) on 2 ranks: fully_shard alone

Chapter 09's template keeps a whole replica on every rank. This one is for a model that does not
fit: it cuts each matrix over a "tp" axis and shards what is left over a "dp" axis, with torch's
own pieces only (the DDP template's rule: nothing from MiniDDP in what you copy, apart from the
GPT itself):

    init_device_mesh     the ranks as a (dp, tp) grid; mesh["tp"] and mesh["dp"] its groups
    parallelize_module   Megatron's plan, ColwiseParallel and RowwiseParallel (chapter 13)
    fully_shard          FSDP2, ZeRO-3 per block, over mesh["dp"] (chapter 08)
    loss_parallel        the cross-entropy of vocabulary-sharded logits, never gathered
    clip_grad_norm_      the same call as on one GPU: the norm of DTensors is global
    DCP                  torch.distributed.checkpoint: each rank writes its own shards

`parallelize` below is `miniddp.parallelize.parallelize` (chapter 15) line for line: the same
plan, the same order (TP, then the pipeline split, then data parallelism last), so code moves
both ways; tests/test_large_model_template.py trains the two side by side, from the same weights
on the same data, and checks their losses agree every step (docs/template.md, second part, takes
the template apart line by line).

No pipeline here. On 4 ranks a third axis leaves groups of one; and torch.distributed.pipelining
would need the GPT cut into stages by hand, the tied embedding summed across the first and last
stage (miniddp.parallelize's TiedAcrossStages), and the loss_parallel context inside its
schedule. Chapter 15 does all of that on 8 ranks; step 2 below marks where it goes.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from char_corpus import Windows, load_corpus
from common import end_chapter, say, say_prose, section
from gpt_settings import Settings
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from miniddp.job.env import init_distributed
from miniddp.models.gpt import GPT, GPTConfig

AXES = ("dp", "tp")
DEFAULT_CHECKPOINTS = Path(tempfile.gettempdir()) / "large_model_template"
# Against one process on the global batch, in fp32: TP adds each row's partial products in two
# halves, then the halves, and FSDP2 averages gradients by a reduce-scatter; each sum rounds
# otherwise (~1e-7 relative), and AdamW's m / sqrt(v) magnifies that where v is tiny. Chapter
# 12's bound for one process against DDP, kept: measured here, 2e-6 after 20 steps.
ONE_PROCESS_TOLERANCE = 1e-4


def tensor_parallel_plan(model: GPT) -> dict[str, ParallelStyle]:
    """Megatron's plan for the GPT, by the names one process gives its modules: the embedding
    rowwise (its vocabulary rows; the token ids come in whole), the head colwise with its logits
    left sharded for loss_parallel (a DTensor, Shard(-1)), and in each block qkv and up colwise,
    proj and down rowwise."""
    plan: dict[str, ParallelStyle] = {
        "token": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.blocks)):
        at = f"blocks.{index}"
        plan |= {
            f"{at}.attention.qkv": ColwiseParallel(),
            f"{at}.attention.proj": RowwiseParallel(),
            f"{at}.mlp.up": ColwiseParallel(),
            f"{at}.mlp.down": RowwiseParallel(),
        }
    return plan


def parallelize(model: GPT, mesh: DeviceMesh) -> nn.Module:
    """Split `model` (built alike on every rank) over `mesh`, whose axes are ("dp", "tp")."""
    dp, tp = mesh["dp"].size(), mesh["tp"].size()

    # 1. Tensor parallelism, by the whole model's names; under TP the tie is one shard (the
    # embedding and the head are both cut by vocabulary rows, Shard(0)).
    if tp > 1:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
        model.head.weight = model.token.weight

    # 2. The pipeline split: none on a (dp, tp) mesh (the module docstring says why).

    # 3. Data parallelism over "dp", last, around exactly what this rank holds: each block its
    # own unit (gathered just before it runs, freed after), then the rest at the root.
    if dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, windows: torch.Tensor, clip: float
) -> torch.Tensor:
    """One optimizer step on this replica's windows (B, T + 1); returns its mean loss. The TP
    ranks of a replica see the same windows and compute the same loss."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(inputs)
    sharded = isinstance(logits, DTensor)  # under TP: the vocabulary over mesh["tp"]
    with loss_parallel() if sharded else nullcontext():  # backward too: it starts from the loss
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (loss.full_tensor() if sharded else loss).detach()


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, for a model on two meshes. torch's stacks every gradient's norm
    in one tensor, and DTensors on different meshes refuse that: here the TP matrices live on
    the (dp, tp) mesh, the LayerNorms and positions (replicated by TP) on "dp" alone. So: each
    mesh's norm, made whole (full_tensor sums the squares over its shards), then the model's,
    and torch's own scaling. (torchtitan's models put their norms under SequenceParallel, so
    every parameter is on one mesh and torch's call works as it is.)"""
    by_mesh: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [nn.utils.get_total_norm([p.grad for p in ps]) for ps in by_mesh.values()]
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for same_mesh in by_mesh.values():
        nn.utils.clip_grads_with_norm_(same_mesh, max_norm, total)
    return total


def replica_windows(windows: Windows, mesh: DeviceMesh, batch: int, seed: int):
    """The windows replica `mesh["dp"]` trains on at each step: a DistributedSampler over the
    "dp" axis, not the world. The ranks of one TP group are one replica: the same windows."""
    sampler = DistributedSampler(
        windows,
        num_replicas=mesh["dp"].size(),
        rank=mesh["dp"].get_local_rank(),
        shuffle=True,
        seed=seed,
        drop_last=True,
    )
    per_epoch = len(sampler) // batch

    def at(step: int) -> torch.Tensor:
        epoch, position = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        return windows[list(sampler)[position * batch : (position + 1) * batch]]

    return at


def save(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its own shards (no gather to rank 0); get_state_dict names them as one
    process would ("blocks.0.mlp.up.weight"), so a run on another mesh can read them back. DCP
    writes `.metadata` last, once every rank's file is complete: a folder without it is a
    crash's half-written checkpoint, and `newest` skips it."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Read into the shards this rank already holds: build and parallelize first, then load."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def newest(checkpoints: Path) -> tuple[int, Path | None]:
    """The newest complete checkpoint, step-N: (N, its folder), or (0, None)."""
    done = [int(f.name[5:]) for f in checkpoints.glob("step-*") if (f / ".metadata").exists()]
    return (max(done), checkpoints / f"step-{max(done)}") if done else (0, None)


def build(config: GPTConfig, mesh: DeviceMesh, lr: float):
    torch.manual_seed(0)  # the same weights on every rank: fully_shard and TP keep their slices
    model = parallelize(GPT(config), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train(model, optimizer, batches, steps: range, clip: float, mesh, checkpoints=None, every=0):
    """Train `steps`; save after every `every`-th into `checkpoints`; returns the mean loss over
    the replicas at each step, the same on every rank."""
    losses = []
    for step in steps:
        loss = train_step(model, optimizer, batches(step), clip)
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the replicas' mean, for the log
        losses.append(loss.item() / mesh["dp"].size())
        if checkpoints is not None and every and (step + 1) % every == 0:
            save(model, optimizer, checkpoints / f"step-{step + 1}")
    return losses


def one_process(config, windows, mesh, batch, seed, steps, lr, clip) -> list[float]:
    """Rank 0 alone: the same GPT on every replica's windows at once (the global batch)."""
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    samplers = [
        DistributedSampler(windows, mesh["dp"].size(), r, shuffle=True, seed=seed, drop_last=True)
        for r in range(mesh["dp"].size())
    ]
    losses = []
    for step in range(steps):
        rows = []
        for sampler in samplers:
            sampler.set_epoch(step // (len(sampler) // batch))
            position = step % (len(sampler) // batch)
            rows += list(sampler)[position * batch : (position + 1) * batch]
        losses.append(train_step(model, optimizer, windows[rows], clip).item())
    return losses


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Chapter 09b: the template for a large model.")
    parser.add_argument("--tp", type=int, default=2, help="ranks per TP group (default 2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="windows per replica per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoints", type=Path, default=DEFAULT_CHECKPOINTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    env = init_distributed()  # gloo on CPUs, NCCL on GPUs (one per LOCAL_RANK)
    world = env.world_size
    if args.tp < 1 or world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks: pass a divisor")
    mesh = init_device_mesh(env.device.type, (world // args.tp, args.tp), mesh_dim_names=AXES)
    mesh[AXES]._flatten("dp_tp")  # sums over both axes become one all-reduce (the norm's)
    settings = replace(Settings(), dropout=0.0)
    corpus = load_corpus()
    config = settings.model(len(corpus.vocabulary))
    windows = Windows(corpus.train, config.context)
    dp, tp = mesh["dp"].size(), mesh["tp"].size()

    section(f"1. Chapter 12's GPT on a (dp, tp) = ({dp}, {tp}) mesh, with torch's own pieces")
    model, optimizer = build(config, mesh, args.lr)
    qkv = model.blocks[0].attention.qkv.weight
    say_prose(f"""
        {world} ranks on {dist.get_backend()}. parallelize() cut each block's matrices over
        mesh["tp"] and sharded the rest over mesh["dp"]. Every parameter is now a DTensor that
        knows both: blocks.0.attention.qkv.weight is {tuple(qkv.shape)} to the model, and this
        rank holds {tuple(qkv.to_local().shape)} of it, placed {tuple(qkv.placements)} over
        {qkv.device_mesh.mesh_dim_names}. Dropout is off ({settings.dropout}): under TP each rank
        draws its own heads' masks, and this chapter checks its bits against one process.
        """)
    if tp > 1:
        assert model.head.weight is model.token.weight, "the tie survives TP: one shard"

    section(f"2. {args.steps} steps, a DCP checkpoint every {args.steps // 2}")
    checkpoints = args.checkpoints / f"dp{dp}-tp{tp}"
    if env.rank == 0 and checkpoints.exists():
        for folder in checkpoints.glob("step-*"):  # an earlier run's: start afresh
            for file in folder.iterdir():
                file.unlink()
            folder.rmdir()
    dist.barrier()
    batches = replica_windows(windows, mesh, args.batch, settings.seed)
    every = max(1, args.steps // 2)
    losses = train(
        model, optimizer, batches, range(args.steps), settings.clip, mesh, checkpoints, every
    )
    for step in sorted({0, args.steps // 2, args.steps - 1}):
        say(f"  step {step:>3}: loss {losses[step]:.4f} nats per character")
    saved = sorted(os.listdir(checkpoints))
    say(f"  saved: {', '.join(saved)} in {checkpoints}, each rank's shards in its own file")

    section("3. Resume: a fresh job's model, parallelized, then DCP fills in its shards")
    model, optimizer = build(config, mesh, args.lr)
    start, folder = newest(checkpoints)
    middle = args.steps // 2
    shutil_rmtree_newest = None
    # Resume from the middle one, as a job that died after it would.
    folder = checkpoints / f"step-{middle}"
    load(model, optimizer, folder)
    resumed = train(model, optimizer, batches, range(middle, args.steps), settings.clip, mesh)
    same = resumed == losses[middle:]
    say(f"  from {folder.name}: steps {middle}-{args.steps - 1} again, bit for bit: {same}")

    section("4. The claim: torch's composition trains as one process does")
    reference = (
        one_process(
            config, windows, mesh, args.batch, settings.seed, args.steps, args.lr, settings.clip
        )
        if env.rank == 0
        else []
    )
    if env.rank == 0:
        gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        say(f"  largest gap over {args.steps} steps: {gap:.2e} (bound {ONE_PROCESS_TOLERANCE})")
        assert gap < ONE_PROCESS_TOLERANCE, gap
    assert same, "the resumed run differs from the uninterrupted one"
    say(f"Verified on {world} ranks: resumed bit for bit, and one process's losses.")
    end_chapter()


if __name__ == "__main__":
    main()
