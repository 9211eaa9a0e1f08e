"""What every pipeline schedule shares: one step, run as a list of forwards and backwards.

A schedule is an ORDER: for each stage, the sequence of actions F i (forward of microbatch i)
and B i (its backward). GPipe and 1F1B (at the end of this file) differ only there. Everything
else is the same for both, and lives here:

    step(x) / step() / step(target=y, losses=losses)      torch's call, per stage
      check     every stage states what it was given; bad input is refused on all (step_checks)
      split     the batch (first stage) and the target (last) into m equal microbatches
      run       for each action of `order()`: receive what it needs (an activation for F on
                every stage but the first, a gradient for B on every stage but the last),
                compute, and hand its sends to the next action's batch of transfers (p2p.py)
      finish    wait for the sends, report the losses

Gradients: the last stage backpropagates loss_i / m, not loss_i, so after all m microbatches
`.grad` holds sum_i d(loss_i / m)/d theta, the gradient of the batch's mean loss (each loss_i a
mean over its b samples, so mean_i loss_i = mean over all m*b). Each step scales only its own
microbatches: two steps before `optimizer.step()` leave G1 + G2, as one process accumulating
two batches does. Torch's default (`scale_grads=True`) instead divides all of `.grad` by m at the
end of each step, so there the first step's part is divided twice, G1/m + G2. The bits are the
same as torch's within one step whenever m is a power of two (scaling by 2^-k commutes with
rounding); for other m, dividing each loss and dividing the sum round differently, in the last
place. The losses reported are loss_i itself.

Events (`record_events()`, as MiniDDP's; miniddp/pipeline/timeline.py draws them): step
start/end, forward and backward "start i"/"end i", send and recv of each transfer, and idle
start/end around every wait for a receive.

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

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from miniddp.observe.events import EventRecorder
from miniddp.pipeline.actions import BACKWARD, FORWARD, Action, encode, order_problem
from miniddp.pipeline.p2p import Header, Mailbox, Transfer
from miniddp.pipeline.stage import PipelineStage
from miniddp.pipeline.step_checks import Problem, check_on_every_stage, check_orders_together


@dataclass
class StepData:
    """One step's microbatches, and what the last stage collects from them."""

    inputs: list[torch.Tensor | None]  # the first stage's; None elsewhere
    targets: list[torch.Tensor | None]  # the last stage's; None elsewhere
    outputs: list[torch.Tensor] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


class PipelineSchedule(EventRecorder):
    """Runs `stage`'s part of each step in the order `order()` gives. Subclasses define only
    the order; `loss_fn(output, target)` is called on the last stage, once per microbatch."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
        if not callable(loss_fn):
            raise TypeError(
                "loss_fn must be a function loss_fn(output, target) -> scalar tensor, "
                f"called on the last stage; got {loss_fn!r}"
            )
        self.stage = stage
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.mailbox = Mailbox(stage.group, self._note)
        example = stage.input_example
        self._input_header = None if example is None else Header.of(example)
        self._header_sent = stage.next_knows_its_shape
        self._first_microbatch_shape: tuple[int, ...] | None = None
        self._orders_unchecked = True  # the first step checks that the orders cannot deadlock
        self._start_event_log()

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """The shape of this stage's input microbatch, as given or as learnt from the previous
        stage in the first step (None on the first stage, or before the first step)."""
        return None if self._input_header is None else self._input_header.shape

    def order(self) -> list[Action]:
        """This stage's actions in one step, each F i and B i exactly once, F i before B i."""
        raise NotImplementedError

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """One training step of this stage (torch's signature); the last stage returns the
        batch's outputs and fills `losses` with each microbatch's loss. Gradients are left in
        `.grad` (added to what was there), the gradient of the mean loss over the microbatches:
        call the optimizer after it."""
        if len(args) > 1:
            raise TypeError(f"step takes one input tensor (the first stage's), got {len(args)}")
        x = args[0] if args else None
        stage, m = self.stage, self.n_microbatches
        order = self.order()
        found = self._inspect(x, target, order)
        check_on_every_stage(found, m, type(self).__name__, stage.group, stage.device)
        if self._orders_unchecked:  # once: the orders of a schedule do not change
            check_orders_together(encode(order), stage.group, stage.device)
            self._orders_unchecked = False
        data = StepData(
            inputs=list(x.tensor_split(m)) if stage.is_first else [None] * m,
            targets=list(target.tensor_split(m)) if stage.is_last else [None] * m,
        )
        stage.start_step()
        self._note("step", "start")
        sends: list[Transfer] = []
        last_backward = [a for a in order if a.kind == BACKWARD][-1]  # DP x PP reduces there
        for action in order:
            # This action's receive goes out in one batch with the previous action's sends.
            received = self._receive_for(action, sends)
            if action.kind == FORWARD:
                sends = self._forward(data, action.microbatch, received)
            else:
                last = action == last_backward
                sends = self._backward(data, action.microbatch, received, last)
        self.mailbox.post(sends)
        self.mailbox.finish_sends()
        self._note("step", "end")
        if stage.is_last and losses is not None:
            losses.clear()
            losses.extend(data.losses)
        return torch.cat(data.outputs) if stage.is_last else None

    def _receive_for(self, action: Action, sends: list[Transfer]) -> torch.Tensor | None:
        """Post `sends` in one batch with the receive `action` needs, and wait for that receive.
        An action that needs none (F on the first stage, B on the last) returns None, and the
        sends go out alone."""
        stage, i = self.stage, action.microbatch
        if action.kind == FORWARD and not stage.is_first:
            if self._input_header is None:  # the first step: learn the shape first
                self.mailbox.post(sends)
                sends = []
                previous = stage.stage_index - 1
                buffer = Header.buffer(stage.device)
                codes = self.mailbox.receive_now(buffer, previous, "the shape")
                self._input_header = Header.decode(codes)
            buffer = self._input_header.empty(stage.device)
            receive = Transfer(buffer, stage.stage_index - 1, f"activation {i}", is_send=False)
        elif action.kind == BACKWARD and not stage.is_last:
            buffer = torch.empty_like(stage.held[i].output)
            receive = Transfer(buffer, stage.stage_index + 1, f"gradient {i}", is_send=False)
        else:
            self.mailbox.post(sends)
            return None
        work = self.mailbox.post(sends, receive)
        return self.mailbox.wait_receive(work, receive)

    def _forward(self, data: StepData, i: int, received: torch.Tensor | None) -> list[Transfer]:
        stage = self.stage
        self._note("forward", f"start {i}")
        output = stage.forward(i, data.inputs[i] if stage.is_first else received)
        if stage.is_last:
            loss = self.loss_fn(output, data.targets[i])
            stage.keep_loss(i, loss / self.n_microbatches)  # this step's share of the mean
            data.losses.append(loss.detach())
            data.outputs.append(output.detach())
        self._note("forward", f"end {i}")
        if stage.is_last:
            return []
        sends = []
        activation = output.detach().contiguous()
        if not self._header_sent:
            header = Header.of(activation).encode(stage.device)
            sends.append(Transfer(header, stage.stage_index + 1, "the shape", is_send=True))
            self._header_sent = True
        sends.append(Transfer(activation, stage.stage_index + 1, f"activation {i}", True))
        return sends

    def _backward(
        self, data: StepData, i: int, received: torch.Tensor | None, last: bool
    ) -> list[Transfer]:
        stage = self.stage
        self._note("backward", f"start {i}")
        input_grad = stage.backward(i, received, last)
        self._note("backward", f"end {i}")
        if stage.is_first:
            return []
        return [Transfer(input_grad, stage.stage_index - 1, f"gradient {i}", is_send=True)]

    def _inspect(
        self, x: torch.Tensor | None, target: torch.Tensor | None, order: list[Action]
    ) -> tuple[Problem, int, int] | tuple[Problem, int, int, str]:
        """What this stage can see wrong with its own part of the step: its input, and its
        order (a learner's schedule may be wrong; then also why, for this stage's message)."""
        stage, m = self.stage, self.n_microbatches
        problem = order_problem(order, m)
        if problem is not None:
            return Problem.BAD_ORDER, 0, 0, problem
        if stage.is_first:
            if x is None:
                return Problem.NO_INPUT, 0, 0
            if x.shape[0] % m:
                return Problem.INPUT_NOT_DIVISIBLE, x.shape[0], m
            shape = (x.shape[0] // m, *x.shape[1:])
            if self._first_microbatch_shape is None:
                self._first_microbatch_shape = shape
            elif shape != self._first_microbatch_shape:
                return Problem.INPUT_SHAPE_CHANGED, shape[0], self._first_microbatch_shape[0]
        elif x is not None:
            return Problem.INPUT_NOT_ON_FIRST, 0, 0
        if stage.is_last:
            if target is None:
                return Problem.NO_TARGET, 0, 0
            if target.shape[0] % m:
                return Problem.TARGET_NOT_DIVISIBLE, target.shape[0], m
        return Problem.NONE, 0, 0


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
