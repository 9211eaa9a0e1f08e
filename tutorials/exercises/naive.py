"""Exercise 2 (chapter 02, rung 1): NaiveDDP, one blocking all-reduce per gradient, after backward.

Fill in the two TODOs, then check your class with the same property tests the ladder passes:

    python -m pytest tests/test_ddp_equivalence.py --ddp tutorials/exercises/naive.py:NaiveDDP

They train random models on 2 and 3 ranks with your class and compare: every rank must hold the
same replica, the gradients must equal one process training on the global batch (up to rounding),
and with 2 ranks they must be bit for bit those of torch's DistributedDataParallel. A failure
names the parameter, the step, the values expected and got, and what such a gap usually means.

Stuck? Chapter 02 (tutorials/02_naive_ddp.py) explains the idea, and the failure says what the
gap usually means. Only once your own attempt passes, compare it with rung 1,
miniddp/steps/naive_ddp.py.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from miniddp.steps import shared


class NaiveDDP(nn.Module):
    """Average gradients over ranks with one blocking all-reduce per gradient.

    The protocol the tests drive: `NaiveDDP(module, bucket_cap_mb=...)`, forward as the module,
    and `finish_gradient_synchronization()` after every `loss.backward()`. `bucket_cap_mb` is
    accepted, so that every rung is built the same way, and ignored: there are no buckets yet.
    """

    claims = frozenset({"batchnorm", "mixed-dtypes"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        # The parameters to average, in registration order, a tied weight once.
        self.param_names, self.params = shared.trainable_parameters(module, "NaiveDDP")
        # TODO 1: every replica must start equal, or averaging gradients keeps them apart
        # forever: the ranks may have built their models from different seeds. Which rank's
        # values win does not matter, as long as every rank ends with the same ones; and the
        # buffers (BatchNorm's statistics) are part of the replica too. Chapter 02, "start
        # equal", shows the collective that does it.

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Given: like torch's DDP, start every forward from rank 0's buffers (BatchNorm's running
        # statistics), since each rank's forward updates its own.
        shared.broadcast_from_rank0(self.module.buffers())
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Replace every `param.grad` by its average over the ranks; called after backward.

        TODO 2. What must hold afterwards: every rank's `.grad` is the mean over the ranks of
        their gradients, so each rank takes the optimizer step one process would take on the
        global batch (chapter 02 derives why the mean, not the sum). The checks also want
        torch's exact bits, and floating-point arithmetic is not associative: find in chapter 02
        in which order torch scales and sums, and do the same.

        Two traps. A collective pairs the ranks' calls by their order: every rank must make the
        same calls in the same order, even for a parameter that got no gradient on this rank
        (`.grad is None`), or the others wait forever; this rung may then refuse such a
        parameter (`shared.no_gradient`). And `dist.all_reduce` works in place.
        """
        raise NotImplementedError(
            "TODO exercise 2 (tutorials/exercises/naive.py, chapter 02): average every "
            "gradient over the ranks in NaiveDDP.finish_gradient_synchronization"
        )
