"""MiniDDP, the top rung: torch's layout plus what real training needs, and clear errors.

Rung 7 of `miniddp/steps/` (torch's layout, no_sync, unused parameters, comm hooks and
gradient_as_bucket_view) plus what production needs: every rank checked to hold the same model,
the named faults of one wait seam, uneven inputs (Join), static_graph, mixed precision. Its
whole life in one file, the states of each forward/backward pair named by `Phase`:

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
(layout.py, bucket.py). Each bucket travels through the `Reducer` it holds (default_hooks.py):
the process group, a comm hook if one is registered, the wait seam.

What changes that life is an object MiniDDP holds rather than code spread through it: under
Join, `join_hook()`'s ShadowsTraining (join.py) answers, on a rank out of batches, every
collective the others' forward and backward issue; with static_graph, a `StaticGraph`
(static_graph.py) says when a gradient is ready; with mixed_precision, `ComputeCopies`
(compute_copies.py) puts bf16 copies of the fp32 masters in the module and hands each gradient
to its master; an instrument's `observer` (observe/events.py) hears each step's moments.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from miniddp.data_parallel.arguments import DeprecatedName, ParamsToIgnore, buffer_sync, group_of
from miniddp.data_parallel.autograd_graph import (
    ParameterUsage,
    hook_every_parameter,
    parameters_not_reached,
    when_backward_reaches,
)
from miniddp.data_parallel.bucket import BucketInfo
from miniddp.data_parallel.compute_copies import ComputeCopies, MixedPrecision
from miniddp.data_parallel.default_hooks import CommHook, Reducer
from miniddp.data_parallel.join import ShadowsTraining, any_rank_syncs, highest_rank_where
from miniddp.data_parallel.layout import BucketLayout
from miniddp.data_parallel.refusals import (
    armed_twice,
    gradient_after_sync,
    gradient_twice,
    join_with_skipped_buckets,
    no_gradient,
    no_gradient_unlike_the_first,
    not_mixed_precision,
)
from miniddp.data_parallel.static_graph import FINDS_UNUSED_ITSELF, StaticGraph
from miniddp.job.env import HOW_TO_LAUNCH
from miniddp.observe.events import NO_OBSERVER, Observer
from miniddp.same_model import (
    broadcast_from_rank0,
    check_wrappable,
    verify_same_model_on_every_rank,
)


class Phase(Enum):
    """Where the current forward/backward pair stands: what a gradient hook must do."""

    LOCAL = "gradients only accumulate locally (inside no_sync, or no synced forward yet)"
    ARMED = "a synced forward ran: its backward will reduce"
    REDUCING = "backward is filling and launching buckets"
    SYNCED = "this forward's gradients are averaged; another backward through it is an error"


class MiniDDP(nn.Module, Joinable):
    """Wrap `module` so that `loss.backward()` leaves gradients averaged over all ranks, used
    exactly like torch's DistributedDataParallel. Where torch is silent about a mistake, MiniDDP
    raises: a parameter that got no gradient (at the end of that backward, not the next forward),
    a model that differs across ranks (on every rank), a second backward through one forward."""

    claims = frozenset(
        {"batchnorm", "mixed-dtypes", "torch-layout", "no-sync", "find-unused-parameters"}
        | {"comm-hook", "gradient-as-bucket-view"}
    )
    broadcast_buffers = DeprecatedName("forward_sync_buffers")  # torch 2.13's old name

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        forward_sync_buffers: bool | None = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)  # nn.Module's __init__ does not call it (torch's DDP does this)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise not_mixed_precision(mixed_precision)
        if not dist.is_initialized():
            raise RuntimeError(f"MiniDDP needs a process group, and there is none. {HOW_TO_LAUNCH}")
        self.module = module
        process_group = group_of(process_group, device_mesh)  # torch 2.13's keywords: arguments.py
        self.device_mesh = device_mesh
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._reducer = Reducer(process_group)  # every bucket's: the group, the wait seam
        buffers = buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.forward_sync_buffers = buffers.at_forward
        self.find_unused_parameters = find_unused_parameters
        # Skip the all-reduce of a bucket no parameter of which this backward reaches (torch's
        # meaning: decided on each rank alone, so every rank must leave the same ones unused).
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        ignored = ParamsToIgnore.of(module)  # torch's: someone else reduces them
        self.parameters_to_ignore = ignored.names
        named = check_wrappable(module, ignored.names)  # a tied parameter once
        self.param_names, self.params = [n for n, _ in named], [p for _, p in named]
        self.mixed_precision = mixed_precision
        self._params_to_sync = ignored.others  # frozen ones too: what makes replicas equal
        cast = self.params + ignored.trainable  # mixed precision casts the ignored ones too
        self._copies = ComputeCopies(module, mixed_precision, cast) if mixed_precision else None
        # The autograd graph's leaves: the parameters, or under mixed precision their copies.
        self._leaves = self._copies.copies_of(self.params) if self._copies else self.params
        reduce_dtype = mixed_precision.reduce_dtype if mixed_precision else None  # the buckets'
        self._layout = BucketLayout(
            self.params,
            bucket_cap_mb,
            find_unused_parameters,
            gradient_as_bucket_view,
            reduce_dtype,
            self._reducer,
        )
        # Settings that shape the sequence of collectives must agree too, or ranks would issue
        # different all-reduces and gloo would abort or hang instead of explaining.
        caps_in_bytes = (self._layout.first_cap, self._layout.cap)
        settings = {
            "bucket_cap_mb": caps_in_bytes,
            "buffers": buffers,
            "find_unused_parameters": find_unused_parameters,
            "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
            "static_graph": static_graph,
            "mixed_precision": mixed_precision,
        }
        self._buffers_to_sync = [b for n, b in module.named_buffers() if n not in ignored.names]
        if init_sync:  # False: the caller vouches that every rank already holds the same model
            verify_same_model_on_every_rank(named, settings, process_group)
            # Every replica starts from rank 0's weights (and buffers), whatever seed each used.
            buffers_now = self._buffers_to_sync if buffers.at_construction else []
            everything = [*self._params_to_sync, *buffers_now]
            what = "parameters and buffers"
            broadcast_from_rank0(everything, what, process_group, self._reducer.wait)
        self.all_reduce_count = 0
        self.observer: Observer = NO_OBSERVER  # instruments attach theirs (observe/events.py)
        self._divide_by = self.world_size  # 1 once a comm hook does the averaging
        self._divide_by_initial_world_size = True  # Join's option: join_hook() sets it
        self._static_graph: StaticGraph | None = None
        self._usage = ParameterUsage(len(self.params))
        # torch's DDP's public names (Join's hook and code written for torch's DDP set them):
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # buffers are refreshed after a synced forward
        self._reset_backward(Phase.LOCAL)
        on_ready = self._on_gradient_ready
        if self._copies is not None:  # each copy's gradient goes to its master, then on_ready
            on_ready = self._copies.fold_then(on_ready)
        self._hooks = hook_every_parameter(module, self._leaves, on_ready)
        if self._copies is not None:  # the ignored: folded into their masters, not reduced
            self._hooks += self._copies.fold_alone(range(len(self.params), len(cast)))
        if static_graph:
            self._set_static_graph()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._hooks:
            raise RuntimeError("A newer MiniDDP wraps this module and owns its hooks: use it.")
        self._tell_join_this_rank_trains()  # outside a Join: nothing
        if self._phase is Phase.REDUCING and torch.is_grad_enabled():
            self._abandon_unfinished_backward()
        if self._layout.rebuild_due and torch.is_grad_enabled():
            self._rebuild_buckets()
        self._sync_buffers(training=True)
        self.observer.note("forward", "start")
        if self._copies is not None:
            inputs, kwargs = self._copies.before_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        if self._copies is not None:
            self._copies.after_forward(output)  # the masters back now, or when backward ends
        # Whether this forward's backward synchronizes is decided now, at forward time: that is
        # why the forward must run inside `no_sync()` for accumulation to skip communication.
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = synced
        self._phase = Phase.ARMED if synced else Phase.LOCAL
        if not synced and torch.is_grad_enabled():
            self.observer.note_when_backward_starts(output)
        if synced and self.find_unused_parameters:
            self._unused_in_forward = parameters_not_reached(output, self._leaves)
        if synced:
            # Queue the end-of-backward callback when backward reaches this output: it then belongs
            # to the outermost backward, even if a checkpointed block runs an inner one first.
            when_backward_reaches(output, self._start_reducing)
        self.observer.note("forward", "end")
        return output

    def prepare_for_backward(self, output: Any) -> None:
        """Arm the reduction for the next backward through `output`, run inside `no_sync()`: a
        pipeline reduces at its last microbatch's backward (pipeline/stage.py; torch's calls its
        DDP's `reducer.prepare_for_backward`). A synced forward's arming, less the buffers'."""
        if self._phase in (Phase.ARMED, Phase.REDUCING):
            raise armed_twice()
        self._phase = Phase.ARMED
        if self.find_unused_parameters:
            self._unused_in_forward = parameters_not_reached(output, self._leaves)
        when_backward_reaches(output, self._start_reducing)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards run inside this block skip the all-reduce;
        the first forward+backward outside it then reduces the whole accumulated `.grad`."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: the end of backward already waited for every bucket."""
        if self._phase is Phase.REDUCING:
            raise RuntimeError("A backward pass is still reducing gradients; let it finish first.")

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace what happens to a full bucket: `hook(state, bucket) -> Future[Tensor]`, as in
        torch. The bucket holds this rank's own gradients, NOT divided by the world size: the
        hook averages. Register once, before the first backward."""
        if self._reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per wrapper.")
        if self._phase is not Phase.LOCAL or self.all_reduce_count:
            raise RuntimeError("Register the comm hook before the first backward pass.")
        self._reducer.comm_hook = (state, hook)
        self._divide_by = 1

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced forward (third with static_graph): rank 0's order."""
        order = torch.tensor(self._layout.ready_order, device=self.params[0].device)
        broadcast_from_rank0([order], "the ready order", self.process_group, self._reducer.wait)
        self._layout.rebuild(order.tolist())
        self.observer.note("rebuild", f"{len(self._layout.buckets)} buckets")

    def _start_reducing(self) -> None:
        """The first sign of a synced backward: queue the wait for its end, and mark the
        parameters this forward's graph never reaches (their buckets must still fill)."""
        if self._phase is not Phase.ARMED:
            return
        self._phase = Phase.REDUCING
        self.observer.note("backward", "start")
        Variable._execution_engine.queue_callback(self._finish_backward)
        unused = set(self._unused_in_forward)
        if self.skip_all_reduce_unused_params and self.find_unused_parameters:
            for index in self._layout.skip_buckets_within(unused):  # they stay home
                unused.discard(index)
                self._marked_ready[index] = True
        for index in sorted(unused):
            self._mark_ready(index)  # may hold what no_sync accumulated

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if self.find_unused_parameters:
            self._usage.note(index)
        if self._phase is Phase.SYNCED:
            raise gradient_after_sync(self.param_names[index])
        self._start_reducing()  # in case backward reached a parameter before the output
        if self._phase is Phase.LOCAL:
            if self._copies is not None:  # no average will come: the fold was the last write
                self._copies.gradient_written(param)
            return
        if self._static_graph is not None and not self._static_graph.last_hook(index):
            return  # static_graph: ready after as many hooks as the first backward had
        self._layout.record_ready(index)
        self.observer.note("hook", self.param_names[index])
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy one gradient into its bucket; once the bucket is full, launch what can go."""
        if self._marked_ready[index]:
            raise gradient_twice(self.param_names[index])
        self._marked_ready[index] = True
        bucket, position = self._layout.slot[index]
        bucket.add(position, self._divide_by)
        if bucket.is_full:
            self.observer.note("ready", f"bucket {bucket.index}")
            self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Launch buckets strictly in index order, so every rank issues the same collectives in
        the same sequence even if its gradients arrive in a different order."""
        buckets = self._layout.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].is_full:
            bucket = buckets[self._next_bucket]
            if not bucket.skipped:
                self.observer.note("launch", f"bucket {bucket.index}")
                bucket.launch()
                self.all_reduce_count += 1
                self.observer.note_when_done(bucket.pending, "reduced", f"bucket {bucket.index}")
            self._next_bucket += 1

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done."""
        self.observer.note("backward", "end")
        first_static = self._static_graph_first_backward_ends()  # counted hooks, found usage
        missing = [i for i, ready in enumerate(self._marked_ready) if not ready]
        if missing and self._static_graph is not None and not first_static:
            self._abandon_unfinished_backward()
            raise no_gradient_unlike_the_first(self.param_names[i] for i in missing)
        if missing and not (self.find_unused_parameters or first_static):
            self._abandon_unfinished_backward()
            raise no_gradient(self.param_names[i] for i in missing)
        for index in missing:  # reachable from the output, yet no gradient came: unused too
            self._mark_ready(index)
        self._launch_full_buckets()  # nothing left to launch, unless a subclass held launches
        # Parameters no rank used keep .grad (None stays None): static_graph's first backward
        # learnt which; find_unused_parameters asks every backward.
        used = None if self._static_graph is None else self._static_graph.used_on_any_rank
        if self.find_unused_parameters:
            used = self._usage.on_any_rank(
                self.params[0].device, self.process_group, self._reducer.wait
            )
        for bucket in self._layout.buckets:
            # Each bucket goes back to `.grad` as soon as it arrives, while later ones travel.
            bucket.wait()
            self.observer.note("wait", f"bucket {bucket.index}")
            bucket.write_back(used)
            if self._copies is not None:  # each master holds its average now
                self._copies.averaged(bucket.param_indices, bucket.params, used)
        self._reset_backward(Phase.SYNCED)
        self.observer.note("sync", "end")

    def _abandon_unfinished_backward(self) -> None:
        """A backward raised halfway (on every rank, or the collectives would not match): let
        what it launched finish, then start clean, so a fresh forward works again."""
        for bucket in self._layout.buckets[: self._next_bucket]:
            bucket.wait()
        self._layout.ready_order.clear()
        self._usage.clear()
        self._reset_backward(Phase.LOCAL)

    def _reset_backward(self, phase: Phase) -> None:
        self._phase = phase  # and every bucket empty, no parameter marked ready
        # What the next backward won't reach (static_graph's first backward found it; unused
        # parameters are found in each forward) fires no hook: last in the rebuild, by index.
        self._unused_in_forward: list[int] = []
        if self._static_graph is not None:
            self._unused_in_forward = self._static_graph.start_over()
            order = self._layout.ready_order
            if order and not self._layout.has_rebuilt:
                order.extend(i for i in self._unused_in_forward if i not in order)
        self._marked_ready = [False] * len(self.params)
        self._next_bucket = 0
        for bucket in self._layout.buckets:
            bucket.reset()

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """`with model.join(): for batch in my_batches: ...` trains on uneven inputs, as torch's
        `DistributedDataParallel.join` does (the arguments are Join's; ShadowsTraining, join.py)."""
        divisor = {"divide_by_initial_world_size": divide_by_initial_world_size}  # join_hook's
        return Join([self], enable, throw_on_early_termination, **divisor)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What this rank runs once it is out of batches while others train (Joinable)."""
        if self.skip_all_reduce_unused_params and self.find_unused_parameters:
            raise join_with_skipped_buckets()  # on every rank: each builds the Join
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return ShadowsTraining(self)

    @property
    def join_device(self) -> torch.device:
        return self.params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _tell_join_this_rank_trains(self) -> None:
        """At the start of each forward under a Join: count in the ranks still training (and
        raise on every rank if one has joined and `throw_on_early_termination`), choose the
        divisor, and say whether this forward's backward will sync. Outside a Join: nothing."""
        if not self._join_config.enable:
            return
        still_training = Join.notify_join_context(self)  # an all-reduce of 1 (0 from joiners)
        if self._reducer.comm_hook is None:  # (a comm hook averages; the bucket is not divided)
            self._divide_by = self.world_size
            if still_training is not None and not self._divide_by_initial_world_size:
                still_training.wait()
                self._divide_by = int(still_training.get_future().value()[0].item())
        this_rank_syncs = torch.is_grad_enabled() and self.require_backward_grad_sync
        any_rank_syncs(this_rank_syncs, self.join_device, self.process_group)

    def _sync_buffers(self, training: bool) -> None:
        """After a synced forward (with forward_sync_buffers), every buffer from rank 0: replicas
        compute with the same BatchNorm statistics. Under Join rank 0 may have joined with stale
        ones: they come from the highest rank still `training` (a joined rank passes False)."""
        buffers, group, joining = self._buffers_to_sync, self.process_group, self._join_config
        if not (self.forward_sync_buffers and self.require_forward_param_sync and buffers):
            return
        source = highest_rank_where(training, self.join_device, group) if joining.enable else 0
        broadcast_from_rank0(buffers, "buffers", group, self._reducer.wait, source)

    def joined_forward(self, any_rank_syncs: bool) -> None:
        """Join's side (join.py): a forward's collectives, for a rank with no batch left."""
        if self._layout.rebuild_due:
            self._rebuild_buckets()
        self._sync_buffers(training=False)
        self.require_forward_param_sync = any_rank_syncs

    def joined_backward(self) -> None:
        """Join's side: a synced backward's collectives, for a rank with no batch left."""
        # static_graph's first synced backward asks which parameters any rank used before its
        # buckets go; a rank that joined before its own first one answers "none" (and learns).
        first_static = self._static_graph_first_backward_ends()
        shadows = [bucket.shadow(self.params) for bucket in self._layout.buckets]  # zeros
        for shadow in shadows:
            shadow.launch()
        for shadow in shadows:
            shadow.wait()
        if self.find_unused_parameters:
            self._usage.resend_last(self.join_device, self.process_group, self._reducer.wait)
        # Joined before seeing any order: it offers registration order to the rebuild, as torch's
        # does (under static_graph, after the counting backward, as the others record theirs).
        layout = self._layout
        if not layout.has_rebuilt and not layout.ready_order and not first_static:
            layout.ready_order = list(range(len(self.params)))

    def copy_model_from(self, source: int) -> None:
        """Join's side: at the end, rank `source`'s parameters (and buffers), on every rank."""
        buffers = self._buffers_to_sync if self.forward_sync_buffers else []
        state = [*self._params_to_sync, *buffers]
        what = "the final model (Join)"
        broadcast_from_rank0(state, what, self.process_group, self._reducer.wait, source)

    _set_params_and_buffers_to_ignore_for_model = staticmethod(ParamsToIgnore.set_for_model)

    @property
    def static_graph(self) -> bool:
        return self._static_graph is not None

    def _set_static_graph(self) -> None:
        """Declare the graph static (torch's name, for code written against torch's DDP): from
        now on a `StaticGraph` says when each gradient is ready (static_graph.py)."""
        if self._static_graph is not None:
            warnings.warn("static_graph is already True; nothing to do.", stacklevel=2)
            return
        if self.all_reduce_count:
            raise RuntimeError("Set static_graph before the first backward pass, not after.")
        if self.find_unused_parameters:
            warnings.warn(FINDS_UNUSED_ITSELF, stacklevel=2)
            self.find_unused_parameters = False
            self._layout.start_over_for_static_graph()
        self._static_graph = StaticGraph(self.param_names)

    def _static_graph_first_backward_ends(self) -> bool:
        """At the end of each synced backward: True if it was static_graph's first, which only
        counted hooks and learnt which parameters some rank used (static_graph.py)."""
        graph, group, wait = self._static_graph, self.process_group, self._reducer.wait
        if graph is None:
            return False
        return graph.first_backward_ends(self._usage, self.join_device, group, wait)

    @property
    def buckets(self) -> list[BucketInfo]:
        """The current bucket layout, in launch order, described for printing."""
        return self._layout.describe(self.param_names)

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._layout.has_rebuilt

    def bucket_state(self) -> dict[str, Any]:
        """The bucket layout by parameter name, for checkpoints (see BucketLayout.state)."""
        return self._layout.state(self.param_names)

    def load_bucket_state(self, state: dict[str, Any]) -> None:
        """Adopt a layout saved by `bucket_state()` (the same on every rank)."""
        self._layout.load_state(state, self.param_names)  # fresh, empty buckets
