"""Chapter 12: train a real model. A character-level GPT on real text, on MiniDDP and on torch's
DDP side by side, curve for curve and bit for bit.

    ./launch.sh tutorials/12_train_gpt.py                        the default run, 2 CPU ranks
    ./launch.sh tutorials/12_train_gpt.py --data input.txt       any text file (see below)
    ./launch.sh tutorials/12_train_gpt.py --accum 4 --plot DIR   4 micro-steps a step; a figure
    ./launch.sh tutorials/12_train_gpt.py --shard zero2          ZeRO-1, ZeRO-2 or fully_shard
    ./launch.sh tutorials/12_train_gpt.py --precision bf16       bf16 compute, fp32 masters
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
the order of its sums: within 1e-4, checked (measured: 0 at W = 2 with --accum 1, 1e-7 with 2).

`--shard` adds a sharded replica, checked against MiniDDP the same way, its bytes per rank
printed beside chapter 08's formula. zero1 (miniddp.ZeroRedundancyOptimizer) is bitwise at any
W. zero2 (reduce_scatter_hook) and zero3 (fully_shard on each block, then on the root) hold only
a share of the gradients, so they clip with miniddp.sharding.clip_grad_norm_, whose norm adds
the shares in another order: within 1e-4 when clipping acts, bitwise at W = 2 when it never does.

`--precision bf16` trains in bf16 with fp32 masters: each forward computes with a bf16 cast of
the fp32 parameters, the gradients are reduced in fp32 into the masters' fp32 `.grad`, AdamW
steps the masters, and the checkpoint holds them (MiniDDP(mixed_precision=MixedPrecision(bf16));
fully_shard(..., mp_policy=MixedPrecisionPolicy(bf16, reduce_dtype=float32))). torch's DDP
mixed precision does not run on CPU, so the reference is torch's own fully_shard with the same
policy: at W = 2 MiniDDP and fully_shard are its bits, every step, where clipping never acts.
Where it acts, the norm's sum over shards rounds otherwise, and under bf16 the runs then part for
good (BF16_LOSS_COST says why): their final validation losses are checked instead. An fp32
MiniDDP trains beside them from the same weights, on the same windows and masks: the gap
between the two validation curves is what bf16 costs. (The training losses printed under bf16
are bf16 themselves, the model's output: steps of 1/64 near 3 nats. The validation losses are
summed in fp32.)

Every replica saves an atomic checkpoint (miniddp.checkpoint) every --checkpoint-every steps;
the step number alone fixes the windows and the dropout masks. After a torchrun restart, or
with --resume, each resumes from its own, and the last two lines (final-val-loss,
final-params-sha256) are those of a run that never stopped.

Measured, the default run on 2 CPU ranks (docs/figures/12_loss.png): the validation loss falls from
about 4.4 nats per character to about 2.3 in 200 steps (the training loss, noisier, ends between 2.0
and 2.3). The text is this Python's own standard library, so the exact figures move with the Python
version (4.37 to 2.27 on the one the figure was drawn with, a first 4.42 on 3.11). 2.3 nats is a
perplexity of about 10 characters, against 98 for a guess. (It starts below ln 98 = 4.58: with
the head tied to the embedding, the untrained model already favours repeating its input
character, and code repeats spaces.) Both replicas, the whole run included, took 174 s of CPU time
over the two ranks: about a minute and a half of wall time on two idle cores, by that count.
(Measured here on two cores shared with a dozen other processes, load average 12: 7 minutes.)

Measured, `--precision bf16 --no-compare` (bf16 MiniDDP beside fp32 MiniDDP, 2 CPU ranks): the
two validation curves part by at most 0.015 nats on the way (bf16 ahead at some points, behind
at others: each rounding sends the run down another path), and end 0.001 apart, 2.278 against
2.277: here bf16 costs nothing visible in loss. Nor does it save bytes between steps: MiniDDP
keeps its fp32 masters, gradients, bucket and AdamW state, and adds a bf16 copy (2Ψ: 17.1 MiB a
rank against fp32's 15.6 MiB; miniddp/sharding/memory.py counts it). What bf16 saves is the
activations (half) and, on hardware with bf16 units, time; this CPU has none, and its bf16
matmuls ran 7x slower than fp32 (455 characters a second against 3,053).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import textwrap
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from char_corpus import Corpus, Windows, load_corpus
from common import end_chapter, say, section
from gpt_settings import Settings, parse_args
from side_by_side import (
    DESIGNS,
    Agreement,
    Replica,
    ascii_curves,
    build_replica,
    params_sha256,
    say_memory,
)
from torch import nn

from miniddp import DistributedSampler
from miniddp.checkpoint import Progress, read_checkpoint
from miniddp.job.env import DistEnv, init_distributed
from miniddp.models.gpt import next_character_loss

# How far one process on the global batch may land from DDP after its steps: its sums run in
# another order (W·K micro-batches accumulated in one process, against K per rank and then an
# all-reduce), ~1e-7 relative per step, and AdamW's division by √v magnifies that where v is tiny.
ONE_PROCESS_TOLERANCE = 1e-4
# ZeRO-2 and fully_shard clip by a norm summed over shards, in another order than torch's
# clip_grad_norm_: the same factor up to rounding, in the steps where clipping acts (and beyond
# W = 2, the ring and gloo add the gradients in different orders too). At W = 2 in a run where
# clipping never acted (--clip 1e9, say), they are bitwise MiniDDP's, and checked so.
SHARDED_TOLERANCE = 1e-4
# What bf16 may cost in final validation loss against the fp32 run, in nats per character.
# Measured on the default run: 0.001 at the end, 0.015 at most on the way; the bound is three
# times the largest wander. It bounds two bf16 replicas whose sums differ too: a master one fp32
# ulp away can round to another bf16 copy (a step of 2^-8 relative), which moves the next forward
# far more than the ulp did, and AdamW's m/sqrt(v) turns that into whole steps where gradients
# are small. Measured, --precision bf16 --shard zero3, clipping acting in 23 of the first 25
# steps: parameters 0.028 apart after 25 steps, and growing; so no bound on them, only on loss.
BF16_LOSS_COST = 0.05
LABELS = {
    "miniddp": "MiniDDP",
    "torch": "torch's DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "fully_shard",
    "torch-fsdp": "torch's fully_shard",
    "fp32": "MiniDDP in fp32",
}


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
        self.samplers = [
            DistributedSampler(
                windows, num_replicas=world, rank=r, shuffle=True, seed=s.seed, drop_last=True
            )
            for r in range(world)
        ]
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
    with torch.no_grad():  # through the wrapper: under bf16 it computes as in training
        logits = replica.model(mine[:, :-1])
        total = nn.functional.cross_entropy(  # in fp32: bf16 logits, but a loss to 24 bits
            logits.flatten(0, 1).float(), mine[:, 1:].flatten(), reduction="sum"
        )
    replica.module.train()
    summed = torch.stack([total, torch.tensor(float(mine[:, 1:].numel()))]).double()
    dist.all_reduce(summed)
    return (summed[0] / summed[1]).item()


@dataclass
class Training:
    """One run of the chapter: its replicas, their data, and what they recorded so far, with
    the three phases of its life: start (fresh, or resumed), train, report and check."""

    s: Settings
    args: argparse.Namespace
    env: DistEnv
    corpus: Corpus
    replicas: dict[str, Replica]
    batches: Batches
    validation: Windows
    directory: Path  # the checkpoints: one a replica, <name>.pt
    start: int = 0
    agreements: dict[str, Agreement] = field(default_factory=dict)
    one_process: dict[str, float] = field(default_factory=dict)  # its largest gaps, when run
    clipped_steps: int = 0  # steps whose gradient norm exceeded --clip, so clipping scaled them

    @property
    def ours(self) -> Replica:
        return self.replicas["miniddp"]

    def against(self, name: str) -> str:
        """The replica `name` is checked against: MiniDDP's, but under bf16 fully_shard is
        checked against torch's own fully_shard with the same policy, where there is one."""
        return "torch-fsdp" if name == "zero3" and "torch-fsdp" in self.replicas else "miniddp"

    def checkpoint(self, name: str) -> Path:
        return self.directory / f"{name}.pt"

    def start_or_resume(self) -> None:
        """Resume from the checkpoints after a torchrun restart (or with --resume); otherwise
        delete an earlier run's, so a crash before our first save cannot resume that one."""
        compared = [name for name in self.replicas if name not in ("miniddp", "fp32")]
        self.agreements = {name: Agreement() for name in compared}
        if (self.args.resume or self.env.restart_count > 0) and self.checkpoint("miniddp").exists():
            extra = read_checkpoint(self.checkpoint("miniddp"))["extra"]
            if extra["settings"] != asdict(self.s):  # before anything loads: it would not fit
                raise ValueError(
                    f"{self.directory} holds a run with other settings ({extra['settings']}): "
                    "pass another --checkpoint-dir, or the same flags, or no --resume"
                )
            steps = {n: r.load(self.checkpoint(n)) for n, r in self.replicas.items()}
            if len(set(steps.values())) > 1:
                raise ValueError(
                    f"the replicas' checkpoints in {self.directory} are at different steps "
                    f"({steps}): the job died while saving. Start again without --resume."
                )
            self.start = steps["miniddp"]
            for name, replica in self.replicas.items():
                replica.train_losses = extra["train_losses"][name]
                replica.val_losses = [tuple(v) for v in extra["val_losses"][name]]
            self.agreements = {n: Agreement(**a) for n, a in extra["agreements"].items()}
            self.one_process = extra["one_process"]
            self.clipped_steps = extra["clipped_steps"]
            progress = self.batches.progress(self.start)
            say(
                f"resumed from step {self.start} (epoch {progress.epoch}, step "
                f"{progress.batches_done} of it): every replica from its own checkpoint in "
                f"{self.directory}"
            )
            return
        if self.env.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            for name in DESIGNS:
                self.checkpoint(name).unlink(missing_ok=True)
        dist.barrier()  # nobody looks for a checkpoint before it is gone
        for replica in self.replicas.values():
            replica.val_losses.append(
                (0, validation_loss(replica, self.validation, self.s, self.env))
            )
        vocabulary = len(self.corpus.vocabulary)
        say(
            f"step 0: validation loss {self.ours.val_losses[0][1]:.3f} nats per character "
            f"(a uniform guess over the characters: ln {vocabulary} = {math.log(vocabulary):.3f})"
        )

    def train(self) -> None:
        """Every replica takes each step on the same windows and seeds; then the checks."""
        s, env, world = self.s, self.env, self.env.world_size
        solo = None  # the one-process replica: rank 0, from step 0, for the first few steps
        fresh = self.start == 0 and self.args.one_process_steps > 0
        if env.is_main and fresh and s.precision == "fp32":
            solo = build_replica(
                "one-process", s.model(len(self.corpus.vocabulary)), s.seed, s.lr, s.weight_decay
            )
        tokens_per_step = world * s.accum * s.batch * s.context
        began = time.perf_counter()
        for step in range(self.start, s.steps):
            mine = self.batches.of_rank(env.rank, step)
            micro = [(dropout_seed(s, step, k, env.rank, world), w) for k, w in enumerate(mine)]
            # Each replica reseeds before each micro-batch, so their order cannot change a bit;
            # alternating it keeps their tokens per second fair (the second finds caches warm).
            order = list(self.replicas.items())[:: -1 if step % 2 else 1]
            results = {name: train_step(replica, micro, s, step) for name, replica in order}
            means = torch.stack([results[name][0] for name in self.replicas])
            dist.all_reduce(means)  # every rank's loss: their mean is the global batch's
            for replica, mean in zip(self.replicas.values(), (means / world).tolist()):
                replica.train_losses.append(mean)
            self.clipped_steps += results["miniddp"][1].item() > s.clip
            # Gathered in one order on every rank: under fully_shard each is a collective.
            checked = ["miniddp", *self.agreements]
            params = {name: self.replicas[name].parameters() for name in checked}
            for name, agreement in self.agreements.items():
                against = self.against(name)
                losses = (results[against][0].item(), results[name][0].item())
                agreement.record(losses, params[against], params[name])
            if solo is not None and step < self.args.one_process_steps:
                self.compare_one_process(solo, step, params["miniddp"])
            done = step + 1
            if done % s.eval_every == 0 or done == s.steps:
                for replica in self.replicas.values():
                    loss = validation_loss(replica, self.validation, s, env)
                    replica.val_losses.append((done, loss))
            if done % self.args.log_every == 0 or done in (self.start + 1, s.steps):
                rates = "  ".join(
                    f"{name} {tokens_per_step * (done - self.start) / r.seconds:,.0f}"
                    for name, r in self.replicas.items()
                )
                left = (time.perf_counter() - began) / (done - self.start) * (s.steps - done)
                val = self.ours.val_losses[-1]
                val = f"  val {val[1]:.3f}" if val[0] == done else ""
                say(
                    f"step {done:4d}/{s.steps}  loss {self.ours.train_losses[-1]:.3f}{val}  lr "
                    f"{learning_rate(step, s):.1e}  |g| {results['miniddp'][1].item():.2f}  "
                    f"tokens/s {rates}  ETA {left:.0f} s"
                )
            if done % self.args.checkpoint_every == 0 or done == s.steps:
                self.save(done)
            if self.args.crash_at_step == done and env.restart_count == 0 and env.rank == world - 1:
                print(f"[rank {env.rank}] exits abruptly after step {done}", flush=True)
                if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
                    print(
                        "torchrun has no --max-restarts, so the job ends here: run it again "
                        "with --resume to continue from the last checkpoint.",
                        flush=True,
                    )
                os._exit(1)  # no cleanup and no exception, like a segfault or the OOM killer
        say(f"steps {self.start + 1}..{s.steps} took {time.perf_counter() - began:.0f} s")

    def compare_one_process(self, solo: Replica, step: int, reference: dict) -> None:
        """Rank 0 alone: every rank's micro-batches of this step, with each one's dropout seed."""
        world = self.env.world_size
        everyone = [
            (dropout_seed(self.s, step, k, rank, world), windows)
            for rank in range(world)
            for k, windows in enumerate(self.batches.of_rank(rank, step))
        ]
        loss, _ = train_step(solo, everyone, self.s, step)
        gaps = [
            (a.double() - b.double()).abs().max().item()
            for a, b in zip(solo.parameters().values(), reference.values())
        ]
        loss_gap = abs(loss.item() - self.ours.train_losses[-1])
        self.one_process = {
            "steps": step + 1,
            "parameters": max(gaps),
            "loss": max(self.one_process.get("loss", 0.0), loss_gap),
        }

    def save(self, done: int) -> None:
        """An atomic checkpoint of every replica (rank 0 writes a temporary file and renames it
        over the old one), MiniDDP's last, with what the report needs: the curves so far and
        the agreements."""
        agreements = {n: asdict(a.on_every_rank()) for n, a in self.agreements.items()}
        extra = {
            "settings": asdict(self.s),
            "agreements": agreements,
            "one_process": self.one_process,
            "clipped_steps": self.clipped_steps,
            "train_losses": {n: r.train_losses for n, r in self.replicas.items()},
            "val_losses": {n: r.val_losses for n, r in self.replicas.items()},
        }
        progress = self.batches.progress(done)
        for name, replica in reversed(self.replicas.items()):
            mine = extra if name == "miniddp" else {"settings": asdict(self.s)}
            replica.save(self.checkpoint(name), progress, mine)

    def report(self) -> bool:
        """Sections 4 and 5: the curves, how each replica agreed, memory, and a sample. Returns
        whether the sharded replica's memory is the formula's (True without --shard)."""
        section("4. Curve for curve")
        shown = {f"MiniDDP ({self.s.precision})": self.ours.train_losses}
        others = [n for n in self.replicas if n != "miniddp"]
        for name in (["fp32"] if "fp32" in self.replicas else others)[:1]:
            shown[name] = self.replicas[name].train_losses
        say("training loss, nats per character (each step's mean over every rank's windows):")
        say(ascii_curves(shown))
        say("validation loss: " + ", ".join(f"{v:.3f} at {n}" for n, v in self.ours.val_losses))
        if "fp32" in self.replicas:
            self.say_what_bf16_costs()
        self.agreements = {n: a.on_every_rank() for n, a in self.agreements.items()}
        for name, agreement in self.agreements.items():
            say(f"{name} against {LABELS[self.against(name)]}: {agreement}")
        if {"zero2", "zero3", "torch-fsdp"} & set(self.agreements):
            say(
                f"clipping acted in {self.clipped_steps} of {self.s.steps} steps: there ZeRO-2 "
                "and fully_shard (ours and torch's) scale by a norm summed over the shards, in "
                "another order than clip_grad_norm_'s over whole gradients (at W = 2, --clip "
                "1e9 makes them bitwise)"
            )
        if self.one_process:
            say(
                f"one process on the global batch with accumulation, the first "
                f"{self.one_process['steps']} steps: largest loss gap "
                f"{self.one_process['loss']:.1e}, parameter gap "
                f"{self.one_process['parameters']:.1e} (tolerance {ONE_PROCESS_TOLERANCE:.0e})"
            )
        else:
            say(
                "one process on the global batch: not run (resumed, --one-process-steps 0, or "
                "bf16, which it would need a wrapper to cast for)"
            )
        if self.args.plot and self.env.is_main:
            from miniddp.figures import draw

            bf16 = self.s.precision == "bf16"  # its own figure: the fp32 run's stays
            runs = {
                LABELS[n] + " in bf16" * (r.precision == "bf16"): (r.train_losses, r.val_losses)
                for n, r in self.replicas.items()
            }
            title = f"Chapter 12: a character-level GPT on {self.env.world_size} ranks"
            title += ", bf16 (fp32 masters) beside fp32" * bf16
            path = self.args.plot / ("12_loss_bf16.png" if bf16 else "12_loss.png")
            say(f"wrote {draw.loss_curves(runs, path, title)}")
        formula_holds = True
        psi = sum(p.numel() for p in self.ours.module.parameters())
        measured = ["miniddp"] * (self.s.precision == "bf16") + [self.s.shard] * bool(self.s.shard)
        for name in measured:
            holds = say_memory(self.replicas[name], psi, self.env.world_size)
            formula_holds = formula_holds and holds

        section("5. What the model learned")
        if self.env.is_main:
            vocabulary = self.corpus.vocabulary
            prompt = "def " if set("def ") <= set(vocabulary) else self.corpus.text[0]
            encoded = torch.tensor([[vocabulary.index(c) for c in prompt]])
            generator = torch.Generator().manual_seed(self.s.seed)
            sampled = self.ours.module.generate(encoded, 300, generator)
            say(f"300 characters sampled from MiniDDP's model after {prompt!r}:")
            say(textwrap.indent(self.corpus.decode(sampled[0]), "    | "))
        return formula_holds

    def say_what_bf16_costs(self) -> None:
        """The two validation curves side by side: bf16 (with fp32 masters) and fp32, trained
        from the same weights on the same windows with the same dropout masks."""
        say("validation loss, bf16 (fp32 masters) against fp32, nats per character:")
        fp32_losses = self.replicas["fp32"].val_losses
        for (step, bf16), (_, fp32) in zip(self.ours.val_losses, fp32_losses):
            say(f"    step {step:4d}: bf16 {bf16:.4f}  fp32 {fp32:.4f}  gap {bf16 - fp32:+.4f}")
        gap = self.ours.val_losses[-1][1] - self.replicas["fp32"].val_losses[-1][1]
        say(
            f"what bf16 cost: {gap:+.4f} nats per character in the final validation loss "
            f"({100 * gap / self.replicas['fp32'].val_losses[-1][1]:+.2f}%)"
        )

    def check(self, formula_holds: bool) -> None:
        section("Checks")
        first, last = self.ours.val_losses[0][1], self.ours.val_losses[-1][1]
        say(
            f"validation loss {first:.3f} -> {last:.3f}: down {first - last:.2f} nats per character"
        )
        bf16 = self.s.precision == "bf16"
        for name, agreement in self.agreements.items():
            same_sums = self.env.world_size == 2 and self.clipped_steps == 0  # a + b = b + a
            against = self.against(name)
            if name in ("torch", "zero1") or same_sums:  # the same sums, in the same order
                assert agreement.bitwise, f"{name} is not bitwise {LABELS[against]}'s: {agreement}"
            elif bf16:  # parted for good: only the loss is promised
                gap = (
                    self.replicas[name].val_losses[-1][1] - self.replicas[against].val_losses[-1][1]
                )
                assert abs(gap) <= BF16_LOSS_COST, f"{name}: final validation loss {gap:+.4f} off"
            else:
                assert agreement.largest_parameter_gap <= SHARDED_TOLERANCE, f"{name}: {agreement}"
                assert agreement.largest_loss_gap <= SHARDED_TOLERANCE, f"{name}: {agreement}"
        if "fp32" in self.replicas:
            cost = last - self.replicas["fp32"].val_losses[-1][1]
            assert abs(cost) <= BF16_LOSS_COST, f"bf16 costs {cost:+.4f} nats against fp32"
        if bf16:
            saved = read_checkpoint(self.checkpoint("miniddp"))["model"]
            dtypes = {str(t.dtype) for t in saved.values() if t.is_floating_point()}
            assert dtypes == {"torch.float32"}, f"the checkpoint holds {dtypes}, not fp32 masters"
            say("the checkpoints hold the fp32 masters: bf16 was only ever a copy to compute with")
        if self.one_process:
            assert self.one_process["parameters"] <= ONE_PROCESS_TOLERANCE, self.one_process
            assert self.one_process["loss"] <= ONE_PROCESS_TOLERANCE, self.one_process
        assert formula_holds, "the sharded replica's memory differs from the formula's"
        if self.s.steps >= 100:
            assert first - last >= 1.0, "the validation loss should fall by a nat or more"
        sha = params_sha256(self.ours.parameters())
        dist.barrier()  # every rank has passed its own checks
        compared = ", ".join(self.agreements) or "no other replica (--no-compare)"
        say(
            f"Verified on {self.env.world_size} ranks: MiniDDP trained a GPT, and {compared} "
            "trained it step for step alike, bitwise where the maths allows."
        )
        say(f"final-val-loss: {last:.6f}")
        say(f"final-params-sha256: {sha}")


def main() -> None:
    s, args = parse_args()
    env = init_distributed()
    world = env.world_size
    corpus = load_corpus(args.data, s.max_characters)
    say(
        f"Chapter 12: a character-level GPT on {world} ranks, backend {env.backend}; torchrun "
        f"attempt {env.restart_count}"
    )

    section("1. The text")
    windows = Windows(corpus.train, s.context)
    batches = Batches(windows, world, s)
    say(
        f"{corpus.source}: {len(corpus.text):,} characters, {len(corpus.vocabulary)} distinct, "
        f"SHA-256 {corpus.sha256[:16]}...; the first {len(corpus.train):,} train, the last "
        f"{len(corpus.validation):,} are held out. A sample:"
    )
    middle = len(corpus.train) // 2
    say(textwrap.indent(corpus.decode(corpus.train[middle : middle + 200]), "    | "))
    say(
        f"{len(windows):,} training windows of {s.context} + 1 characters; an epoch is "
        f"{batches.steps_per_epoch} steps of {world} ranks x {s.accum} micro-steps x {s.batch} "
        "windows"
    )

    section("2. The model, and its replicas")
    config = s.model(len(corpus.vocabulary))
    bf16 = s.precision == "bf16"
    # torch's DDP mixed precision does not run on CPU: under bf16, torch's fully_shard checks.
    reference = ["torch-fsdp" if bf16 else "torch"] * s.compare
    designs = ["miniddp", *reference] + ["fp32"] * bf16 + [s.shard] * bool(s.shard)
    replicas = {
        d: build_replica(d, config, s.seed, s.lr, s.weight_decay, s.precision) for d in designs
    }
    module, groups = replicas["miniddp"].module, replicas["miniddp"].optimizer.param_groups
    say(
        f"GPT: {s.layers} blocks, width {s.width}, {s.heads} heads, context {s.context}, dropout "
        f"{s.dropout}: {sum(p.numel() for p in module.parameters()):,} parameters in "
        f"{len(list(module.parameters()))} tensors (the head is the token embedding). AdamW: "
        f"weight decay {s.weight_decay} on {len(groups[0]['params'])} matrices, none on "
        f"{len(groups[1]['params'])} biases and gains. Replicas, from the same weights: "
        + ", ".join(f"{n} ({r.precision})" if bf16 else n for n, r in replicas.items())
    )
    # Keyed by the settings, so that runs with other settings never resume each other.
    key = f"12_train_gpt-{world}ranks-{hashlib.sha256(repr(s).encode()).hexdigest()[:8]}"
    directory = args.checkpoint_dir or Path("checkpoints", key)
    validation = Windows(corpus.validation, s.context)
    run = Training(s, args, env, corpus, replicas, batches, validation, directory)
    run.start_or_resume()

    section("3. Train")
    say(
        f"{s.steps} steps of {world * s.accum * s.batch * s.context:,} characters: warmup "
        f"{s.warmup}, then cosine {s.lr:g} -> {s.min_lr:g}; clip at {s.clip}; validation every "
        f"{s.eval_every} steps on {min(s.eval_windows, len(validation))} held-out windows; a "
        f"checkpoint every {args.checkpoint_every} in {directory}"
    )
    try:
        run.train()
    except RuntimeError as error:
        # A peer died and our collective failed: leave at once (os._exit: a normal exit can
        # abort in gloo's threads), for torchrun to restart everyone from the checkpoint.
        print(f"[rank {env.rank}] a collective failed: {str(error).strip()}", flush=True)
        os._exit(1)
    run.check(run.report())
    end_chapter()


if __name__ == "__main__":
    main()
