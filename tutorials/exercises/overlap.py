"""Exercise 2 (chapter 03a): OverlapDDP, each gradient's all-reduce launched from its hook.

Rung 1 sent nothing until backward was over. Here a hook on every parameter launches that
gradient's all-reduce the moment autograd has accumulated it into `.grad`, without waiting, and
one callback at the end of backward waits for them all. Fill in the TODOs, then check:

    python -m pytest tests/test_ddp_equivalence.py --ddp tutorials/exercises/overlap.py:OverlapDDP

Stuck? Chapter 03a (tutorials/03a_overlap.py) explains the idea; the answer is rung 2,
miniddp/steps/overlap.py (`python -m miniddp.steps diff 1 2` shows what it adds to rung 1).
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
        # Given (exercise 1 did it by hand): every replica starts from rank 0's weights.
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

        TODO 1. On the first gradient of a backward (nothing in flight yet), queue
        `self._finish_backward` to run when this backward is over:
        `torch.autograd.Variable._execution_engine.queue_callback(...)`.
        TODO 2. Scale the gradient by 1.0 / W and launch its all-reduce without waiting
        (`dist.all_reduce(..., async_op=True)` returns a Work); remember it in `self._in_flight`.
        Careful: the hook is handed the parameter. Reduce `param.grad`, not `param`.
        """
        raise NotImplementedError(
            "TODO exercise 2 (tutorials/exercises/overlap.py, chapter 03a): launch this "
            "gradient's all-reduce in OverlapDDP._on_gradient_ready"
        )

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done.

        TODO 3. Wait for every launched all-reduce (`work.wait()`), in launch order, and empty
        `self._in_flight` for the next backward. Until the wait, `.grad` may hold anything
        between this rank's share and the sum. If fewer gradients arrived than there are
        parameters, raise `shared.no_gradient(names)`: this rung does not support unused ones.
        """
        raise NotImplementedError(
            "TODO exercise 2 (tutorials/exercises/overlap.py, chapter 03a): wait for every "
            "all-reduce in OverlapDDP._finish_backward"
        )
