"""What a schedule is made of: actions, F i (the forward of microbatch i) and B i (its backward),
and what makes a list of them a valid order for one stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

FORWARD, BACKWARD = "F", "B"


class Action(NamedTuple):
    """One thing a stage does in a step: "F" (forward) or "B" (backward) of a microbatch."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def order_problem(order: Sequence[Action], n_microbatches: int) -> str | None:
    """Why `order` is not one stage's order of a step (None if it is): it must hold F i and B i
    exactly once for each microbatch i in 0 .. m-1, and F i before B i."""
    expected = {Action(kind, i) for kind in (FORWARD, BACKWARD) for i in range(n_microbatches)}
    seen: set[Action] = set()
    for action in order:
        action = Action(*action)
        if action not in expected:
            return f"{action} is not an action of microbatches 0 .. {n_microbatches - 1}"
        if action in seen:
            return f"{action} appears twice"
        if action.kind == BACKWARD and Action(FORWARD, action.microbatch) not in seen:
            return f"{action} comes before F{action.microbatch}"
        seen.add(action)
    missing = sorted(expected - seen, key=lambda a: (a.kind != FORWARD, a.microbatch))
    return f"{', '.join(map(str, missing))} missing" if missing else None


def encode(order: Sequence[Action]) -> list[int]:
    """F i -> i + 1, B i -> -(i + 1): an order as integers, to send to the other stages."""
    return [a.microbatch + 1 if a.kind == FORWARD else -(a.microbatch + 1) for a in order]


def decode(codes: Sequence[int]) -> list[Action]:
    return [Action(FORWARD, c - 1) if c > 0 else Action(BACKWARD, -c - 1) for c in codes]
