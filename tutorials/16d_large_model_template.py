"""Chapter 16d: the template for a large model. Chapter 12's GPT on torch's own FSDP2 and TP.

    torchrun --standalone --nproc_per_node=4 tutorials/16d_large_model_template.py   (dp, tp) (2, 2)
    torchrun --standalone --nproc_per_node=2 tutorials/16d_large_model_template.py          (1, 2)
    torchrun --standalone --nproc_per_node=2 tutorials/16d_large_model_template.py --tp 1   (2, 1)

Chapter 08's template keeps a whole replica on every rank. This one is for a model that does not
fit: it cuts each block's matrices over a "tp" axis of ranks and shards what each rank holds over
a "dp" axis, with torch's own pieces (as in chapter 08, nothing from MiniDDP in what you copy but
the GPT itself, and `init_distributed`, which only picks gloo or NCCL):

    init_device_mesh     the ranks as a (dp, tp) grid; mesh["tp"], mesh["dp"]: this rank's groups
    parallelize_module   Megatron's plan, ColwiseParallel and RowwiseParallel (chapter 13)
    fully_shard          FSDP2: ZeRO-3 per block, over mesh["dp"] (chapter 11)
    loss_parallel        the cross-entropy of vocabulary-sharded logits, never gathered
    clip_grad_norm_      torch's, once per mesh (its docstring says why), one global norm
    torch.distributed.checkpoint (DCP)   each rank writes its own shards; any mesh reads them

`parallelize` below is `miniddp.parallelize.parallelize` (chapter 16) line for line: the same
plan, the same order (TP, then the pipeline split, then data parallelism last), so that code
moves both ways. tests/test_large_model_template.py trains the two side by side from the same
weights on the same windows, and their losses agree every step; docs/template.md takes this
file apart line by line.

No pipeline. On 4 ranks a third axis leaves groups of one; and torch.distributed.pipelining needs
the GPT cut into stage modules by hand, the tied embedding's two copies summed across the first
and last stage (miniddp.parallelize's TiedAcrossStages), and loss_parallel inside the schedule's
loss. Chapter 16 does all of that on 8 ranks; step 2 of `parallelize` marks where it goes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import replace
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
# Against one process on the global batch, in fp32: TP adds each dot product in tp pieces, then
# the pieces; FSDP2 averages gradients by a reduce-scatter; the norm sums over shards. Each
# rounds otherwise (~1e-7 relative), and AdamW's m / sqrt(v) magnifies that where v is tiny.
# Chapter 12's bound for one process against DDP, kept; measured: 3.8e-6 after 20 steps.
ONE_PROCESS_TOLERANCE = 1e-4


def build_mesh(dp: int, tp: int, device_type: str) -> DeviceMesh:
    """The ranks as a (dp, tp) grid, row-major: the ranks of a TP group are neighbours (on a
    GPU node, the NVLink-connected ones), each replica one row."""
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=AXES)
    mesh[AXES]._flatten("dp_tp")  # a sum over both axes (the norm's) as one all-reduce
    return mesh


def tensor_parallel_plan(model: GPT) -> dict[str, ParallelStyle]:
    """Megatron's plan for the GPT, by the names one process gives its modules. torch's styles
    need told what crosses each border: the token ids come in whole (Replicate), and the head's
    logits stay cut by vocabulary, a DTensor (Shard(-1)) for loss_parallel."""
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

    # 3. Data parallelism over "dp", last, around exactly what this rank holds: each block a
    # unit of its own (gathered just before it runs, freed after), then the rest at the root.
    if dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, windows: torch.Tensor, clip: float
) -> torch.Tensor:
    """One optimizer step on this replica's windows (B, T + 1); returns their mean loss (the
    TP ranks of one replica see the same windows, and compute the same loss)."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(inputs)
    sharded = isinstance(logits, DTensor)  # under TP: the vocabulary over mesh["tp"]
    with loss_parallel() if sharded else nullcontext():  # backward too: it starts there
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (loss.full_tensor() if sharded else loss).detach()


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for a model on two meshes. TP leaves the LayerNorms and the
    positions plain tensors, so fully_shard puts them on the "dp" mesh, and the TP matrices on
    (dp, tp); torch's call stacks all the norms in one tensor, which DTensors on two meshes
    refuse. So: each mesh's norm (a DTensor; full_tensor() sums the squares over its shards),
    the whole model's from those, and torch's own scaling, mesh by mesh. (torchtitan puts its
    norms under SequenceParallel: every parameter on one mesh, and torch's call as it is.)"""
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


def replica_batch(windows: Windows, step: int, batch: int, seed: int, replicas: int, replica: int):
    """The `batch` windows replica `replica` trains on at `step`: a DistributedSampler over the
    "dp" axis, not over the world, since the ranks of one TP group are one replica. The step
    alone fixes the windows, so a resumed run picks up mid-epoch where it stopped."""
    sampler = DistributedSampler(
        windows, replicas, replica, shuffle=True, seed=seed, drop_last=True
    )
    epoch, position = divmod(step, len(sampler) // batch)
    sampler.set_epoch(epoch)
    return windows[list(sampler)[position * batch : (position + 1) * batch]]


def save(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its own shards, with no gather to rank 0. get_state_dict names them as
    one process would ("blocks.0.mlp.up.weight"), so a job on another mesh can read them."""
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
    """The newest complete checkpoint: (its step, its folder), or (0, None). DCP writes a
    folder's `.metadata` last, once every rank's file is complete: a folder without it is what
    a crash left half-written."""
    done = [int(f.name[5:]) for f in checkpoints.glob("step-*") if (f / ".metadata").exists()]
    return (max(done), checkpoints / f"step-{max(done)}") if done else (0, None)


class Run:
    """The chapter's job: its mesh, data and settings, and a fresh model whenever asked."""

    def __init__(self, args: argparse.Namespace, mesh: DeviceMesh, device: torch.device) -> None:
        self.args, self.mesh, self.device = args, mesh, device
        self.settings = replace(Settings(), dropout=0.0)
        corpus = load_corpus()
        self.config: GPTConfig = self.settings.model(len(corpus.vocabulary))
        self.windows = Windows(corpus.train, self.config.context)
        self.replicas, self.replica = mesh["dp"].size(), mesh["dp"].get_local_rank()

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)  # the same weights on every rank; each keeps its slice
        model = parallelize(GPT(self.config).to(self.device), self.mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=self.args.lr)

    def batch(self, step: int, replica: int) -> torch.Tensor:
        s = self.settings
        windows = replica_batch(self.windows, step, self.args.batch, s.seed, self.replicas, replica)
        return windows.to(self.device)

    def train(self, model, optimizer, steps: range, save_every: int = 0) -> list[float]:
        """Train `steps`, saving after every `save_every`-th; the replicas' mean loss, each step."""
        losses = []
        for step in steps:
            loss = train_step(model, optimizer, self.batch(step, self.replica), self.settings.clip)
            dist.all_reduce(loss, group=self.mesh["dp"].get_group())  # for the log: the mean
            losses.append(loss.item() / self.replicas)
            if save_every and (step + 1) % save_every == 0:
                save(model, optimizer, self.args.checkpoints / f"step-{step + 1}")
        return losses

    def one_process(self) -> list[float]:
        """The same GPT alone, on every replica's windows at once (the global batch)."""
        torch.manual_seed(0)
        model = GPT(self.config).to(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.args.lr)
        batches = (
            torch.cat([self.batch(step, r) for r in range(self.replicas)])
            for step in range(self.args.steps)
        )
        return [train_step(model, optimizer, b, self.settings.clip).item() for b in batches]


def say_what_was_cut(rows: int, dp: int, tp: int) -> None:
    """qkv's rows, as each parallelism cut them, in words."""
    if tp > 1:
        say_prose(f"""
            TP's Shard(0) gives each of the {tp} TP ranks {rows // tp} of qkv's {rows} rows:
            whole heads. It leaves the LayerNorms and the positions whole.
            """)
    if dp > 1 < tp:
        say_prose(f"""
            fully_shard then cuts each TP slice again over "dp", {rows // tp // dp} rows a rank,
            which DTensor records as _StridedShard (FSDP2's rows of TP's rows), and the
            LayerNorms over "dp" alone: two meshes in one model, the reason this
            clip_grad_norm_ works mesh by mesh.
            """)
    elif dp > 1:
        say(f"  fully_shard cuts every parameter's rows over \"dp\": {rows // dp} of qkv's {rows}.")


def refuse_what_cannot_run(args: argparse.Namespace) -> None:
    """Before any process group: every rank decides alike, rank 0 alone says why."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    problem = None
    if not (world >= 1 and args.tp >= 1 and world % args.tp == 0):
        problem = (
            f"Chapter 16d lays out the ranks as (dp, tp) with tp = {args.tp}, and this job has "
            f"{world or 'no torchrun'}: run it as torchrun --nproc_per_node=4 "
            "tutorials/16d_large_model_template.py (or pass a --tp that divides the ranks)"
        )
    elif args.steps < 2:
        problem = f"--steps {args.steps}: pass at least 2 (a checkpoint to lose, one to resume)"
    if problem is None:
        return
    if os.environ.get("RANK", "0") == "0":
        raise SystemExit(problem)
    raise SystemExit(2)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Chapter 16d: the template for a large model.")
    parser.add_argument("--tp", type=int, default=2, help="ranks per TP group (default 2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="windows per replica per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoints", type=Path, default=DEFAULT_CHECKPOINTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    refuse_what_cannot_run(args)
    env = init_distributed()  # gloo on CPUs, NCCL on GPUs (one per LOCAL_RANK)
    mesh = build_mesh(env.world_size // args.tp, args.tp, env.device.type)
    run = Run(args, mesh, env.device)
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    args.checkpoints = args.checkpoints / f"dp{dp}-tp{tp}"

    section(f"1. Chapter 12's GPT on a (dp, tp) = ({dp}, {tp}) mesh, with torch's own pieces")
    model, optimizer = run.build()
    say_prose(f"""
        {env.world_size} ranks on {dist.get_backend()}, dropout off (under TP each rank draws
        its own heads' masks, and the chapter ends by checking one process's bits). What a
        parallelism cut is now a DTensor: its whole shape, and how this rank's piece was cut.
        """)
    say(f"  {'parameter':<30} {'whole':>10} {'rank 0 holds':>13}  placements over {AXES}")
    for name in (
        "token.weight",
        "blocks.0.attention.qkv.weight",
        "blocks.0.attention.proj.weight",
        "blocks.0.mlp_norm.weight",
        "position.weight",
    ):
        p = model.get_parameter(name)
        local, placements = (p.to_local(), p.placements) if isinstance(p, DTensor) else (p, ())
        cuts = ", ".join(
            f"{type(q).__name__.lstrip('_')}({getattr(q, 'dim', '')})" for q in placements
        )
        whole, mine = "x".join(map(str, p.shape)), "x".join(map(str, local.shape))
        say(f"  {name:<30} {whole:>10} {mine:>13}  {cuts or 'a plain tensor'}")
    say_what_was_cut(3 * run.config.width, dp, tp)
    if tp > 1:
        assert model.head.weight is model.token.weight, "the tie survives TP: one shard"

    every = max(1, args.steps // 2)
    section(f"2. {args.steps} steps of AdamW with clipping, a DCP checkpoint every {every}")
    if env.rank == 0:  # an earlier run's checkpoints: start afresh
        for file in sorted(args.checkpoints.glob("step-*/*")):
            file.unlink()
    dist.barrier()
    losses = run.train(model, optimizer, range(args.steps), save_every=every)
    say("  the loss, in nats per character (the mean over the replicas):")
    for step in sorted({*range(0, args.steps, 5), args.steps - 1}):
        say(f"  step {step:>3}: {losses[step]:.4f}")
    files = sorted(os.listdir(args.checkpoints / f"step-{every}"))
    shards = len([f for f in files if f.endswith(".distcp")])
    say(f"  step-{every}/: {shards} .distcp files (one a rank) and .metadata, the index")

    section("3. A crash, and a fresh job resumes from DCP")
    last, folder = newest(args.checkpoints)
    if env.rank == 0:  # as if the job had died while writing the last checkpoint
        (folder / ".metadata").unlink()
    dist.barrier()
    start, folder = newest(args.checkpoints)
    model, optimizer = run.build()  # a fresh job: build and parallelize, then load the shards
    load(model, optimizer, folder)
    resumed = run.train(model, optimizer, range(start, args.steps))
    same = resumed == losses[start:]
    say_prose(f"""
        step-{last} has no .metadata, so newest() skips it and picks {folder.name}.
        Steps {start}-{args.steps - 1} again from there, every loss bit for bit the
        uninterrupted run's: {same}. The AdamW moments and step counts came back too.
        """)

    section("4. The claim: torch's composition trains as one process does")
    if env.rank == 0:
        gaps = [abs(a - b) for a, b in zip(losses, run.one_process(), strict=True)]
        say(
            f"  rank 0 alone, on the global batch: the largest gap in {args.steps} steps is "
            f"{max(gaps):.1e} nats (bound {ONE_PROCESS_TOLERANCE:g})"
        )
        assert max(gaps) < ONE_PROCESS_TOLERANCE, f"one process differs by {max(gaps):.3g}"
    assert same, "the resumed run differs from the uninterrupted one"
    say(f"Verified on {env.world_size} ranks: one process's losses; a bit-identical resume.")
    end_chapter()


if __name__ == "__main__":
    main()
