"""Exercise 1 (chapter 02): NaiveDDP, one blocking all-reduce per gradient, after backward.

Fill in the two TODOs, then check your class with the same property tests the ladder passes:

    python -m pytest tests/test_ddp_equivalence.py --ddp tutorials/exercises/naive.py:NaiveDDP

They train random models on 2 and 3 ranks with your class and compare: every rank must hold the
same replica, the gradients must equal one process training on the global batch (up to rounding),
and with 2 ranks they must be bit for bit those of torch's DistributedDataParallel. A failure
names the parameter, the step, the values expected and got, and what such a gap usually means.

Stuck? Chapter 02 (tutorials/02_naive_ddp.py) explains the idea; the answer is rung 1,
miniddp/steps/naive.py (`python -m miniddp.steps show 1`).
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
        # TODO 1: start every replica equal. Ranks may have built their models from different
        # seeds: overwrite every parameter AND buffer with rank 0's values, on every rank
        # (hint: dist.broadcast(tensor, src=0), under torch.no_grad()).

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Given: like torch's DDP, start every forward from rank 0's buffers (BatchNorm's running
        # statistics), since each rank's forward updates its own.
        shared.broadcast_from_rank0(self.module.buffers())
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Replace every `param.grad` by its average over the ranks; called after backward.

        TODO 2. The average of W gradients is sum(g_r) / W. Compute it as torch's DDP does, to
        get torch's bits: multiply each gradient by the float 1.0 / W, then dist.all_reduce it
        (SUM, in place). Dividing after the sum gives other last bits when W = 3. A parameter
        whose .grad is None got no gradient: this rung may refuse it (shared.no_gradient), but
        only after sending zeros in its place, or the other ranks wait for it forever.
        """
        raise NotImplementedError(
            "TODO exercise 1 (tutorials/exercises/naive.py, chapter 02): average every "
            "gradient over the ranks in NaiveDDP.finish_gradient_synchronization"
        )
