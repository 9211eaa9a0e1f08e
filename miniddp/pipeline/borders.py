"""What crosses this rank's borders at each action of a step, and under which tag.

A schedule's action computes at one stage; around it, tensors cross the stage's two borders
(p2p.py moves them):

    F i    receives microbatch i's activation from stage s-1 (all but the first stage), and
           sends its output to stage s+1 (all but the last): one transfer per tensor
    B i    receives the gradients of its output's floating-point tensors from stage s+1 (all
    I i    but the last), and sends those of its input's to stage s-1 (all but the first)
    W i    nothing: the weights' gradient stays on the stage

Before its first activation a stage sends its neighbour a header of their shapes (p2p.Header),
unless the neighbour was given an example input; the receiver learns the shapes from it once and
allocates its buffers from them in every later step, until the first stage's microbatches change
shape (a smaller validation batch under eval()): then every border learns them again.

Each transfer's tag names what it carries, for which microbatch, at which receiving stage, and
which tensor of the tuple: with several stages a rank, two ranks exchange several streams and
must match each receive with its own send, whatever order they are posted in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miniddp.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, Action
from miniddp.pipeline.p2p import MAX_TENSORS, Header, Mailbox, Transfer, as_tuple, carries_gradient
from miniddp.pipeline.stage import Activation, PipelineStage

ACTIVATION, GRADIENT, SHAPE = range(3)  # what a transfer carries, in its tag


@dataclass
class Border:
    """What a stage knows of its input's shape, and whether its next stage knows its own."""

    input_header: Header | None
    header_sent: bool


class Borders:
    """The borders of this rank's `stages`, their transfers posted through `mailbox`."""

    def __init__(
        self, stages: Sequence[PipelineStage], n_microbatches: int, mailbox: Mailbox
    ) -> None:
        self.n_microbatches = n_microbatches
        self.mailbox = mailbox
        self._by_index = {stage.stage_index: stage for stage in stages}
        examples: dict[int, bool] = {}  # every stage of this rank's rounds: given an example?
        for stage in stages:
            examples.update(stage.examples)
        self._borders = {
            s.stage_index: Border(
                None if s.input_example is None else Header.of(s.input_example),
                s.is_last or examples.get(s.stage_index + 1, False),
            )
            for s in stages
        }

    def relearn(self) -> None:
        """Learn every border's shapes again, from a header before the next activation (an
        example given at construction described the old ones): called on every rank at once,
        when the first stage's microbatches change shape."""
        for index, border in self._borders.items():
            stage = self._by_index[index]
            border.input_header = None if not stage.is_first else border.input_header
            border.header_sent = stage.is_last

    def input_header(self, stage_index: int) -> Header | None:
        """The shapes stage `stage_index` receives (None on the first stage, or before the
        first step taught them)."""
        return self._borders[stage_index].input_header

    def receive_for(self, action: Action, sends: list[Transfer]) -> Activation | None:
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

    def activation_sends(self, output: torch.Tensor | Activation, s: int, i: int) -> list[Transfer]:
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
            header = Header.of(activation).encode(self._by_index[s].device)
            sends.append(self._send(header, s, SHAPE, 0))
            border.header_sent = True
        return sends + [self._send(t, s, ACTIVATION, i, k) for k, t in enumerate(activation)]

    def gradient_sends(self, input_grads: Activation, s: int, i: int) -> list[Transfer]:
        """The gradients of stage s's floating-point inputs for microbatch i, to stage s - 1,
        each tagged with its tensor's place in the input tuple (none from the first stage)."""
        if self._by_index[s].is_first:
            return []
        entries = self._borders[s].input_header.entries
        places = [k for k, (dtype, _) in enumerate(entries) if carries_gradient(dtype)]
        return [
            self._send(grad, s, GRADIENT, i, k) for k, grad in zip(places, input_grads, strict=True)
        ]

    def _tag(self, carries: int, i: int, stage: int, k: int) -> tuple[int, str]:
        """The tag of tensor k of what `carries` for microbatch i at `stage` (the receiver), and
        its name for events and messages: "activation 3", "gradient 3 (tensor 1)"."""
        tag = carries + 3 * (k + MAX_TENSORS * (i + self.n_microbatches * stage))
        what = "the shape" if carries == SHAPE else f"{('activation', 'gradient')[carries]} {i}"
        return tag, what + (f" (tensor {k})" if k else "")

    def _receive(self, buffer, peer: int, carries: int, i: int, me: int, k: int = 0) -> Transfer:
        tag, what = self._tag(carries, i, me, k)
        return Transfer(buffer, peer, what, False, self._by_index[me].rank_of(peer), tag)

    def _send(self, tensor, s: int, carries: int, i: int, k: int = 0) -> Transfer:
        """Stage s sends `tensor` down (an activation, the shape) or up (a gradient)."""
        peer = s - 1 if carries == GRADIENT else s + 1
        tag, what = self._tag(carries, i, peer, k)
        return Transfer(tensor, peer, what, True, self._by_index[s].rank_of(peer), tag)
