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
printed beside chapter 11's formula. zero1 (miniddp.ZeroRedundancyOptimizer) is bitwise at any
W. zero2 (reduce_scatter_hook) and zero3 (fully_shard on each block, then on the root) hold only
a share of the gradients, so they clip with miniddp.sharding.clip_grad_norm_, whose norm adds
the shares in another order: within 1e-4 when clipping acts, bitwise at W = 2 when it never does.

`--precision bf16` computes in bf16 from fp32 masters: forward and backward use a bf16 cast of
the parameters, the gradients are reduced in fp32 into the masters' `.grad`, AdamW steps the
masters, and the checkpoint holds them. torch's DDP mixed precision does not run on CPU, so the
reference is torch's own fully_shard with the same policy: MiniDDP and fully_shard are its bits
at W = 2 while clipping never acts. Once it acts, the norm's sum over shards rounds otherwise,
the runs part for good (BF16_LOSS_COST says why), and only their final validation losses are
checked. An fp32 MiniDDP trains beside them: the gap between the two curves is what bf16 costs.

Every replica saves an atomic checkpoint (miniddp.checkpoint) every --checkpoint-every steps;
the step number alone fixes the windows and the dropout masks. After a torchrun restart, or
with --resume, each resumes from its own, and the last two lines (final-val-loss,
final-params-sha256) are those of a run that never stopped.

Measured, the default run on 2 CPU ranks (docs/figures/12_loss.png): the validation loss falls
from about 4.4 nats per character to about 2.3 in 200 steps (the text is this Python's standard
library, so the exact figures move with the Python version). 2.3 nats is a perplexity of about
10 characters, against 98 for a guess. (It starts below ln 98 = 4.58: with the head tied to the
embedding, the untrained model already favours repeating its input character, and code repeats
spaces.) Both replicas took 174 s of CPU time over the two ranks: a minute and a half of wall
time on two idle cores.

Measured, `--precision bf16 --no-compare`: the two validation curves part by at most 0.015 nats
on the way and end 0.001 apart (2.278 against 2.277). Nor does bf16 save bytes between steps:
MiniDDP keeps its fp32 state and adds a bf16 copy (17.1 MiB a rank against 15.6). It saves
activations, and time on hardware with bf16 units; this CPU has none, and ran 7x slower.
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
from char_corpus import Batches, Corpus, Windows, load_corpus
from common import end_chapter, say, section
from gpt_settings import Settings, parse_args
from side_by_side import (
    LABELS,
    Agreement,
    Checkpoints,
    Record,
    Replica,
    ascii_curves,
    build_replica,
    draw_curves,
    exit_abruptly,
    params_sha256,
    say_memory,
    say_what_bf16_costs,
)
from torch import nn

from miniddp.checkpoint import read_checkpoint
from miniddp.job.env import DistEnv, init_distributed
from miniddp.models.gpt import next_character_loss

# How far one process on the global batch may land from DDP after its steps: its sums run in
# another order (W·K micro-batches accumulated in one process, against K per rank and then an
# all-reduce), ~1e-7 relative per step, and AdamW's division by √v magnifies that where v is tiny.
ONE_PROCESS_TOLERANCE = 1e-4
# ZeRO-2 and fully_shard clip by a norm summed over shards, in another order than torch's
# clip_grad_norm_ (and beyond W = 2, the ring and gloo add the gradients in other orders too).
# At W = 2 in a run where clipping never acts (--clip 1e9), they are bitwise MiniDDP's: checked.
SHARDED_TOLERANCE = 1e-4
# What bf16 may cost in final validation loss against the fp32 run, in nats per character:
# three times the largest wander measured (0.015). It bounds two bf16 replicas whose sums differ
# too: a master one fp32 ulp away can round to another bf16 copy (2^-8 relative), and AdamW's
# m/sqrt(v) turns that into whole steps where gradients are small (measured, --shard zero3:
# parameters 0.028 apart after 25 steps, and growing). So no bound on parameters, only on loss.
BF16_LOSS_COST = 0.05


def learning_rate(step: int, s: Settings) -> float:
    """Linear warmup over `warmup` steps (Adam's moments are noise at first: small steps while
    they settle), then half a cosine from `lr` down to `min_lr` at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


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
    checkpoints: Checkpoints
    start: int = 0
    record: Record = field(default_factory=lambda: Record({}))  # start_or_resume's

    @property
    def ours(self) -> Replica:
        return self.replicas["miniddp"]

    def against(self, name: str) -> str:
        """The replica `name` is checked against: MiniDDP's, but under bf16 fully_shard is
        checked against torch's own fully_shard with the same policy, where there is one."""
        return "torch-fsdp" if name == "zero3" and "torch-fsdp" in self.replicas else "miniddp"

    def start_or_resume(self) -> None:
        """Resume every replica from its checkpoint after a torchrun restart (or with --resume);
        otherwise forget an earlier run's, and score the untrained model."""
        resuming = self.args.resume or self.env.restart_count > 0
        if resuming and self.checkpoints.path("miniddp").exists():
            self.start, self.record = self.checkpoints.resume(self.replicas)
            progress = self.batches.progress(self.start)
            say(
                f"resumed from step {self.start} (epoch {progress.epoch}, step "
                f"{progress.batches_done} of it): every replica from its own checkpoint in "
                f"{self.checkpoints.directory}"
            )
            return
        compared = [name for name in self.replicas if name not in ("miniddp", "fp32")]
        self.record = Record({name: Agreement() for name in compared})
        self.checkpoints.forget()
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
            self.record.clipped_steps += results["miniddp"][1].item() > s.clip
            # Gathered in one order on every rank: under fully_shard each is a collective.
            checked = ["miniddp", *self.record.agreements]
            params = {name: self.replicas[name].parameters() for name in checked}
            for name, agreement in self.record.agreements.items():
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
                self.checkpoints.save(self.replicas, self.batches.progress(done), self.record)
            if self.args.crash_at_step == done and env.restart_count == 0 and env.rank == world - 1:
                exit_abruptly(env.rank, done)  # torchrun restarts every rank from the checkpoints
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
        losses = (self.ours.train_losses[-1], loss.item())
        self.record.one_process.record(losses, reference, solo.parameters())

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
            say_what_bf16_costs(self.ours, self.replicas["fp32"])
        agreements = {n: a.on_every_rank() for n, a in self.record.agreements.items()}
        self.record.agreements = agreements
        for name, agreement in agreements.items():
            say(f"{name} against {LABELS[self.against(name)]}: {agreement}")
        if {"zero2", "zero3", "torch-fsdp"} & set(agreements):
            say(
                f"clipping acted in {self.record.clipped_steps} of {self.s.steps} steps: there "
                "ZeRO-2 and fully_shard (ours and torch's) scale by a norm summed over the "
                "shards, in another order than clip_grad_norm_'s over whole gradients (at W = 2, "
                "--clip 1e9 makes them bitwise)"
            )
        if (one := self.record.one_process).steps:
            say(
                f"one process on the global batch with accumulation, the first {one.steps} "
                f"steps: largest loss gap {one.largest_loss_gap:.1e}, parameter gap "
                f"{one.largest_parameter_gap:.1e} (tolerance {ONE_PROCESS_TOLERANCE:.0e})"
            )
        else:  # resumed, --one-process-steps 0, or bf16 (it has no wrapper to cast for it)
            say("one process on the global batch: not run")
        if self.args.plot and self.env.is_main:
            say(f"wrote {draw_curves(self.replicas, self.args.plot, self.env.world_size)}")
        psi = sum(p.numel() for p in self.ours.module.parameters())
        measured = ["miniddp"] * (self.s.precision == "bf16") + [self.s.shard] * bool(self.s.shard)
        holds = [say_memory(self.replicas[n], psi, self.env.world_size) for n in measured]

        section("5. What the model learned")
        if self.env.is_main:
            vocabulary = self.corpus.vocabulary
            prompt = "def " if set("def ") <= set(vocabulary) else self.corpus.text[0]
            encoded = torch.tensor([[vocabulary.index(c) for c in prompt]])
            generator = torch.Generator().manual_seed(self.s.seed)
            sampled = self.ours.module.generate(encoded, 300, generator)
            say(f"300 characters sampled from MiniDDP's model after {prompt!r}:")
            say(textwrap.indent(self.corpus.decode(sampled[0]), "    | "))
        return all(holds)

    def check(self, formula_holds: bool) -> None:
        section("Checks")
        first, last = self.ours.val_losses[0][1], self.ours.val_losses[-1][1]
        say(
            f"validation loss {first:.3f} -> {last:.3f}: down {first - last:.2f} nats per character"
        )
        bf16 = self.s.precision == "bf16"
        for name, agreement in self.record.agreements.items():
            same_sums = self.env.world_size == 2 and self.record.clipped_steps == 0  # a + b = b + a
            against = self.against(name)
            if name in ("torch", "zero1") or same_sums:  # the same sums, in the same order
                assert agreement.bitwise, f"{name} is not bitwise {LABELS[against]}'s: {agreement}"
            elif bf16:  # parted for good: only the loss is promised
                ends = [self.replicas[n].val_losses[-1][1] for n in (name, against)]
                gap = ends[0] - ends[1]
                assert abs(gap) <= BF16_LOSS_COST, f"{name}: final validation loss {gap:+.4f} off"
            else:
                assert agreement.largest_parameter_gap <= SHARDED_TOLERANCE, f"{name}: {agreement}"
                assert agreement.largest_loss_gap <= SHARDED_TOLERANCE, f"{name}: {agreement}"
        if "fp32" in self.replicas:
            cost = last - self.replicas["fp32"].val_losses[-1][1]
            assert abs(cost) <= BF16_LOSS_COST, f"bf16 costs {cost:+.4f} nats against fp32"
        if bf16:
            saved = read_checkpoint(self.checkpoints.path("miniddp"))["model"]
            dtypes = {str(t.dtype) for t in saved.values() if t.is_floating_point()}
            assert dtypes == {"torch.float32"}, f"the checkpoint holds {dtypes}, not fp32 masters"
            say("the checkpoints hold the fp32 masters: bf16 was only ever a copy to compute with")
        if (one := self.record.one_process).steps:
            assert max(one.largest_parameter_gap, one.largest_loss_gap) <= ONE_PROCESS_TOLERANCE
        assert formula_holds, "the sharded replica's memory differs from the formula's"
        if self.s.steps >= 100:
            assert first - last >= 1.0, "the validation loss should fall by a nat or more"
        sha = params_sha256(self.ours.parameters())
        dist.barrier()  # every rank has passed its own checks
        compared = ", ".join(self.record.agreements) or "no other replica (--no-compare)"
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
    batches = Batches(windows, world, s.batch, s.accum, s.seed)
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
    checkpoints = Checkpoints(args.checkpoint_dir or Path("checkpoints", key), asdict(s))
    validation = Windows(corpus.validation, s.context)
    run = Training(s, args, env, corpus, replicas, batches, validation, checkpoints)
    run.start_or_resume()

    section("3. Train")
    say(
        f"{s.steps} steps of {world * s.accum * s.batch * s.context:,} characters: warmup "
        f"{s.warmup}, then cosine {s.lr:g} -> {s.min_lr:g}; clip at {s.clip}; validation every "
        f"{s.eval_every} steps on {min(s.eval_windows, len(validation))} held-out windows; a "
        f"checkpoint every {args.checkpoint_every} in {checkpoints.directory}"
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
