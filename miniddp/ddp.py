"""MiniDDP: data-parallel training whose whole life fits in one file.

    construct   check every rank has the same model, copy rank 0's weights to everyone,
                lay gradients out in buckets, put a hook on every parameter
    forward     (re)build buckets once, refresh buffers from rank 0, run the model, and decide
                whether the coming backward synchronizes (not inside `no_sync()`)
    backward    each parameter's hook copies its gradient, scaled by 1/W, into its bucket; a full
                bucket starts an async all-reduce at once, while backward keeps computing
    wait        when backward ends, a queued callback waits for the buckets in order and writes
                each one's averaged values back into `.grad` as soon as it arrives

So gradients are averaged by the time `loss.backward()` returns, exactly like torch's
DistributedDataParallel, and bit for bit the same: the bucket layout, the 1/W scaling and the
launch order follow torch's rules (facts in the docstrings below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.buckets import (
    Bucket,
    BucketInfo,
    GradBucket,
    bucket_caps,
    describe_layout,
    initial_layout,
    rebuilt_layout,
)
from miniddp.env import HOW_TO_LAUNCH
from miniddp.events import EventRecorder
from miniddp.faults import future_of, wait_for
from miniddp.model_checks import (
    parameters_not_reached,
    refuse_sparse_gradients,
    verify_same_model_on_every_rank,
)

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class MiniDDP(nn.Module, EventRecorder):
    """Wrap `module` so that `loss.backward()` leaves gradients averaged over all ranks.

    Used exactly like `torch.nn.parallel.DistributedDataParallel`. Where torch is silent about a
    mistake, MiniDDP raises: a parameter that got no gradient is reported at the end of that
    same backward (torch only complains at the next forward), a model that differs across
    ranks is reported on every rank (torch's rank 0 sees "Connection closed by peer"), and a
    second backward through one synced forward is an error (torch leaves it unsynchronized).
    """

    # Flip to False (as the benchmark's "deferred" ablation does) to hold every launch until
    # backward is over: the same all-reduces, minus the overlap.
    launch_during_backward = True
    # Gradients with fewer elements are copied in and scaled in batches of about
    # `small_batch_numel` elements (or whatever is left when their bucket fills), bigger ones one
    # by one as each arrives: see `_copy_small_gradients`.
    small_gradient_numel = 16_384
    small_batch_numel = 262_144

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"MiniDDP needs a running process group, and there is none. {HOW_TO_LAUNCH}"
            )
        self.module = module
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.first_bucket_bytes, self.bucket_bytes = bucket_caps(bucket_cap_mb)

        # Only parameters that require grad are reduced, and a tied weight only once: it is one
        # variable with one gradient. `named_parameters()` walks modules in registration order
        # and skips repeats, as torch's reducer does.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "MiniDDP got a module with no parameter that requires grad: there is nothing to "
                "synchronize. Wrap the model you train (or unfreeze its parameters)."
            )
        refuse_sparse_gradients(module)
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # Settings that shape the sequence of collectives must agree too, or ranks would issue
        # different all-reduces and gloo would abort or hang instead of explaining.
        settings = {
            "bucket_cap_mb (bytes: first, rest)": (self.first_bucket_bytes, self.bucket_bytes),
            "find_unused_parameters": self.find_unused_parameters,
            "broadcast_buffers": self.broadcast_buffers,
        }
        verify_same_model_on_every_rank(named, settings, process_group)
        self._buffers_to_sync = list(module.buffers())
        self._broadcast_from_rank0([*module.parameters(), *self._buffers_to_sync])

        self.all_reduce_count = 0
        self._start_event_log()
        self._comm_hook: tuple[Any, CommHook] | None = None
        self.has_rebuilt_buckets = False
        self._ready_order: list[int] = []  # gradient arrival order in the first synced backward
        self._build_buckets(
            initial_layout(
                self.params, self.first_bucket_bytes, self.bucket_bytes, find_unused_parameters
            )
        )
        # Small bookkeeping collectives run where the gradients live: NCCL only moves GPU tensors.
        self._comm_device = self.params[0].device
        self._locally_used = torch.zeros(len(self.params), dtype=torch.int32)
        self._usage_work: dist.Work | None = None
        self._require_backward_grad_sync = True  # False inside no_sync()
        self._require_forward_param_sync = True  # buffers are refreshed after a synced forward
        self._reset_backward_state()
        self._synced_forward_reduced = False
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            if self._backward_started:
                raise RuntimeError(
                    "The previous backward pass started reducing gradients but never finished "
                    "(did it raise?). Start again from a fresh forward on every rank."
                )
            self._synced_forward_reduced = False
            if self._ready_order and not self.has_rebuilt_buckets:
                self._rebuild_buckets()
        if self.broadcast_buffers and self._require_forward_param_sync:
            self._broadcast_from_rank0(self._buffers_to_sync)
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        if self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
        # Whether this forward's backward synchronizes is decided now, at forward time: that is
        # why the forward must run inside `no_sync()` for accumulation to skip communication.
        if torch.is_grad_enabled() and self._require_backward_grad_sync:
            self._require_forward_param_sync = True
            self._armed = True
            if self.find_unused_parameters:
                self._unused_in_forward = parameters_not_reached(output, self.params)
        else:
            self._require_forward_param_sync = False
        self._note("forward", "end")
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards run inside this block skip the all-reduce.

        The first forward+backward outside it then reduces the whole accumulated `.grad`.
        """
        previous = self._require_backward_grad_sync
        self._require_backward_grad_sync = False
        try:
            yield
        finally:
            self._require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Kept for readers of courses that call it: gradients are already averaged when
        `backward()` returns, because the wait runs in a callback at the end of backward."""
        if self._backward_started:
            raise RuntimeError("A backward pass is still reducing gradients; let it finish first.")

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace what happens to a full bucket: `hook(state, bucket) -> Future[Tensor]`.

        torch's signature, so torch's own hooks work too (e.g. `fp16_compress_hook` from
        `torch.distributed.algorithms.ddp_comm_hooks.default_hooks`). The bucket is NOT divided
        by the world size beforehand: the hook averages. Register once, before training.
        """
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per MiniDDP.")
        if self._backward_started or self.all_reduce_count:
            raise RuntimeError("Register the comm hook before the first backward pass.")
        self._comm_hook = (state, hook)

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if self.find_unused_parameters and param.grad is not None:
            self._locally_used[index] = 1  # counts in no_sync steps too, as in torch
        if not self._armed:
            if self._synced_forward_reduced:
                raise RuntimeError(
                    f"Gradient of '{self.param_names[index]}' arrived after this forward's "
                    "gradients were already synchronized: backward ran twice on one synced "
                    "forward, and the second result would stay unsynchronized. Run a new forward "
                    "for each backward, or put the forward inside no_sync() to accumulate."
                )
            return
        if not self._backward_started:
            self._backward_started = True
            Variable._execution_engine.queue_callback(self._finish_backward)
            for unused in self._unused_in_forward:
                self._mark_ready(unused, self.params[unused].grad)  # may hold no_sync sums
        if not self.has_rebuilt_buckets and not self.find_unused_parameters:
            self._ready_order.append(index)
        self._note("hook", self.param_names[index])
        self._mark_ready(index, param.grad)

    def _mark_ready(self, index: int, grad: torch.Tensor | None) -> None:
        """Copy one gradient into its bucket, scaled by 1/W; once the bucket is full, launch."""
        if self._marked_ready[index]:
            raise RuntimeError(
                f"Parameter '{self.param_names[index]}' got its gradient twice in one backward "
                "(reentrant backward, e.g. torch.utils.checkpoint with use_reentrant=True, or a "
                "parameter used in two separate backward calls). Use use_reentrant=False."
            )
        self._marked_ready[index] = True
        bucket, position, view, small = self._slot[index]
        if grad is None or not self.gradient_as_bucket_view:
            bucket.copy_back.append((index, grad, view))  # the result goes back to this .grad
        if grad is None:
            view.zero_()  # unused here: contributes zeros to the sum
        elif grad.is_sparse:
            raise RuntimeError(
                f"Parameter '{self.param_names[index]}' produced a sparse gradient; MiniDDP "
                "reduces dense buckets only. Use dense gradients (e.g. nn.Embedding(sparse=False))."
            )
        elif self.gradient_as_bucket_view and grad.data_ptr() == view.data_ptr():
            # Already in the bucket: torch divides it in place (a comm hook averages by itself,
            # so it gets the plain sum).
            if self._comm_hook is None:
                view.div_(self.world_size)
        elif small:
            if self.gradient_as_bucket_view:
                # `.grad` becomes the view below, so copy now and let the old gradient go:
                # keeping dropped gradients alive until the batch fragmented the heap (the MLP
                # ran 20% slower). Only the scaling waits for the batch.
                view.copy_(grad)
            bucket.small_batch.append((position, None if self.gradient_as_bucket_view else grad))
            bucket.small_batch_numel += grad.numel()
            if bucket.small_batch_numel >= self.small_batch_numel:
                self._copy_small_gradients(bucket)
        elif self._comm_hook is None:
            # torch multiplies by the float 1/W while copying (one pass over the gradient);
            # `g / W` would differ in the last bit when W is not a power of two.
            torch.mul(grad, 1.0 / self.world_size, out=view)
        else:
            view.copy_(grad)
        if self.gradient_as_bucket_view and grad is not None:
            self.params[index].grad = view  # the next backward accumulates in the bucket
        bucket.ready_count += 1
        if bucket.is_ready:
            self._copy_small_gradients(bucket)
            self._note("ready", f"bucket {bucket.index}")
            if self.launch_during_backward:
                self._launch_ready_buckets()

    def _copy_small_gradients(self, bucket: Bucket) -> None:
        """Copy a batch of small gradients into the bucket in one call, then scale them by 1/W
        in one call per run of neighbours (usually one: after the rebuild, a bucket's gradients
        arrive in its order).

        For a small gradient a call costs more than the arithmetic (a 32x32 weight: ~4 us of
        dispatch for 1,024 multiplies); batching keeps the bits (the same elementwise product)
        and, unlike leaving it all to the bucket's last gradient, keeps the work spread over
        backward instead of delaying the launch.
        """
        if not bucket.small_batch:
            return
        copies = [(bucket.views[p], grad) for p, grad in bucket.small_batch if grad is not None]
        if copies:
            torch._foreach_copy_(*zip(*copies))
        if self._comm_hook is None:
            for run in bucket.runs([position for position, _ in bucket.small_batch]):
                run.mul_(1.0 / self.world_size)
        bucket.small_batch = []
        bucket.small_batch_numel = 0

    def _launch_ready_buckets(self) -> None:
        """Launch buckets strictly in index order, so every rank issues the same collectives in
        the same sequence even if its gradients arrive in a different order."""
        while self._next_bucket < len(self.buckets_) and self.buckets_[self._next_bucket].is_ready:
            bucket = self.buckets_[self._next_bucket]
            self._note("launch", f"bucket {bucket.index}")
            if self._comm_hook is None:
                bucket.pending = dist.all_reduce(
                    bucket.flat, group=self.process_group, async_op=True
                )
            else:
                state, hook = self._comm_hook
                bucket.pending = hook(state, GradBucket(bucket, self.params, self.buckets_))
            self.all_reduce_count += 1
            if self._observed:
                name = f"bucket {bucket.index}"
                future = future_of(bucket.pending)
                future.add_done_callback(lambda _, n=name: self._note("reduced", n))
            self._next_bucket += 1
        if self._next_bucket == len(self.buckets_) and self.find_unused_parameters:
            if self._usage_work is None:
                # Which parameters did *any* rank use? Those unused everywhere keep their .grad.
                self._global_usage = self._locally_used.to(self._comm_device, copy=True)
                self._usage_work = dist.all_reduce(
                    self._global_usage, group=self.process_group, async_op=True
                )

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done."""
        self._note("backward", "end")
        self._launch_ready_buckets()  # nothing left to launch, unless launch_during_backward=False
        self._armed = False
        self._synced_forward_reduced = True
        missing = [self.param_names[i] for i, ready in enumerate(self._marked_ready) if not ready]
        # Each bucket's result goes back to `.grad` as soon as that bucket is reduced, while the
        # later ones are still travelling: copying back everything after the last wait left the
        # whole copy exposed (7 ms of a 75 ms step on the MLP). Unless usage must be known first.
        write_back_each = not missing and not self.find_unused_parameters
        for bucket in self.buckets_:
            if bucket.pending is not None:
                # Like bucket.pending.wait(), but a rank that died, stalled or stopped early is
                # named in the error instead of surfacing as a bare gloo timeout.
                what = f"all-reduce of bucket {bucket.index} ({bucket.nbytes:,} bytes)"
                result = wait_for(bucket.pending, what, self.process_group)
                result = result[0] if isinstance(result, list) else result
                if result.data_ptr() != bucket.flat.data_ptr():
                    bucket.flat.copy_(result)  # a comm hook may answer in a tensor of its own
                self._note("wait", f"bucket {bucket.index}")
                if write_back_each:
                    self._write_back_gradients(bucket, globally_used=None)
        if missing:
            self._ready_order.clear()
            self._locally_used.zero_()
            self._reset_backward_state()
            raise RuntimeError(
                f"These parameters got no gradient in this backward pass: {', '.join(missing)}. "
                "Their buckets were never all-reduced, so gradients are NOT synchronized. Either "
                "make every parameter take part in computing the loss, freeze the unused ones "
                "(requires_grad=False), or construct MiniDDP(..., find_unused_parameters=True)."
            )
        if self._usage_work is not None:
            what = "all-reduce of which parameters were used"
            wait_for(self._usage_work, what, self.process_group)
            globally_used = self._global_usage.tolist()
            for bucket in self.buckets_:
                self._write_back_gradients(bucket, globally_used)
        self._locally_used.zero_()
        self._reset_backward_state()
        self._note("sync", "end")

    def _write_back_gradients(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        """Put each averaged gradient of `bucket` into the `.grad` its hook copied from, in one
        batched kernel call. A parameter that had no gradient gets a copy of its slice."""
        to_fill, averaged = [], []
        for index, grad, view in bucket.copy_back:
            if globally_used is not None and not globally_used[index]:
                continue  # unused on every rank: leave .grad as it was (None stays None)
            if grad is not None:
                to_fill.append(grad)
                averaged.append(view)
            else:
                self.params[index].grad = view if self.gradient_as_bucket_view else view.clone()
        if to_fill:
            torch._foreach_copy_(to_fill, averaged)

    def _reset_backward_state(self) -> None:
        self._armed = False
        self._backward_started = False
        self._unused_in_forward: list[int] = []
        self._marked_ready = [False] * len(self.params)
        self._next_bucket = 0
        self._usage_work = None
        for bucket in self.buckets_:
            bucket.ready_count = 0
            bucket.small_batch = []
            bucket.small_batch_numel = 0
            bucket.copy_back = []
            bucket.pending = None

    def _build_buckets(self, layout: list[list[int]]) -> None:
        self.buckets_ = [Bucket(i, indices, self.params) for i, indices in enumerate(layout)]
        # Where each parameter's gradient goes: (bucket, position, view, is it small).
        self._slot: dict[int, tuple[Bucket, int, torch.Tensor, bool]] = {}
        for bucket in self.buckets_:
            for position, index in enumerate(bucket.param_indices):
                view = bucket.views[position]
                small = view.numel() < self.small_gradient_numel
                self._slot[index] = (bucket, position, view, small)
        if self.gradient_as_bucket_view:
            # Existing gradients move into the new buckets, so `.grad` stays the bucket view.
            for index, param in enumerate(self.params):
                if param.grad is not None:
                    view = self._slot[index][2]
                    view.copy_(param.grad)
                    param.grad = view

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced iteration's forward: rebuild from the observed order.

        Ranks could observe different orders; rank 0's wins, so all ranks keep launching the
        same buckets in the same sequence.
        """
        order = torch.tensor(self._ready_order, dtype=torch.int64, device=self._comm_device)
        self._broadcast(order, "broadcast of the gradient-ready order for the rebuild")
        self._build_buckets(
            rebuilt_layout(self.params, order.tolist(), self.first_bucket_bytes, self.bucket_bytes)
        )
        self.has_rebuilt_buckets = True
        self._ready_order = []
        self._note("rebuild", f"{len(self.buckets_)} buckets")

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite `tensors` with rank 0's values: one flat message per (dtype, device)."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        with torch.no_grad():
            for group in groups.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                nbytes = flat.numel() * flat.element_size()
                self._broadcast(flat, f"broadcast from rank 0 ({nbytes:,} bytes)")
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        src = self._global_rank0()
        work = dist.broadcast(tensor, src=src, group=self.process_group, async_op=True)
        wait_for(work, what, self.process_group)

    def _global_rank0(self) -> int:
        if self.process_group is None:
            return 0
        return dist.get_global_rank(self.process_group, 0)

    def bucket_state(self) -> dict[str, Any]:
        """The bucket layout by parameter name, for checkpoints.

        A fresh MiniDDP starts again from the first-iteration layout; with 3+ ranks gloo's sums
        depend on each gradient's place in its bucket, so an exact resume restores this too.
        """
        return {
            "buckets": [list(info.param_names) for info in self.buckets],
            "rebuilt": self.has_rebuilt_buckets,
            "ready_order": [self.param_names[i] for i in self._ready_order],
        }

    def load_bucket_state(self, state: dict[str, Any]) -> None:
        """Adopt a layout saved by `bucket_state()` (the same on every rank)."""
        index = {name: i for i, name in enumerate(self.param_names)}
        saved = [name for bucket in state["buckets"] for name in bucket]
        if sorted(saved) != sorted(self.param_names):
            raise ValueError(
                "The saved bucket layout names other parameters than this model has "
                f"(saved {len(saved)}, model {len(self.param_names)}): load it into the model "
                "it was saved from."
            )
        self._build_buckets([[index[name] for name in bucket] for bucket in state["buckets"]])
        self._reset_backward_state()
        self.has_rebuilt_buckets = state["rebuilt"]
        self._ready_order = [index[name] for name in state["ready_order"]]

    @property
    def buckets(self) -> list[BucketInfo]:
        """The current bucket layout, in launch order, described for printing."""
        return [bucket.describe(self.param_names) for bucket in self.buckets_]

    def describe_buckets(self) -> str:
        return describe_layout(self.buckets)
