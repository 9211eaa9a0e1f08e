"""Past 1F1B: v stages a rank (interleaved 1F1B), and the backward split in two (zero bubble).

Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM's; torch's `ScheduleInterleaved1F1B`).
Cut the model into v W stages instead of W, and give rank r the stages r, r + W, ..,
r + (v-1) W (stage.py). A microbatch now crosses the W ranks v times, but each visit runs 1/v
of the rank's layers: with t_f, t_b a rank's whole forward and backward, a stage costs t_f / v
and t_b / v. The pipeline fills and drains in p - 1 hops of a STAGE's time, not a rank's:

    bubble = (p - 1)(t_f + t_b)/v / (m (t_f + t_b) + (p - 1)(t_f + t_b)/v)
           = (p - 1) / (v m + p - 1)                           (p = W ranks)

v times less idle time, paid in messages: every microbatch crosses v W - 1 borders instead of
W - 1, so the activations (and their gradients) sent per step grow about v times.

The order (torch's, so the bits are torch's too): the k-th forward of rank r goes to local
stage (k // R) % v, in rounds of R = m / max(1, m // W) microbatches (R = W when W divides m);
the k-th backward to local stage v - 1 - (k // R) % v, the last stage first. Rank r warms up
with (v - 1) R + 2 (W - 1 - r) forwards: enough for microbatch 0 to go down every stage and
its gradient to come back to rank r, so the steady state (one F, one B) never waits. It holds
at most warm-up + 1 microbatch-stages' activations (each 1/v of a rank's layers): rank 0,
((v - 1) R + 2 W - 1) / v rank-microbatches, against 1F1B's W.

Zero bubble (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"; torch's
`ScheduleInterleavedZeroBubble`). A backward computes two things: dL/dx, the input's gradient,
which stage s-1 waits for; and dL/dW, the weights' gradient, which nobody needs before the
optimizer step. For a Linear y = x W^T, with g = dL/dy:

    dL/dx = g W           needed upstream now: the critical path runs through it
    dL/dW = g^T x         needed by the optimizer, after the step: it can wait

So B i becomes two actions. I i: `torch.autograd.grad(output, [input], g, retain_graph=True)`
walks only the graph on the path to the input leaf (it computes no parameter's gradient and
touches no .grad), and the gradient is sent upstream at once; `retain_graph` keeps the graph and
what forward saved. W i, later: `torch.autograd.backward(output, g, inputs=parameters)`
accumulates the parameters' .grad through the same graph (recomputing the gradients between
output and weights: torch's own split keeps them instead; the values, and so the bits, are the
same). The gradient that goes upstream arrives after I, not I + W: each hop of the cool-down is
shorter, and the W's, free to run any time before the step ends, fill the slots where the rank
would wait. The bits do not change: each stage still adds its microbatches' weight gradients
into .grad in the order 0 .. m-1, each the same kernels on the same values.

The zero-bubble order is torch's ZB1P: interleaved 1F1B's, with a warm-up of (v - 1) R +
(W - 1 - r) forwards (the gradient comes back faster), each B an I, and rank r deferring its W's
by r slots (the ranks nearest the end idle least in the cool-down, so defer least); then the
W's left. The price is memory: a microbatch-stage is held until its W.

The V-shaped schedules, ScheduleZBVZeroBubble and ScheduleDualPipeV, are in v_schedules.py: they
place stage s on rank s for s < W and on rank 2W - 1 - s beyond, so the last stage is on rank 0
with the first, and run on the same executor with their own orders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from miniddp.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from miniddp.pipeline.schedule import PipelineSchedule
from miniddp.pipeline.stage import PipelineStage


def interleaved_order(
    rank: int, ranks: int, stages_per_rank: int, n_microbatches: int, zero_bubble: bool = False
) -> list[Action]:
    """Rank `rank`'s order, of `ranks` ranks holding `stages_per_rank` stages each: interleaved
    1F1B's, or with `zero_bubble` its ZB1P form (each B split into I and a deferred W)."""
    v, m = stages_per_rank, n_microbatches
    per_round = m // max(1, m // ranks)  # R above
    hops = 1 if zero_bubble else 2  # the gradient's way back: a B's time, or an I's half
    warmup = min((v - 1) * per_round + hops * (ranks - 1 - rank), m * v)
    counts: dict[tuple[str, int], int] = {}  # (kind, stage) -> microbatches done there

    def next_action(kind: str, k: int) -> Action:
        local = (k // per_round) % v
        stage = (v - 1 - local if kind != FORWARD else local) * ranks + rank
        i = counts.get((kind, stage), 0)
        counts[(kind, stage)] = i + 1
        return Action(kind, i, stage)

    backward = INPUT_GRAD if zero_bubble else BACKWARD
    order = [next_action(FORWARD, k) for k in range(warmup)]
    inputs_done: list[Action] = []  # the I's whose W is still to come, oldest first
    weights_done = 0
    for k in range(m * v):  # every backward, after one more forward while there are any
        if warmup + k < m * v:
            order.append(next_action(FORWARD, warmup + k))
        order.append(next_action(backward, k))
        if zero_bubble:
            inputs_done.append(order[-1])
            if k >= rank:  # rank r defers its weight gradients by r slots
                order.append(inputs_done[weights_done]._replace(kind=WEIGHT_GRAD))
                weights_done += 1
    order += [a._replace(kind=WEIGHT_GRAD) for a in inputs_done[weights_done:]]
    return order


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B over this rank's v stages (torch's `ScheduleInterleaved1F1B`):
    `stages` is [stage rank, stage rank + W, ..], `n_microbatches` a multiple of
    max(1, n_microbatches // W), as torch asks."""

    stages_per_rank_at_most = None  # any v
    zero_bubble = False

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__(stages, n_microbatches, loss_fn)
        ranks = self.stage.group_size
        rounds = max(1, n_microbatches // ranks)
        if n_microbatches % rounds and not self.setup_problem:
            self.setup_problem = (
                f"n_microbatches={n_microbatches} is not a multiple of its number of rounds, "
                f"max(1, m // W) = {rounds}: use a multiple of W = {ranks}"
            )

    def order(self) -> list[Action]:
        stage = self.stage
        return interleaved_order(
            stage.rank, stage.group_size, len(self.stages), self.n_microbatches, self.zero_bubble
        )


class ScheduleInterleavedZeroBubble(ScheduleInterleaved1F1B):
    """Interleaved 1F1B with each backward split into the input's gradient, sent upstream at
    once, and the weights', deferred into the bubble (torch's `ScheduleInterleavedZeroBubble`,
    its ZB1P order). The same bits as ScheduleInterleaved1F1B."""

    splits_backward = True
    zero_bubble = True
