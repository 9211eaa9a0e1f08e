"""The designs MiniDDP is measured against (chapter 04 and `python -m miniddp.bench step`).

    none       NoCommunication: a step as if communication were free, the floor under every design
    naive      NaiveDDP (rung 1): after backward, one blocking all-reduce per gradient
    flat       BucketedDDP (rung 3) with one bucket for everything: a single all-reduce, launched
               when the last gradient arrives, so one latency but no overlap
    async      OverlapDDP (rung 2): every gradient's all-reduce launched from its hook
    deferred   DeferredMiniDDP: MiniDDP's buckets, launched only once backward is over

All but the first are rungs of the ladder (miniddp/steps/) or MiniDDP itself: one copy of each
design. Call `finish_gradient_synchronization()` after every backward (the naive rung averages
there; for the others it is a no-op), and each notes the same events, so `miniddp.observe.timeline`
draws them all.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from miniddp.data_parallel.ddp import MiniDDP
from miniddp.steps import BucketedDDP, NaiveDDP, OverlapDDP


class NoCommunication(NaiveDDP):
    """NaiveDDP minus the gradient all-reduces: local gradients only (not data parallelism!)."""

    claims = frozenset()

    def finish_gradient_synchronization(self) -> None:
        self._note("backward", "end")
        self._note("sync", "end")


class DeferredMiniDDP(MiniDDP):
    """MiniDDP with every bucket's launch held back until backward is over: the same buckets
    and the same all-reduces, minus the overlap. Only the timing differs from MiniDDP."""

    _backward_over = False  # launches go only inside `_finish_backward`

    def _launch_full_buckets(self) -> None:
        if self._backward_over:
            super()._launch_full_buckets()

    def _finish_backward(self) -> None:
        self._backward_over = True
        try:
            super()._finish_backward()  # launches every bucket, in index order
        finally:
            self._backward_over = False


ONE_BUCKET_MB = 2**20  # 1 TiB: every gradient of a dtype in one bucket

BASELINES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "none": NoCommunication,
    "naive": NaiveDDP,
    "flat": partial(BucketedDDP, bucket_cap_mb=ONE_BUCKET_MB),
    "async": OverlapDDP,
}
