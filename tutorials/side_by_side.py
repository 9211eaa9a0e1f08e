"""Chapter 12's replicas: one GPT trained under several designs at once, and how they compare.

Each design is a Replica: the same GPT from the same weights, wrapped (or sharded) its own way,
with its own AdamW. The chapter steps them in lockstep on the same windows and dropout seeds, and
after every optimizer step an Agreement notes whether each one's loss and parameters are still
bitwise MiniDDP's, and if not, how far apart they are.

    miniddp       MiniDDP + AdamW: the run the chapter is about
    torch         torch's DistributedDataParallel + AdamW
    one-process   no wrapper, rank 0 alone, on the whole global batch with accumulation
    zero1         MiniDDP + miniddp.ZeroRedundancyOptimizer(AdamW)
    zero2         the same, with the reduce-scatter hook: each rank keeps its share's gradients
    zero3         miniddp.fully_shard on every block, then on the root; AdamW on the shards
    torch-fsdp    torch's own fully_shard, the same way (the reference under bf16)
    fp32          MiniDDP in fp32 beside a bf16 run: what bf16 costs in loss

Under precision "bf16" every design but fp32 computes in bf16 and keeps fp32 masters (the
parameters the optimizer steps, and the checkpoint holds): MiniDDP and ZeRO-1/2 through
MiniDDP(mixed_precision=MixedPrecision(torch.bfloat16)), fully_shard (miniddp's and torch's)
through MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32). torch's
DDP has mixed precision too, but not on CPU ("cpu backend doesn't support events"), so torch's
fully_shard is the reference: at W = 2 MiniDDP's mixed precision is its bits (every sum of two
terms is the same sum; tests/test_ddp_mixed_precision.py).

Clipping needs the norm of all the gradients. Under DDP, one process and ZeRO-1 every rank holds
every averaged gradient, and torch's clip_grad_norm_ computes it. Under ZeRO-2 and fully_shard a
rank holds only its share: miniddp.sharding.clip_grad_norm_ adds the shares' squares over the
ranks, a sum in another order, so those two match MiniDDP within rounding once clipping acts.

Every replica keeps its own atomic checkpoint (Checkpoints), MiniDDP's with the Record of what
the run measured so far: the step number alone fixes the windows and the dropout masks, so a
resumed run reports and ends as one that never stopped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from common import fmt_bytes, say, say_all_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP, MixedPrecision, ZeroRedundancyOptimizer, full_state_dict, fully_shard
from miniddp.checkpoint import Progress, load_checkpoint, read_checkpoint, save_checkpoint
from miniddp.models.gpt import GPT, GPTConfig, parameter_groups
from miniddp.sharding import (
    Formula,
    MixedPrecisionPolicy,
    ddp_buckets,
    ddp_compute_copies,
    measure_memory,
    reduce_scatter_hook,
)
from miniddp.sharding import clip_grad_norm_ as sharded_clip_grad_norm_

DESIGNS = ("miniddp", "torch", "one-process", "zero1", "zero2", "zero3", "torch-fsdp", "fp32")
BF16 = torch.bfloat16
LABELS = {
    "miniddp": "MiniDDP",
    "torch": "torch's DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "fully_shard",
    "torch-fsdp": "torch's fully_shard",
    "fp32": "MiniDDP in fp32",
}
BETAS = (0.9, 0.95)  # nanoGPT's: a shorter memory for the second moment than Adam's 0.999


@dataclass
class Replica:
    """One way of training the GPT: what forward is called on, the GPT inside, its optimizer,
    how to skip gradient sync, how to clip, and what it computes in; plus the losses it
    recorded. It saves and loads its own checkpoints."""

    name: str
    model: nn.Module
    module: GPT
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], AbstractContextManager]
    clip: Callable[[float], torch.Tensor]
    precision: str = "fp32"  # what forward and backward compute in; the masters stay fp32
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0  # spent in its training steps, for its tokens per second

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every full fp32 parameter by name (a collective under fully_shard: it gathers them)."""
        if self.name == "torch-fsdp":
            return {k: v.full_tensor() for k, v in self.module.state_dict().items()}
        return full_state_dict(self.module) if self.name == "zero3" else self.module.state_dict()

    def save(self, path: Path, progress: Progress, extra: dict) -> None:
        """An atomic checkpoint (every rank calls it): miniddp.checkpoint's, except for torch's
        fully_shard, whose DTensors that does not know: torch's full state dicts, written by
        rank 0 and renamed into place."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.consolidate_state_dict(to=0)  # its state, whole, on rank 0
        if self.name != "torch-fsdp":
            save_checkpoint(path, self.model, self.optimizer, progress, extra)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0's alone
        model, optimizer = get_state_dict(self.module, self.optimizer, options=options)
        if dist.get_rank() == 0:
            state = {"model": model, "optimizer": optimizer, "step": progress.step}
            torch.save(state, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        dist.barrier()

    def load(self, path: Path) -> int:
        """Resume from `save`'s checkpoint (every rank calls it); the step it was saved at."""
        if self.name != "torch-fsdp":
            return load_checkpoint(path, self.model, self.optimizer).progress.step
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = torch.load(path, weights_only=True)
        options = StateDictOptions(full_state_dict=True)  # each rank cuts its own shards
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
        return state["step"]


def build_gpt(config: GPTConfig, seed: int) -> GPT:
    """The same initial weights on every rank and in every replica: a seeded, forked RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def build_replica(
    design: str,
    config: GPTConfig,
    seed: int,
    lr: float,
    weight_decay: float,
    precision: str = "fp32",
) -> Replica:
    """A fresh GPT under `design` (one of DESIGNS), with AdamW and the two parameter groups,
    computing in `precision` ("fp32", or "bf16" with fp32 masters; the fp32 design: fp32)."""
    module = build_gpt(config, seed)
    params = list(module.parameters())
    precision = "fp32" if design == "fp32" else precision
    bf16 = precision == "bf16"
    if bf16 and design in ("torch", "one-process"):
        raise ValueError(
            f"no {design} replica in bf16: torch's DDP mixed precision needs CUDA events ('cpu "
            "backend doesn't support events'), and one process has no wrapper to cast for it. "
            "Under bf16 torch's fully_shard (torch-fsdp) is the reference."
        )
    if design in ("zero3", "torch-fsdp"):
        if design == "zero3":
            shard = fully_shard
            policy = MixedPrecisionPolicy(BF16, torch.float32) if bf16 else None
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy  # slow import
            from torch.distributed.fsdp import fully_shard as shard

            policy = TorchPolicy(BF16, torch.float32) if bf16 else TorchPolicy()
        for block in module.blocks:
            shard(block, mp_policy=policy)  # the blocks first, then the root: embeddings, norm
        shard(module, mp_policy=policy)
        params = list(module.parameters())  # now this rank's shards
    groups = parameter_groups(module, weight_decay)
    if design in ("zero1", "zero2"):
        optimizer = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=lr, betas=BETAS)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=BETAS)
    # ZeRO-2 and fully_shard: a rank holds only its share of the gradients, so the norm is a
    # sum over the ranks. Everywhere else every rank holds them all: torch's own clipping.
    # torch's fully_shard holds DTensors, whose norm torch's clip_grad_norm_ sums over the ranks.
    clip = sharded_clip_grad_norm_ if design in ("zero2", "zero3") else nn.utils.clip_grad_norm_

    def clip_mine(max_norm: float) -> torch.Tensor:
        return clip(params, max_norm)

    if design in ("zero3", "torch-fsdp"):
        no_sync = _no_gradient_sync(module)
        return Replica(design, module, module, optimizer, no_sync, clip_mine, precision)
    if design == "one-process":
        return Replica(design, module, module, optimizer, nullcontext, clip_mine)
    if design == "torch":
        model = DistributedDataParallel(module)
    else:
        model = MiniDDP(module, mixed_precision=MixedPrecision(BF16) if bf16 else None)
    if design == "zero2":
        model.register_comm_hook(optimizer, reduce_scatter_hook)
    return Replica(design, model, module, optimizer, model.no_sync, clip_mine, precision)


def _no_gradient_sync(module: nn.Module) -> Callable[[], AbstractContextManager]:
    """fully_shard's no_sync(): backward keeps full gradients, the next synced one reduces."""

    @contextmanager
    def no_sync():
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    return no_sync


@dataclass
class Agreement:
    """How a replica compares with MiniDDP's after each step: bitwise, else the largest gap."""

    steps: int = 0
    bitwise_steps: int = 0
    largest_loss_gap: float = 0.0
    largest_parameter_gap: float = 0.0

    def record(self, losses: tuple[float, float], ours: dict, theirs: dict) -> None:
        pairs = [(ours[name], theirs[name]) for name in ours]
        bitwise = losses[0] == losses[1] and all(torch.equal(a, b) for a, b in pairs)
        gap = max((a.double() - b.double()).abs().max().item() for a, b in pairs)
        self.steps += 1
        self.bitwise_steps += bitwise
        self.largest_loss_gap = max(self.largest_loss_gap, abs(losses[0] - losses[1]))
        self.largest_parameter_gap = max(self.largest_parameter_gap, gap)

    @property
    def bitwise(self) -> bool:
        return self.bitwise_steps == self.steps

    def on_every_rank(self) -> Agreement:
        """The worst over every rank (a collective)."""
        mine = [self.bitwise_steps, -self.largest_loss_gap, -self.largest_parameter_gap]
        worst = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MIN)
        return Agreement(self.steps, int(worst[0].item()), -worst[1].item(), -worst[2].item())

    def __str__(self) -> str:
        exact = "bit for bit after every one" if self.bitwise else "not bit for bit"
        return (
            f"{self.steps} steps, {exact} (largest loss gap {self.largest_loss_gap:.1e}, "
            f"parameter gap {self.largest_parameter_gap:.1e})"
        )


def params_sha256(parameters: dict[str, torch.Tensor]) -> str:
    """A fingerprint of the exact bits of every parameter, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in parameters.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def ascii_curves(curves: dict[str, list[float]], width: int = 60, height: int = 12) -> str:
    """Loss against step: '*' for the first curve, 'o' for the second, '#' where they share
    a cell (one curve exactly on top of the other is all '#')."""
    longest = max(len(values) for values in curves.values())
    low = min(min(values) for values in curves.values())
    high = max(max(values) for values in curves.values())
    grid = [[" "] * width for _ in range(height)]
    for mark, values in zip("*o", curves.values()):
        for column in range(width):
            chunk = values[column * longest // width : (column + 1) * longest // width]
            if chunk:
                row = round((high - sum(chunk) / len(chunk)) / (high - low + 1e-12) * (height - 1))
                grid[row][column] = mark if grid[row][column] in (" ", mark) else "#"
    lines = [
        f"{high - (high - low) * r / (height - 1):6.2f} |{''.join(row)}"
        for r, row in enumerate(grid)
    ]
    lines.append(f"{'':6} +{'-' * width}\n{'':8}step 1{longest:>{width - 6}}")
    legend = ", ".join(f"{mark} {name}" for mark, name in zip("*o", curves))
    return "\n".join(lines + [f"{'':8}{legend}" + (", # both" if len(curves) > 1 else "")])


def say_memory(replica: Replica, psi: int, world: int) -> bool:
    """Each rank's bytes after the last step, by kind, beside the formula's (chapter 11;
    miniddp/sharding/memory.py for bf16's); whether they are equal on this rank. Every rank
    must call it."""
    params = list(replica.module.parameters())
    mine = params  # under fully_shard: this rank's padded shards
    if isinstance(replica.optimizer, ZeroRedundancyOptimizer):
        rank = replica.optimizer.rank
        mine = [p for p in params if replica.optimizer.owner_of(p) == rank]
    copies = ddp_compute_copies(replica.model)  # MiniDDP's bf16 copies, kept between steps
    measured = measure_memory(params, replica.optimizer, ddp_buckets(replica.model), copies)
    # fully_shard casts each gathered unit afresh and frees it after use: no copy stays.
    dtype = BF16 if replica.precision == "bf16" and replica.name != "zero3" else None
    formula = Formula(replica.name, psi, len(mine), world, param_dtype=dtype)
    expected = formula.expected(sum(p.numel() for p in mine))
    kinds = ("parameters", "gradients", "buckets", "optimizer_state")
    kinds += ("compute_copies",) * (dtype is not None)
    line = "  ".join(f"{kind} {fmt_bytes(getattr(measured, kind))}" for kind in kinds)
    line += f"  = {fmt_bytes(measured.total)}"
    if measured != expected:
        formula = "  ".join(f"{kind} {fmt_bytes(getattr(expected, kind))}" for kind in kinds)
        line += f"\n    but the formula says {formula}"
    say(
        f"{replica.name} ({replica.precision}): each rank's bytes after the last step, counted "
        "from the storages:"
    )
    say_all_ranks(f"{line}{'' if measured != expected else ': the formula, to the byte'}")
    bf16 = BF16 if replica.precision == "bf16" else None
    ddp = Formula("ddp", psi, len(params), world, param_dtype=bf16).expected()
    say(
        f"plain DDP's formula for the same model ({replica.precision}): {fmt_bytes(ddp.total)} "
        "on every rank"
    )
    return measured == expected


@dataclass
class Record:
    """What the run measured beyond each replica's own curves."""

    agreements: dict[str, Agreement]  # each compared replica's, against its reference
    one_process: Agreement = field(default_factory=Agreement)  # rank 0's, steps 0 if not run
    clipped_steps: int = 0  # steps whose gradient norm exceeded the clip, so clipping scaled them


class Checkpoints:
    """One atomic checkpoint a replica, <name>.pt in `directory`, MiniDDP's written last and
    holding the run's settings, the Record and every replica's curves."""

    def __init__(self, directory: Path, settings: dict) -> None:
        self.directory, self.settings = directory, settings

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.pt"

    def forget(self) -> None:
        """Delete an earlier run's, so that a crash before our first save cannot resume that
        one (every rank calls it)."""
        if dist.get_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for name in DESIGNS:
                self.path(name).unlink(missing_ok=True)
        dist.barrier()  # nobody looks for a checkpoint before it is gone

    def save(self, replicas: dict[str, Replica], progress: Progress, record: Record) -> None:
        agreements = {n: asdict(a.on_every_rank()) for n, a in record.agreements.items()}
        extra = {
            "settings": self.settings,
            "agreements": agreements,
            "one_process": asdict(record.one_process),
            "clipped_steps": record.clipped_steps,
            "train_losses": {n: r.train_losses for n, r in replicas.items()},
            "val_losses": {n: r.val_losses for n, r in replicas.items()},
        }
        for name, replica in reversed(replicas.items()):
            mine = extra if name == "miniddp" else {"settings": self.settings}
            replica.save(self.path(name), progress, mine)

    def resume(self, replicas: dict[str, Replica]) -> tuple[int, Record]:
        """Every replica from its own checkpoint, and their curves; the step they were at, and
        the Record. Another run's settings are refused before anything loads: they would not fit."""
        extra = read_checkpoint(self.path("miniddp"))["extra"]
        if extra["settings"] != self.settings:
            raise ValueError(
                f"{self.directory} holds a run with other settings ({extra['settings']}): "
                "pass another --checkpoint-dir, or the same flags, or no --resume"
            )
        steps = {n: r.load(self.path(n)) for n, r in replicas.items()}
        if len(set(steps.values())) > 1:
            raise ValueError(
                f"the replicas' checkpoints in {self.directory} are at different steps "
                f"({steps}): the job died while saving. Start again without --resume."
            )
        for name, replica in replicas.items():
            replica.train_losses = extra["train_losses"][name]
            replica.val_losses = [tuple(v) for v in extra["val_losses"][name]]
        agreements = {n: Agreement(**a) for n, a in extra["agreements"].items()}
        one_process = Agreement(**extra["one_process"])
        return steps["miniddp"], Record(agreements, one_process, extra["clipped_steps"])


def exit_abruptly(rank: int, done: int) -> None:
    """Leave as a crash does: no cleanup and no exception, like a segfault or the OOM killer."""
    print(f"[rank {rank}] exits abruptly after step {done}", flush=True)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
        print(
            "torchrun has no --max-restarts, so the job ends here: run it again "
            "with --resume to continue from the last checkpoint.",
            flush=True,
        )
    os._exit(1)


def draw_curves(replicas: dict[str, Replica], folder: Path, world: int) -> Path:
    """The figure of every replica's training and validation curves (a bf16 run its own)."""
    from miniddp.instruments.figures import draw

    bf16 = replicas["miniddp"].precision == "bf16"  # its own figure: the fp32 run's stays
    runs = {
        LABELS[n] + " in bf16" * (r.precision == "bf16"): (r.train_losses, r.val_losses)
        for n, r in replicas.items()
    }
    title = f"Chapter 12: a character-level GPT on {world} ranks"
    title += ", bf16 (fp32 masters) beside fp32" * bf16
    return draw.loss_curves(runs, folder / ("12_loss_bf16.png" if bf16 else "12_loss.png"), title)


def say_what_bf16_costs(bf16: Replica, fp32: Replica) -> None:
    """The two validation curves side by side: bf16 (with fp32 masters) and fp32, trained from
    the same weights on the same windows with the same dropout masks."""
    say("validation loss, bf16 (fp32 masters) against fp32, nats per character:")
    for (step, ours), (_, theirs) in zip(bf16.val_losses, fp32.val_losses):
        say(f"    step {step:4d}: bf16 {ours:.4f}  fp32 {theirs:.4f}  gap {ours - theirs:+.4f}")
    gap = bf16.val_losses[-1][1] - fp32.val_losses[-1][1]
    say(
        f"what bf16 cost: {gap:+.4f} nats per character in the final validation loss "
        f"({100 * gap / fp32.val_losses[-1][1]:+.2f}%)"
    )
