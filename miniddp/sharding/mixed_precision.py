"""fully_shard's mixed precision: compute in bf16, keep fp32 masters, with torch's names.

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

Where each dtype lives, in one step of a unit (as torch's FSDP2 does, bit for bit at W = 2):

    shard (the master, stepped by the optimizer)  fp32 (the module's own dtype)
    all-gather                                    param_dtype: each shard is cast first, so the
                                                  gather moves half the bytes
    full parameters, forward and backward         param_dtype; so are the activations saved
    full gradients, from autograd                 param_dtype
    reduce-scatter (and no-sync accumulation)     reduce_dtype: each full gradient is cast on its
                                                  way into the flat buffer
    shard's gradient (.grad), optimizer state     fp32 again: the reduced shard is cast back

Only the shard is fp32, so the fp32 copy costs no extra memory: ZeRO-3 keeps it anyway.

Bit for bit torch's at W = 2. At W >= 3: with reduce_dtype=float32, still bit for bit (a sum of
bf16 gradients is exact in fp32, and the one division by W is gloo's AVG's); with bf16, within
an ulp or two of bf16 (the three-term sum rounds in another order, fully_shard.py says why):
about 5e-5 in the parameters after three AdamW steps at lr 0.01.

float16 works too, with a loss scaler: bf16 has fp32's 8 exponent bits, so gradients neither
overflow nor vanish; fp16 has 5, and small gradients underflow to zero unless the loss is scaled
first and the gradients unscaled after. Sharded gradients need the ranks to agree on an overflow:
use miniddp.sharding.ShardedGradScaler (loss_scaling.py), torch.amp.GradScaler's interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch.distributed.fsdp.MixedPrecisionPolicy's fields and meaning.

    param_dtype: the dtype of the all-gather and of the full parameters in forward and
        backward; None keeps the parameters' own.
    reduce_dtype: the dtype of the gradients' reduce-scatter; None means param_dtype.
    output_dtype: the unit's floating-point outputs are cast to it; None leaves them.
    cast_forward_inputs: cast the unit's floating-point inputs to param_dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is None:
                continue
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy's {name} must be a floating-point torch.dtype (such "
                    f"as torch.bfloat16), or None; got {dtype!r}"
                )

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype of the full parameters, for masters of dtype `master`."""
        return self.param_dtype or master

    def gradient_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced (and accumulated without sync) in."""
        return self.reduce_dtype or self.compute_dtype(master)

    def cast_inputs(self, args: Any, kwargs: dict) -> tuple[Any, dict] | None:
        """The unit's inputs in param_dtype; None where nothing is cast."""
        if not (self.cast_forward_inputs and self.param_dtype):
            return None
        return _cast(self.param_dtype, (args, kwargs))

    def cast_output(self, output: Any) -> Any:
        return output if self.output_dtype is None else _cast(self.output_dtype, output)


def _cast(dtype: torch.dtype, tree: Any) -> Any:
    def one(x: Any) -> Any:
        if torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(one, tree)


def refuse_a_child_in_another_dtype(parent: Any, child: Any) -> None:
    """`parent` and `child`: two units (fully_shard's ShardedParameters: a name, a policy, a
    compute dtype), the child directly inside the parent.

    A unit computing in one dtype inside a parent computing in another hands its output to the
    parent's layers in the wrong dtype, and they fail at the first forward ("mat1 and mat2 must
    have the same dtype"). torch's FSDP2 lets each unit have its own policy and fails there;
    MiniDDP refuses at the parent's fully_shard, unless the child converts at both of its edges,
    torch's idiom for a layer kept in fp32: its inputs cast to its param_dtype, its outputs back
    to the parent's dtype (output_dtype)."""
    policy, dtype, parent_dtype = child.policy, child.compute_dtype, parent.compute_dtype
    if dtype == parent_dtype:
        return
    if policy.param_dtype and policy.cast_forward_inputs and policy.output_dtype == parent_dtype:
        return
    raise ValueError(
        f"{child.name} computes in {dtype}, inside {parent.name}, which computes in "
        f"{parent_dtype}: its outputs would reach the parent's layers in the wrong dtype. Give "
        f"both the same mp_policy, or give the child MixedPrecisionPolicy(param_dtype={dtype}, "
        f"output_dtype={parent_dtype})."
    )
