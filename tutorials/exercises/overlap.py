"""Exercise 3 (chapter 02b, rung 2): OverlapDDP, each gradient's all-reduce launched from its hook.

Rung 1 sent nothing until backward was over. Here a hook on every parameter launches that
gradient's all-reduce the moment autograd has accumulated it into `.grad`, without waiting, and
one callback at the end of backward waits for them all. Fill in the TODOs, then check:

    python -m pytest tests/test_ddp_equivalence.py --ddp tutorials/exercises/overlap.py:OverlapDDP \
        --ddp-claims overlap

`--ddp-claims overlap` watches your all-reduces: one launched from a hook must still be in
flight (not waited for) when a later gradient arrives. A hook that waits for its own
all-reduce gets the numbers right and fails it: that is rung 1 again, one gradient at a time.

Stuck? Chapter 02b (tutorials/02b_overlap.py) explains the idea. Only once your own attempt
passes, compare it with rung 2, miniddp/steps/overlap.py.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp.steps import shared


class OverlapDDP(nn.Module):
    """Average gradients with an async all-reduce per gradient, launched from its hook.

    Gradients must be averaged by the time `loss.backward()` returns, as with torch's DDP, so
    `finish_gradient_synchronization()` has nothing left to do. `bucket_cap_mb` is accepted and
    ignored: there are no buckets yet.
    """

    claims = frozenset({"batchnorm", "mixed-dtypes"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "OverlapDDP")
        self._in_flight: list[tuple[int, dist.Work]] = []  # this backward's launches, in order
        # Given (exercise 2 did it by hand): every replica starts from rank 0's weights.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        for index, param in enumerate(self.params):
            # Autograd calls the hook with the parameter, right after adding into param.grad.
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        shared.broadcast_from_rank0(self.module.buffers())  # rank 0's BatchNorm statistics
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: the end of backward already waited for every all-reduce."""

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated.

        TODO 1. Something must wait for this backward's all-reduces once the last gradient is
        in, before `loss.backward()` returns, and a hook cannot know it is the last one. So on
        the first gradient of each backward, arrange for `self._finish_backward` to run when the
        autograd engine is done with this backward: the engine's `queue_callback`, which chapter
        02b's first section names (its --diff flag prints rung 2 whole: keep it for after).
        TODO 2. This gradient's all-reduce must leave now, while backward goes on computing the
        others: launched, not waited for. Scale it as rung 1 did, so the bits stay torch's, and
        keep what you need to wait for it later. The hook is handed the parameter: which tensor
        holds its gradient?
        """
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/overlap.py, chapter 02b): launch this "
            "gradient's all-reduce in OverlapDDP._on_gradient_ready"
        )

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done.

        TODO 3. When this returns, every `.grad` must hold the average: until its all-reduce is
        waited for, a `.grad` may hold anything between this rank's share and the sum. Leave
        nothing behind for the next backward. A parameter that got no gradient sent nothing, so
        the ranks may no longer agree: this rung refuses it (`shared.no_gradient(names)`).
        """
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/overlap.py, chapter 02b): wait for every "
            "all-reduce in OverlapDDP._finish_backward"
        )
