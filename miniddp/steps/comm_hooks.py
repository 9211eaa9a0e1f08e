"""Rung 7, comm hooks and gradient_as_bucket_view: what a full bucket does, where .grad lives.

Two of torch's options, both about the bucket. Up to the previous rung (unused.py) a full bucket
always went out as gloo's all-reduce of the average, and each gradient was copied into its
bucket and back out again.

`register_comm_hook(state, hook)` hands the full bucket to `hook(state, bucket)` instead, which
returns a `torch.futures.Future` of the reduced flat tensor: torch's own hooks
(`torch.distributed.algorithms.ddp_comm_hooks`: `allreduce_hook`, `fp16_compress_hook`, ...)
and this project's (`miniddp.comm_hooks.all_reduce_hook("ring")`, chapter 01's ring) run here
unchanged, because `GradBucket` below offers torch's `dist.GradBucket` methods. The protocol's
one surprise: the bucket arrives holding this rank's own gradients, NOT scaled by 1/W; the hook
averages (torch's `allreduce_hook` divides by W, then all-reduces with SUM), so with a hook the
copy into the bucket scales by 1, not 1/W. The future's tensor is copied into the bucket if the
hook answered in a tensor of its own (fp16 compression does).

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
it lacks (MiniDDP, miniddp/ddp.py, adds it): what production needs around the same algorithm:
checks that every rank holds the same model and settings, errors that name a rank that stopped
answering instead of a bare timeout, uneven inputs (Join), static_graph, a process group of
one's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.layout import MiB, bucket_caps
from miniddp.observe.events import EventRecorder
from miniddp.steps import shared


class Bucket:
    """One flat tensor holding the gradients of `params` (indices into the wrapper's params)
    end to end; `views[i]` is params[i]'s slice of it, shaped like that parameter."""

    def __init__(self, index: int, params: list[int], tensors: list[torch.Tensor]) -> None:
        self.index, self.params = index, params
        self.flat = tensors[0].new_zeros(sum(t.numel() for t in tensors))  # same dtype, device
        pieces = self.flat.split([t.numel() for t in tensors])
        self.views = [piece.view_as(t) for piece, t in zip(pieces, tensors)]
        self.ready = 0  # gradients copied in during this backward
        self.work: dist.Work | torch.futures.Future | None = None  # the all-reduce in flight


def assign_buckets(
    params: list[torch.Tensor], order: list[int], first_cap: float, cap: float
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


def parameters_not_reached(output: Any, params: list[torch.Tensor]) -> list[int]:
    """Walk the autograd graph back from every tensor in `output`; return the indices of
    `params` it never reaches: they get no gradient in this forward's backward."""
    position = {id(p): i for i, p in enumerate(params)}
    reached, seen, stack = set(), set(), []
    for tensor in tensors_in(output):
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif id(tensor) in position:  # the output is a parameter itself
            reached.add(position[id(tensor)])
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node holds its parameter
        if leaf is not None and id(leaf) in position:
            reached.add(position[id(leaf)])
        stack.extend(parent for parent, _ in node.next_functions if parent is not None)
    return [i for i in range(len(params)) if i not in reached]


def tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output: a tensor, or lists, tuples and dicts of them."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output
    if isinstance(output, (list, tuple, dict)):
        return [tensor for item in items for tensor in tensors_in(item)]
    return []


class GradBucket:
    """What a comm hook receives: torch's `dist.GradBucket` methods over one of this rung's
    buckets, so that hooks written for torch's DDP run here unchanged."""

    def __init__(self, bucket: Bucket, params: list[torch.Tensor], is_last: bool) -> None:
        self._bucket, self._params, self._is_last = bucket, params, is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat tensor of this bucket's gradients, not yet averaged."""
        return self._bucket.flat

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.flat.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return [self._params[i] for i in self._bucket.params]

    def is_last(self) -> bool:
        return self._is_last


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
        if bucket_cap_mb is None:  # torch's default: a small first bucket, to start sending soon
            self.caps = (MiB, 25 * MiB)
        else:
            self.caps = bucket_caps(bucket_cap_mb)  # in bytes, the first bucket's and the rest's
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.world_size = dist.get_world_size()
        self._comm_hook: tuple[Any, Callable] | None = None  # (state, hook), once registered
        self._divide_by = self.world_size  # 1 once a comm hook does the averaging
        self.param_names, self.params = shared.trainable_parameters(module, "CommHookDDP")
        self.all_reduce_count = 0
        self._start_event_log()
        self._arrived: set[int] = set()  # parameters marked ready in this backward
        self._next_bucket = 0  # the next bucket to launch
        self._ready_order: list[int] = []  # the order gradients arrived in, until the rebuild
        self.has_rebuilt_buckets = find_unused_parameters  # the graph may change: never rebuilt
        self._require_backward_grad_sync = True  # False inside no_sync()
        self._sync_this_backward = False  # what the latest forward decided
        self._refresh_buffers = True  # buffers come from rank 0 after a synced forward
        self._unused_in_forward: list[int] = []  # what the latest synced forward's graph skips
        self._used_here = torch.zeros(len(self.params), dtype=torch.int32)  # since the last sync
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        # Iteration 0: one bucket per (dtype, device), or with unused parameters torch's caps
        # for good; the bucket whose parameters start latest in registration order launches
        # first (torch still assumes backward runs in reverse).
        caps = self.caps if find_unused_parameters else (math.inf, math.inf)
        initial = assign_buckets(self.params, range(len(self.params)), *caps)
        self._build_buckets(sorted(initial, key=min, reverse=True))
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._arrived:
            raise shared.unfinished_backward()
        if self._ready_order and torch.is_grad_enabled():
            self._rebuild_buckets()
        # Each forward updates buffers (BatchNorm's statistics) locally: like torch's DDP, start
        # every forward that follows a synced one from rank 0's.
        if self.broadcast_buffers and self._refresh_buffers:
            shared.broadcast_from_rank0(self.module.buffers())
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        # Decided now, and read by every hook of the coming backward: that is why the forward
        # must run inside no_sync() for accumulation to skip communication.
        self._sync_this_backward = torch.is_grad_enabled() and self._require_backward_grad_sync
        self._refresh_buffers = self._sync_this_backward
        if self._sync_this_backward and self.find_unused_parameters:
            self._unused_in_forward = parameters_not_reached(output, self.params)
        if self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
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

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace what happens to a full bucket: `hook(state, bucket) -> Future[Tensor]`, as in
        torch. The bucket holds this rank's own gradients, NOT divided by the world size: the
        hook averages. Register once, before the first backward."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per wrapper.")
        if self.all_reduce_count or self._arrived:
            raise RuntimeError("Register the comm hook before the first backward pass.")
        self._comm_hook = (state, hook)
        self._divide_by = 1

    def _build_buckets(self, layout: list[list[int]]) -> None:
        self.buckets = [Bucket(n, ix, [self.params[i] for i in ix]) for n, ix in enumerate(layout)]
        # Where each parameter's gradient goes: its bucket and its view in it.
        self._slot = {i: (b, view) for b in self.buckets for i, view in zip(b.params, b.views)}
        if self.gradient_as_bucket_view:  # gradients move into the new buckets, as views
            for index, (_, view) in self._slot.items():
                param = self.params[index]
                if param.grad is not None:
                    view.copy_(param.grad)
                    param.grad = view

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced forward: rank 0's order, torch's caps."""
        order = torch.tensor(self._ready_order, device=self.params[0].device)
        dist.broadcast(order, src=0)
        self._build_buckets(assign_buckets(self.params, order.tolist(), *self.caps))
        self._ready_order, self.has_rebuilt_buckets = [], True
        self._note("rebuild", f"{len(self.buckets)} buckets")

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if self.find_unused_parameters:
            self._used_here[index] = 1  # in no_sync steps too: they accumulate into .grad
        if not self._sync_this_backward:
            return  # the forward ran inside no_sync(): .grad accumulates here, nothing travels
        if not self._arrived:  # the first gradient of this backward
            Variable._execution_engine.queue_callback(self._finish_backward)
            for unused in self._unused_in_forward:  # no gradient will come: ready now
                self._mark_ready(unused)
        if not self.has_rebuilt_buckets:
            self._ready_order.append(index)
        self._note("hook", self.param_names[index])
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy one gradient into its bucket, zeros if it has none; launch what can go."""
        self._arrived.add(index)
        bucket, view = self._slot[index]
        param = self.params[index]
        if param.grad is None:
            view.zero_()
        elif self.gradient_as_bucket_view and param.grad.data_ptr() == view.data_ptr():
            view.div_(self._divide_by)  # already in the bucket: torch divides it in place
        else:
            torch.mul(param.grad, 1.0 / self._divide_by, out=view)  # scale while copying
            if self.gradient_as_bucket_view:
                param.grad = view  # from now on backward accumulates straight into the bucket
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._note("ready", f"bucket {bucket.index}")
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch each full bucket whose predecessors have all been launched, in index order."""
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if bucket.ready < len(bucket.params):
                return
            name = f"bucket {bucket.index}"
            self._note("launch", name)
            if self._comm_hook is None:
                bucket.work = dist.all_reduce(bucket.flat, async_op=True)  # SUM; returns at once
            else:
                state, hook = self._comm_hook
                is_last = bucket.index == len(self.buckets) - 1
                bucket.work = hook(state, GradBucket(bucket, self.params, is_last))  # a Future
            self._note_when_done(bucket.work, name)
            self.all_reduce_count += 1
            self._next_bucket += 1

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: wait for each bucket and copy it back into `.grad`."""
        self._note("backward", "end")
        missing = [i for i in range(len(self.params)) if i not in self._arrived]
        for index in missing:  # reachable, yet no gradient came: zeros, so every bucket launches
            self._mark_ready(index)
        used = self._used_on_any_rank() if self.find_unused_parameters else None
        for bucket in self.buckets:
            reduced = bucket.work.wait()  # a Work's wait() answers True, a hook's future a Tensor
            reduced = reduced[0] if isinstance(reduced, list) else reduced
            if isinstance(reduced, torch.Tensor) and reduced.data_ptr() != bucket.flat.data_ptr():
                bucket.flat.copy_(reduced)  # a comm hook may answer in a tensor of its own
            self._note("wait", f"bucket {bucket.index}")
            for index, view in zip(bucket.params, bucket.views):
                param = self.params[index]
                if used is not None and not used[index]:
                    continue  # no rank used it since the last sync: .grad stays as it was
                if param.grad is None:
                    param.grad = view if self.gradient_as_bucket_view else view.clone()
                elif param.grad.data_ptr() != view.data_ptr():
                    param.grad.copy_(view)
            bucket.ready, bucket.work = 0, None
        self._arrived, self._next_bucket = set(), 0
        if missing and not self.find_unused_parameters:
            self._ready_order = []  # incomplete: learn the order again in the next backward
            raise shared.no_gradient(self.param_names[i] for i in missing)
        self._note("sync", "end")

    def _used_on_any_rank(self) -> list[bool]:
        """One all-reduce (SUM) of every rank's marks: which parameters any rank used."""
        used = self._used_here.to(self.params[0].device, copy=True)  # NCCL: GPU tensors only
        dist.all_reduce(used)
        self._used_here.zero_()
        return [bool(count) for count in used.tolist()]
