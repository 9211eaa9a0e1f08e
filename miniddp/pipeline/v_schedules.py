"""The V: two stages a rank, the first going down and its mirror coming back (ZB-V, DualPipeV).

Cut the model into 2W stages, as interleaving with v = 2 does, but place them in a V instead of
a loop: stage s runs on rank s for s < W, and on rank 2W - 1 - s beyond, so rank r holds
stages r and 2W - 1 - r.

    loop (interleaved.py)     rank 0: 0, 4    rank 1: 1, 5    rank 2: 2, 6    rank 3: 3, 7
    V                         rank 0: 0, 7    rank 1: 1, 6    rank 2: 2, 5    rank 3: 3, 4

A microbatch goes down the ranks, turns around on rank W - 1 (stages W - 1 and W share it: the
activation and its gradient are handed over in memory, no message, p2p.py) and comes back up,
so rank 0 holds both the first stage and the last: the loss is computed where the batch went
in, and each rank's two stages are the same distance from the turn.

ScheduleZBVZeroBubble (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", section 6; torch's
`ScheduleZBVZeroBubble`, whose order this is, so the bits are torch's too). Each backward split
in I and W (interleaved.py says why W can wait). Rank r warms up with 2(W - r) - 1 forwards of
its first stage, then r pairs (F of its second stage, F of its first), then W - r rounds of
(F, I, W) on its second stage; the steady state repeats F, I, W on the first stage, then on the
second; the cool-down runs the I's first and the W's last. With t_F = t_I = t_W (a stage's
forward as long as each half of its backward) no rank idles inside its own span: the W's fill
the holes that 1F1B leaves. What remains is the ramp, each rank starting and ending W - 1
forwards apart: on the logical clock of bubble.replay (F, I, W 1 each), W - 1 idle a rank per
step against interleaved 1F1B's 3 (W - 1), and 2W microbatch-stages held on every rank (each
half a rank's layers: W rank-microbatches, 1F1B's first stage's, on no rank more).

ScheduleDualPipeV (DeepSeek-V3's DualPipe, 2024, cut in half into a V: the DualPipe
repository's DualPipeV; torch's `ScheduleDualPipeV`, whose order this is). The same V, with a
steady state of pairs (F of one microbatch at one stage, B of another at the other stage),
m >= 2W, 2W + 1 microbatch-stages held on every rank. DeepSeek runs each pair at once on a
GPU, the forward's all-to-all hidden behind the backward's compute and the other way round (two
CUDA streams).
Here the pair runs one after the other, the forward first, as torch's schedule does without
an overlapped function: the order is what this schedule is, the overlap is what a GPU adds to
it (tutorials/14c_v_schedules.py says what each buys). Its warm-up and cool-down split some
backwards into I and W, as ZB-V does.

With MiniDDP inside each stage (DP x PP), a stage all-reduces at its last backward action,
a whole B or the last W (stage.py arms it there): one reduction a stage a step.

Everything else (the step, the checks, the transfers, the split backward) is the executor's
(schedule.py) and the loop's stages' (stage.py): a V schedule differs only in its order and in
telling its stages where their neighbours are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from miniddp.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from miniddp.pipeline.schedule import PipelineSchedule
from miniddp.pipeline.stage import PipelineStage


def v_stages(rank: int, ranks: int) -> tuple[int, int]:
    """The two stages rank `rank` of `ranks` holds in the V: its first, and its mirror."""
    return rank, 2 * ranks - 1 - rank


def v_placement(ranks: int) -> list[int]:
    """The rank of each of the 2W stages in the V: s below W, 2W - 1 - s from W on."""
    return [s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)]


class _Order:
    """A rank's order, written one action at a time: each kind at each stage takes the next
    microbatch (a W the oldest whose I ran, a B the next backward, counting the split ones)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: Counter[tuple[str, int]] = Counter()  # (kind, stage) -> microbatch
        self.pending_weights: list[Action] = []  # the I's whose W is still to come, oldest first

    def add(self, kind: str, stage: int) -> None:
        counted = INPUT_GRAD if kind == BACKWARD else kind  # B and I count the same backwards
        i = self.next[(counted, stage)]
        self.next[(counted, stage)] = i + 1
        self.actions.append(Action(kind, i, stage))
        if kind == INPUT_GRAD:
            self.pending_weights.append(Action(WEIGHT_GRAD, i, stage))

    def add_oldest_weight(self) -> None:
        """The W of the oldest I still waiting for it, if any."""
        if self.pending_weights:
            self.actions.append(self.pending_weights.pop(0))

    def count(self, kind: str, stage: int) -> int:
        return self.next[(kind, stage)]


def zbv_order(rank: int, ranks: int, n_microbatches: int) -> list[Action]:
    """Rank `rank`'s ZB-V order: torch's `ScheduleZBVZeroBubble`'s, written as the paper's
    phases. It is built for max(m, 2W - 1) microbatches, the fewest that fill the V, and the
    actions of microbatches past m are then left out."""
    first, second = v_stages(rank, ranks)
    enough = max(n_microbatches, 2 * ranks - 1)
    order = _Order()

    def split_backward(stage: int) -> None:
        order.add(INPUT_GRAD, stage)
        order.add(WEIGHT_GRAD, stage)

    for _ in range(2 * (ranks - rank) - 1):  # down the V: the first stage alone
        order.add(FORWARD, first)
    for _ in range(rank):  # the first microbatches come back up: both stages forward
        order.add(FORWARD, second)
        order.add(FORWARD, first)
    for _ in range(ranks - rank):  # their gradients start: the second stage's F, I, W
        order.add(FORWARD, second)
        split_backward(second)
    while order.count(FORWARD, second) < order.count(FORWARD, first) or (
        order.count(FORWARD, first) < enough
    ):
        if order.count(FORWARD, first) < enough:
            order.add(FORWARD, first)
        split_backward(first)
        order.add(FORWARD, second)
        split_backward(second)
    # Cool-down: the input gradients first (the ranks above wait for them), the W's last.
    for _ in range(rank):
        order.add(INPUT_GRAD, first)
        order.add(INPUT_GRAD, second)
    for _ in range(ranks - rank):
        order.add(INPUT_GRAD, first)
        order.add(WEIGHT_GRAD, first)
    for stage in (second, first):
        while order.count(WEIGHT_GRAD, stage) < order.count(INPUT_GRAD, stage):
            order.add(WEIGHT_GRAD, stage)
    return [a for a in order.actions if a.microbatch < n_microbatches]


def dualpipev_order(rank: int, ranks: int, n_microbatches: int) -> list[Action]:
    """Rank `rank`'s DualPipeV order (torch's `ScheduleDualPipeV`'s; m >= 2W). Each pair that
    DualPipe overlaps is written as its two actions, the forward first, as torch runs them."""
    first, second = v_stages(rank, ranks)
    below = ranks - rank - 1  # ranks further down the V
    order = _Order()
    for _ in range(2 * below):  # down the V
        order.add(FORWARD, first)
    for _ in range(rank + 1):
        order.add(FORWARD, first)
        order.add(FORWARD, second)
    for _ in range(below):  # zero bubble while the pipe fills
        order.add(INPUT_GRAD, second)
        order.add_oldest_weight()
        order.add(FORWARD, second)
    for _ in range(n_microbatches - 2 * ranks + rank + 1):  # the overlapped pairs
        order.add(FORWARD, first)  # F first stage + B second (rank W - 1's first: not paired)
        order.add(BACKWARD, second)
        order.add(FORWARD, second)  # F second stage + B first
        order.add(BACKWARD, first)
    for _ in range(below):
        order.add(BACKWARD, second)
        order.add(FORWARD, second)
        order.add(BACKWARD, first)
    # The last backwards: whole at first, then split (from the middle of this run on, the
    # second stage first on odd ranks, the first stage first on even ones), their W's last.
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        order.add(INPUT_GRAD if split else BACKWARD, second)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        order.add(INPUT_GRAD if split else BACKWARD, first)
    for _ in range(below):
        order.add_oldest_weight()
        order.add(INPUT_GRAD if split else BACKWARD, first)
    for _ in range(rank + 1):
        order.add_oldest_weight()
    return order.actions


def v_stages_problem(stages: Sequence[PipelineStage], schedule_name: str) -> str | None:
    """What is wrong with the stages this rank gave a V schedule (None: nothing)."""
    first = stages[0]
    ranks, indices = first.group_size, [s.stage_index for s in stages]
    if any(s.group is not first.group or s.num_stages != first.num_stages for s in stages):
        return "its stages belong to different pipelines (groups or num_stages differ)"
    expected = list(v_stages(first.rank, ranks))
    if len(stages) != 2 or first.num_stages != 2 * ranks or indices != expected:
        return (
            f"{schedule_name} runs two stages a rank in a V, 2W = {2 * ranks} stages on "
            f"W = {ranks} ranks, stage s on rank s below W and on rank 2W - 1 - s from W on; "
            f"rank {first.rank} was given stages {indices} of {first.num_stages}: give it "
            f"stages {expected}, in that order"
        )
    return None


class ScheduleZBVZeroBubble(PipelineSchedule):
    """ZB-V (torch's `ScheduleZBVZeroBubble`, its arguments): `stages` is this rank's two, r and
    2W - 1 - r. torch's chunk specs are not taken (the batch is split along dim 0);
    `scale_grads=False` leaves each microbatch's loss as loss_fn returns it, instead of / m;
    `defer_pp_recv` (when torch posts its receives) changes no value and nothing here: each
    receive goes out with the previous action's sends."""

    splits_backward = True
    a_microbatch_a_stage = False  # DualPipeV: m >= 2W

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        args_chunk_spec: None = None,
        kwargs_chunk_spec: None = None,
        output_merge_spec: None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        specs = {"args_chunk_spec": args_chunk_spec, "kwargs_chunk_spec": kwargs_chunk_spec}
        specs |= {"output_merge_spec": output_merge_spec}
        given = [name for name, spec in specs.items() if spec is not None]
        if given or not backward_requires_autograd:
            raise NotImplementedError(
                f"{type(self).__name__} splits every input along dim 0 and backpropagates with "
                f"autograd: leave {', '.join(given) or 'backward_requires_autograd'} at its "
                "default"
            )
        super().__init__(stages, n_microbatches, loss_fn)
        self.scale_grads = scale_grads
        # The loop's check (stage.py's s % W) does not hold here: the V's replaces it.
        self.setup_problem = v_stages_problem(self.stages, type(self).__name__)
        count = 2 * self.stage.group_size
        if self.a_microbatch_a_stage and n_microbatches < count and not self.setup_problem:
            self.setup_problem = (
                f"n_microbatches={n_microbatches}: {type(self).__name__} needs at least as "
                f"many microbatches as stages, {count}"
            )
        if self.setup_problem is None:
            for stage in self.stages:  # where their neighbours are, as torch's schedule says
                stage.ranks_of_stages = v_placement(stage.group_size)

    def order(self) -> list[Action]:
        return zbv_order(self.stage.rank, self.stage.group_size, self.n_microbatches)


class ScheduleDualPipeV(ScheduleZBVZeroBubble):
    """DualPipeV (torch's `ScheduleDualPipeV`, its arguments), on the same V; at least as many
    microbatches as stages, 2W, as torch asks."""

    a_microbatch_a_stage = True

    def order(self) -> list[Action]:
        return dualpipev_order(self.stage.rank, self.stage.group_size, self.n_microbatches)
