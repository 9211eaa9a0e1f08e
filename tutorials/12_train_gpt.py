"""Chapter 12: train a real model. A character-level GPT on real text, on MiniDDP and on torch's
DDP side by side, curve for curve and bit for bit.

    ./launch.sh tutorials/12_train_gpt.py                        the default run, 2 CPU ranks
    ./launch.sh tutorials/12_train_gpt.py --data input.txt       any text file (see below)
    ./launch.sh tutorials/12_train_gpt.py --accum 4 --plot DIR   4 micro-steps a step; a figure
    ./launch.sh tutorials/12_train_gpt.py --shard zero2          ZeRO-1, ZeRO-2 or fully_shard
    MAX_RESTARTS=2 ./launch.sh tutorials/12_train_gpt.py --crash-at-step 60

Every model so far was a toy. This one is what people train: a GPT (miniddp/models/gpt.py),
AdamW with and without weight decay, warmup then a cosine learning rate, gradient clipping,
accumulation under no_sync(), a validation loss on held-out text, an atomic checkpoint every few
steps, and a DistributedSampler with set_epoch over windows of text. The text is Python's own
standard library by default (tutorials/char_corpus.py: no download, the same bytes on every
machine with the same Python); `--data FILE` trains on any text instead, e.g. tinyshakespeare:
curl -O https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt

In the same job, from the same weights, torch's DistributedDataParallel trains a second replica
(`--no-compare` skips it): every micro-step seeds torch's generator from (step, micro-step, rank),
so both draw the same dropout masks, and the chapter checks that every training loss and every
parameter are bitwise equal after every optimizer step. For the first steps, rank 0 also trains
a third copy alone, on the whole global batch with accumulation: one process, equal to DDP up to
the order of its sums. `--shard` trains the sharded design instead of torch's DDP beside MiniDDP.

Measured (2 CPU ranks, the default settings): the validation loss falls from 4.62 nats per
character (ln 98: a uniform guess over the 98 characters) to 1.9 in 200 steps; the run, both
replicas included, takes about 2 minutes on a laptop's two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import textwrap
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from char_corpus import Corpus, Windows, load_corpus
from common import add_plot_option, end_chapter, fmt_bytes, say, say_all_ranks, section
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import DistributedSampler, MiniDDP, ZeroRedundancyOptimizer
from miniddp import full_state_dict, fully_shard
from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint
from miniddp.env import DistEnv, init_distributed
from miniddp.models.gpt import GPT, GPTConfig, next_character_loss, parameter_groups
from miniddp.sharding import Formula, ddp_buckets, measure_memory, reduce_scatter_hook

# How far one process on the global batch may land from DDP after the first steps: its sums
# run in another order (W·K micro-batches accumulated in one process against K per rank and an
# all-reduce), ~1e-7 relative per step; AdamW's division by √v amplifies that where v is tiny.
ONE_PROCESS_TOLERANCE = 1e-4
SHARD_TOLERANCE = 1e-4  # beyond W = 2, where the ring and gloo add in different orders


@dataclass(frozen=True)
class Settings:
    """Everything that shapes the run: a checkpoint resumes only a run with the same."""

    steps: int = 200
    batch: int = 16  # windows per rank per micro-step
    accum: int = 1  # micro-steps per optimizer step
    context: int = 64
    width: int = 128
    layers: int = 4
    heads: int = 4
    dropout: float = 0.1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 25
    eval_windows: int = 128
    seed: int = 0
    data: str | None = None
    max_characters: int | None = None
    compare: bool = True
    shard: str | None = None


def learning_rate(step: int, s: Settings) -> float:
    """Linear warmup over `warmup` steps (Adam's moments are noise at first: small steps while
    they settle), then half a cosine from `lr` down to `min_lr` at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


class Batches:
    """Which windows each rank trains on at each step. Rank r's own DistributedSampler (drop_last:
    every rank the same number of steps), `set_epoch` at each epoch's start, and K micro-batches
    of B windows per step. Everything follows from the step number, so a resumed run picks up
    mid-epoch at exactly the right window; rank 0 can also ask for every rank's share."""

    def __init__(self, windows: Windows, world: int, s: Settings) -> None:
        self.windows, self.batch, self.accum = windows, s.batch, s.accum
        self.samplers = [DistributedSampler(windows, num_replicas=world, rank=r, shuffle=True,
                                            seed=s.seed, drop_last=True) for r in range(world)]  # fmt: skip
        self.steps_per_epoch = len(self.samplers[0]) // (s.batch * s.accum)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(windows)} training windows cannot fill one step of {world} ranks x "
                f"{s.accum} x {s.batch}: pass a longer text or a smaller --batch"
            )
        self.orders: dict[int, tuple[int, list[int]]] = {}  # rank -> (epoch, its indices)

    def progress(self, steps_done: int) -> Progress:
        epoch, position = divmod(steps_done, self.steps_per_epoch)
        return Progress(steps_done, epoch, position)

    def of_rank(self, rank: int, step: int) -> list[torch.Tensor]:
        epoch, position = divmod(step, self.steps_per_epoch)
        if self.orders.get(rank, (None,))[0] != epoch:
            self.samplers[rank].set_epoch(epoch)  # forget it and every epoch replays one order
            self.orders[rank] = (epoch, list(self.samplers[rank]))
        start = position * self.batch * self.accum
        mine = self.orders[rank][1][start : start + self.batch * self.accum]
        return [self.windows[mine[k : k + self.batch]] for k in range(0, len(mine), self.batch)]


def dropout_seed(s: Settings, step: int, micro: int, rank: int, world: int) -> int:
    """One seed per (step, micro-step, rank): the masks that micro-batch draws, in any replica."""
    return s.seed * 1_000_003 + (step * s.accum + micro) * world + rank


@dataclass
class Replica:
    """One way of training the same GPT: what forward is called on, the GPT inside, its
    optimizer, how to skip gradient sync, and how to clip; plus what it recorded."""

    name: str
    model: nn.Module
    module: GPT
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], AbstractContextManager]
    clip: Callable[[float], torch.Tensor]
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter by name (a collective under fully_shard: it gathers them)."""
        return full_state_dict(self.module) if self.name == "zero3" else self.module.state_dict()


def build_gpt(vocabulary: int, s: Settings) -> GPT:
    """The same initial weights on every rank and in every replica: a seeded, forked RNG."""
    config = GPTConfig(vocabulary, s.context, s.width, s.layers, s.heads, s.dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        return GPT(config)


def clip_all(parameters: list[nn.Parameter]) -> Callable[[float], torch.Tensor]:
    """torch's clip_grad_norm_: scale every gradient by min(1, max_norm / ‖all gradients‖)."""
    return lambda max_norm: nn.utils.clip_grad_norm_(parameters, max_norm)


def build_replica(design: str, vocabulary: int, s: Settings) -> Replica:
    """`design`: miniddp, torch, one-process, zero1, zero2 or zero3; AdamW for all of them."""
    module = build_gpt(vocabulary, s)
    adamw = {"lr": s.lr, "betas": (0.9, 0.95)}
    if design == "zero3":
        for block in module.blocks:
            fully_shard(block)  # the blocks first, then the root for the embeddings and norm
        fully_shard(module)
        optimizer = torch.optim.AdamW(parameter_groups(module, s.weight_decay), **adamw)

        @contextmanager
        def no_sync():  # FSDP2's spelling: accumulate full gradients, reduce-scatter later
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)

        return Replica(design, module, module, optimizer, no_sync, clip_all(list(module.parameters())))
    groups = parameter_groups(module, s.weight_decay)
    if design == "one-process":
        optimizer = torch.optim.AdamW(groups, **adamw)
        return Replica(design, module, module, optimizer, nullcontext, clip_all(list(module.parameters())))
    model = DistributedDataParallel(module) if design == "torch" else MiniDDP(module)
    if design in ("zero1", "zero2"):
        optimizer = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **adamw)
        if design == "zero2":
            model.register_comm_hook(optimizer, reduce_scatter_hook)
    else:
        optimizer = torch.optim.AdamW(groups, **adamw)
    return Replica(design, model, module, optimizer, model.no_sync, clip_all(list(module.parameters())))


def train_step(
    replica: Replica, micro_batches: list[tuple[int, torch.Tensor]], s: Settings, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `micro_batches` (dropout seed, windows): every backward but the
    last under no_sync(), so gradients are averaged over ranks once, after the sum of all K.
    Returns this rank's loss (the mean over its micro-batches) and the gradients' norm."""
    started = time.perf_counter()
    for group in replica.optimizer.param_groups:
        group["lr"] = learning_rate(step, s)
    replica.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for number, (seed, windows) in enumerate(micro_batches):
        torch.manual_seed(seed)  # this micro-batch's dropout masks, the same in every replica
        last = number == len(micro_batches) - 1
        with nullcontext() if last else replica.no_sync():
            # / K: the gradient of the mean over K micro-batches is the mean of theirs
            loss = next_character_loss(replica.model, windows) / len(micro_batches)
            loss.backward()
        total += loss.detach()
    norm = replica.clip(s.clip)
    replica.optimizer.step()
    replica.seconds += time.perf_counter() - started
    return total, norm


def validation_loss(replica: Replica, windows: Windows, s: Settings, env: DistEnv) -> float:
    """Mean loss per character on `eval_windows` held-out windows, evenly spaced through the
    validation text, each rank scoring every W-th one; dropout off, no gradients."""
    spaced = torch.linspace(0, len(windows) - 1, min(s.eval_windows, len(windows))).long()
    mine = windows[spaced[env.rank :: env.world_size].tolist()]
    replica.module.eval()
    with torch.no_grad():
        logits = replica.module(mine[:, :-1])
        total = nn.functional.cross_entropy(
            logits.flatten(0, 1), mine[:, 1:].flatten(), reduction="sum"
        )
    replica.module.train()
    summed = torch.stack([total, torch.tensor(float(mine[:, 1:].numel()))]).double()
    dist.all_reduce(summed)
    return (summed[0] / summed[1]).item()


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

    def on_every_rank(self) -> Agreement:
        """The worst of every rank's (a collective)."""
        worst = torch.tensor([self.bitwise_steps == self.steps, -self.largest_loss_gap,
                              -self.largest_parameter_gap], dtype=torch.float64)  # fmt: skip
        dist.all_reduce(worst, op=dist.ReduceOp.MIN)
        bitwise = self.steps if worst[0].item() == 1.0 else 0
        return Agreement(self.steps, bitwise, -worst[1].item(), -worst[2].item())


def params_sha256(module: dict[str, torch.Tensor]) -> str:
    """A fingerprint of the exact bits of every parameter, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in module.items():
        digest.update(name.encode())
        digest.update(bytes(tensor.detach().cpu().contiguous().view(torch.uint8).flatten()))
    return digest.hexdigest()


def ascii_curves(curves: dict[str, list[float]], marks: str = "*o", width: int = 60,
                 height: int = 12) -> str:  # fmt: skip
    """Loss against step, one mark per curve ('#' where they fall on the same cell)."""
    longest = max(len(values) for values in curves.values())
    low = min(min(values) for values in curves.values())
    high = max(max(values) for values in curves.values())
    grid = [[" "] * width for _ in range(height)]
    for mark, values in zip(marks, curves.values()):
        for column in range(width):
            chunk = values[column * longest // width : (column + 1) * longest // width]
            if not chunk:
                continue
            row = round((high - sum(chunk) / len(chunk)) / (high - low + 1e-12) * (height - 1))
            grid[row][column] = "#" if grid[row][column] not in (" ", mark) else mark
    lines = [f"{high - (high - low) * r / (height - 1):6.2f} |{''.join(row)}"
             for r, row in enumerate(grid)]  # fmt: skip
    lines.append(f"{'':6} +{'-' * width}\n{'':8}step 1{'':>{width - 12}}{longest:>5}")
    legend = ", ".join(f"{mark} {name}" for mark, name in zip(marks, curves))
    return "\n".join(lines + [f"{'':8}{legend}, # both"])


def parse_args() -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description="Chapter 12: train a character-level GPT.")
    defaults = Settings()
    for name, value in asdict(defaults).items():
        if isinstance(value, bool) or name in ("data", "max_characters", "shard"):
            continue
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                            help=f"(default {value})")  # fmt: skip
    parser.add_argument("--data", type=Path, help="a text file to train on (default: stdlib)")
    parser.add_argument("--max-characters", type=int, help="use only the text's first N")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also train torch's DDP and check it bit for bit (default on)")  # fmt: skip
    parser.add_argument("--shard", choices=("zero1", "zero2", "zero3"),
                        help="also train the sharded design and check it against MiniDDP")  # fmt: skip
    parser.add_argument("--one-process-steps", type=int, default=10, metavar="N",
                        help="rank 0 trains one process on the global batch for N steps")  # fmt: skip
    parser.add_argument("--log-every", type=int, default=10, metavar="N")
    parser.add_argument("--checkpoint-every", type=int, default=25, metavar="N")
    parser.add_argument("--checkpoint-dir", type=Path, help="(default: ./checkpoints/12_...)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint-dir (automatic after a torchrun restart)")  # fmt: skip
    parser.add_argument("--crash-at-step", type=int, metavar="K",
                        help="the last rank exits abruptly after step K, on the first attempt")  # fmt: skip
    add_plot_option(parser)
    args = parser.parse_args()
    chosen = {name: getattr(args, name) for name in asdict(defaults)}
    chosen["data"] = str(args.data) if args.data else None
    settings = Settings(**chosen)
    if settings.steps < 1 or settings.accum < 1 or settings.eval_every < 1 or args.log_every < 1:
        parser.error("--steps, --accum, --eval-every and --log-every must be at least 1")
    return settings, args


def main() -> None:
    s, args = parse_args()
    env = init_distributed()
    world = env.world_size
    corpus: Corpus = load_corpus(args.data, s.max_characters)
    say(f"Chapter 12: a character-level GPT on {world} ranks, backend {env.backend}; torchrun "
        f"attempt {env.restart_count}")  # fmt: skip

    section("1. The text")
    train_windows, val_windows = Windows(corpus.train, s.context), Windows(corpus.validation, s.context)
    batches = Batches(train_windows, world, s)
    tokens_per_step = world * s.accum * s.batch * s.context
    say(f"{corpus.source}: {len(corpus.text):,} characters, {len(corpus.vocabulary)} distinct, "
        f"SHA-256 {corpus.sha256[:16]}...")  # fmt: skip
    say(f"training on the first {len(corpus.train):,}, validating on the last "
        f"{len(corpus.validation):,}; {len(train_windows):,} training windows of {s.context} + 1")  # fmt: skip
    say(f"an epoch is {batches.steps_per_epoch} steps of {world} ranks x {s.accum} micro-steps x "
        f"{s.batch} windows = {tokens_per_step:,} characters; a sample of the text:")  # fmt: skip
    middle = len(corpus.train) // 2
    say(textwrap.indent(corpus.decode(corpus.train[middle : middle + 240]), "    | "))

    section("2. The model and its replicas")
    vocabulary = len(corpus.vocabulary)
    designs = ["miniddp"] + ["torch"] * s.compare + ([s.shard] if s.shard else [])
    replicas = {design: build_replica(design, vocabulary, s) for design in designs}
    ours = replicas["miniddp"]
    groups = ours.optimizer.param_groups
    psi = sum(p.numel() for p in ours.module.parameters())
    say(f"GPT: {s.layers} blocks, width {s.width}, {s.heads} heads, context {s.context}, dropout "
        f"{s.dropout}; {psi:,} parameters in {len(list(ours.module.parameters()))} tensors (the "
        f"head is the token embedding); AdamW, weight decay {s.weight_decay} on "
        f"{len(groups[0]['params'])} matrices, none on {len(groups[1]['params'])} biases and gains")  # fmt: skip
    say(f"replicas, each from the same weights: {', '.join(replicas)}")
    directory = args.checkpoint_dir or Path(
        "checkpoints", f"12_train_gpt-{world}ranks-{hashlib.sha256(repr(s).encode()).hexdigest()[:8]}"
    )
    path = directory / "checkpoint.pt"
    start, agreements, one_process_gaps = 0, {name: Agreement() for name in designs[1:]}, {}
    if (args.resume or env.restart_count > 0) and path.exists():
        for name, replica in replicas.items():  # bitwise equal at every save, so one file fits all
            loaded = load_checkpoint(path, replica.model, replica.optimizer)
        if loaded.extra["settings"] != asdict(s):
            raise ValueError(f"{path} was written with other settings: {loaded.extra['settings']}")
        start = loaded.progress.step
        for name, replica in replicas.items():
            replica.train_losses = loaded.extra["train_losses"][name]
            replica.val_losses = [tuple(v) for v in loaded.extra["val_losses"][name]]
        agreements = {n: Agreement(**a) for n, a in loaded.extra["agreements"].items()}
        one_process_gaps = loaded.extra["one_process_gaps"]
        say(f"resumed from step {start} (epoch {loaded.progress.epoch}, step "
            f"{loaded.progress.batches_done} of it): {path}")  # fmt: skip
    else:
        if env.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # an earlier run's: a crash now must not resume it
        dist.barrier()
        for replica in replicas.values():
            replica.val_losses.append((0, validation_loss(replica, val_windows, s, env)))
        say(f"step 0: validation loss {ours.val_losses[0][1]:.3f} nats per character "
            f"(a uniform guess: ln {vocabulary} = {math.log(vocabulary):.3f})")  # fmt: skip
    solo = None
    if env.is_main and start == 0 and args.one_process_steps > 0:
        solo = build_replica("one-process", vocabulary, s)

    section("3. Train")
    say(f"{s.steps} steps: warmup {s.warmup}, then cosine {s.lr:g} -> {s.min_lr:g}; clip at "
        f"{s.clip}; validation every {s.eval_every} steps, a checkpoint every "
        f"{args.checkpoint_every} into {directory}")  # fmt: skip
    began = time.perf_counter()
    try:
        for step in range(start, s.steps):
            mine = batches.of_rank(env.rank, step)
            micro = [(dropout_seed(s, step, k, env.rank, world), w) for k, w in enumerate(mine)]
            results = {name: train_step(r, micro, s, step) for name, r in replicas.items()}
            means = torch.stack([loss for loss, _ in results.values()])
            dist.all_reduce(means)
            for replica, mean in zip(replicas.values(), (means / world).tolist()):
                replica.train_losses.append(mean)
            reference = ours.parameters()
            for name, agreement in agreements.items():
                losses = (results["miniddp"][0].item(), results[name][0].item())
                agreement.record(losses, reference, replicas[name].parameters())
            if solo is not None and step < args.one_process_steps:
                everyone = [(dropout_seed(s, step, k, r, world), w)
                            for r in range(world) for k, w in enumerate(batches.of_rank(r, step))]  # fmt: skip
                loss, _ = train_step(solo, everyone, s, step)
                gaps = [(a.double() - b.double()).abs().max().item()
                        for a, b in zip(solo.parameters().values(), reference.values())]  # fmt: skip
                one_process_gaps = {"steps": step + 1, "parameters": max(gaps),
                                    "loss": max(one_process_gaps.get("loss", 0.0),
                                                abs(loss.item() - ours.train_losses[-1]))}  # fmt: skip
            done = step + 1
            if done % s.eval_every == 0 or done == s.steps:
                for replica in replicas.values():
                    replica.val_losses.append((done, validation_loss(replica, val_windows, s, env)))
            if done % args.log_every == 0 or done == s.steps or done == start + 1:
                rates = "  ".join(f"{name} {tokens_per_step * (done - start) / r.seconds / 1e3:.1f}k"
                                  for name, r in replicas.items())  # fmt: skip
                left = (time.perf_counter() - began) / (done - start) * (s.steps - done)
                val = f"  val {ours.val_losses[-1][1]:.3f}" if ours.val_losses[-1][0] == done else ""
                say(f"step {done:4d}/{s.steps}  loss {ours.train_losses[-1]:.3f}{val}  lr "
                    f"{learning_rate(step, s):.1e}  |g| {results['miniddp'][1].item():.2f}  "
                    f"tokens/s: {rates}  ETA {left:.0f} s")  # fmt: skip
            if done % args.checkpoint_every == 0 or done == s.steps:
                combined = {n: asdict(a.on_every_rank()) for n, a in agreements.items()}
                extra = {"settings": asdict(s), "agreements": combined,
                         "one_process_gaps": one_process_gaps,
                         "train_losses": {n: r.train_losses for n, r in replicas.items()},
                         "val_losses": {n: r.val_losses for n, r in replicas.items()}}  # fmt: skip
                save_checkpoint(path, ours.model, ours.optimizer, batches.progress(done), extra)
            if args.crash_at_step == done and env.restart_count == 0 and env.rank == world - 1:
                print(f"[rank {env.rank}] exits abruptly after step {done}", flush=True)
                os._exit(1)  # no cleanup and no exception, like a segfault or the OOM killer
    except RuntimeError as error:
        # A peer died and our collective failed: leave at once (os._exit: a normal exit can
        # abort in gloo's threads), for torchrun to restart everyone from the checkpoint.
        print(f"[rank {env.rank}] a collective failed: {str(error).strip()[:120]}", flush=True)
        os._exit(1)
    minutes = (time.perf_counter() - began) / 60
    say(f"trained steps {start + 1}..{s.steps} in {minutes:.1f} minutes")
    report_and_check(replicas, agreements, one_process_gaps, corpus, s, env, args)


def report_and_check(replicas, agreements, one_process_gaps, corpus, s, env, args) -> None:
    ours = replicas["miniddp"]
    section("4. Curve for curve")
    others = [name for name in replicas if name != "miniddp"]
    shown = {"MiniDDP": ours.train_losses}
    if others:
        shown[others[0]] = replicas[others[0]].train_losses
    say("training loss, nats per character (the mean over every rank's windows):")
    say(ascii_curves(shown))
    say("validation loss: " + ", ".join(f"step {step} {value:.3f}" for step, value in ours.val_losses))
    agreements = {name: agreement.on_every_rank() for name, agreement in agreements.items()}
    for name, a in agreements.items():
        say(f"{name} against MiniDDP: bit for bit after {a.bitwise_steps} of {a.steps} steps "
            f"(largest loss gap {a.largest_loss_gap:.1e}, parameter gap {a.largest_parameter_gap:.1e})")  # fmt: skip
    if one_process_gaps:
        say(f"one process on the global batch with accumulation, {one_process_gaps['steps']} "
            f"steps: largest loss gap {one_process_gaps['loss']:.1e}, parameters "
            f"{one_process_gaps['parameters']:.1e} (tolerance {ONE_PROCESS_TOLERANCE:.0e})")  # fmt: skip
    else:
        say("one process on the global batch: not run (this attempt resumed, or --one-process-steps 0)")
    if args.plot and env.is_main:
        from miniddp.figures import draw

        curves = {("MiniDDP" if n == "miniddp" else n): (r.train_losses, r.val_losses)
                  for n, r in replicas.items()}  # fmt: skip
        written = draw.loss_curves(curves, args.plot / "12_loss.png",
                                   f"char-level GPT, {env.world_size} ranks")  # fmt: skip
        say(f"wrote {written}")
    if s.shard:
        say_memory(replicas[s.shard], s, env)

    section("5. What the model learned")
    if env.is_main:
        prompt = "def " if set("def ") <= set(corpus.vocabulary) else corpus.text[0]
        encoded = torch.tensor([[corpus.vocabulary.index(c) for c in prompt]])
        sampled = ours.module.generate(encoded, 300, torch.Generator().manual_seed(s.seed))
        say(f"300 characters sampled after {prompt!r}:")
        say(textwrap.indent(corpus.decode(sampled[0]), "    | "))
    dist.barrier()

    section("Checks")
    final_val = ours.val_losses[-1][1]
    fell = ours.val_losses[0][1] - final_val
    say(f"validation loss {ours.val_losses[0][1]:.3f} -> {final_val:.3f}: down {fell:.2f} nats per character")
    for name, a in agreements.items():
        if name == "torch" or (name == "zero1") or env.world_size == 2:
            assert a.bitwise_steps == a.steps, f"{name} differs from MiniDDP: {a}"
        else:
            assert a.largest_parameter_gap <= SHARD_TOLERANCE, f"{name}: {a}"
    if one_process_gaps:
        assert one_process_gaps["parameters"] <= ONE_PROCESS_TOLERANCE, one_process_gaps
        assert one_process_gaps["loss"] <= ONE_PROCESS_TOLERANCE, one_process_gaps
    if s.steps >= 100:
        assert fell >= 1.0, "the validation loss should fall by a nat per character or more"
    sha = params_sha256(ours.parameters())
    dist.barrier()  # every rank has passed its own checks
    say(f"Verified on {env.world_size} ranks: {', '.join(agreements) or 'MiniDDP alone'} "
        "trained step for step as MiniDDP, bit for bit where the maths allows.")  # fmt: skip
    say(f"final-val-loss: {final_val:.6f}")
    say(f"final-params-sha256: {sha}")
    end_chapter()


def say_memory(replica: Replica, vocabulary: int, s: Settings, env: DistEnv) -> None:
    """Each rank's bytes after the last step, by kind, beside the formula's (chapter 08)."""
    params = list(replica.module.parameters())
    psi = sum(p.numel() for p in build_gpt(vocabulary, s).parameters())
    mine = params  # zero3: this rank's padded shards
    if replica.name != "zero3":
        rank = replica.optimizer.rank
        mine = [p for p in params if replica.optimizer.owner_of(p) == rank]
    measured = measure_memory(params, replica.optimizer, ddp_buckets(replica.model))
    formula = Formula(replica.name, psi, len(mine), env.world_size)
    expected = formula.expected(sum(p.numel() for p in mine))
    kinds = ("parameters", "gradients", "buckets", "optimizer_state")
    say(f"{replica.name} memory per rank after the last step, measured (formula):")
    say_all_ranks("  ".join(f"{kind} {fmt_bytes(getattr(measured, kind))} "
                            f"({fmt_bytes(getattr(expected, kind))})" for kind in kinds))  # fmt: skip
    ddp = Formula("ddp", psi, len(params) if replica.name != "zero3" else 0, env.world_size)
    say(f"  total {fmt_bytes(measured.total)}; plain DDP's formula: {fmt_bytes(ddp.expected().total)}")
    return measured == expected


if __name__ == "__main__":
    main()
