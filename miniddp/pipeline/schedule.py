"""What every pipeline schedule shares: one step, run as a list of forwards and backwards.

A schedule is an ORDER: for each rank, the sequence of actions F i (forward of microbatch i)
and B i (its backward), at the rank's one stage or, interleaved, at one of its v stages (and
zero-bubble schedules split B i into I i and W i: actions.py). GPipe and 1F1B (at the end of
this file) and the interleaved schedules (interleaved.py) differ only there. Everything else is
the same for all of them, and is run from here:

    step(x) / step() / step(target=y, losses=losses)      torch's call, per stage
                                                          (x: the batch's tensors, any number)
      check     every stage states what it was given (rank_checks); bad input is refused on all
                (step_checks)
      split     the batch (first stage) and the target (last) into m equal microbatches
                (microbatches.py, which also merges the outputs back)
      run       for each action of `order()`: receive what it needs (an activation for F on
                every stage but the first, a gradient for B or I on every stage but the last),
                compute, and hand its sends to the next action's batch of transfers (what
                crosses which border, borders.py; how, p2p.py)
      finish    wait for the sends, report the losses

What crosses a border is a tuple of tensors: a stage's output, a tensor or a tuple, is the next
stage's arguments; only the floating-point ones carry a gradient back.

Forward only (torch's two ways): `eval(...)`, with step()'s arguments, or step() of a schedule
built with loss_fn=None. The order is step()'s with the backwards left out: the same forwards
in the same order, so the same messages, and no action waits on one that is gone (an F waits
only on the F before it). It runs under torch.no_grad(), so no stage holds anything for a
backward. A step() that would train under torch.no_grad() is refused on every stage at the
step's check, saying to call eval(): autograd would fail on one stage and leave the others
waiting.

Gradients: the last stage backpropagates loss_i / m, not loss_i, so after all m microbatches
`.grad` holds sum_i d(loss_i / m)/d theta, the gradient of the batch's mean loss (each loss_i a
mean over its b samples, so mean_i loss_i = mean over all m*b). Each step scales only its own
microbatches: two steps before `optimizer.step()` leave G1 + G2, as one process accumulating
two batches does. Torch's default (`scale_grads=True`) instead divides all of `.grad` by m at the
end of each step, so there the first step's part is divided twice, G1/m + G2. The bits are the
same as torch's within one step whenever m is a power of two (scaling by 2^-k commutes with
rounding); for other m, dividing each loss and dividing the sum round differently, in the last
place. The losses reported are loss_i itself.

Accumulating over several steps (a batch too big for one step): give each step the loss you
want divided by the number of steps too, loss_fn = lambda out, y: mse(out, y) / steps; nothing
else changes, since every step only adds to `.grad`.

Events (heard by the `observer`, as MiniDDP's; miniddp/pipeline/bubble.py draws them): step
start/end, forward, backward, input and weight "start i s"/"end i s" (microbatch i at stage
s), send and recv of each transfer, and idle start/end around every wait for a receive.

GPipe and 1F1B: two orders of the same forwards and backwards, and what each one costs.

Every stage runs F i (forward of microbatch i) and B i (its backward) for i = 0 .. m-1. F i on
stage s needs F i on stage s-1; B i on stage s needs B i on stage s+1. With p stages, and each
F taking t_f and each B t_b on every stage:

GPipe (Huang et al., 2019): all forwards, then all backwards ("fill, then drain").

    stage 0   F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
    stage 1   .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .        (B drawn as long as F here)
    stage 2   .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
    stage 3   .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .

  The last stage starts after p-1 forwards and the first ends p-1 backwards after the last
  stage's, so a step lasts (m + p - 1)(t_f + t_b) while each stage computes for m(t_f + t_b):
  the idle share, the *bubble*, is (p - 1) / (m + p - 1). Every stage holds all m microbatches'
  activations when its first backward starts.

1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs min(m, p - s) forwards ("warm-up"),
then alternates one backward and one forward, then runs the backwards left ("cool-down").

    stage 0   F0 F1 F2 F3 .  .  B0 F4 B1 F5 B2 ...
    stage 3   .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 ...

  The same dependencies bound the same makespan, so the bubble is the same (p - 1)/(m + p - 1);
  but a microbatch's activations are freed by its backward as soon as possible, so stage s holds
  at most p - s microbatches at once, however large m is. That is what 1F1B buys: memory, which
  lets m grow, which shrinks the bubble.

With m < p, 1F1B still works: stages whose warm-up covers all m microbatches run GPipe's order,
the later ones alternate as usual (torch's Schedule1F1B refuses m < p; nothing here needs to).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from miniddp.observe.events import NO_OBSERVER, Observer
from miniddp.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    encode,
)
from miniddp.pipeline.borders import Borders
from miniddp.pipeline.microbatches import StepData
from miniddp.pipeline.p2p import Mailbox, Transfer
from miniddp.pipeline.rank_checks import microbatch_shapes, rank_problem, stages_problem
from miniddp.pipeline.stage import Activation, PipelineStage
from miniddp.pipeline.step_checks import (
    Found,
    Problem,
    check_on_every_stage,
    check_orders_together,
)

EVENT_KIND = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRAD: "input", WEIGHT_GRAD: "weight"}


def _the_loss(returned: object, trains: bool) -> torch.Tensor:
    """What loss_fn returned, if it is a loss: a tensor, of one element where the step trains
    (the last stage divides it by m and backpropagates it). A tuple (loss, aux) would fail deep
    inside, with a bare TypeError that names neither loss_fn nor the fix."""
    if isinstance(returned, torch.Tensor) and (returned.numel() == 1 or not trains):
        return returned
    what = f"a {type(returned).__name__}"
    if isinstance(returned, torch.Tensor):
        what = f"a tensor of shape {tuple(returned.shape)}"
    raise TypeError(
        f"loss_fn must return the loss, one tensor of one element, as torch's schedules "
        f"expect a torch.Tensor; it returned {what}: return the loss alone (reduce it, e.g. "
        "with .mean()), and keep anything else yourself, e.g. in a list loss_fn appends to"
    )


class PipelineSchedule:
    """Runs this rank's part of each step in the order `order()` gives. Subclasses define only
    the order; `loss_fn(output, target)` is called on the last stage, once per microbatch;
    without one (None, torch's), the schedule runs forward only, as eval() does.
    `stages`: this rank's stage (GPipe, 1F1B), or its v stages in order (interleaved)."""

    stages_per_rank_at_most: int | None = 1  # the interleaved schedules: None, any
    splits_backward = False  # the zero-bubble schedules: B i as I i, then W i
    scale_grads = True  # each loss divided by m; the V schedules take torch's scale_grads=False

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                "loss_fn must be a function loss_fn(output, target) -> scalar tensor, "
                f"called on the last stage, or None for a forward-only schedule; got {loss_fn!r}"
            )
        self.stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not self.stages or not all(isinstance(s, PipelineStage) for s in self.stages):
            raise TypeError(f"{type(self).__name__} takes a PipelineStage or a list of them")
        self.stage = self.stages[0]  # this rank's first stage (its only one, v = 1)
        self.has_first_stage = any(stage.is_first for stage in self.stages)
        self.has_last_stage = any(stage.is_last for stage in self.stages)
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.observer: Observer = NO_OBSERVER  # instruments attach theirs (observe/events.py)
        self.mailbox = Mailbox(self.stage.group, lambda kind, name: self.observer.note(kind, name))
        self.borders = Borders(self.stages, n_microbatches, self.mailbox)
        self._by_index = {stage.stage_index: stage for stage in self.stages}
        # Refused at the first step, on every rank.
        self.setup_problem = stages_problem(
            self.stages, type(self).__name__, self.stages_per_rank_at_most, self.splits_backward
        )
        self._first_microbatch_shapes: tuple[tuple[int, ...], ...] | None = None  # training's
        self._border_shapes: tuple[tuple[int, ...], ...] | None = None  # the borders learnt
        self._orders_checked: set[bool] = set()  # a training and a forward-only order, once each
        self.peak_held = 0  # the most microbatch-stages this rank held at once, last step

    @property
    def input_shape(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...] | None:
        """The shape of this rank's first stage's input microbatch (a tuple of shapes for
        several tensors), as given or as learnt from the previous stage in the first step (None
        on the first stage, or before)."""
        header = self.borders.input_header(self.stage.stage_index)
        if header is None:
            return None
        return header.shapes[0] if len(header.shapes) == 1 else header.shapes

    def order(self) -> list[Action]:
        """This rank's actions in one step (actions.py says what makes an order)."""
        raise NotImplementedError

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | Activation | None:
        """One training step of this rank (torch's signature): `args`, the batch's tensors on
        the first stage, are split into m microbatches each; the rank of the last stage returns
        the batch's outputs and fills `losses` with each microbatch's loss. Gradients are left
        in `.grad` (added to what was there), the gradient of the mean loss over the
        microbatches: call the optimizer after it. Without a loss_fn: eval()."""
        return self._step(args, target, losses, backward=self.loss_fn is not None)

    def eval(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | Activation | None:
        """Forward only (torch's name): the forwards of step()'s order and no backward, under
        `torch.no_grad()`, so nothing is held for a backward and no `.grad` changes. The last
        stage returns the outputs, and with a loss_fn and a target fills `losses`."""
        return self._step(args, target, losses, backward=False)

    def _step(
        self,
        args: tuple[torch.Tensor, ...],
        target: torch.Tensor | None,
        losses: list[torch.Tensor] | None,
        backward: bool,
    ) -> torch.Tensor | Activation | None:
        stage, m = self.stage, self.n_microbatches
        order = [] if self.setup_problem else [a.at(stage.stage_index) for a in self.order()]
        found = self._inspect(args, target, losses, order, backward)
        if not backward:  # the same forwards in the same order (replayed below, once)
            order = [a for a in order if a.kind == FORWARD]
        who = "stage" if len(self.stages) == 1 else "rank"
        shapes = microbatch_shapes(args, m) if self.has_first_stage and found[0] == 0 else None
        relearn = shapes is not None and self._border_shapes not in (None, shapes)
        if check_on_every_stage(
            found, m, type(self).__name__, stage.group, stage.device, who, backward, relearn
        ):
            self.borders.relearn()
        self._border_shapes = shapes or self._border_shapes
        if backward not in self._orders_checked:  # once: the orders of a schedule do not change
            longest = 3 * m * len(self.stages)  # every row as long: zeros pad (actions.py)
            codes = encode(order, stage.stage_index)
            check_orders_together(codes + [0] * (longest - len(codes)), stage.group, stage.device)
            self._orders_checked.add(backward)
        data = StepData.split(args, target, m, backward)
        for each in self.stages:
            each.start_step()
        self.peak_held = 0
        self.observer.note("step", "start")
        sends: list[Transfer] = []
        last_backward = {a.stage: a for a in order if a.kind in (BACKWARD, WEIGHT_GRAD)}
        with contextlib.nullcontext() if backward else torch.no_grad():
            for action in order:
                # This action's receives go out in one batch with the previous action's sends.
                received = self.borders.receive_for(action, sends)
                last = last_backward.get(action.stage) == action
                sends = self._run(action, data, received, last, final=action is order[-1])
                self.peak_held = max(self.peak_held, sum(len(s.held) for s in self.stages))
        self.mailbox.post(sends)
        self.mailbox.finish_sends()
        self.observer.note("step", "end")
        if self.has_last_stage and losses is not None:
            losses.clear()
            losses.extend(data.losses)
        return data.merged_outputs() if self.has_last_stage else None

    def _run(
        self,
        action: Action,
        data: StepData,
        received: Activation | None,
        last: bool,
        final: bool = False,
    ) -> list[Transfer]:
        """Compute `action` at its stage; what it sends (an activation downstream, gradients
        upstream), for the next action's batch. The rank's `final` action has no next batch:
        its gradients go out alone, as soon as autograd has them (stage.py, `early`)."""
        stage, i, s = self._by_index[action.stage], action.microbatch, action.stage
        name = f"{i} {s}"
        self.observer.note(EVENT_KIND[action.kind], f"start {name}")
        sends = []
        if action.kind == FORWARD:
            inputs = data.inputs[i] if stage.is_first else received
            output = stage.forward(i, inputs, keep=data.backward)
            if stage.is_last:
                if self.loss_fn is not None and data.targets[i] is not None:
                    loss = _the_loss(self.loss_fn(output, data.targets[i]), data.backward)
                    if data.backward:  # its share of the mean (unless scale_grads is off)
                        stage.keep_loss(i, loss / self.n_microbatches if self.scale_grads else loss)
                    data.losses.append(loss.detach())
                data.keep_output(output)
            else:
                sends += self.borders.activation_sends(output, s, i)
        elif action.kind == WEIGHT_GRAD:
            stage.backward_weight(i, last)
        else:
            if action.kind == BACKWARD:

                def early(grads: Activation) -> None:
                    self.mailbox.post(self.borders.gradient_sends(grads, s, i))

                input_grads = stage.backward(i, received, last, early if final else None)
            else:
                input_grads = stage.backward_input(i, received)
            if input_grads is not None:
                sends += self.borders.gradient_sends(input_grads, s, i)
        self.observer.note(EVENT_KIND[action.kind], f"end {name}")
        return sends

    def _inspect(
        self,
        args: tuple[torch.Tensor, ...],
        target: torch.Tensor | None,
        losses: list | None,
        order: list[Action],
        backward: bool,
    ) -> Found:
        """What this rank sees wrong with its stages or its part of the step (rank_checks);
        the first training step's microbatch shapes are kept, for every later training step to
        match. A forward-only step may take others (a smaller validation batch): the borders
        learn its shapes, and the next training step's back (torch re-infers its shapes when
        eval follows training)."""
        if self.setup_problem:
            return Problem.BAD_STAGES, 0, 0, self.setup_problem
        m, shapes = self.n_microbatches, self._first_microbatch_shapes
        found = rank_problem(
            self.stages,
            order,
            m,
            args,
            target,
            losses,
            backward=backward,
            has_loss_fn=self.loss_fn is not None,
            first_shapes=shapes if backward else None,
        )
        if found[0] == Problem.NONE and self.has_first_stage and shapes is None and backward:
            self._first_microbatch_shapes = microbatch_shapes(args, m)
        return found


class ScheduleGPipe(PipelineSchedule):
    """All m forwards, then all m backwards (torch's `ScheduleGPipe`)."""

    def order(self) -> list[Action]:
        m = self.n_microbatches
        return [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)]


class Schedule1F1B(PipelineSchedule):
    """Warm-up forwards, then one backward and one forward in turn (torch's `Schedule1F1B`)."""

    def order(self) -> list[Action]:
        m, stage = self.n_microbatches, self.stage
        # Stage s's first backward can start only after microbatch 0 went down the remaining
        # p - s stages: p - s forwards fit before it, and no more are needed to keep it busy.
        warmup = min(m, stage.num_stages - stage.stage_index)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: B i frees what F (i + warmup) takes
            actions += [Action(BACKWARD, i), Action(FORWARD, i + warmup)]
        actions += [Action(BACKWARD, i) for i in range(m - warmup, m)]
        return actions
