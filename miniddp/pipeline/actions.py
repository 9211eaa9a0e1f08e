"""What a schedule is made of: actions, and what makes a list of them one rank's order.

    F i    the forward of microbatch i
    B i    its whole backward: the input's gradient (sent upstream) and the weights'
    I i    the input's gradient alone (zero-bubble schedules split B in two) ...
    W i    ... and the weights' gradient, later (interleaved.py says why)

An action names its stage too, once a rank holds several (interleaving, stage s on rank s % W);
`stage=None` means "this rank's only stage", so a one-stage order reads `Action("F", 0)`.

A rank's order holds, for every stage it runs and every microbatch i in 0 .. m-1, F i once and
then either B i, or I i and later W i: the backward's two halves, in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
FREES = (BACKWARD, WEIGHT_GRAD)  # the actions after which a microbatch's activations are gone
STAGE_CODE = 1 << 16  # encode(): room for 2^14 microbatches a stage


class Action(NamedTuple):
    """One thing a rank does in a step: a kind (F, B, I, W) of a microbatch, at a stage."""

    kind: str
    microbatch: int
    stage: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + ("" if self.stage is None else f"@{self.stage}")

    def at(self, stage: int) -> Action:
        """This action with its stage named (a one-stage order's None filled in)."""
        return self if self.stage is not None else self._replace(stage=stage)


def order_problem(
    order: Sequence[Action], n_microbatches: int, stages: Sequence[int] | None = None
) -> str | None:
    """Why `order` is not one rank's order of a step (None if it is), for a rank holding
    `stages` (None: one stage, actions naming none)."""
    held = [None] if stages is None else list(stages)
    seen: set[Action] = set()
    for action in order:
        action = Action(*action)
        if action.kind not in KINDS or action.stage not in held:
            where = "" if stages is None else f" of stages {list(stages)}"
            return f"{action} is not an action{where} (kinds F, B, I, W)"
        if not 0 <= action.microbatch < n_microbatches:
            return f"{action} is not an action of microbatches 0 .. {n_microbatches - 1}"
        if action in seen:
            return f"{action} appears twice"
        before = {BACKWARD: FORWARD, INPUT_GRAD: FORWARD, WEIGHT_GRAD: INPUT_GRAD}
        needed = before.get(action.kind)
        if needed and action._replace(kind=needed) not in seen:
            return f"{action} comes before {action._replace(kind=needed)}"
        split, whole = action._replace(kind=INPUT_GRAD), action._replace(kind=BACKWARD)
        if (action.kind == BACKWARD and split in seen) or (
            action.kind == INPUT_GRAD and whole in seen
        ):
            return f"{action}: microbatch {action.microbatch}'s backward is both B and I + W"
        seen.add(action)
    for stage in held:
        for i in range(n_microbatches):
            needs = [Action(FORWARD, i, stage)]
            needs += (
                [Action(k, i, stage) for k in (INPUT_GRAD, WEIGHT_GRAD)]
                if (Action(INPUT_GRAD, i, stage) in seen)
                else [Action(BACKWARD, i, stage)]
            )
            missing = [str(a) for a in needs if a not in seen]
            if missing:
                return f"{', '.join(missing)} missing"
    return None


def encode(order: Sequence[Action], stage: int) -> list[int]:
    """An order as positive integers, to send to the other ranks (0 pads a shorter row); a
    stage-less action is `stage`'s."""
    return [
        1 + KINDS.index(a.kind) + 4 * (a.microbatch + STAGE_CODE * a.at(stage).stage)
        for a in (Action(*action) for action in order)
    ]


def decode(codes: Sequence[int]) -> list[Action]:
    actions = []
    for code in codes:
        if code > 0:
            kind, rest = (code - 1) % 4, (code - 1) // 4
            actions.append(Action(KINDS[kind], rest % STAGE_CODE, rest // STAGE_CODE))
    return actions
