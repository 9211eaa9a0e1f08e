"""Chapter 15: 3-D parallelism. Chapter 12's GPT on 8 ranks as (pp, dp, tp) = (2, 2, 2): tensor
parallelism inside each pair, a pipeline of two stages, two data-parallel replicas of it all.

    NPROC=8 ./launch.sh tutorials/15_three_d_parallel.py     (torchrun --nproc_per_node=8 ...)
    ... --link alpha=100us,bandwidth=1mbit                      the simulated link (the default)
    ... --link none --steps 2                                   the quick run: no timing
    ... --plot DIR                                              draw this run's step in DIR
    ... --precision bf16                                        and the 3-D run in bf16 too

Chapters 13 and 14 each cut the model one way. Real training cuts it three ways at once, on one
grid of ranks (the Ultra-Scale Playbook's "3-D parallelism", torchtitan's `parallelize_llama`):

    1. the mesh and its groups      init_device_mesh("cpu", (2, 2, 2), ("pp", "dp", "tp"))
    2. what each rank holds         parameters, gradients, buckets, Adam, activations: counted
    3. what each rank sends         per axis, per step, counted against the formulas
    4. the same training            the loss curve of one process and of DP alone, step by step
    5. which layout wins            the alpha-beta model for all 8 layouts; two timed on the link
    6. one step, drawn              the pipeline in ASCII; docs/figures/15_three_d.png
    7. bf16 (--precision bf16)      the 3-D run again, bf16 compute on fp32 masters, beside fp32

All of it through one call, miniddp.parallelize.parallelize (tensor parallelism, then the
pipeline split, then MiniDDP; read it first). The figure is drawn by miniddp/figures/three_d.py
(`python -m miniddp.figures --only 15`).

`--precision bf16` adds section 7: the 3-D layout trained again, bf16 compute on fp32 masters
(parallelize's mixed_precision), its loss beside the fp32 run's and its bytes per rank. Measured
over the default 8 steps: the two losses part by at most 1.9e-3 nats (the check allows 0.01); a
rank holds 318 KiB against fp32's 290 (the bf16 copy adds 2 bytes an element) and half the
activations (41.5 KiB against 82.0 on the first stage).

Any other number of ranks is refused, naming the command. Measured on 2 cores shared with other
jobs (load average about 15): the default run took 36-51 s from the first line to the last, and
1.2-1.6 minutes with torchrun and 8 processes importing torch; the quick run 17 s, 30-50 s in
all. Most of the wait is start-up: torch, then torch._dynamo at each rank's first AdamW step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from char_corpus import Corpus, Windows, load_corpus
from common import (
    add_link_option,
    add_plot_option,
    end_chapter,
    fmt_bytes,
    say,
    say_all_ranks,
    say_prose,
    section,
)
from torch.nn import functional as F

from miniddp import MixedPrecision
from miniddp.bench.options import whole_number
from miniddp.figures import three_d
from miniddp.job.env import init_distributed
from miniddp.mesh import init_device_mesh
from miniddp.models.gpt import GPT, GPTConfig
from miniddp.observe.link import Link, wire_bytes
from miniddp.observe.link_group import link_groups, simulated_link
from miniddp.parallelize import ParallelGPT, parallelize
from miniddp.pipeline.bubble import ascii_chart
from miniddp.pipeline.step_checks import CheckRow
from miniddp.sharding import MemoryPerRank, ddp_buckets, ddp_compute_copies, measure_memory

WORLD = 8
AXES = ("pp", "dp", "tp")
# Small enough for 8 ranks on 2 cores: T = 16 characters, H = 32, 4 blocks of 4 heads.
CONTEXT, WIDTH, LAYERS, HEADS = 16, 32, 4, 4
WINDOWS = 8  # windows of text a step, over all replicas
CHARACTERS = 20_000  # the first characters of chapter 12's text: plenty for a few steps
LEARNING_RATE = 1e-2
# One process and the parallel runs add in other orders (split matmuls, sums over ranks):
# float32 rounding, a little magnified by AdamW's division by the root of its second moment.
LOSS_TOLERANCE = 1e-5
PARAMETER_TOLERANCE = 1e-4
# A network slowed to the model's scale: a ring all-reduce of DP alone's 212 KiB of gradients
# takes 3 s at 1 Mbit/s, as one of 20 GB does at 100 Gbit/s. And one where every message's
# latency costs more than its bytes.
BANDWIDTH_BOUND = "alpha=100us,bandwidth=1mbit"
LATENCY_BOUND = "alpha=1ms,bandwidth=10gbit"
ROUNDS = 3  # timed steps per layout and link, interleaved
CLEAR_WIN = 1.3  # the model's faster layout is checked only when it predicts this much of a win
# --precision bf16: its loss against the fp32 run's, each step. bf16 keeps 8 significant bits,
# so the logits (and every activation) round by up to 2^-9 relative, about 8e-3 nats at the
# first step's loss near 4.4; the runs then take slightly other AdamW steps, and part a little
# more each step, while the loss falls. Measured over the default 8 steps: at most 1.9e-3.
BF16_LOSS_TOLERANCE = 0.01
FIGURE = "docs/figures/15_three_d.png"


@dataclass(frozen=True)
class Layout:
    """How 8 ranks are cut: pp stages x dp replicas x tp shards; with a pipeline, each
    replica's windows go through it one a microbatch."""

    pp: int
    dp: int
    tp: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    @property
    def microbatches(self) -> int:
        return WINDOWS // self.dp if self.pp > 1 else 1

    @property
    def tokens(self) -> int:
        """N: the tokens of one microbatch (or of a replica's whole batch, without a pipeline)."""
        return WINDOWS // self.dp // self.microbatches * CONTEXT

    @property
    def bubble(self) -> float:
        return (self.pp - 1) / (self.microbatches + self.pp - 1)


THREE_D, DP_ONLY = Layout(2, 2, 2), Layout(1, 8, 1)
LAYOUTS = [  # every (pp, dp, tp) of 8 ranks this GPT allows: tp divides the heads, pp the blocks
    Layout(pp, WORLD // (pp * tp), tp)
    for pp in (1, 2, 4, 8)
    for tp in (1, 2, 4, 8)
    if LAYERS % pp == 0 and HEADS % tp == 0 and WORLD % (pp * tp) == 0
]


def stage_elements(c: GPTConfig, layout: Layout, stage: int) -> int:
    """Parameter elements on a rank of `stage`. A block is Ψ = 12H² + 13H (qkv 3H² + 3H, proj
    H² + H, up 4H² + 4H, down 4H² + H, two LayerNorms 4H); TP splits 12H² + 7H of it and
    keeps the rowwise biases and the LayerNorms (6H) whole. The first stage adds the token
    rows VH/t and the positions TH, the last the final LayerNorm 2H and the tied copy VH/t."""
    h, t = c.width, layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    elements = c.layers // layout.pp * ((12 * h * h + 7 * h) // t + 6 * h)
    if first:
        elements += c.vocab_size * h // t + c.context * h
    if last:
        elements += 2 * h + (0 if first else c.vocab_size * h // t)
    return elements


def stage_tensors(c: GPTConfig, layout: Layout, stage: int) -> int:
    """Parameter tensors on the stage (Adam keeps a 4-byte step count for each): 12 a block,
    token and positions first, the final LayerNorm (and the tied copy) last."""
    first, last = stage == 0, stage == layout.pp - 1
    return 12 * c.layers // layout.pp + 2 * first + (2 + (not first)) * last


def memory_formula(c: GPTConfig, layout: Layout, stage: int) -> MemoryPerRank:
    """fp32 AdamW under MiniDDP: 4 bytes of weight, 4 of gradient, 4 of bucket (with DP), 8 of
    moments an element, and the step counts."""
    n = stage_elements(c, layout, stage)
    buckets = 4 * n if layout.dp > 1 else 0
    return MemoryPerRank(4 * n, 4 * n, buckets, 8 * n + 4 * stage_tensors(c, layout, stage))


def activation_formula(c: GPTConfig, layout: Layout, stage: int) -> tuple[int, int]:
    """(bytes autograd saves for one microbatch's backward on this stage, microbatches held at
    1F1B's peak), under TP (t > 1). For N tokens, fp32, a heads, per block:

        4N(4H + 4)             what TP keeps whole: each LayerNorm's input and statistics
                               (H + 2) and its output, which the next matmul saves (H)
        4N(12H + a)/t          this rank's heads and hidden: q, k, v (3H), attention's output
                               (H) and log-sum-exp (a), the MLP's 4H before and after GELU

    The first stage adds the token ids the lookup keeps (8N), the mask of ids other ranks own
    (N) and the positions (8T); the last the final LayerNorm's 4N(2H + 2) and the loss's
    softmax slice 4N·V/t with the target ids and mask (9N). 1F1B holds min(m, p - s) at once."""
    n, h, t, a = layout.tokens, c.width, layout.tp, c.heads
    first, last = stage == 0, stage == layout.pp - 1
    block = 4 * n * (4 * h + 4) + 4 * n * (12 * h + a) // t
    per_microbatch = c.layers // layout.pp * block
    per_microbatch += (8 * n + n + 8 * c.context) if first else 0
    per_microbatch += (4 * n * (2 * h + 2) + 4 * n * c.vocab_size // t + 9 * n) if last else 0
    return per_microbatch, min(layout.microbatches, layout.pp - stage)


@dataclass(frozen=True)
class Traffic:
    """`count` messages a step of `elements` numbers of `element_bytes` each: all-reduces over
    `ranks` ranks, or (ranks = 0) point-to-point sends to a neighbouring stage."""

    axis: str
    what: str
    count: int
    elements: int
    element_bytes: int = 4
    ranks: int = 0

    @property
    def kind(self) -> str:
        return "send" if self.ranks == 0 else "all_reduce"

    @property
    def wire_bytes(self) -> float:
        """Bytes a rank puts on the wire for all `count` (a ring all-reduce: 2(g-1)/g n)."""
        nbytes = self.elements * self.element_bytes
        one = nbytes if self.ranks == 0 else wire_bytes("all_reduce", nbytes, self.ranks)
        return self.count * one


def traffic_formula(c: GPTConfig, layout: Layout, stage: int) -> list[Traffic]:
    """What a rank of `stage` sends in one step (after the first, which also sends shapes)."""
    m, n, h = layout.microbatches, layout.tokens, c.width
    pp, dp, tp = layout.shape
    first, last = stage == 0, stage == pp - 1
    sent = []
    if tp > 1:  # per microbatch: g twice forward and f twice backward a block (chapter 13),
        # the embedding's g forward (first stage) and the head's f backward (last stage)
        blocks = 4 * (c.layers // pp) + first + last
        sent.append(Traffic("tp", "f and g, activations of N·H", m * blocks, n * h, ranks=tp))
        if last:
            sent.append(Traffic("tp", "the loss's max, sum, target logit", 3 * m, n, ranks=tp))
    if pp > 1:
        if not last:
            sent.append(Traffic("pp", "activations to the next stage", m, n * h))
        if not first:
            sent.append(Traffic("pp", "gradients to the stage before", m, n * h))
        fields = len(CheckRow._fields)  # what each stage checks before a step (step_checks.py)
        sent.append(
            Traffic("pp", f"the schedule's check, {fields} int64 a stage", 1, fields * pp, 8, pp)
        )
        if first or last:
            tied = c.vocab_size * h // tp
            sent.append(Traffic("pp", "the tied embedding's gradient", 1, tied, ranks=2))
    if dp > 1:
        elements = stage_elements(c, layout, stage)
        sent.append(Traffic("dp", "the gradients, one bucket", 1, elements, ranks=dp))
    return sent


def link_seconds(sent: list[Traffic], layout: Layout, link: Link, sends: bool = True) -> float:
    """The alpha-beta model of what `sent` adds to a step on `link`: each message costs
    alpha + wire bytes / bandwidth, one after another on the rank's link. TP's and PP's sit
    inside the F's and B's, so the pipeline's fill and drain stretch them by (m + p - 1)/m;
    DP's and the tie's come once, at the end. `sends=False`: the all-reduces only (the
    simulated link delays collectives; a pipeline's sends go around it)."""
    stretch = (layout.microbatches + layout.pp - 1) / layout.microbatches
    total = 0.0
    for traffic in sent:
        if traffic.kind == "send" and not sends:
            continue
        seconds = traffic.count * link.alpha + traffic.wire_bytes / link.bandwidth
        inside = traffic.axis == "tp" or traffic.kind == "send"
        total += seconds * (stretch if inside else 1.0)
    return total


class SavedForBackward:
    """Inside `hooks()`, count the bytes autograd saves for backward that are not parameters,
    each storage once, while they live; `peak` is the most held at once."""

    def __init__(self, parameters) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, saved references]
        self.now = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.parameters or not storage.nbytes():
            return tensor
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        return _Saved(tensor, key, self)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]


class _Saved:
    """A saved tensor, handed back to autograd; freed with the graph, it tells its counter."""

    def __init__(self, tensor: torch.Tensor, key: int, counter: SavedForBackward) -> None:
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self) -> None:
        self.counter.release(self.key)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


def text_batches(steps: int) -> tuple[list[torch.Tensor], Corpus]:
    """Chapter 12's text (its first CHARACTERS) cut into windows of T + 1 characters, WINDOWS
    of them a step, in a fixed shuffled order; and the text."""
    corpus = load_corpus(max_characters=CHARACTERS)
    windows = Windows(corpus.train, CONTEXT)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0)).tolist()
    return [windows[order[s * WINDOWS : (s + 1) * WINDOWS]] for s in range(steps)], corpus


def build_gpt(c: GPTConfig) -> GPT:
    torch.manual_seed(0)  # every rank builds the same model: parallelize keeps its part
    return GPT(c)


@dataclass
class Run:
    """One layout trained: this rank's part, its optimizer, and what was observed."""

    layout: Layout
    parts: ParallelGPT
    optimizer: torch.optim.Optimizer
    losses: list[float | None]
    memory: MemoryPerRank | None = None
    activations: int = 0
    held: int = 0
    step: three_d.RankStep | None = None

    def batch(self, windows: torch.Tensor) -> torch.Tensor:
        """This replica's share of the step's windows."""
        return windows.tensor_split(self.layout.dp)[self.parts.mesh["dp"].get_local_rank()]

    def train_step(self, windows: torch.Tensor) -> float | None:
        loss = self.parts.train_step(self.batch(windows))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return None if loss is None else loss.item()


def train(
    layout: Layout,
    mesh,
    c: GPTConfig,
    batches: list[torch.Tensor],
    mixed_precision: MixedPrecision | None = None,
) -> Run:
    """parallelize over `mesh`, then AdamW over `batches`; step 1 (after the first, which also
    exchanges shapes and builds Adam's state) is observed: memory, activations, the wire, the
    timeline. `mixed_precision`: compute in its param_dtype, on fp32 masters."""
    parts = parallelize(
        build_gpt(c), mesh, n_microbatches=layout.microbatches, mixed_precision=mixed_precision
    )
    optimizer = torch.optim.AdamW(parts.parameters(), lr=LEARNING_RATE)
    run = Run(layout, parts, optimizer, [])
    for number, windows in enumerate(batches):
        if number != 1:
            run.losses.append(run.train_step(windows))
            continue
        copies = ddp_compute_copies(parts.module)  # under bf16: what forward computes with
        saved = SavedForBackward([*parts.parameters(), *copies])
        with saved.hooks():
            loss, run.step = three_d.record_step(parts, run.batch(windows))
        buckets = ddp_buckets(parts.module)
        run.memory = measure_memory(parts.parameters(), optimizer, buckets, copies)
        run.activations = saved.peak
        run.held = parts.schedule.stage.peak_held if parts.schedule else 1
        optimizer.step()
        optimizer.zero_grad()
        run.losses.append(None if loss is None else loss.item())
    return run


def one_process(c: GPTConfig, batches: list[torch.Tensor]) -> tuple[list[float], GPT]:
    """The whole GPT in this process on every step's whole batch: the reference."""
    model = build_gpt(c)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for windows in batches:
        logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def global_losses(run: Run) -> list[float]:
    """Each step's loss over the whole batch: the mean over the ranks that computed one (the
    last stage's; a TP pair reports the same number, each replica its own windows')."""
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, run.losses)
    reporting = [losses for losses in everyone if losses[0] is not None]
    return [
        statistics.fmean(losses[step] for losses in reporting) for step in range(len(run.losses))
    ]


def parameter_gap(run: Run, reference: GPT) -> float:
    """The largest difference between this rank's parameters and the reference's (its TP
    chunk of them; the last stage's tied copy against the embedding)."""
    whole = dict(reference.named_parameters())
    tp, shard = run.layout.tp, run.parts.mesh["tp"].get_local_rank()
    gap = 0.0
    for name, param in run.parts.model.named_parameters():
        expected = whole["token.weight" if name == "head.weight" else name].detach()
        if param.shape != expected.shape:  # a TP shard: cut the reference as TP cut it
            dim = next(d for d in range(param.dim()) if param.shape[d] != expected.shape[d])
            expected = torch.chunk(expected, tp, dim)[shard]
        gap = max(gap, (param.detach() - expected).abs().max().item())
    return gap


def timed_step(run: Run, windows: torch.Tensor, link: Link | None) -> float:
    """One training step between barriers, over `link` (None: the bare machine): the slowest
    rank's seconds, the same number on every rank."""
    dist.barrier()
    started = time.perf_counter()
    with simulated_link(link):
        run.train_step(windows)
    dist.barrier()
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def ascii_mesh(groups: dict[str, list[list[int]]]) -> str:
    """The grid as mesh.py's docstring draws it, with every axis's groups beside it."""
    labels = {"tp": "TP groups, a row:", "dp": "DP groups, a column:", "pp": "PP groups, pages:"}
    beside = [
        f"{labels[axis]:<21}" + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[axis])
        for axis in ("tp", "dp", "pp")
    ]
    lines = [" " * len("    pp=0  dp=0 [") + "".join(f"{f'tp={t}':>5}" for t in range(THREE_D.tp))]
    for p, page in enumerate(torch.arange(WORLD).view(THREE_D.shape).tolist()):
        for d, row in enumerate(page):
            cells = "".join(f"{rank:>5}" for rank in row)
            lines.append(f"    {f'pp={p}' if d == 0 else '':<4}  dp={d} [{cells}  ]")
    for number, text in enumerate(beside, start=1):
        lines[number] += f"      {text}"
    return "\n".join(lines)


def section_mesh(mesh) -> bool:
    section("1. The mesh and its groups")
    groups = three_d.groups_of(THREE_D.shape)
    say_prose("""\
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp")) lays the
        8 ranks out as torch does, torch.arange(8).view(2, 2, 2), the last axis fastest: rank
        = 4 pp + 2 dp + tp. Along an axis, a rank's group is the ranks that differ from it in
        that coordinate only:
        """)
    say(f"\n{ascii_mesh(groups)}\n")
    say_prose("""\
        parts = parallelize(gpt, mesh, n_microbatches=4) then applies, in this order: tensor
        parallelism over mesh["tp"] (Megatron's plan, chapter 13), the pipeline split over
        mesh["pp"] (1F1B, chapter 14: stage s keeps blocks 2s and 2s + 1, the first stage the
        embeddings too, the last the final norm and the head), and MiniDDP over mesh["dp"],
        around exactly what the rank holds. TP takes the fastest axis: consecutive ranks share
        a machine and its fast link, and TP talks inside every layer. Every rank, asked for its
        groups:""")
    stage = mesh.get_coordinate()[0]
    mine = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in AXES}
    ends = "the embeddings" if stage == 0 else "the final norm, the head"
    say_all_ranks(
        f"{tuple(mesh.get_coordinate())}: TP {mine['tp']}, DP {mine['dp']}, PP {mine['pp']}; "
        f"blocks {2 * stage} and {2 * stage + 1}, {ends}"
    )
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, all(mine[name] in groups[name] for name in AXES))
    say(f"  (the mesh and one step on it, drawn: {FIGURE})")
    return all(everyone)


def section_holdings(c: GPTConfig, characters: int, run: Run, dp_only: Run) -> bool:
    section("2. What each rank holds")
    h, v, t, p, layers = c.width, c.vocab_size, THREE_D.tp, THREE_D.pp, c.layers
    block = (12 * h * h + 7 * h) // t + 6 * h
    first, last = (stage_elements(c, THREE_D, s) for s in (0, 1))
    whole = stage_elements(c, DP_ONLY, 0)
    first_sum = f"{v * h // t:,} + {c.context * h} + {layers // p} x {block:,} = {first:,}"
    last_sum = f"{layers // p} x {block:,} + {2 * h} + {v * h // t:,} = {last:,}"
    say_prose(f"""\
        The GPT: V = {v} (the text's {characters} characters, padded to a multiple of 8 as
        nanoGPT pads GPT-2's 50,257 to 50,304, so any TP size splits it), T = {c.context}, H =
        {h}, L = {layers} blocks of {c.heads} heads, dropout 0.0 (section 4 says why). A block
        is Ψ_b = 12H² + 13H = {12 * h * h + 13 * h:,} elements; TP splits 12H² + 7H of it over t
        ranks and keeps 6H whole (rowwise biases, LayerNorms), and the pipeline gives each stage
        L/p blocks. So a rank of stage s holds, with t = {t}, p = {p}:

            first stage  VH/t + TH + (L/p)((12H² + 7H)/t + 6H) = {first_sum}
            last stage   (L/p)((12H² + 7H)/t + 6H) + 2H + VH/t = {last_sum}
            DP alone     VH + TH + L Ψ_b + 2H = {whole:,}, on every rank

        The last stage's VH/t is its own copy of the tied embedding (the first embeds, the last
        projects; their gradients are summed after backward, section 3). In bytes, as chapter
        08 counts them from the storages (measure_memory): 4 of weight, 4 of gradient, 4 of
        MiniDDP's bucket and 8 of Adam's two moments an element, and a 4-byte step count a
        tensor. Activations: the bytes autograd saves for backward, counted by
        saved_tensors_hooks while the step runs, at their peak; per microbatch of
        N = {THREE_D.tokens} tokens (one window of T) and per block

            4N(4H + 4) + 4N(12H + a)/t bytes     (what TP keeps whole, then this rank's heads
                                                   and 4H/t of the MLP; a = {c.heads} heads)

        plus the token ids on the first stage and the loss's softmax slice on the last
        (activation_formula says each term), times the microbatches 1F1B holds at once,
        min(m, p - s) (chapter 14). Measured on every rank, in the step after the first:""")
    rows: list = [None] * WORLD
    stage = run.parts.mesh["pp"].get_local_rank()
    per_microbatch, held = activation_formula(c, THREE_D, stage)
    expected = memory_formula(c, THREE_D, stage)
    mine = (
        tuple(run.parts.mesh.get_coordinate()),
        sum(param.numel() for param in run.parts.parameters()),
        run.memory,
        run.activations,
        run.held,
    )
    exact = (
        mine[1] == stage_elements(c, THREE_D, stage)
        and run.memory == expected
        and (run.activations, run.held) == (per_microbatch * held, held)
        and dp_only.memory == memory_formula(c, DP_ONLY, 0)
    )
    dist.all_gather_object(rows, (*mine, exact))
    say(
        f"  {'rank':>4} {'(pp,dp,tp)':>10} {'elements':>9} {'weights':>9} {'grads':>9} "
        f"{'bucket':>9} {'Adam':>9} {'activations (B)':>19} formula"
    )
    for rank, (where, elements, memory, activations, peak, same) in enumerate(rows):
        say(
            f"  {rank:>4} {str(where):>10} {elements:>9,} {fmt_bytes(memory.parameters):>9} "
            f"{fmt_bytes(memory.gradients):>9} {fmt_bytes(memory.buckets):>9} "
            f"{fmt_bytes(memory.optimizer_state):>9} {activations:>8,} = {peak} x "
            f"{activations // peak:>6,} {'=' if same else 'differs':>7}"
        )
    alone = dp_only.memory
    same = "= the formula" if alone == memory_formula(c, DP_ONLY, 0) else "DIFFERS from it"
    say(
        f"  DP alone, (1, 8, 1), every rank: {whole:,} elements, {fmt_bytes(alone.total)} of "
        f"state ({same}; 3-D:\n  {fmt_bytes(rows[0][2].total)} and "
        f"{fmt_bytes(rows[-1][2].total)}), {dp_only.activations:,} B of activations for its "
        "one window"
    )
    say_prose(f"""\
        Each 3-D rank keeps about a quarter of the model (a half of each block's matrices, half
        of the blocks) and of its gradients and optimizer state, where DP alone keeps all of it
        on every rank. Activations per microbatch shrink less: what TP keeps whole, 4N(4H + 4)
        a block, is {4 * (4 * h + 4)} of the {4 * (4 * h + 4) + 4 * (12 * h + c.heads) // t:,}
        bytes a token (it is what sequence parallelism would split next). Beside them each
        stage keeps the output of every microbatch in flight, to start its backward from
        (N·H·4 = {fmt_bytes(4 * THREE_D.tokens * h)} each, not a saved tensor).""")
    everyone = [row[-1] for row in rows]
    return all(everyone)


def measured_traffic(step: three_d.RankStep) -> Counter:
    """(axis, kind, elements, bytes per element) -> how many, of what a rank put on the wire
    (its sends and all-reduces; a receive is its neighbour's send)."""
    return Counter(
        (event.axis, event.kind, event.elements, event.nbytes // event.elements)
        for event in step.wire
        if event.kind != "recv"
    )


def expected_traffic(sent: list[Traffic]) -> Counter:
    counted: Counter = Counter()
    for traffic in sent:
        counted[(traffic.axis, traffic.kind, traffic.elements, traffic.element_bytes)] += (
            traffic.count
        )
    return counted


def section_sends(c: GPTConfig, run: Run, dp_only: Run) -> bool:
    section("3. What each rank sends")
    m, n = THREE_D.microbatches, THREE_D.tokens
    say_prose(f"""\
        Every dist.all_reduce and every point-to-point batch a rank issues, logged with the
        axis of its group (three_d.recording_the_wire), in the same step. The formulas, per
        step of m = {m} microbatches of N = {n} tokens, for a rank of stage s holding L/p = 2
        blocks:

            TP  m(4 L/p + 1) all-reduces of N·H: g twice in forward and f twice in backward a
                block (chapter 13), and the embedding's g (first stage) or the head's f (last);
                the last also 3m of N numbers: the loss's max, sum and target logit
            PP  m activations of N·H sent on (first stage) or m gradients sent back (last);
                one all-reduce of the schedule's check; one of the tied embedding's gradient,
                VH/t, over the first and last stage of the pipeline
            DP  one all-reduce of the gradients, Ψ_s, in one bucket (MiniDDP, chapter 03)

        and each all-reduce on g ranks puts 2(g - 1)/g of its bytes on a ring's wire
        (chapter 01). Per rank, counted:""")
    stage = run.parts.mesh["pp"].get_local_rank()
    formula = traffic_formula(c, THREE_D, stage)
    same = measured_traffic(run.step) == expected_traffic(formula)
    mine = {
        axis: (
            sum(t.count for t in formula if t.axis == axis),
            sum(t.wire_bytes for t in formula if t.axis == axis),
        )
        for axis in ("tp", "pp", "dp")
    }
    rows: list = [None] * WORLD
    dist.all_gather_object(rows, (tuple(run.parts.mesh.get_coordinate()), mine, same))
    say(f"  {'rank':>4} {'(pp,dp,tp)':>10}   {'TP':>19}   {'PP':>19}   {'DP':>19}   formula")
    for rank, (where, axes, equal) in enumerate(rows):
        cells = "   ".join(
            f"{axes[axis][0]:>3} msgs {fmt_bytes(axes[axis][1]):>10}" for axis in ("tp", "pp", "dp")
        )
        say(f"  {rank:>4} {str(where):>10}   {cells}   {'=' if equal else 'differs'}")
    say("  what the formula lists for a rank of each stage:")
    for number in range(THREE_D.pp):
        for traffic in traffic_formula(c, THREE_D, number):
            size = f"{traffic.elements:,} x {traffic.element_bytes} B"
            plural = "s" if traffic.count > 1 else ""
            kind = f"all-reduce{plural} on {traffic.ranks}" if traffic.ranks else f"send{plural}"
            say(
                f"    stage {number} {traffic.axis} {traffic.count:>3} {kind:<16} of "
                f"{size:<13} {traffic.what}"
            )
    alone = traffic_formula(c, DP_ONLY, 0)
    alone_same = measured_traffic(dp_only.step) == expected_traffic(alone)
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, alone_same)
    say(
        f"  DP alone, every rank: {alone[0].count} all-reduce of {alone[0].elements:,} over "
        f"{WORLD}: {fmt_bytes(alone[0].wire_bytes)} on the wire "
        f"({'=' if all(everyone) else 'differs from'} the formula)"
    )
    tp_count, tp_bytes = rows[0][1]["tp"]
    dp_bytes = rows[0][1]["dp"][1]
    say_prose(f"""\
        DP alone sends the fewest messages and the most bytes: every rank the whole gradient,
        once. 3-D cuts DP's wire bytes from {fmt_bytes(alone[0].wire_bytes)} to
        {fmt_bytes(dp_bytes)} (a rank holds about a quarter of the model, and a ring of 2 puts
        once its bytes on the wire where a ring of 8 puts 1.75 times), and pays with TP's
        {tp_count} messages a step ({fmt_bytes(tp_bytes)}). TP's grow with the tokens and wait
        inside every layer; DP's grow with the parameters and leave once, at the end of
        backward. PP's are few and small: one activation a microbatch, to one neighbour.""")
    return all(row[-1] for row in rows) and all(everyone)


def section_training(
    run: Run, dp_only: Run, reference: tuple[list[float], GPT]
) -> tuple[float, float, float]:
    section("4. The same training")
    say_prose(f"""\
        Dropout is 0.0 here, and must be for this comparison: under TP a rank computes only its
        own heads, so the attention's dropout draws masks of shape (b, a/t, T, T) where one
        process draws (b, a, T, T), from another point of the random stream; a TP run with
        dropout trains as well, but on other masks than one process's. Without dropout, the
        3-D run, DP alone on (1, 8, 1) (MiniDDP over all 8 ranks, a window each) and one
        process on the whole batch of {WINDOWS} windows take the same AdamW steps (lr
        {LEARNING_RATE:g}), up to rounding. The loss of each step, over the whole batch (on
        3-D, the mean of the last stage's replicas):""")
    three, alone = global_losses(run), global_losses(dp_only)
    losses, model = reference
    say(
        f"  {'step':>4} {'one process':>12} {'3-D':>10} {'DP alone':>10}   "
        f"{'|3-D - one|':>11} {'|DP - one|':>10} {'|3-D - DP|':>10}"
    )
    for step, (one, a, b) in enumerate(zip(losses, three, alone)):
        say(
            f"  {step:>4} {one:>12.6f} {a:>10.6f} {b:>10.6f}   {abs(a - one):>11.1e} "
            f"{abs(b - one):>10.1e} {abs(a - b):>10.1e}"
        )
    to_one = max(abs(a - one) for a, one in zip(three, losses))
    to_dp = max(abs(a - b) for a, b in zip(three, alone))
    gaps: list = [None] * WORLD
    dist.all_gather_object(gaps, parameter_gap(run, model))
    say(
        f"  after {len(losses)} steps, every rank's parameters (its shards) against one "
        f"process's:\n  largest difference {max(gaps):.1e} "
        f"(ranks 0-7: {', '.join(f'{gap:.0e}' for gap in gaps)})"
    )
    say_prose(f"""\
        The 3-D run and one process agree within {to_one:.0e} a step, the 3-D run and DP alone
        within {to_dp:.0e}: the same training, cut three ways. The differences are float32's
        rounding: TP's matmuls on split shapes, sums over ranks in another order.""")
    return to_one, to_dp, max(gaps)


def busiest(c: GPTConfig, layout: Layout, link: Link, sends: bool = True) -> float:
    """The model's time on `link` for the layout's slowest stage."""
    return max(
        link_seconds(traffic_formula(c, layout, stage), layout, link, sends)
        for stage in range(layout.pp)
    )


def fmt_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def section_layouts(c: GPTConfig, links: dict[str, Link]) -> dict[str, str]:
    section("5. Which layout wins, on which link")
    say_prose("""\
        The formulas of section 3 hold for any layout, so the alpha-beta model (chapter 01;
        miniddp/collectives/cost_model.py) can price all of them without running one: on a link
        of latency alpha and bandwidth beta each message costs alpha + wire bytes / beta, one
        after another on a rank's link; TP's and PP's sit inside the F's and B's, which the
        pipeline's fill and drain stretch by (m + p - 1)/m; DP's come once, at the end. Every
        layout of 8 ranks this GPT allows (t divides the 4 heads, p the 4 blocks; with a
        pipeline a microbatch is one window), for the slowest stage, per step:""")
    names = list(links)
    short = [name.split("-")[0] or name for name in names]  # "latency", "bandwidth", "link"
    widths = [max(len(name), 9) for name in short]
    say(f"  {'':>21}{'messages and wire bytes a step, slowest stage':^48}  time on the link")
    say(
        f"  {'(pp,dp,tp)':>10} {'m':>2} {'bubble':>6}  "
        + "".join(f"{axis:<16}" for axis in ("TP", "PP", "DP"))
        + "  ".join(f"{name:>{width}} " for name, width in zip(short, widths)).rstrip()
    )
    best = {
        name: min(LAYOUTS, key=lambda layout: busiest(c, layout, links[name])) for name in names
    }
    for layout in LAYOUTS:
        stages = [traffic_formula(c, layout, stage) for stage in range(layout.pp)]
        heaviest = max(stages, key=lambda sent: sum(t.wire_bytes for t in sent))
        cells = ""
        for axis in ("tp", "pp", "dp"):
            count = sum(t.count for t in heaviest if t.axis == axis)
            wire = sum(t.wire_bytes for t in heaviest if t.axis == axis)
            cells += f"{count:>3} {fmt_bytes(wire):>10}  "
        times = "  ".join(
            f"{fmt_seconds(busiest(c, layout, links[name])):>{width}}"
            + ("*" if best[name] == layout else " ")
            for name, width in zip(names, widths)
        )
        say(
            f"  {str(layout.shape):>10} {layout.microbatches:>2} {layout.bubble:>6.2f}  "
            f"{cells}{times}".rstrip()
        )
    for name in names:
        say(f"  * {name} ({links[name]}): {best[name].shape} sends the least time")
    say_prose("""\
        On a link where latency dominates, the fewest messages win: DP alone, one all-reduce a
        step. Where bandwidth does, the fewest bytes: pipeline stages (a few activations of
        N·H) and DP over few ranks, each holding little; TP's messages are small but many, and
        the bubble (p - 1)/(m + p - 1) is idle compute the link model does not price. Real
        machines mix links: TP inside a machine on NVLink (its column costs almost nothing
        there), PP and DP across machines; that is why the mesh puts TP on the fastest axis.""")
    return {name: str(best[name].shape) for name in names}


def section_measured(
    c: GPTConfig, runs: dict[str, Run], link: Link | None, windows: torch.Tensor
) -> bool | None:
    say("")
    if link is None:
        say("  The bare machine (--link none): nothing timed; give --link to time two layouts.")
        return None
    say_prose(f"""\
        Measured: the 3-D run and DP alone, {ROUNDS} steps each on the bare machine and {ROUNDS}
        over the simulated link {link} (miniddp/observe/link_group.py: every collective runs,
        and completes when such a link would have delivered it), interleaved. The model
        predicts the bare step plus its all-reduces' time on the link (the pipeline's sends
        cross the link too, but the model leaves them out).""")
    times: dict[str, dict[str, list[float]]] = {name: {"bare": [], "link": []} for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            times[name]["bare"].append(timed_step(run, windows, None))
            times[name]["link"].append(timed_step(run, windows, link))
    bare, measured, model = {}, {}, {}
    for name, run in runs.items():
        bare[name] = statistics.median(times[name]["bare"])
        measured[name] = statistics.median(times[name]["link"])
        model[name] = busiest(c, run.layout, link, sends=False)
        say(
            f"  {name:<20} bare {fmt_seconds(bare[name]):>9}   on the link "
            f"{fmt_seconds(measured[name]):>9}   predicted "
            f"{fmt_seconds(bare[name] + model[name]):>9} (bare + {fmt_seconds(model[name])})"
        )
    three, alone = runs
    say_prose(f"""\
        Bare, the 3-D step takes {bare[three] / bare[alone]:.1f} times DP alone's here: 8
        processes share {os.cpu_count()} cores, and each of TP's small all-reduces waits until
        its partner is scheduled. The link adds {fmt_seconds(measured[three] - bare[three])}
        to it (the model: {fmt_seconds(model[three])}) and
        {fmt_seconds(measured[alone] - bare[alone])} to DP alone's (the model:
        {fmt_seconds(model[alone])}).""")
    predicted = {name: bare[name] + model[name] for name in runs}
    faster, expected = (min(values, key=values.get) for values in (measured, predicted))
    ratio = max(predicted.values()) / min(predicted.values())
    if ratio < CLEAR_WIN:
        say(
            f"  the model calls it close ({ratio:.2f}x): {faster} was faster here, unchecked "
            "on a machine this noisy"
        )
        return None
    say(f"  predicted: {expected} wins by {ratio:.1f}x; measured: {faster} wins")
    return faster == expected


def section_step(run: Run, plot: Path | None) -> list[three_d.RankStep]:
    section("6. One step, drawn")
    steps = three_d.gather_steps(run.step)
    pipeline = [steps[rank].blocks for rank in (0, 4)]
    say_prose("""\
        The step of sections 2 and 3 as it ran, for one pipeline (ranks 0 and 4, replica 0,
        shard 0): F and B of each microbatch, stages down, time across, '.' idle (chapter 14's
        picture). Every other pipeline ran the same order beside it:""")
    say(ascii_chart(pipeline))
    say("  per rank, ms in the step: F and B (of which TP's all-reduces), waiting, DP's all-reduce")
    computing, talking = 0.0, 0.0
    for rank_step in steps:
        busy = sum(block.duration for block in rank_step.blocks)
        tp, dp = (
            sum((e.end or e.start) - e.start for e in rank_step.wire if e.axis == axis)
            for axis in ("tp", "dp")
        )
        waiting = sum(end - start for start, end in rank_step.waits)
        computing, talking = computing + busy, talking + tp
        say(
            f"    rank {rank_step.rank} {str(tuple(rank_step.coordinate)):>9}: F and B "
            f"{busy * 1e3:6.1f} ({tp * 1e3:6.1f}), waiting {waiting * 1e3:6.1f}, DP "
            f"{dp * 1e3:5.1f}"
        )
    say_prose(f"""\
        TP's all-reduces took {talking / computing:.0%} of the ranks' F and B time here (8
        ranks on {os.cpu_count()} cores: a rank waits in each until its partner is scheduled). DP's
        one all-reduce goes out from inside the last backward, when the bucket's last gradient
        is ready, and that backward ends when it has arrived (MiniDDP's wait). The figure
        ({FIGURE}, `python -m miniddp.figures --only 15`) draws the mesh beside every rank's
        step, with what each axis sent and when.""")
    if plot is not None and dist.get_rank() == 0:
        path = three_d.mesh_and_step(steps, plot / "15_three_d.png")
        say(f"  this run's step, drawn: {path}")
    return steps


def section_bf16(c: GPTConfig, mesh, batches: list[torch.Tensor], run: Run) -> dict[str, bool]:
    section("7. The same 3-D run in bf16, on fp32 masters")
    say_prose("""\
        parallelize(gpt, mesh, n_microbatches=4, mixed_precision=MixedPrecision(torch.bfloat16))
        trains the same layout in bf16 (miniddp/parallelize.py's docstring): the masters stay
        fp32, and every forward computes with a bf16 copy of them (MiniDDP's, around what the
        rank holds). TP's all-reduces then sum bf16 partial products, the activations between
        the stages travel in bf16 (half the bytes), the loss is computed in fp32 from the logits
        cast up, and the gradients are summed in fp32: over the microbatches, over the two
        replicas, and for the tied embedding over the first and last stage. The loss of each
        step, the same windows in both runs:""")
    bf16 = train(THREE_D, mesh, c, batches, MixedPrecision(param_dtype=torch.bfloat16))
    fp32_losses, bf16_losses = global_losses(run), global_losses(bf16)
    say(f"  {'step':>4} {'fp32':>10} {'bf16':>10} {'bf16 - fp32':>12}")
    for step, (a, b) in enumerate(zip(fp32_losses, bf16_losses)):
        say(f"  {step:>4} {a:>10.6f} {b:>10.6f} {b - a:>+12.2e}")
    gap = max(abs(a - b) for a, b in zip(fp32_losses, bf16_losses))
    stage = bf16.parts.mesh["pp"].get_local_rank()
    n = stage_elements(c, THREE_D, stage)
    expected = memory_formula(c, THREE_D, stage)
    expected = replace(expected, compute_copies=2 * n)
    masters = {str(p.dtype) for p in bf16.parts.parameters()}
    copies = {str(t.dtype) for t in ddp_compute_copies(bf16.parts.module)}
    mine = (stage, run.memory, bf16.memory, bf16.memory == expected, masters, copies)
    rows: list = [None] * WORLD
    dist.all_gather_object(rows, (*mine, run.activations, bf16.activations))
    say_prose("""\
        The bytes of one rank, measured from the storages in the step after the first (chapter
        08's measure_memory): bf16 keeps all of fp32's (4 bytes of master, 4 of gradient, 4 of
        bucket, 8 of Adam an element) and adds 2 of bf16 copy; it saves in activations, which
        autograd holds in bf16:""")
    say(
        f"  {'rank':>4} {'stage':>5} {'fp32 total':>11} {'bf16 total':>11} {'of it copies':>13} "
        f"{'formula':>8} {'activations fp32':>17} {'bf16':>9}"
    )
    for rank, (s, m32, m16, same, _, _, a32, a16) in enumerate(rows):
        say(
            f"  {rank:>4} {s:>5} {fmt_bytes(m32.total):>11} {fmt_bytes(m16.total):>11} "
            f"{fmt_bytes(m16.compute_copies):>13} {'=' if same else 'differs':>8} "
            f"{fmt_bytes(a32):>17} {fmt_bytes(a16):>9}"
        )
    say_prose(f"""\
        The largest difference in the loss is {gap:.1e} nats, within the {BF16_LOSS_TOLERANCE}
        a step that bf16's 8-bit rounding allows here: what bf16 costs, for the bytes it saves
        in activations (and, on hardware with bf16 units, time; this CPU has none). Outside
        forward and backward every parameter is its fp32 master: the optimizer, clipping and
        a checkpoint never see bf16.""")
    return {
        f"bf16 loss within {BF16_LOSS_TOLERANCE} of fp32's, each step": gap <= BF16_LOSS_TOLERANCE,
        "bf16 memory per rank = the formula (fp32's + 2 bytes of copy an element)": all(
            row[3] for row in rows
        ),
        "bf16: parameters fp32 outside forward, copies bf16": all(
            row[4] == {"torch.float32"} and row[5] == {"torch.bfloat16"} for row in rows
        ),
    }


def refuse_other_world_sizes() -> None:
    """Before any process group: the mesh needs exactly 8 ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == WORLD:
        return
    if os.environ.get("RANK", "0") == "0":
        raise SystemExit(
            f"Chapter 15 lays out 8 ranks as (pp, dp, tp) = (2, 2, 2), and this job has "
            f"{world}: run it as torchrun --nproc_per_node=8 tutorials/15_three_d_parallel.py "
            "(or NPROC=8 ./launch.sh tutorials/15_three_d_parallel.py)"
        )
    raise SystemExit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 15: 3-D parallelism on 8 ranks.")
    parser.add_argument(
        "--steps", type=whole_number(at_least=2), default=8, help="AdamW steps (default 8)"
    )
    add_link_option(parser, default_link=BANDWIDTH_BOUND)
    add_plot_option(parser)
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: train the 3-D layout again, bf16 on fp32 masters, beside fp32 (section 7)",
    )
    args = parser.parse_args()
    refuse_other_world_sizes()
    started = time.perf_counter()
    init_distributed(backend="gloo")  # CPU tensors on a CPU mesh, GPU or not
    torch.set_num_threads(1)
    batches, corpus = text_batches(args.steps)
    characters = len(corpus.vocabulary)
    padded = -(-characters // 8) * 8  # so that every TP size splits the vocabulary evenly
    c = GPTConfig(padded, CONTEXT, WIDTH, LAYERS, HEADS, dropout=0.0)
    say_prose(f"""\
        Chapter 15: 3-D parallelism, chapter 12's GPT on {WORLD} ranks as (pp, dp, tp) =
        {THREE_D.shape}: {args.steps} steps of {WINDOWS} windows of {CONTEXT} characters each,
        from chapter 12's text ({corpus.source}).""")
    with link_groups():  # its groups cross the link of section_measured, bare elsewhere
        mesh = init_device_mesh("cpu", THREE_D.shape, mesh_dim_names=AXES)
        checks = {"every rank's groups are the ones drawn": section_mesh(mesh)}
        reference = one_process(c, batches)  # on every rank: it is small
        run = train(THREE_D, mesh, c, batches)
        alone_mesh = init_device_mesh("cpu", DP_ONLY.shape, mesh_dim_names=AXES)
        dp_only = train(DP_ONLY, alone_mesh, c, batches)
        checks["memory per rank = the formulas"] = section_holdings(c, characters, run, dp_only)
        checks["what each axis sends = the formulas"] = section_sends(c, run, dp_only)
        to_one, to_dp, parameters = section_training(run, dp_only, reference)
        checks[f"3-D loss within {LOSS_TOLERANCE:g} of one process's, each step"] = (
            to_one <= LOSS_TOLERANCE
        )
        checks[f"3-D loss within {LOSS_TOLERANCE:g} of DP alone's, each step"] = (
            to_dp <= LOSS_TOLERANCE
        )
        checks[f"parameters within {PARAMETER_TOLERANCE:g} of one process's"] = (
            parameters <= PARAMETER_TOLERANCE
        )
        links = {
            "latency-bound": Link.parse(LATENCY_BOUND),
            "bandwidth-bound": Link.parse(BANDWIDTH_BOUND),
        }
        if args.link is not None and args.link not in links.values():
            links["link"] = args.link  # --link
        winners = section_layouts(c, links)
        checks["latency-bound: DP alone sends the least time"] = (
            winners["latency-bound"] == "(1, 8, 1)"
        )
        runs = {"3-D (2, 2, 2)": run, "DP alone (1, 8, 1)": dp_only}
        measured = section_measured(c, runs, args.link, batches[0])
        if measured is not None:
            checks["on the link, the model's faster layout was faster"] = measured
        steps = section_step(run, args.plot)
        checks["one pipeline step recorded on every rank"] = all(s.blocks for s in steps)
        if args.precision == "bf16":
            checks |= section_bf16(c, mesh, batches, run)

    section("Checks")
    for name, passed in checks.items():
        say(f"  {'ok ' if passed else 'FAILED'} {name}")
    assert all(checks.values()), [name for name, passed in checks.items() if not passed]
    dist.barrier()
    say_prose(f"""\
        Verified on {WORLD} ranks in {time.perf_counter() - started:.0f} s: each rank holds and
        sends what the formulas say, and 3-D trains as one process and as DP alone do.""")
    end_chapter()


if __name__ == "__main__":
    main()
