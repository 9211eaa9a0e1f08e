"""Mixed precision for MiniDDP: fp32 master parameters, and a bf16 copy that forward and backward
compute with.

    model = MiniDDP(module, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))

Why two copies. A bf16 matmul is faster than a fp32 one, and its activations take half the
bytes. But the update must land in fp32: bf16 keeps 8 significant bits, so a weight of 0.1
moves only in steps of 2^-11 (about 5e-4), and Adam's update of lr = 1e-4 is under half a step:
it rounds away. So the optimizer steps fp32 masters, and each forward computes with a fresh
cast of them. torch's DDP calls this `mixed_precision=_MixedPrecision(...)`, and these are its
names and meanings, but for one default: reduce_dtype is float32 here, param_dtype in torch
(a bf16 sum of W gradients rounds to 8 bits at each addition).

torch's DDP does its reduction as a comm hook of its own, so it takes no other hook. Here the
buckets themselves are in reduce_dtype, so a comm hook gets a bf16 or fp32 bucket like any
other: ZeRO-2's reduce_scatter_hook (miniddp/sharding/zero2.py) runs under mixed precision.

The life of one step, beside MiniDDP's own (ddp.py):

    forward      every master is cast into its copy, and the copies take the masters' places in
                 the module: inside forward and backward, `module.parameters()` are bf16.
                 Floating-point inputs are cast to param_dtype too, as torch's DDP does.
    backward     autograd leaves each bf16 gradient on its copy. The copy's hook adds it into the
                 master's `.grad` (fp32; every bf16 value is exactly a float32), drops the copy's,
                 and hands the master to MiniDDP, whose bucket is in reduce_dtype: the gradient
                 is cast on its way in.
    reduce       each bucket is summed in reduce_dtype, and only then divided by W (bucket.py):
                 torch's DDP mixed-precision hook divides after its sum, and fully_shard reduces
                 with AVG (a sum, then a division), so their averages are these bits at any W.
                 The average is written into the master's fp32 `.grad`, and then the hooks
                 registered on the master run (optimizer in backward: gradient_written).
    backward     the masters take their places back, and the optimizer steps them in fp32.
    ends

Inside `no_sync()` the gradients accumulate in the masters' fp32 `.grad`, as fully_shard's
(FSDP2's) do in reduce_dtype. torch's DDP instead casts the accumulated `.grad` down to bf16 at
each forward (its backward would otherwise meet fp32 and bf16 gradients), so each microbatch's
addition rounds to 8 bits (after k of them, a relative error up to k·2^-9), and
reduce_dtype=float32 then carries bits already lost. The fp32 `.grad` costs nothing more: the
optimizer steps an fp32 master and needs a `.grad` of its dtype, so it exists after the sync
anyway (4Ψ bytes; miniddp/sharding/memory.py counts it).

The buckets count their bytes in reduce_dtype (layout.py): with reduce_dtype=float32, the
layout is fp32 DDP's; with bfloat16, a bucket of the same cap holds twice the elements, so
there are about half as many buckets (as many as tensor boundaries allow).

A pipeline stage runs several forwards before their backwards: each casts again, in a way
autograd does not see as a change (before_forward says why). Without data parallelism,
ComputeInCopies (at the end) gives a module the same copies and folds, with no reduction:
parallelize.py's mixed precision at dp = 1.

float16 works too, with a loss scaler. Its exponent has 5 bits (largest value 65504; below 6e-5
precision fades, below 6e-8 a value is 0), so small gradients underflow unless the loss is
scaled up first: `scaler = torch.amp.GradScaler(device)`, `scaler.scale(loss).backward()`,
`scaler.step(optimizer)`, `scaler.update()`. The scaler unscales the masters' fp32 `.grad`,
which every rank holds alike after the all-reduce, so every rank finds the same inf and skips
the same steps: torch's scaler serves as it is (sharded gradients need
miniddp.sharding.ShardedGradScaler). bfloat16 has float32's 8-bit exponent and needs none.

A forward with grad enabled whose backward never runs leaves the copies in the module until
the next forward: evaluate under `torch.no_grad()`, which puts the masters back at once. Either
way `state_dict()` and `load_state_dict()` put the masters back first, so a checkpoint saves and
restores the fp32 masters, never the copies (which the next forward would overwrite).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd import Variable

from miniddp.data_parallel.autograd_graph import find_tensors, when_backward_reaches


@dataclass(frozen=True)
class MixedPrecision:
    """What MiniDDP computes, reduces and keeps buffers in; the masters stay in their own dtype.

    param_dtype   the copies forward and backward compute with (and the inputs' dtype)
    reduce_dtype  the buckets' dtype: the gradients are summed and averaged in it
    buffer_dtype  what the module's floating-point buffers are cast to, once; None keeps them
    """

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(self, name)
            if dtype is None and name == "buffer_dtype":
                continue
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"MixedPrecision's {name} must be a torch.dtype, got {dtype!r}")
            if not dtype.is_floating_point:
                raise ValueError(
                    f"MixedPrecision's {name} must be a floating-point dtype (e.g. "
                    f"torch.bfloat16), got {dtype}: parameters and gradients are floats."
                )


class Holds(Enum):
    """Which tensors sit in the module's parameter slots."""

    MASTERS = "the masters: outside forward and backward"
    COPIES = "the param_dtype copies: from forward to the end of its backward"


class ComputeCopies:
    """The param_dtype copy of each of a module's floating-point parameters, and their swaps
    with the masters. MiniDDP holds one (`MiniDDP(module, mixed_precision=...)`).

    `trainable` are the masters MiniDDP reduces; `trainable_copies` their copies, in the same
    order: the autograd graph's leaves, where the gradient hooks go. Frozen parameters are cast
    too (they take part in the compute), but get no hook.
    """

    def __init__(
        self, module: nn.Module, policy: MixedPrecision, trainable: Sequence[nn.Parameter]
    ) -> None:
        self.policy = policy
        self.masters = [p for p in module.parameters() if p.is_floating_point()]
        self.copies = [
            nn.Parameter(torch.empty_like(p, dtype=policy.param_dtype), p.requires_grad)
            for p in self.masters
        ]
        copy_of = {id(m): c for m, c in zip(self.masters, self.copies)}
        self.trainable = list(trainable)
        if not all(id(p) in copy_of for p in self.trainable):
            raise ValueError(
                "MixedPrecision casts floating-point parameters only, and this module trains one "
                "that is not (complex?): train it without mixed_precision."
            )
        self.trainable_copies = [copy_of[id(p)] for p in self.trainable]
        # Every slot a master sits in (a tied weight sits in two): its copy takes each in turn.
        self._slots = [
            (sub, name, master, copy_of[id(master)])
            for sub in module.modules()
            for name, master in sub._parameters.items()
            if master is not None and id(master) in copy_of
        ]
        self.holds = Holds.MASTERS
        # A checkpoint reads and writes the masters, whatever sits in the slots (the docstring).
        module.register_state_dict_pre_hook(lambda *_: self._put(Holds.MASTERS))
        module.register_load_state_dict_pre_hook(lambda *_: self._put(Holds.MASTERS))
        if policy.buffer_dtype is not None:
            for buffer in module.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(policy.buffer_dtype)  # the same object, as torch

    def before_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Cast every master into its copy, put the copies in the module, and cast the inputs.

        The cast writes through `.data`, which autograd does not count as a change. Why: a
        pipeline stage runs several microbatches' forwards before their backwards (1F1B: F0 F1
        B0 F2 B1 ...), and each graph saved the copies it computed with. An in-place cast bumps
        their version counters, and autograd would refuse a pending backward ("modified by an
        inplace operation"), though it writes the same values: the masters move only at the
        optimizer's step, after every backward. (Casting only when a master's version moved
        would miss a fused optimizer's step: torch's AdamW(fused=True) bumps no counter.)"""
        with torch.no_grad():
            torch._foreach_copy_([copy.data for copy in self.copies], self.masters)
        self._put(Holds.COPIES)
        dtype = self.policy.param_dtype

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(dtype) if tensor.is_floating_point() else tensor

        return pytree.tree_map_only(torch.Tensor, cast, (inputs, kwargs))

    def after_forward(self, output: Any) -> None:
        """The masters go back when this forward's backward ends, or now if none will run
        (grad disabled, or nothing in the output needs it)."""
        needs_backward = torch.is_grad_enabled() and any(
            t.requires_grad for t in find_tensors(output)
        )
        if not needs_backward:
            self._put(Holds.MASTERS)
            return
        # Queued when backward reaches the output: it runs when the outermost backward ends (a
        # checkpointed block recomputes inside it with the copies), before the optimizer steps.
        queue = Variable._execution_engine.queue_callback
        when_backward_reaches(output, lambda: queue(lambda: self._put(Holds.MASTERS)))

    def fold_then(self, on_ready: Callable[[int, torch.Tensor], None]) -> Callable:
        """The hook for copy `index`: move its gradient into the master's fp32 `.grad` (set it,
        or add to what no_sync accumulated), drop the copy's, then `on_ready(index, master)`."""

        def hook(index: int, copy: torch.Tensor) -> None:
            master, grad = self.trainable[index], copy.grad
            copy.grad = None
            if master.grad is None:
                master.grad = grad.to(master.dtype)
            else:
                master.grad.add_(grad)  # bf16 -> fp32 is exact; the one rounding is fp32's
            on_ready(index, master)

        return hook

    def copies_of(self, masters: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """The copies of these trainable masters, in their order."""
        copy = {id(m): c for m, c in zip(self.trainable, self.trainable_copies)}
        return [copy[id(master)] for master in masters]

    def fold_alone(self, indices: Iterable[int]) -> list:
        """Hooks on copies `indices` that fold each gradient into its master and run the
        master's own hooks, with no reduction: every parameter of ComputeInCopies, and those
        MiniDDP leaves to someone else to reduce (torch's params-to-ignore)."""
        fold = self.fold_then(lambda index, master: self.gradient_written(master))
        return [
            self.trainable_copies[index].register_post_accumulate_grad_hook(partial(fold, index))
            for index in indices
        ]

    @staticmethod
    def gradient_written(master: torch.Tensor) -> None:
        """Run the post-accumulate-grad hooks registered on `master`, now that its `.grad` holds
        this backward's gradient. Autograd runs a leaf's hooks when it accumulates into it, but
        the graph's leaves are the copies: the masters' `.grad` is written here (the fold) and
        by MiniDDP (the average), and their hooks, where optimizer-in-backward steps
        (`p.register_post_accumulate_grad_hook` on `model.parameters()`), would never run. So
        they run once each master's gradient is final: after the average in a synced backward,
        after the fold otherwise, as fully_shard runs them on each reduced shard."""
        for hook in (master._post_accumulate_grad_hooks or {}).values():
            hook(master)

    def averaged(
        self, indices: Sequence[int], masters: Sequence[torch.Tensor], used: Sequence[bool] | None
    ) -> None:
        """MiniDDP wrote these masters' averages (a bucket's `indices` and parameters): each
        master's gradient is final now, but for one no rank `used`, whose `.grad` stayed."""
        for index, master in zip(indices, masters):
            if master.grad is not None and (used is None or used[index]):
                self.gradient_written(master)

    def _put(self, holds: Holds) -> None:
        """Swap masters or copies into the module's slots. setattr, not `_parameters[name]`,
        so that modules that keep their own references (nn.LSTM's flat weights) follow."""
        if holds is self.holds:
            return
        for sub, name, master, copy in self._slots:
            setattr(sub, name, copy if holds is Holds.COPIES else master)
        self.holds = holds


class ComputeInCopies(nn.Module):
    """`module` computing in `policy.param_dtype` on its fp32 masters, with no data parallelism:
    the casts and swaps MiniDDP(module, mixed_precision=policy) makes, and its fold of each
    copy's gradient into the master's fp32 `.grad`, without the buckets and the all-reduce.

    For a rank that holds no replica to average with (a TP x PP mesh, dp = 1): it computes
    exactly what one MiniDDP replica computes, so a mesh with dp = 1 and one with dp > 1 differ
    by the average alone. No `no_sync` here: a pipeline stage reads its presence as data
    parallelism inside (pipeline/stage.py), and there is nothing to hold back.
    """

    def __init__(self, module: nn.Module, policy: MixedPrecision) -> None:
        super().__init__()
        self.module = module
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._copies = ComputeCopies(module, policy, trainable)  # as MiniDDP names it
        self._hooks = self._copies.fold_alone(range(len(trainable)))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._copies.before_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        self._copies.after_forward(output)
        return output
