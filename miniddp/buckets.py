"""Buckets: which gradients travel together, and the flat tensors they travel in.

Sending every gradient as its own all-reduce pays the network's latency once per tensor; sending
them all at once waits for the whole backward pass. A bucket is the compromise: gradients are
packed into flat tensors of about `bucket_cap_mb` each, and a bucket's all-reduce starts as soon
as its last gradient is ready, while backward keeps computing the rest.

The layout rules below are torch's DDP rules, reproduced exactly so that MiniDDP's results are
bit-for-bit torch's (with 3+ ranks gloo's sum depends on each gradient's offset in the bucket):

- walk the parameters in a given order; each (dtype, device) pair fills its own running bucket;
- add the tensor first, *then* close the bucket if its bytes reached the cap (so a bucket can
  overshoot by one tensor, and a tensor is never split);
- the first bucket of each (dtype, device) may have a smaller cap (1 MiB by default) so the
  gradients that are ready first start travelling early.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def assign_buckets(
    tensors: Sequence[torch.Tensor], order: Sequence[int], size_limits: Sequence[int]
) -> list[list[int]]:
    """Group tensor indices into buckets, walking `order`.

    `size_limits` are the caps of the first, second, ... bucket of each (dtype, device); the last
    one repeats. Buckets come out in the order they closed, then the partly filled ones in the
    order their dtypes first appeared (torch takes those from a hash map, in no promised order;
    which bucket launches first does not change any value).
    """
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    buckets_closed: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[int]] = []
    for index in order:
        tensor = tensors[index]
        key = (tensor.dtype, tensor.device)
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + _nbytes(tensor)
        limit = size_limits[min(buckets_closed.get(key, 0), len(size_limits) - 1)]
        if open_bytes[key] >= limit:
            closed.append(open_buckets.pop(key))
            open_bytes[key] = 0
            buckets_closed[key] = buckets_closed.get(key, 0) + 1
    return closed + [bucket for bucket in open_buckets.values() if bucket]


def initial_layout(
    params: Sequence[torch.Tensor], first_cap: int, cap: int, find_unused_parameters: bool
) -> list[list[int]]:
    """The layout before any backward pass has been seen, in launch order.

    Parameters are assumed to be used in the order they were registered, so their gradients are
    expected in reverse: bucket 0 holds the *last* parameters. torch's default goes further: it
    does not trust registration order at all and puts everything in one bucket per dtype for the
    first iteration (no overlap yet), then rebuilds from the order it observed
    (`rebuilt_layout`). With `find_unused_parameters` the graph may change every iteration, so the
    capped layout is built now and never rebuilt.
    """
    if find_unused_parameters:
        limits = [first_cap, cap] if first_cap < cap else [cap]
    else:
        limits = [sys.maxsize]
    buckets = assign_buckets(params, range(len(params)), limits)
    buckets.sort(key=min)
    return buckets[::-1]


def rebuilt_layout(
    params: Sequence[torch.Tensor], ready_order: Sequence[int], first_cap: int, cap: int
) -> list[list[int]]:
    """The layout rebuilt from the order in which gradients actually became ready.

    The first bucket gets the earliest gradients and the small cap, so communication starts as
    early as the backward pass allows.
    """
    return assign_buckets(params, ready_order, [first_cap, cap])


@dataclass(frozen=True)
class BucketInfo:
    """A bucket described for people: what a tutorial prints."""

    index: int
    param_names: tuple[str, ...]
    numels: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype


class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    Each parameter owns a fixed slice (`views[i]`, shaped like the parameter); its hook copies
    the gradient there. When `ready_count` reaches the number of parameters, the whole flat
    tensor goes out in a single all-reduce.
    """

    def __init__(self, index: int, param_indices: Sequence[int], params: Sequence[torch.Tensor]):
        self.index = index
        self.param_indices = list(param_indices)
        members = [params[i] for i in self.param_indices]
        total = sum(p.numel() for p in members)
        self.flat = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
        self.numels = [p.numel() for p in members]
        self.shapes = [p.shape for p in members]
        self.views = self.split(self.flat)
        self.offsets = [0, *itertools.accumulate(self.numels)]  # where each view starts
        self.ready_count = 0
        # Small gradients waiting to be copied in and scaled, as (position, gradient), or
        # (position, None) where only the scaling waits; and how many elements they hold
        self.small_batch: list[tuple[int, torch.Tensor | None]] = []
        self.small_batch_numel = 0
        # (parameter index, the .grad to fill, its view) for every gradient copied in
        self.copy_back: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        # The in-flight all-reduce: the Work torch's returned, or the future a comm hook did
        self.pending: dist.Work | torch.futures.Future | None = None

    def __len__(self) -> int:
        return len(self.param_indices)

    def runs(self, positions: Sequence[int]) -> list[torch.Tensor]:
        """Slices of `flat` covering the views at `positions`, one per run of neighbours."""
        positions = sorted(positions)
        runs, first = [], 0
        for i in range(1, len(positions) + 1):
            if i == len(positions) or positions[i] != positions[i - 1] + 1:
                start, end = self.offsets[positions[first]], self.offsets[positions[i - 1] + 1]
                runs.append(self.flat[start:end])
                first = i
        return runs

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Cut a bucket-shaped flat tensor into one view per parameter, shaped like it."""
        return [piece.view(shape) for piece, shape in zip(flat.split(self.numels), self.shapes)]

    @property
    def is_ready(self) -> bool:
        return self.ready_count == len(self)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.flat)

    def describe(self, names: Sequence[str]) -> BucketInfo:
        return BucketInfo(
            index=self.index,
            param_names=tuple(names[i] for i in self.param_indices),
            numels=tuple(v.numel() for v in self.views),
            nbytes=self.nbytes,
            dtype=self.flat.dtype,
        )


def describe_layout(infos: Sequence[BucketInfo]) -> str:
    """A table of buckets in launch order, one row per parameter."""
    lines = [f"{'bucket':>6}  {'bytes':>10}  {'dtype':<8}  parameters (elements)"]
    for info in infos:
        params = ", ".join(f"{n} ({k})" for n, k in zip(info.param_names, info.numels))
        dtype = str(info.dtype).removeprefix("torch.")
        lines.append(f"{info.index:>6}  {info.nbytes:>10,}  {dtype:<8}  {params}")
    return "\n".join(lines)


class GradBucket:
    """What a communication hook receives: torch's `dist.GradBucket` interface over a Bucket.

    The methods mirror torch's, so hooks written for torch's DDP run on MiniDDP unchanged.
    """

    def __init__(self, bucket: Bucket, params: Sequence[torch.Tensor], buckets: Sequence[Bucket]):
        self._bucket = bucket
        self._params = params
        self._is_last = bucket is buckets[-1]

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
        return [self._params[i] for i in self._bucket.param_indices]

    def is_last(self) -> bool:
        return self._is_last
