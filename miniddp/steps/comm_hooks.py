"""Rung 7, comm hooks and gradient_as_bucket_view: what a full bucket does, where .grad lives.

Two of torch's options, both about the bucket. Up to the previous rung (unused.py) a full bucket
always went out as gloo's all-reduce of the average, and each gradient was copied into its
bucket and back out again.

`register_comm_hook(state, hook)` hands the full bucket to `hook(state, bucket)` instead, which
returns a `torch.futures.Future` of the reduced flat tensor: torch's own hooks
(`torch.distributed.algorithms.ddp_comm_hooks`: `allreduce_hook`, `fp16_compress_hook`, ...) and
this project's (`miniddp.data_parallel.default_hooks.all_reduce_hook("ring")`, chapter 01's ring)
run here unchanged, because `GradBucket` below offers torch's `dist.GradBucket` methods. The
protocol's one surprise: the bucket arrives holding this rank's own gradients, NOT scaled by 1/W;
the hook averages (torch's `allreduce_hook` divides by W, then all-reduces with SUM), so with a
hook the copy into the bucket scales by 1, not 1/W. The future's tensor is copied into the bucket
if the hook answered in a tensor of its own (fp16 compression does).

`gradient_as_bucket_view=True` makes each parameter's `.grad` its slice of the bucket: the first
time a gradient is copied in, `.grad` is replaced by that view, so from the next backward on (while
`zero_grad(set_to_none=False)` keeps it) autograd accumulates straight into the bucket, the copy in
becomes an in-place division by W (torch divides there, rather than multiplying by 1/W), and there
is no copy back out. One copy of the gradients in memory instead of two, and two passes over them
fewer per step. After the rebuild, gradients move into the new buckets the same way.

The rest is rung 6's: no_sync() decided at forward, find_unused_parameters, torch's bucket
layout and its rebuild, buckets launched strictly in index order: bitwise torch's DDP at any
world size, with torch's hooks too.

What it costs: nothing more than rung 6; gradient_as_bucket_view saves memory and copies. What
it lacks (MiniDDP, miniddp/data_parallel/ddp.py, adds it): what production needs around it:
checks that every rank holds the same model and settings, errors that name a rank that stopped
answering instead of a bare timeout, uneven inputs (Join), static_graph, a process group of
one's own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.data_parallel.layout import bucket_caps
from miniddp.observe.events import EventRecorder
from miniddp.steps import shared


class Bucket:
    """One flat gradient buffer that runs its own life, once per backward pass:

        add(position)   a gradient is ready: copy it in, scaled by 1/W, into its slice
        is_full         every slice is filled: the bucket can travel
        launch(reduce)  start its all-reduce without waiting (`pending` holds the handle)
        wait()          block until the sum has arrived
        write_back()    copy each averaged slice into the `.grad` it came from
        reset()         forget this backward, ready for the next

    Each parameter owns a fixed slice of `flat` (`views[i]`, shaped like the parameter), so one
    all-reduce of `flat` averages every gradient in it at once.
    """

    def __init__(
        self,
        index: int,
        param_indices: Sequence[int],
        params: Sequence[torch.Tensor],
        gradient_as_bucket_view: bool = False,
    ) -> None:
        self.index = index
        self.param_indices = list(param_indices)
        self.params = [params[i] for i in self.param_indices]
        self.gradient_as_bucket_view = gradient_as_bucket_view
        total = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(total, dtype=self.params[0].dtype, device=self.params[0].device)
        self.views = [
            piece.view_as(p)
            for piece, p in zip(self.flat.split([p.numel() for p in self.params]), self.params)
        ]
        self.reset()

    def reset(self) -> None:
        self.filled = 0
        # (position, the .grad it was copied from, or None): where write_back() puts the average;
        # empty for gradients that already live in the bucket (gradient_as_bucket_view)
        self.sources: list[tuple[int, torch.Tensor | None]] = []
        # the in-flight all-reduce: the Work torch returned, or the future a comm hook did
        self.pending: dist.Work | torch.futures.Future | None = None

    def add(self, position: int, divide_by: int) -> None:
        """Copy the gradient of parameter `position` into its slice, divided by `divide_by`
        (the world size; 1 when a comm hook averages instead).

        torch multiplies by the float 1/W while copying, one pass over the gradient; `g / W`
        or dividing after the sum would differ in the last bit when W is not a power of two.
        A parameter with no gradient (unused in this backward) contributes zeros.
        """
        param, view = self.params[position], self.views[position]
        grad = param.grad
        if grad is None:
            view.zero_()
            self.sources.append((position, None))  # gets its slice at write-back
        elif self.gradient_as_bucket_view and grad.data_ptr() == view.data_ptr():
            view.div_(divide_by)  # already in the bucket: torch divides it in place
        elif self.gradient_as_bucket_view:
            torch.mul(grad, 1.0 / divide_by, out=view)
            param.grad = view  # from now on backward accumulates straight into the bucket
        else:
            torch.mul(grad, 1.0 / divide_by, out=view)
            self.sources.append((position, grad))
        self.filled += 1

    @property
    def is_full(self) -> bool:
        return self.filled == len(self.params)

    def launch(self, reduce: Callable[[Bucket], dist.Work | torch.futures.Future]) -> None:
        """Start summing `flat` across ranks; `reduce` returns at once with a handle."""
        self.pending = reduce(self)

    def wait(self) -> None:
        """Block until the sum is in `flat`."""
        result = self.pending.wait()  # a Work answers True, a comm hook's future a Tensor
        result = result[0] if isinstance(result, list) else result
        if isinstance(result, torch.Tensor) and result.data_ptr() != self.flat.data_ptr():
            self.flat.copy_(result)  # a comm hook may answer in a tensor of its own
        self.pending = None

    def write_back(self, used: Sequence[bool] | None = None) -> None:
        """Put each average into the `.grad` its gradient was copied from. A parameter that had
        no gradient gets its slice; one that `used` says no rank used keeps `.grad` as it was
        (None stays None), as torch's find_unused_parameters does."""
        for position, grad in self.sources:
            if used is not None and not used[self.param_indices[position]]:
                continue
            view = self.views[position]
            if grad is not None:
                grad.copy_(view)
            else:
                self.params[position].grad = view if self.gradient_as_bucket_view else view.clone()

    def adopt_gradients(self) -> None:
        """With gradient_as_bucket_view: move existing `.grad`s into this (new) bucket, so that
        `.grad` stays a view of the bucket across a rebuild."""
        for param, view in zip(self.params, self.views):
            if param.grad is not None:
                view.copy_(param.grad)
                param.grad = view


def assign_buckets(
    params: Sequence[torch.Tensor], order: Sequence[int], first_cap: float, cap: float
) -> list[list[int]]:
    """Walk `order`; each (dtype, device) fills its own buckets, its first until it holds
    `first_cap` bytes, the others `cap`. Buckets come out in the order they were closed, then the
    partly filled ones (torch takes those from a hash map: their order changes no value)."""
    closed, filling, filled_bytes, has_closed = [], {}, {}, set()
    for index in order:
        key = (params[index].dtype, params[index].device)
        filling.setdefault(key, []).append(index)
        filled_bytes[key] = filled_bytes.get(key, 0) + params[index].nbytes
        if filled_bytes[key] >= (cap if key in has_closed else first_cap):
            closed.append(filling.pop(key))
            filled_bytes[key] = 0
            has_closed.add(key)
    return closed + list(filling.values())


def initial_layout(
    params: Sequence[torch.Tensor], first_cap: float, cap: float, find_unused_parameters: bool
) -> list[list[int]]:
    """The buckets before any backward has been seen, in launch order: one per (dtype, device),
    or with find_unused_parameters torch's caps for good (the graph may change every iteration:
    no order is worth recording). The bucket whose parameters start latest in registration
    order launches first: torch still assumes backward runs in reverse."""
    caps = (first_cap, cap) if find_unused_parameters else (math.inf, math.inf)
    initial = assign_buckets(params, range(len(params)), *caps)
    return sorted(initial, key=min, reverse=True)


class BucketLayout:
    """The buckets of one DDP model, and their life: built at construction (one per dtype,
    unless find_unused_parameters), the gradient-ready order recorded in the first synced
    backward, rebuilt once from rank 0's record before the next forward."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        bucket_cap_mb: float | None,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
    ) -> None:
        self.params = params
        self.first_cap, self.cap = bucket_caps(bucket_cap_mb)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # With unused parameters the graph may change every iteration: no order worth recording.
        self.has_rebuilt = find_unused_parameters
        self.ready_order: list[int] = []  # gradient arrival order in the first synced backward
        self.build(initial_layout(params, self.first_cap, self.cap, find_unused_parameters))

    def build(self, groups: list[list[int]]) -> None:
        self.buckets = [
            Bucket(i, indices, self.params, self.gradient_as_bucket_view)
            for i, indices in enumerate(groups)
        ]
        # Where each parameter's gradient goes: (its bucket, its position in it).
        self.slot = {
            index: (b, pos) for b in self.buckets for pos, index in enumerate(b.param_indices)
        }
        if self.gradient_as_bucket_view:
            for bucket in self.buckets:
                bucket.adopt_gradients()

    def record_ready(self, index: int) -> None:
        if not self.has_rebuilt:
            self.ready_order.append(index)

    @property
    def rebuild_due(self) -> bool:
        return bool(self.ready_order) and not self.has_rebuilt

    def rebuild(self, ready_order: list[int]) -> None:
        """Rebuild from an observed order (rank 0's, so every rank gets the same buckets)."""
        self.build(assign_buckets(self.params, ready_order, self.first_cap, self.cap))
        self.has_rebuilt = True
        self.ready_order = []


class ParameterUsage:
    """Which parameters got a gradient on this rank since the last synced backward (no_sync
    steps count too, as in torch) and, after one small all-reduce, on any rank."""

    def __init__(self, count: int) -> None:
        self._here = torch.zeros(count, dtype=torch.int32)

    def note(self, index: int) -> None:
        self._here[index] = 1

    def clear(self) -> None:
        self._here.zero_()

    def on_any_rank(self, device: torch.device) -> list[bool]:
        usage = self._here.to(device, copy=True)  # NCCL moves only GPU tensors
        dist.all_reduce(usage)
        self.clear()
        return [bool(count) for count in usage.tolist()]


def parameters_not_reached(output: Any, params: Sequence[torch.Tensor]) -> list[int]:
    """Walk the autograd graph back from the outputs; return the indices of `params` it never
    reaches. Those get no gradient in this backward, so the wrapper marks them ready up front
    (contributing zeros, or what no_sync accumulated)."""
    position = {id(p): i for i, p in enumerate(params)}
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = []
    for tensor in find_tensors(output):
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif id(tensor) in position:
            reached.add(position[id(tensor)])
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and id(variable) in position:
            reached.add(position[id(variable)])
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return [i for i in range(len(params)) if i not in reached]


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output, found where torch's DDP looks: tensors, and lists,
    tuples (namedtuples too), dicts and dataclasses of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, field.name))


CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """What a communication hook receives: torch's `dist.GradBucket` interface over a Bucket.

    The methods mirror torch's, so hooks written for torch's DDP run here unchanged.
    """

    def __init__(self, bucket: Bucket, is_last: bool) -> None:
        self._bucket = bucket
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat tensor holding every gradient of this bucket (not yet averaged)."""
        return self._bucket.flat

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.flat.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last


class Phase(Enum):
    """Where the current forward/backward pair stands: what a gradient hook must do."""

    LOCAL = "gradients only accumulate locally (inside no_sync, or no synced forward yet)"
    ARMED = "a synced forward ran: its backward will reduce"
    REDUCING = "backward is filling and launching buckets"


class CommHookDDP(nn.Module, EventRecorder):
    """Average gradients in torch's DDP's buckets by the time `loss.backward()` returns (unless
    the forward ran inside `no_sync()`), through a comm hook if one is registered, with torch's
    `find_unused_parameters` and `gradient_as_bucket_view`."""

    claims = frozenset(
        {"batchnorm", "mixed-dtypes", "torch-layout", "no-sync", "find-unused-parameters"}
        | {"comm-hook", "gradient-as-bucket-view"}
    )

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.param_names, self.params = shared.trainable_parameters(module, "CommHookDDP")
        self._layout = BucketLayout(
            self.params, bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view
        )
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        self.all_reduce_count = 0
        self._start_event_log()
        self._comm_hook: tuple[Any, CommHook] | None = None
        self._divide_by = self.world_size  # 1 once a comm hook does the averaging
        self._usage = ParameterUsage(len(self.params))
        self._require_backward_grad_sync = True  # False inside no_sync()
        self._require_forward_param_sync = True  # buffers are refreshed after a synced forward
        self._reset_backward(Phase.LOCAL)
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._phase is Phase.REDUCING:
            raise shared.unfinished_backward()
        if self._layout.rebuild_due and torch.is_grad_enabled():
            self._rebuild_buckets()
        # Each forward updates buffers (BatchNorm's statistics) locally: like torch's DDP, start
        # every forward that follows a synced one from rank 0's.
        if self.broadcast_buffers and self._require_forward_param_sync:
            shared.broadcast_from_rank0(self.module.buffers())
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        # Whether this forward's backward synchronizes is decided now, at forward time: that is
        # why the forward must run inside `no_sync()` for accumulation to skip communication.
        synced = torch.is_grad_enabled() and self._require_backward_grad_sync
        self._require_forward_param_sync = synced
        self._phase = Phase.ARMED if synced else Phase.LOCAL
        if self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
        if synced and self.find_unused_parameters:
            self._unused_in_forward = parameters_not_reached(output, self.params)
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
        """Nothing to do: the end of backward already waited for every bucket."""

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace what happens to a full bucket: `hook(state, bucket) -> Future[Tensor]`, as in
        torch. The bucket holds this rank's own gradients, NOT divided by the world size: the
        hook averages. Register once, before the first backward."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per wrapper.")
        if self._phase is not Phase.LOCAL or self.all_reduce_count:
            raise RuntimeError("Register the comm hook before the first backward pass.")
        self._comm_hook = (state, hook)
        self._divide_by = 1

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced forward: rank 0's order, torch's caps."""
        order = torch.tensor(self._layout.ready_order, device=self.params[0].device)
        dist.broadcast(order, src=0)
        self._layout.rebuild(order.tolist())
        self._note("rebuild", f"{len(self._layout.buckets)} buckets")

    def _start_reducing(self) -> None:
        """The first sign of a synced backward: queue the wait for its end, and mark the
        parameters this forward's graph never reaches (their buckets must still fill)."""
        if self._phase is not Phase.ARMED:
            return
        self._phase = Phase.REDUCING
        Variable._execution_engine.queue_callback(self._finish_backward)
        for index in self._unused_in_forward:
            self._mark_ready(index)  # may hold what no_sync accumulated

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if self.find_unused_parameters:
            self._usage.note(index)
        self._start_reducing()  # the first gradient of a synced backward starts it
        if self._phase is Phase.LOCAL:
            return
        self._layout.record_ready(index)
        self._note("hook", self.param_names[index])
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy one gradient into its bucket; once the bucket is full, launch what can go."""
        self._marked_ready[index] = True
        bucket, position = self._layout.slot[index]
        bucket.add(position, self._divide_by)
        if bucket.is_full:
            self._note("ready", f"bucket {bucket.index}")
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
            return dist.all_reduce(bucket.flat, async_op=True)
        state, hook = self._comm_hook
        is_last = bucket.index == len(self._layout.buckets) - 1
        return hook(state, GradBucket(bucket, is_last))

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done."""
        self._note("backward", "end")
        missing = [i for i, ready in enumerate(self._marked_ready) if not ready]
        for index in missing:  # reachable from the output, yet no gradient came: unused too
            self._mark_ready(index)
        # Parameters no rank used keep .grad (None stays None): find_unused_parameters asks
        # every backward.
        used = None
        if self.find_unused_parameters:
            used = self._usage.on_any_rank(self.params[0].device)
        for bucket in self._layout.buckets:
            # Each bucket goes back to `.grad` as soon as it arrives, while later ones travel.
            bucket.wait()
            self._note("wait", f"bucket {bucket.index}")
            bucket.write_back(used)
        self._reset_backward(Phase.LOCAL)
        if missing and not self.find_unused_parameters:
            self._layout.ready_order.clear()  # incomplete: learn it again in the next backward
            raise shared.no_gradient(self.param_names[i] for i in missing)
        self._note("sync", "end")

    def _reset_backward(self, phase: Phase) -> None:
        self._phase = phase  # and every bucket empty, no parameter marked ready
        self._unused_in_forward: list[int] = []
        self._marked_ready = [False] * len(self.params)
        self._next_bucket = 0
        for bucket in self._layout.buckets:
            bucket.reset()

    @property
    def buckets(self) -> list[Bucket]:
        """The current buckets, in launch order."""
        return self._layout.buckets

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._layout.has_rebuilt
