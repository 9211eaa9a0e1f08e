"""A bucket: the flat tensor a group of gradients travels in, and its life in one backward.

Which gradients share a bucket, and in which order buckets launch, is decided in
miniddp/data_parallel/layout.py; this file is what one bucket does with them. Each bucket holds
its model's `Reducer` (default_hooks.py), so a full bucket launches and is waited for by itself:
MiniDDP only says when, and hands it nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BucketInfo:
    """A bucket described for people: what a tutorial prints."""

    index: int
    param_names: tuple[str, ...]
    numels: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype


class Bucket:
    """One flat gradient buffer that runs its own life, once per backward pass:

        add(position)   a gradient is ready: copy it in, scaled by 1/W, into its slice
        is_full         every slice is filled: the bucket can travel
        launch()        start its all-reduce through its reducer (`pending` holds the handle)
        wait()          block until the sum has arrived
        write_back()    copy each averaged slice into the `.grad` it came from
        reset()         forget this backward, ready for the next

    Each parameter owns a fixed slice of `flat` (`views[i]`, shaped like the parameter), so one
    all-reduce of `flat` averages every gradient in it at once.

    Under mixed precision (compute_copies.py) `flat` is in `reduce_dtype`, each gradient is
    cast on its way in, and the sum is divided by W after it arrives (in `wait`), where torch's
    DDP would multiply each gradient by 1/W first: torch's DDP mixed precision and fully_shard
    both divide after the sum, and at W = 3 the two orders differ in the last bit.
    """

    small_gradient_numel = 16_384  # see _copy_small_gradients

    def __init__(
        self,
        index: int,
        param_indices: Sequence[int],
        params: Sequence[torch.Tensor],
        gradient_as_bucket_view: bool = False,
        reduce_dtype: torch.dtype | None = None,
        reducer: Any = None,
        is_last: bool = False,
    ) -> None:
        self.index = index
        self.param_indices = list(param_indices)
        self.params = [params[i] for i in self.param_indices]
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.reduce_dtype = reduce_dtype  # mixed precision's; None: the parameters' own dtype
        self.reducer = reducer  # its model's Reducer (default_hooks.py): what it travels through
        self.is_last = is_last  # the last of its layout: a comm hook's GradBucket.is_last()
        total = sum(p.numel() for p in self.params)
        dtype = reduce_dtype or self.params[0].dtype
        self.flat = torch.zeros(total, dtype=dtype, device=self.params[0].device)
        self.views = [
            piece.view_as(p)
            for piece, p in zip(self.flat.split([p.numel() for p in self.params]), self.params)
        ]
        self._small_runs = [] if gradient_as_bucket_view else self._runs_of_small_gradients()
        self.reset()

    def reset(self) -> None:
        self.filled = 0
        # (position, the .grad it was copied from, or None): where write_back() puts the average;
        # empty for gradients that already live in the bucket (gradient_as_bucket_view)
        self.sources: list[tuple[int, torch.Tensor | None]] = []
        # the in-flight all-reduce: the Work torch returned, or the future a comm hook did
        self.pending: dist.Work | torch.futures.Future | None = None
        self._small: list[tuple[int, torch.Tensor]] = []  # see _copy_small_gradients
        self.divide_after_sum = 1  # mixed precision: W, set by add()
        self.skipped = False  # see skip()

    def skip(self) -> None:
        """No parameter of this bucket takes part in this backward, and the wrapper was told
        (skip_all_reduce_unused_params) that none does on any rank either: it counts as full,
        never travels, and leaves every `.grad` in it as it is, what no_sync accumulated too."""
        self.filled = len(self.params)
        self.skipped = True

    def add(self, position: int, divide_by: int) -> None:
        """Copy the gradient of parameter `position` into its slice, divided by `divide_by`
        (the world size; 1 when a comm hook averages instead).

        torch multiplies by the float 1/W while copying, one pass over the gradient; `g / W`
        or dividing after the sum would differ in the last bit when W is not a power of two.
        A parameter with no gradient (unused in this backward) contributes zeros.
        """
        if self.reduce_dtype is not None:  # mixed precision: copied as is, divided after the sum
            self.divide_after_sum, divide_by = divide_by, 1
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
        elif grad.numel() < self.small_gradient_numel:
            self._small.append((position, grad))  # copied when the bucket is full
            self.sources.append((position, grad))
        else:
            torch.mul(grad, 1.0 / divide_by, out=view)
            self.sources.append((position, grad))
        self.filled += 1
        if self.is_full:
            self._copy_small_gradients(divide_by)

    def _copy_small_gradients(self, divide_by: int) -> None:
        """A speed trick; skip it on a first reading (its measured effect: docs/PERFORMANCE.md).
        Copying one gradient costs a few microseconds of Python and dispatch however small it
        is, so gradients under `small_gradient_numel` elements wait for the bucket to fill, then
        all go in with one batched copy. Neighbouring small gradients then share one slice of
        `flat` (a run), scaled by 1/W in one multiplication: the same products as one each, so
        the same bits. (A small parameter without a gradient holds zeros, which scale to zeros.)"""
        if self._small:
            views = [self.views[position] for position, _ in self._small]
            torch._foreach_copy_(views, [grad for _, grad in self._small])
            self._small = []
        if self._small_runs:
            # 1/W as a tensor of the bucket's dtype: the factor a Python float would become,
            # which _foreach_mul_ takes without converting it once per run
            scale = torch.tensor(1.0 / divide_by, dtype=self.flat.dtype, device=self.flat.device)
            torch._foreach_mul_(self._small_runs, scale)

    def _runs_of_small_gradients(self) -> list[torch.Tensor]:
        """The slices of `flat` that hold consecutive gradients under `small_gradient_numel`."""
        runs, start, offset = [], None, 0
        for param in self.params:
            small = param.numel() < self.small_gradient_numel
            if small and start is None:
                start = offset
            if not small and start is not None:
                runs.append(self.flat[start:offset])
                start = None
            offset += param.numel()
        if start is not None:
            runs.append(self.flat[start:offset])
        return runs

    @property
    def is_full(self) -> bool:
        return self.filled == len(self.params)

    def launch(self) -> None:
        """Start summing `flat` across ranks through its reducer, which returns at once."""
        self.pending = self.reducer.all_reduce(self)

    def wait(self) -> None:
        """Block until the sum is in `flat`, at the reducer's wait seam (it names a rank that
        never joined the all-reduce)."""
        if self.skipped:
            return
        what = f"all-reduce of bucket {self.index} ({self.nbytes:,} bytes)"
        result = self.reducer.wait(self.pending, what)
        result = result[0] if isinstance(result, list) else result
        if isinstance(result, torch.Tensor) and result.data_ptr() != self.flat.data_ptr():
            self.flat.copy_(result)  # a comm hook may answer in a tensor of its own
        if self.divide_after_sum != 1:
            self.flat.div_(self.divide_after_sum)
        self.pending = None

    def write_back(self, used: Sequence[bool] | None = None) -> None:
        """Put each average into the `.grad` its gradient was copied from. A parameter that had
        no gradient gets its slice; one that `used` says no rank used keeps `.grad` as it was
        (None stays None), as torch's find_unused_parameters does."""
        if self.skipped:
            return
        averaged, into = [], []
        for position, grad in self.sources:
            if used is not None and not used[self.param_indices[position]]:
                continue
            view = self.views[position]
            if grad is not None:
                averaged.append(view)
                into.append(grad)
            else:
                param = self.params[position]
                param.grad = (
                    view if self.gradient_as_bucket_view else view.to(param.dtype, copy=True)
                )
        self._copy_all(averaged, into)

    @staticmethod
    def _copy_all(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """`target.copy_(source)` for each pair, in one call: a speed trick (docs/PERFORMANCE.md).
        One `copy_` costs a few microseconds of Python and dispatch however small the gradient,
        and a bucket may hold hundreds; `_foreach_copy_` loops in C++, with the same bits."""
        if targets:
            torch._foreach_copy_(targets, sources)

    def shadow(self, params: Sequence[torch.Tensor]) -> Bucket:
        """A bucket of zeros in this one's place, through the same reducer: what a rank that
        joined (Join, join.py) all-reduces instead, so that its own gradients, which may live
        in this bucket (gradient_as_bucket_view), stay as they are. Adding zeros changes no
        bit of the others' sum."""
        return Bucket(
            self.index,
            self.param_indices,
            params,
            reduce_dtype=self.reduce_dtype,
            reducer=self.reducer,
            is_last=self.is_last,
        )

    def adopt_gradients(self) -> None:
        """With gradient_as_bucket_view: move existing `.grad`s into this (new) bucket, so that
        `.grad` stays a view of the bucket across a rebuild."""
        for param, view in zip(self.params, self.views):
            if param.grad is not None:
                view.copy_(param.grad)
                param.grad = view

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

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
