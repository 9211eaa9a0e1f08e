"""Mistake: the gradients read before the all-reduce's wait.

Symptom: sometimes nothing, sometimes each rank steps on its own share g_r / W, or on a sum
half done: an async all-reduce writes into .grad whenever gloo gets to it, and whoever reads
.grad first wins. A race: results change from run to run, and a fast network hides it. The
property checks catch it when the race is sure to be lost: a rank whose peer starts its
backward late reads its own share. Then the replicas' gradients differ ("one not waited for").

Why: `dist.all_reduce(t, async_op=True)` returns at once, before any byte has moved; only
`work.wait()` says the sum is in `t`. Hooks launch during backward; something must wait before
anyone reads .grad, and the optimizer reads it right after `loss.backward()` returns.

How torch avoids it: a callback queued on the autograd engine runs at the end of backward and
waits for every bucket, so `loss.backward()` returns with .grad final. Rungs 2-4 and MiniDDP
do the same; rung 1 simply blocks.

This is rung 2 (OverlapDDP) whose end-of-backward callback forgets its works.
"""

from __future__ import annotations

from miniddp.steps import OverlapDDP


class ReadsBeforeWait(OverlapDDP):
    def _finish_backward(self) -> None:
        self._in_flight = []  # the mistake: no work.wait() for any of them
