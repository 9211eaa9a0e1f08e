"""The bucket layout: which gradients travel together, and how that is decided over time.

Sending every gradient as its own all-reduce pays the network's latency once per tensor; sending
them all at once waits for the whole backward pass. A bucket is the compromise: gradients are
packed into flat tensors of about `bucket_cap_mb` each, and a bucket's all-reduce starts as soon
as its last gradient is ready, while backward keeps computing the rest.

The rules below are torch's DDP rules, reproduced exactly so that MiniDDP's results are
bit-for-bit torch's (with 3+ ranks gloo's sum depends on each gradient's offset in the bucket):

- walk the parameters in a given order; each (dtype, device) pair fills its own running bucket;
- add the tensor first, *then* close the bucket if its bytes reached the cap (so a bucket can
  overshoot by one tensor, and a tensor is never split);
- the first bucket of each (dtype, device) may have a smaller cap (1 MiB by default) so the
  gradients that are ready first start travelling early.

Under mixed precision every gradient travels in `reduce_dtype`, and the caps weigh it so: a
bf16 bucket of 25 MiB holds twice the elements of a fp32 one, so there are about half as many
buckets (compute_copies.py).

And the layout's life (`BucketLayout`): one bucket per dtype until a backward pass has shown in
which order gradients really arrive, then one rebuild from that order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from miniddp.data_parallel.bucket import Bucket, BucketInfo
from miniddp.data_parallel.default_hooks import Reducer

MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """Return (first bucket's cap, every other bucket's cap) in bytes, as torch computes them.

    `None` means torch's default: 25 MiB, with a 1 MiB first bucket. An explicit value applies to
    every bucket, the first included.
    """
    if bucket_cap_mb is None:
        return DEFAULT_FIRST_BUCKET_BYTES, int(DEFAULT_BUCKET_CAP_MB * MiB)
    is_number = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if not is_number or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
        raise ValueError(
            f"bucket_cap_mb must be a positive, finite number of MiB, got {bucket_cap_mb!r}. "
            "Use e.g. 25 (torch's default), 1, or a tiny value such as 0.0001 to give every "
            "parameter its own bucket; None keeps the default."
        )
    cap = int(bucket_cap_mb * MiB)
    return cap, cap


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
        reduce_dtype: torch.dtype | None = None,
        reducer: Reducer | None = None,
    ) -> None:
        if gradient_as_bucket_view and any(p.dtype != (reduce_dtype or p.dtype) for p in params):
            raise ValueError(
                f"gradient_as_bucket_view makes each .grad a view of its bucket, so the bucket "
                f"must be in the parameters' dtype, and reduce_dtype={reduce_dtype} is not. Use "
                "MixedPrecision(reduce_dtype=<the parameters' dtype>), or "
                "gradient_as_bucket_view=False."
            )
        self.params = params
        self.first_cap, self.cap = bucket_caps(bucket_cap_mb)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.reduce_dtype = reduce_dtype
        self.reducer = reducer or Reducer(None)  # what every bucket travels through
        # What the caps weigh: each gradient as it travels. Under mixed precision, a stand-in
        # of its shape in reduce_dtype (on the meta device: a shape and a dtype, no memory).
        self.in_flight = params
        if reduce_dtype is not None:
            meta = [torch.empty_like(p, dtype=reduce_dtype, device="meta") for p in params]
            self.in_flight = meta
        # With unused parameters the graph may change every iteration: no order worth recording.
        self.has_rebuilt = find_unused_parameters
        self.ready_order: list[int] = []  # gradient arrival order in the first synced backward
        caps = (self.first_cap, self.cap)
        self.build(initial_layout(self.in_flight, *caps, find_unused_parameters))

    def build(self, groups: list[list[int]]) -> None:
        self.buckets = [
            Bucket(
                i,
                indices,
                self.params,
                self.gradient_as_bucket_view,
                self.reduce_dtype,
                self.reducer,
                is_last=i == len(groups) - 1,
            )
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
        self.build(assign_buckets(self.in_flight, ready_order, self.first_cap, self.cap))
        self.has_rebuilt = True
        self.ready_order = []

    def start_over_for_static_graph(self) -> None:
        """static_graph takes over from find_unused_parameters (ddp.py): as in torch, buckets
        start as one per dtype, and are rebuilt once the order has been seen."""
        self.has_rebuilt = False
        self.build(initial_layout(self.in_flight, self.first_cap, self.cap, False))

    def skip_buckets_within(self, unused: set[int]) -> list[int]:
        """skip_all_reduce_unused_params: skip each bucket whose parameters are all `unused` by
        this backward (it stays home, its `.grad`s as they are); their indices."""
        skipped = [b for b in self.buckets if unused.issuperset(b.param_indices)]
        for bucket in skipped:
            bucket.skip()
        return [index for bucket in skipped for index in bucket.param_indices]

    def describe(self, names: Sequence[str]) -> list[BucketInfo]:
        return [bucket.describe(names) for bucket in self.buckets]

    def state(self, names: Sequence[str]) -> dict[str, Any]:
        """The layout by parameter name, for checkpoints: with 3+ ranks gloo's sums depend on
        each gradient's place in its bucket, so an exact resume restores it too."""
        return {
            "buckets": [list(info.param_names) for info in self.describe(names)],
            "rebuilt": self.has_rebuilt,
            "ready_order": [names[i] for i in self.ready_order],
        }

    def load_state(self, state: dict[str, Any], names: Sequence[str]) -> None:
        """Adopt a layout saved by `state()` (the same on every rank)."""
        index = {name: i for i, name in enumerate(names)}
        saved = [name for bucket in state["buckets"] for name in bucket]
        if sorted(saved) != sorted(names):
            raise ValueError(
                "The saved bucket layout names other parameters than this model has "
                f"(saved {len(saved)}, model {len(names)}): load it into the model it was "
                "saved from."
            )
        self.build([[index[name] for name in bucket] for bucket in state["buckets"]])
        self.has_rebuilt = state["rebuilt"]
        self.ready_order = [index[name] for name in state["ready_order"]]
