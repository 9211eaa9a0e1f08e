"""MiniDDP, the top rung: torch's layout plus what real training needs, and clear errors.

Rung 4 of `miniddp/steps/` plus no_sync, unused parameters, buffers, comm hooks,
gradient_as_bucket_view, uneven inputs (Join) and static_graph; its whole life in one file:

    construct   check every rank has the same model, copy rank 0's weights to everyone,
                lay gradients out in buckets, put a hook on every parameter
    forward     (re)build buckets once, refresh buffers from rank 0, run the model, and decide
                whether the coming backward synchronizes (not inside `no_sync()`)
    backward    each parameter's hook copies its gradient, scaled by 1/W, into its bucket; a full
                bucket starts an async all-reduce at once, while backward keeps computing
    wait        when backward ends, a queued callback waits for the buckets in order and writes
                each one's averages back into `.grad` as soon as it arrives
So gradients are averaged by the time `loss.backward()` returns, bit for bit as in torch's
DistributedDataParallel: the layout, the 1/W scaling and the launch order follow torch's rules
(miniddp/layout.py, miniddp/buckets.py; Join: miniddp/join.py; miniddp/static_graph.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.buckets import Bucket
from miniddp.comm_hooks import CommHook, GradBucket
from miniddp.env import HOW_TO_LAUNCH
from miniddp.events import EventRecorder
from miniddp.faults import wait_for
from miniddp.join import JoinsUnevenInputs
from miniddp.layout import BucketLayout, ShowsItsBuckets
from miniddp.model_checks import (
    ParameterUsage,
    broadcast_from_rank0,
    check_wrappable,
    hook_every_parameter,
    parameters_not_reached,
    verify_same_model_on_every_rank,
    when_backward_reaches,
)
from miniddp.static_graph import MayHaveStaticGraph


class Phase(Enum):
    """Where the current forward/backward pair stands: what a gradient hook must do."""

    LOCAL = "gradients only accumulate locally (inside no_sync, or no synced forward yet)"
    ARMED = "a synced forward ran: its backward will reduce"
    REDUCING = "backward is filling and launching buckets"
    SYNCED = "this forward's gradients are averaged; another backward through it is an error"


class MiniDDP(nn.Module, EventRecorder, ShowsItsBuckets, JoinsUnevenInputs, MayHaveStaticGraph):
    """Wrap `module` so that `loss.backward()` leaves gradients averaged over all ranks, used
    exactly like torch's DistributedDataParallel. Where torch is silent about a mistake, MiniDDP
    raises: a parameter that got no gradient (at the end of that backward, not the next forward),
    a model that differs across ranks (on every rank), a second backward through one forward."""

    claims = frozenset({"batchnorm", "mixed-dtypes", "torch-layout", "no-sync", "comm-hook",
                        "find-unused-parameters", "gradient-as-bucket-view"})  # fmt: skip
    # False (the benchmark's "deferred" ablation) holds launches until backward ends: no overlap.
    launch_during_backward = True

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"MiniDDP needs a process group, and there is none. {HOW_TO_LAUNCH}")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        # Only parameters that require grad are reduced, and a tied weight only once: it is one
        # variable with one gradient. `named_parameters()` walks modules in registration order
        # and skips repeats, as torch's reducer does.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        check_wrappable(module, named)
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._layout = BucketLayout(
            self.params, bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view
        )
        # Settings that shape the sequence of collectives must agree too, or ranks would issue
        # different all-reduces and gloo would abort or hang instead of explaining.
        caps_in_bytes = (self._layout.first_cap, self._layout.cap)
        settings = {"bucket_cap_mb": caps_in_bytes, "broadcast_buffers": broadcast_buffers,
                    "find_unused_parameters": find_unused_parameters,
                    "static_graph": static_graph}  # fmt: skip
        verify_same_model_on_every_rank(named, settings, process_group)
        self._buffers_to_sync = list(module.buffers())
        everything = [*module.parameters(), *self._buffers_to_sync]
        broadcast_from_rank0(everything, "parameters and buffers", process_group, self._wait)
        self.all_reduce_count = 0
        self._start_event_log()
        self._comm_hook: tuple[Any, CommHook] | None = None
        self._divide_by = self.world_size  # 1 once a comm hook does the averaging
        self._usage = ParameterUsage(len(self.params))
        self._require_backward_grad_sync = True  # False inside no_sync()
        self._require_forward_param_sync = True  # buffers are refreshed after a synced forward
        self._reset_backward(Phase.LOCAL)
        self._hooks = hook_every_parameter(module, self.params, self._on_gradient_ready)
        if static_graph:
            self._set_static_graph()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._hooks:
            raise RuntimeError("A newer MiniDDP wraps this module and owns its hooks: use it.")
        self._tell_join_this_rank_trains()  # under Join only (miniddp/join.py)
        if torch.is_grad_enabled():
            if self._phase is Phase.REDUCING:
                self._abandon_unfinished_backward()
            if self._layout.rebuild_due:
                self._rebuild_buckets()
        self._sync_buffers(training=True)  # after a synced forward, if broadcast_buffers
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        # Whether this forward's backward synchronizes is decided now, at forward time: that is
        # why the forward must run inside `no_sync()` for accumulation to skip communication.
        synced = torch.is_grad_enabled() and self._require_backward_grad_sync
        self._require_forward_param_sync = synced
        self._phase = Phase.ARMED if synced else Phase.LOCAL
        if not synced and self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
        if synced:
            if self.find_unused_parameters:
                self._unused_in_forward = parameters_not_reached(output, self.params)
            # Queue the end-of-backward callback when backward reaches this output: it then belongs
            # to the outermost backward, even if a checkpointed block runs an inner one first.
            when_backward_reaches(output, self._start_reducing)
        self._note("forward", "end")
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards run inside this block skip the all-reduce;
        the first forward+backward outside it then reduces the whole accumulated `.grad`."""
        previous = self._require_backward_grad_sync
        self._require_backward_grad_sync = False
        try:
            yield
        finally:
            self._require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """The ladder's protocol (CS336's name): nothing left to do, backward's callback waited."""
        if self._phase is Phase.REDUCING:
            raise RuntimeError("A backward pass is still reducing gradients; let it finish first.")

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace what happens to a full bucket: `hook(state, bucket) -> Future[Tensor]`, as in
        torch (whose hooks work too). The bucket holds this rank's own gradients, NOT divided by
        the world size: the hook averages. Register once, before training."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per MiniDDP.")
        if self._phase is not Phase.LOCAL or self.all_reduce_count:
            raise RuntimeError("Register the comm hook before the first backward pass.")
        self._comm_hook = (state, hook)
        self._divide_by = 1

    def _start_reducing(self) -> None:
        """The first sign of a synced backward: queue the wait for its end, and mark the
        parameters this forward's graph never reaches (their buckets must still fill)."""
        if self._phase is not Phase.ARMED:
            return
        self._phase = Phase.REDUCING
        self._note("backward", "start")
        Variable._execution_engine.queue_callback(self._finish_backward)
        for index in self._unused_in_forward:
            self._mark_ready(index)  # may hold what no_sync accumulated

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if self.find_unused_parameters:
            self._usage.note(index)
        if self._phase is Phase.SYNCED:
            raise RuntimeError(
                f"Gradient of '{self.param_names[index]}' arrived after this forward's "
                "gradients were already synchronized: backward ran twice on one synced "
                "forward, and the second result would stay unsynchronized. Run a new forward "
                "for each backward, or put the forward inside no_sync() to accumulate."
            )
        self._start_reducing()  # in case backward reached a parameter before the output
        if self._phase is Phase.LOCAL:
            return
        if self._static_graph and not self._static_graph.last_hook(index):
            return  # static_graph: ready after as many hooks as the first backward had
        self._layout.record_ready(index)
        self._note("hook", self.param_names[index])
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy one gradient into its bucket; once the bucket is full, launch what can go."""
        if self._marked_ready[index]:
            raise RuntimeError(
                f"Parameter '{self.param_names[index]}' got its gradient twice in one backward "
                "(reentrant backward: e.g. checkpoint(block, use_reentrant=True) with the block "
                "run twice). Use use_reentrant=False, or MiniDDP(..., static_graph=True) if "
                "every iteration uses the same parameters the same number of times."
            )
        self._marked_ready[index] = True
        bucket, position = self._layout.slot[index]
        bucket.add(position, self._divide_by)
        if bucket.is_full:
            self._note("ready", f"bucket {bucket.index}")
            if self.launch_during_backward:
                self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Launch buckets strictly in index order, so every rank issues the same collectives in
        the same sequence even if its gradients arrive in a different order."""
        buckets = self._layout.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].is_full:
            bucket = buckets[self._next_bucket]
            self._note("launch", f"bucket {bucket.index}")
            bucket.launch(self._all_reduce)
            self.all_reduce_count += 1
            self._note_when_done(bucket.pending, f"bucket {bucket.index}")
            self._next_bucket += 1

    def _all_reduce(self, bucket: Bucket) -> dist.Work | torch.futures.Future:
        if self._comm_hook is None:
            return dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
        state, hook = self._comm_hook
        is_last = bucket.index == len(self._layout.buckets) - 1  # a Join shadow is a copy
        return hook(state, GradBucket(bucket, is_last))

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done."""
        self._note("backward", "end")
        first_static = self._static_graph_first_backward_ends()  # counted hooks, found usage
        missing = [i for i, ready in enumerate(self._marked_ready) if not ready]
        if missing and not (self.find_unused_parameters or first_static):
            self._abandon_unfinished_backward()
            names = ", ".join(self.param_names[i] for i in missing)
            raise RuntimeError(
                f"These parameters got no gradient in this backward pass: {names}. Their "
                "buckets were never all-reduced, so gradients are NOT synchronized. Either make "
                "every parameter take part in computing the loss, freeze the unused ones "
                "(requires_grad=False), or construct MiniDDP(..., find_unused_parameters=True)."
            )
        for index in missing:  # reachable from the output, yet no gradient came: unused too
            self._mark_ready(index)
        self._launch_full_buckets()  # nothing left to launch, unless launch_during_backward=False
        used = self._static_graph_used()  # static_graph's, learnt in its first backward, or None
        if self.find_unused_parameters:  # parameters no rank used keep .grad (None stays None)
            used = self._usage.on_any_rank(self.params[0].device, self.process_group, self._wait)
        for bucket in self._layout.buckets:
            # Each bucket goes back to `.grad` as soon as it arrives, while later ones travel.
            bucket.wait(self._wait)
            self._note("wait", f"bucket {bucket.index}")
            bucket.write_back(used)
        self._reset_backward(Phase.SYNCED)
        self._note("sync", "end")

    def _wait(self, pending: dist.Work | torch.futures.Future, what: str) -> Any:
        """The one wait seam: like `pending.wait()`, but a rank that died, stalled or stopped
        early is named in the error instead of surfacing as a bare gloo timeout (faults.py)."""
        return wait_for(pending, what, self.process_group)

    def _abandon_unfinished_backward(self) -> None:
        """A backward raised halfway (on every rank, or the collectives would not match): let
        what it launched finish, then start clean, so a fresh forward works again."""
        for bucket in self._layout.buckets[: self._next_bucket]:
            bucket.wait(self._wait)
        self._layout.ready_order.clear()
        self._usage.clear()
        self._reset_backward(Phase.LOCAL)

    def _reset_backward(self, phase: Phase) -> None:
        self._phase = phase  # and every bucket empty, no parameter marked ready
        # what the next backward won't reach: static_graph knows it, find_unused's forward finds it
        self._unused_in_forward: list[int] = self._static_graph_start_over()
        self._marked_ready = [False] * len(self.params)
        self._next_bucket = 0
        for bucket in self._layout.buckets:
            bucket.reset()

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced iteration's forward (third with static_graph): rebuild
        from the observed order. Rank 0's wins, so all ranks launch the same buckets."""
        order = torch.tensor(self._layout.ready_order, device=self.params[0].device)
        broadcast_from_rank0([order], "the ready order", self.process_group, self._wait)
        self._layout.rebuild(order.tolist())
        self._note("rebuild", f"{len(self._layout.buckets)} buckets")
