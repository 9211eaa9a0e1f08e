"""What every pipeline schedule shares: one step, run as a list of forwards and backwards.

A schedule is an ORDER: for each rank, the sequence of actions F i (forward of microbatch i)
and B i (its backward), at the rank's one stage or, interleaved, at one of its v stages (and
zero-bubble schedules split B i into I i and W i: actions.py). GPipe and 1F1B (at the end of
this file) and the interleaved schedules (interleaved.py) differ only there. Everything else is
the same for all of them, and lives here:

    step(x) / step() / step(target=y, losses=losses)      torch's call, per stage
                                                          (x: the batch's tensors, any number)
      check     every stage states what it was given; bad input is refused on all (step_checks)
      split     the batch (first stage) and the target (last) into m equal microbatches
      run       for each action of `order()`: receive what it needs (an activation for F on
                every stage but the first, a gradient for B or I on every stage but the last),
                compute, and hand its sends to the next action's batch of transfers (p2p.py)
      finish    wait for the sends, report the losses

What crosses a border is a tuple of tensors (p2p.py): a stage's output, a tensor or a tuple,
is the next stage's arguments; only the floating-point ones carry a gradient back.

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

Events (`record_events()`, as MiniDDP's; miniddp/pipeline/bubble.py draws them): step
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
from dataclasses import dataclass, field

import torch

from miniddp.observe.events import EventRecorder
from miniddp.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    encode,
    order_problem,
)
from miniddp.pipeline.p2p import MAX_TENSORS, Header, Mailbox, Transfer, as_tuple, carries_gradient
from miniddp.pipeline.stage import Activation, PipelineStage
from miniddp.pipeline.step_checks import Problem, check_on_every_stage, check_orders_together

EVENT_KIND = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRAD: "input", WEIGHT_GRAD: "weight"}
ACTIVATION, GRADIENT, SHAPE = range(3)  # what a transfer carries, in its tag


@dataclass
class StepData:
    """One step's microbatches, and what the last stage collects from them. `backward`: a
    training step; False: forward only (eval(), or a schedule without a loss_fn)."""

    backward: bool
    inputs: list[Activation | None]  # the first stage's, each microbatch's arguments
    targets: list[torch.Tensor | None]  # the last stage's; None elsewhere, or in eval without
    outputs: list[torch.Tensor | Activation] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Border:
    """What a stage knows of its input's shape, and whether its next stage knows its own."""

    input_header: Header | None
    header_sent: bool


class PipelineSchedule(EventRecorder):
    """Runs this rank's part of each step in the order `order()` gives. Subclasses define only
    the order; `loss_fn(output, target)` is called on the last stage, once per microbatch;
    without one (None, torch's), the schedule runs forward only, as eval() does.
    `stages`: this rank's stage (GPipe, 1F1B), or its v stages in order (interleaved)."""

    stages_per_rank_at_most: int | None = 1  # the interleaved schedules: None, any
    splits_backward = False  # the zero-bubble schedules: B i as I i, then W i

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
        self.mailbox = Mailbox(self.stage.group, self._note)
        self._by_index = {stage.stage_index: stage for stage in self.stages}
        examples: dict[int, bool] = {}  # every stage of this rank's rounds: given an example?
        for stage in self.stages:
            examples.update(stage.examples)
        self._borders = {
            s.stage_index: Border(
                None if s.input_example is None else Header.of(s.input_example),
                s.is_last or examples.get(s.stage_index + 1, False),
            )
            for s in self.stages
        }
        self.setup_problem = self._stages_problem()  # refused at the first step, on every rank
        self._first_microbatch_shapes: tuple[tuple[int, ...], ...] | None = None
        self._orders_checked: set[bool] = set()  # a training and a forward-only order, once each
        self.peak_held = 0  # the most microbatch-stages this rank held at once, last step
        self._start_event_log()

    @property
    def input_shape(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...] | None:
        """The shape of this rank's first stage's input microbatch (a tuple of shapes for
        several tensors), as given or as learnt from the previous stage in the first step (None
        on the first stage, or before)."""
        header = self._borders[self.stage.stage_index].input_header
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
        check_on_every_stage(
            found, m, type(self).__name__, stage.group, stage.device, who, backward
        )
        if backward not in self._orders_checked:  # once: the orders of a schedule do not change
            longest = 3 * m * len(self.stages)  # every row as long: zeros pad (actions.py)
            codes = encode(order, stage.stage_index)
            check_orders_together(codes + [0] * (longest - len(codes)), stage.group, stage.device)
            self._orders_checked.add(backward)
        data = StepData(
            backward,
            inputs=list(zip(*(a.tensor_split(m) for a in args))) or [None] * m,
            targets=[None] * m if target is None else list(target.tensor_split(m)),
        )
        for each in self.stages:
            each.start_step()
        self.peak_held = 0
        self._note("step", "start")
        sends: list[Transfer] = []
        last_backward = {a.stage: a for a in order if a.kind in (BACKWARD, WEIGHT_GRAD)}
        with contextlib.nullcontext() if backward else torch.no_grad():
            for action in order:
                # This action's receives go out in one batch with the previous action's sends.
                received = self._receive_for(action, sends)
                sends = self._run(action, data, received, last_backward.get(action.stage) == action)
                self.peak_held = max(self.peak_held, sum(len(s.held) for s in self.stages))
        self.mailbox.post(sends)
        self.mailbox.finish_sends()
        self._note("step", "end")
        if self.has_last_stage and losses is not None:
            losses.clear()
            losses.extend(data.losses)
        return _merged(data.outputs) if self.has_last_stage else None

    def _receive_for(self, action: Action, sends: list[Transfer]) -> Activation | None:
        """Post `sends` in one batch with the receives `action` needs, and wait for them: an
        activation's tensors for F on every stage but the first, the gradients of its
        floating-point tensors for B or I on every stage but the last. An action that needs
        none (F on the first stage, B or I on the last, W) returns None, and the sends go out
        alone."""
        stage, i = self._by_index[action.stage], action.microbatch
        border = self._borders[stage.stage_index]
        s = stage.stage_index
        if action.kind == FORWARD and not stage.is_first:
            if border.input_header is None:  # the first step: learn the shapes first
                self.mailbox.post(sends)
                sends = []
                shape = self._receive(Header.buffer(stage.device), s - 1, SHAPE, 0, s)
                (codes,) = self.mailbox.receive_now([shape])
                border.input_header = Header.decode(codes)
            buffers = border.input_header.empty(stage.device)
            receives = [self._receive(b, s - 1, ACTIVATION, i, s, k) for k, b in enumerate(buffers)]
        elif action.kind in (BACKWARD, INPUT_GRAD) and not stage.is_last:
            outputs = as_tuple(stage.held[i].output)
            receives = [
                self._receive(torch.empty_like(out), s + 1, GRADIENT, i, s, k)
                for k, out in enumerate(outputs)
                if carries_gradient(out.dtype)
            ]
        else:
            self.mailbox.post(sends)
            return None
        works = self.mailbox.post(sends, receives)
        return self.mailbox.wait_receives(works, receives)

    def _tag(self, carries: int, i: int, stage: int, k: int) -> tuple[int, str]:
        """The tag of tensor k of what `carries` for microbatch i at `stage` (the receiver), and
        its name for events and messages: "activation 3", "gradient 3 (tensor 1)"."""
        tag = carries + 3 * (k + MAX_TENSORS * (i + self.n_microbatches * stage))
        what = "the shape" if carries == SHAPE else f"{('activation', 'gradient')[carries]} {i}"
        return tag, what + (f" (tensor {k})" if k else "")

    def _receive(self, buffer, peer: int, carries: int, i: int, me: int, k: int = 0) -> Transfer:
        tag, what = self._tag(carries, i, me, k)
        return Transfer(buffer, peer, what, False, self.stage.rank_of(peer), tag)

    def _send(self, tensor, peer: int, carries: int, i: int, k: int = 0) -> Transfer:
        tag, what = self._tag(carries, i, peer, k)
        return Transfer(tensor, peer, what, True, self.stage.rank_of(peer), tag)

    def _run(
        self, action: Action, data: StepData, received: Activation | None, last: bool
    ) -> list[Transfer]:
        """Compute `action` at its stage; what it sends (an activation downstream, gradients
        upstream), for the next action's batch."""
        stage, i, s = self._by_index[action.stage], action.microbatch, action.stage
        name = f"{i} {s}"
        self._note(EVENT_KIND[action.kind], f"start {name}")
        sends = []
        if action.kind == FORWARD:
            inputs = data.inputs[i] if stage.is_first else received
            output = stage.forward(i, inputs, keep=data.backward)
            if stage.is_last:
                if self.loss_fn is not None and data.targets[i] is not None:
                    loss = self.loss_fn(output, data.targets[i])
                    if data.backward:
                        stage.keep_loss(i, loss / self.n_microbatches)  # its share of the mean
                    data.losses.append(loss.detach())
                data.outputs.append(_detached(output))
            else:
                sends += self._activation_sends(output, s, i)
        elif action.kind == WEIGHT_GRAD:
            stage.backward_weight(i)
        else:
            if action.kind == BACKWARD:
                input_grads = stage.backward(i, received, last)
            else:
                input_grads = stage.backward_input(i, received)
            if not stage.is_first:
                entries = self._borders[s].input_header.entries
                places = [k for k, (dtype, _) in enumerate(entries) if carries_gradient(dtype)]
                sends += [
                    self._send(grad, s - 1, GRADIENT, i, k)
                    for k, grad in zip(places, input_grads, strict=True)
                ]
        self._note(EVENT_KIND[action.kind], f"end {name}")
        return sends

    def _activation_sends(self, output, s: int, i: int) -> list[Transfer]:
        """Stage s's output for microbatch i, one transfer per tensor, to stage s + 1; before
        the first, the header of their shapes, unless stage s + 1 was given an example."""
        tensors = as_tuple(output)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            kinds = ", ".join(type(t).__name__ for t in tensors)
            raise TypeError(
                f"stage {s}'s forward returned ({kinds}): a stage hands the next one a tensor or "
                "a tuple of tensors; make any other value a tensor (e.g. torch.tensor(n))"
            )
        activation = tuple(t.detach().contiguous() for t in tensors)
        sends = []
        border = self._borders[s]
        if not border.header_sent:
            header = Header.of(activation).encode(self.stage.device)
            sends.append(self._send(header, s + 1, SHAPE, 0))
            border.header_sent = True
        return sends + [self._send(t, s + 1, ACTIVATION, i, k) for k, t in enumerate(activation)]

    def _stages_problem(self) -> str | None:
        """What is wrong with the stages this rank gave its schedule (None: nothing)."""
        first, stages = self.stage, self.stages
        size, v = first.group_size, len(stages)
        if any(s.group is not first.group or s.num_stages != first.num_stages for s in stages):
            return "its stages belong to different pipelines (groups or num_stages differ)"
        most = self.stages_per_rank_at_most
        if most is not None and first.num_stages > size * most:
            return (
                f"{type(self).__name__} runs one stage a rank, and there are "
                f"{first.num_stages} stages on {size} ranks: use ScheduleInterleaved1F1B"
            )
        expected = [first.rank + i * size for i in range(first.num_stages // size)]
        if [s.stage_index for s in stages] != expected:
            return (
                f"it was given stages {[s.stage_index for s in stages]} (v = {v}); rank "
                f"{first.rank} holds stages {expected}, every one of them, in that order"
            )
        if any(s.data_parallel for s in stages) and (v > 1 or self.splits_backward):
            return (
                "a data-parallel stage (MiniDDP inside) runs under ScheduleGPipe or "
                "Schedule1F1B only, one stage a rank, its backward whole"
            )
        return None

    def _inspect(
        self,
        args: tuple[torch.Tensor, ...],
        target: torch.Tensor | None,
        losses: list | None,
        order: list[Action],
        backward: bool,
    ) -> tuple[Problem, int, int] | tuple[Problem, int, int, str]:
        """What this rank can see wrong with its own part of the step: its stages, its inputs,
        and its order (a learner's schedule may be wrong; then also why, for this rank's
        message)."""
        m = self.n_microbatches
        if self.setup_problem:
            return Problem.BAD_STAGES, 0, 0, self.setup_problem
        if len(self.stages) == 1:  # its actions are named as written: F0, not F0@0
            own = self.stage.stage_index
            problem = order_problem([a._replace(stage=None) for a in order if a.stage == own], m)
            strangers = [str(a) for a in order if a.stage != own]
            problem = problem or (f"{strangers[0]} is not this rank's" if strangers else None)
        else:
            problem = order_problem(order, m, [s.stage_index for s in self.stages])
        if problem is not None:
            return Problem.BAD_ORDER, 0, 0, problem
        if self.has_first_stage:
            if not args:
                return Problem.NO_INPUT, 0, 0
            if not all(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
                return Problem.INPUT_NOT_TENSORS, 0, 0
            size = next((a.shape[0] for a in args if a.shape[0] % m), None)
            if size is not None:
                return Problem.INPUT_NOT_DIVISIBLE, size, m
            shapes = tuple((a.shape[0] // m, *a.shape[1:]) for a in args)
            if self._first_microbatch_shapes is None:
                self._first_microbatch_shapes = shapes
            elif shapes != self._first_microbatch_shapes:
                first = self._first_microbatch_shapes
                return Problem.INPUT_SHAPE_CHANGED, shapes[0][0], first[0][0]
        elif args:
            return Problem.INPUT_NOT_ON_FIRST, 0, 0
        if self.has_last_stage:
            if target is not None and self.loss_fn is None:
                return Problem.TARGET_WITHOUT_LOSS_FN, 0, 0
            if target is None and backward:
                return Problem.NO_TARGET, 0, 0
            if target is not None and target.shape[0] % m:
                return Problem.TARGET_NOT_DIVISIBLE, target.shape[0], m
            if losses is not None and target is None:
                return Problem.NO_LOSSES_TO_FILL, 0, 0
        return Problem.NONE, 0, 0


def _detached(output: torch.Tensor | Activation) -> torch.Tensor | Activation:
    return tuple(t.detach() for t in output) if isinstance(output, tuple) else output.detach()


def _merged(outputs: list[torch.Tensor | Activation]) -> torch.Tensor | Activation:
    """The microbatches' outputs as the batch's, each tensor concatenated along dim 0 (torch's
    default merge)."""
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outputs))
    return torch.cat(outputs)


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
