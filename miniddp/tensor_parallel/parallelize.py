"""`parallelize_module(module, group, plan)`: split a model by a plan, in place, as torch does.

The plan maps submodule names (as `named_modules` spells them: "blocks.0.attention.q") to a
style, or is one style for `module` itself. Each named submodule is replaced in its parent by its
split version, holding only this rank's shards, so build the optimizer afterwards. Everything
the plan does not name stays replicated: every rank keeps it whole, computes it on the same
input, and so gets the same gradient (LayerNorms, position embeddings), with no extra talking.

torch's `parallelize_module` takes a DeviceMesh where this one takes a process group; a 1-D mesh
is accepted too, and means its group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from miniddp.tensor_parallel.shards import group_size_and_rank
from miniddp.tensor_parallel.styles import ParallelStyle


def parallelize_module(
    module: nn.Module,
    group: dist.ProcessGroup | Any | None = None,
    plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
) -> nn.Module:
    """Split `module`'s named submodules across `group` (None: the default group); return it."""
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh, as torch's API takes
        group = group.get_group()
    group_size_and_rank(group)  # refuse at once when there is no process group
    if plan is None:
        raise ValueError("give a plan: a style, or {submodule name: ColwiseParallel() ...}")
    if isinstance(plan, ParallelStyle):
        return plan.apply(module, group, "")
    names = dict(module.named_modules())
    unknown = [name for name in plan if name not in names or name == ""]
    if unknown:
        raise ValueError(
            f"the plan names {unknown}, which are not submodules of {type(module).__name__}; "
            f"its submodules are {[n for n in names if n][:20]}"
        )
    for name, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"plan[{name!r}] is {style!r}: give ColwiseParallel() or RowwiseParallel()"
            )
    # Split everything first, then swap: a refused entry leaves the model as it was.
    split = {name: style.apply(names[name], group, name) for name, style in plan.items()}
    for name, replacement in split.items():
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, replacement)
    return module
