"""Rung 1, naive: after backward, one blocking all-reduce per gradient.

Data parallelism in its plainest form. Every rank holds the same model (rank 0's weights are
copied to everyone at construction) and runs it on its own slice of the batch, so each rank's
backward produces its own gradient g_r. Their average

    g = (g_0 + g_1 + ... + g_{W-1}) / W

is the gradient of the loss over the whole global batch, and the same optimizer step on every
rank keeps the replicas identical. The average is one all-reduce: each rank multiplies its
gradient by the float 1/W, then the all-reduce sums (torch's recipe: dividing by W after the sum
differs in the last bit when W is not a power of two).

What it costs: P gradient tensors of N bytes in all are P messages, one after another, all
after backward. With a latency alpha per message and a time beta per byte (a ring all-reduce
moves 2 (W-1)/W of the bytes through each rank):

    communication = P * alpha + 2 (W-1)/W * N * beta,   none of it hidden behind compute.

What it lacks (the next rung, overlap.py, adds it): gradients become ready one by one while
backward runs, yet nothing is sent until the last one exists; the network idles during
backward, and the step then idles while the network works.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp.observe.events import EventRecorder
from miniddp.steps import shared


class NaiveDDP(nn.Module, EventRecorder):
    """Average gradients over ranks with one blocking all-reduce per gradient.

    CALL `finish_gradient_synchronization()` AFTER EVERY `loss.backward()`. Nothing happens
    during backward here: no hooks, no callbacks. Without that call each rank steps with its
    own, unaveraged gradients and the replicas drift apart silently.

    `bucket_cap_mb` is accepted, so that every rung is built the same way, and ignored: there
    are no buckets yet.
    """

    claims = frozenset({"batchnorm", "mixed-dtypes"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "NaiveDDP")
        self.all_reduce_count = 0
        self._start_event_log()
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Each forward updates buffers (BatchNorm's statistics) locally: like torch's DDP, start
        # every forward from rank 0's.
        shared.broadcast_from_rank0(self.module.buffers())
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        if self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
        self._note("forward", "end")
        return output

    def finish_gradient_synchronization(self) -> None:
        """Average every `.grad` over the ranks; call it after each `loss.backward()`.

        `.grad` is taken as it stands, with whatever earlier backwards accumulated into it.
        """
        self._note("backward", "end")  # as far as we know: the caller's backward has returned
        missing = []
        for index, (name, param) in enumerate(zip(self.param_names, self.params)):
            grad = param.grad
            if grad is None:
                # Send zeros anyway: every rank must issue the same all-reduces, or the others
                # would wait forever for this one. Then refuse, below.
                missing.append(name)
                grad = torch.zeros_like(param)
            grad.mul_(1.0 / self.world_size)
            self._note("launch", f"grad {index}")
            dist.all_reduce(grad)  # SUM; returns once every rank's share has arrived
            self.all_reduce_count += 1
            self._note("wait", f"grad {index}")
        if missing:
            raise shared.no_gradient(missing)
        self._note("sync", "end")
