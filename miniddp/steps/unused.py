"""Rung 6, unused parameters: a parameter that gets no gradient still lets its bucket travel.

The previous rung (no_sync.py) refused a backward that left some parameter without a gradient:
a bucket launches once all its gradients are in, so a bucket holding a parameter the forward
never used would wait forever (the rung fills it with zeros, so the ranks stay in step, and
raises). Models with branches (a head used in some steps, experts a router skips, a layer one
rank uses and another does not) need that to be normal. With `find_unused_parameters=True`,
as in torch's DDP:

- at the end of each synced forward the autograd graph is walked back from the output; the
  parameters it never reaches will get no gradient, so the first hook of the backward marks them
  ready at once: their slice holds zeros, or what `no_sync()` steps accumulated in `.grad`;
- a parameter reachable from the output that still got no gradient (backward through part of
  it) is marked ready with zeros when backward ends, so every bucket launches on every rank;
- every hook, in no_sync steps too, notes that its parameter was used on this rank, and one
  more all-reduce of those marks tells every rank which parameters any rank used since the last
  sync. One no rank used keeps `.grad` as it was (None stays None: torch's optimizers skip it,
  so momentum and weight decay do not touch it); one used anywhere gets the average, zeros
  included for the ranks that did not use it.

The layout changes too: the graph may differ from one iteration to the next, so no
gradient-ready order is worth recording. The buckets are built once, at construction, as torch
builds them: parameters walked in registration order with torch's caps (the small first cap
goes to the first-registered parameters), buckets launched in the reverse order; never rebuilt.

The rest is rung 5's: no_sync() decided at forward, torch's bucket layout (one bucket per dtype
at first, rebuilt once from rank 0's order, unless find_unused_parameters), gradients copied
into their slices scaled by 1/W, buckets launched strictly in index order: bitwise torch's DDP at
any world size.

What it costs: the graph walk at every synced forward (a Python loop over the graph's nodes;
torch warns at run time when the flag finds nothing unused, for this cost), one small all-reduce
of P integers per synced step, and no rebuilt layout. What it lacks (the next rung,
comm_hooks.py, adds it): a way to change what happens to a full bucket (compress it, use another
all-reduce), and gradients living in the buckets instead of being copied in and out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
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
        self.work: dist.Work | None = None  # the all-reduce in flight


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


class UnusedParametersDDP(nn.Module, EventRecorder):
    """Average gradients in torch's DDP's buckets by the time `loss.backward()` returns (unless
    the forward ran inside `no_sync()`), with `find_unused_parameters=True` even for parameters
    that got no gradient."""

    claims = frozenset(
        {"batchnorm", "mixed-dtypes", "torch-layout", "no-sync", "find-unused-parameters"}
    )

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        if bucket_cap_mb is None:  # torch's default: a small first bucket, to start sending soon
            self.caps = (MiB, 25 * MiB)
        else:
            self.caps = bucket_caps(bucket_cap_mb)  # in bytes, the first bucket's and the rest's
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "UnusedParametersDDP")
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

    def _build_buckets(self, layout: list[list[int]]) -> None:
        self.buckets = [Bucket(n, ix, [self.params[i] for i in ix]) for n, ix in enumerate(layout)]
        # Where each parameter's gradient goes: its bucket and its view in it.
        self._slot = {i: (b, view) for b in self.buckets for i, view in zip(b.params, b.views)}

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
        grad = self.params[index].grad
        if grad is None:
            view.zero_()
        else:
            torch.mul(grad, 1.0 / self.world_size, out=view)  # scale while copying: one pass
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
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)  # SUM; returns at once
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
            bucket.work.wait()
            self._note("wait", f"bucket {bucket.index}")
            for index, view in zip(bucket.params, bucket.views):
                param = self.params[index]
                if used is not None and not used[index]:
                    continue  # no rank used it since the last sync: .grad stays as it was
                if param.grad is None:
                    param.grad = view.clone()
                else:
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
