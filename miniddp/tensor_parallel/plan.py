"""The plan: which module splits how (ColwiseParallel, RowwiseParallel, torch's names), and
`parallelize_module`, which applies a plan to a model.

ColwiseParallel and RowwiseParallel: how to split one module, named as torch names them.

A style is a small object with one method, `apply(module, group, name)`, that returns the module
split across `group`. They take one option: by default torch's default layouts (colwise:
replicated input, output sharded on the last dim; rowwise: input sharded on the last dim,
replicated output), with `sequence_parallel=True` Megatron-SP's (layers.py): the colwise input
and the rowwise output are this rank's positions, torch.chunk(x, W, 1)[rank], as torch's
ColwiseParallel(input_layouts=Shard(1)) and RowwiseParallel(output_layouts=Shard(1)) take and
give them. The outputs are plain local tensors, as with torch's `use_local_output=True`.

    module         ColwiseParallel()              RowwiseParallel()
    nn.Linear      ColwiseLinear: rows of A       RowwiseLinear: columns of A, bias after g
    nn.Embedding   ColwiseEmbedding: width        VocabParallelEmbedding: vocabulary rows

    module         SequenceParallel() (torch's name): the module whole, on [B, S/W, H]
    nn.LayerNorm   SequenceParallelLayerNorm: weight and bias entered through f
    nn.RMSNorm     SequenceParallelRMSNorm: its weight entered through f
    nn.Dropout     itself: it acts on each element alone. Seed the ranks of a group
                   differently (Megatron's tensor-parallel RNG tracker), or their shards draw
                   the same mask

`parallelize_module(module, group, plan)`: split a model by a plan, in place, as torch does.

The plan maps submodule names (as `named_modules` spells them: "blocks.0.attention.q") to a
style, or is one style for `module` itself. Each named submodule is replaced in its parent by its
split version, holding only this rank's shards, so build the optimizer afterwards. Everything
the plan does not name stays replicated: every rank keeps it whole, computes it on the same
input, and so gets the same gradient (LayerNorms, position embeddings), with no extra talking.

torch's `parallelize_module` takes a DeviceMesh where this one takes a process group; a 1-D mesh
is accepted too, and means its group.

A style is anything with that one `apply` method (`Style`, a structural protocol), not only a
ParallelStyle: expert parallelism's ExpertParallel (miniddp/expert_parallel/, torchtitan's name)
goes through this same `parallelize_module` without either package importing the other, as
floor 2's parallelisms never do. Each style checks that this rank is in the group it is given,
and names its kind of group when it is not.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch import nn

from miniddp.job.env import HOW_TO_LAUNCH
from miniddp.tensor_parallel.layers import (
    ColwiseEmbedding,
    ColwiseLinear,
    RowwiseLinear,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    group_size_and_rank,
)


@runtime_checkable
class Style(Protocol):
    """What `parallelize_module` asks of a style: split `module` (named `name` in the model)
    across `group`, and return what replaces it."""

    def apply(self, module: nn.Module, group: dist.ProcessGroup | None, name: str) -> nn.Module:
        """The split module, holding this rank's part only."""
        ...


class ParallelStyle:
    """Split one module: the kinds of module a style knows, and the class that splits each
    (`sequence_parallel` reaches the linear layers only)."""

    splits: dict[type[nn.Module], Any] = {}

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        self.sequence_parallel = sequence_parallel

    def apply(self, module: nn.Module, group: dist.ProcessGroup | None, name: str) -> nn.Module:
        group_size_and_rank(group)  # refuse a group without this rank, naming it tensor-parallel
        for kind, split in self.splits.items():
            if type(module) is not kind:  # a subclass may compute something else with its weight
                continue
            if not self.sequence_parallel:
                return split(module, group, name)
            if kind is not nn.Linear:
                raise ValueError(
                    f"{self!r} splits nn.Linear only, but {name or 'the module'} is a "
                    f"{kind.__name__}: give it {type(self).__name__}() without "
                    "sequence_parallel, and gather or scatter the sequence around it yourself"
                )
            return split(module, group, name, sequence_parallel=True)
        known = " and ".join(k.__name__ for k in self.splits)
        raise TypeError(
            f"{type(self).__name__} splits {known} only, but {name or 'the module'} is a "
            f"{type(module).__name__}: name its {known} submodules in the plan instead"
        )

    def __repr__(self) -> str:
        options = "sequence_parallel=True" if self.sequence_parallel else ""
        return f"{type(self).__name__}({options})"


class ColwiseParallel(ParallelStyle):
    """Keep chunk(weight, W, 0)[rank] of an nn.Linear (chunk(weight, W, 1) of an nn.Embedding)."""

    splits = {nn.Linear: ColwiseLinear, nn.Embedding: ColwiseEmbedding}


class RowwiseParallel(ParallelStyle):
    """Keep chunk(weight, W, 1)[rank] of an nn.Linear (chunk(weight, W, 0) of an nn.Embedding)."""

    splits = {nn.Linear: RowwiseLinear, nn.Embedding: VocabParallelEmbedding}


def _whole(module: nn.Module, group: dist.ProcessGroup | None, name: str) -> nn.Module:
    return module


class SequenceParallel(ParallelStyle):
    """Run an nn.LayerNorm, nn.RMSNorm or nn.Dropout whole on this rank's positions [B, S/W, H]."""

    splits = {
        nn.LayerNorm: SequenceParallelLayerNorm,
        nn.RMSNorm: SequenceParallelRMSNorm,
        nn.Dropout: _whole,
    }

    def __init__(self) -> None:
        super().__init__()


def parallelize_module(
    module: nn.Module,
    group: dist.ProcessGroup | Any | None = None,
    plan: Style | dict[str, Style] | None = None,
) -> nn.Module:
    """Split `module`'s named submodules across `group` (None: the default group); return it."""
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh, as torch's API takes
        group = group.get_group()
    if not dist.is_initialized():  # refuse at once when there is no process group
        raise RuntimeError(
            f"parallelize_module needs a process group, and none exists. {HOW_TO_LAUNCH}"
        )
    if plan is None:
        raise ValueError("give a plan: a style, or {submodule name: ColwiseParallel() ...}")
    if isinstance(plan, Style):
        return plan.apply(module, group, "")
    names = dict(module.named_modules())
    unknown = [name for name in plan if name not in names or name == ""]
    if unknown:
        raise ValueError(
            f"the plan names {unknown}, which are not submodules of {type(module).__name__}; "
            f"its submodules are {[n for n in names if n][:20]}"
        )
    for name, style in plan.items():
        if not isinstance(style, Style):
            raise TypeError(
                f"plan[{name!r}] is {style!r}: give ColwiseParallel(), RowwiseParallel(), "
                "SequenceParallel(), or any style with an apply(module, group, name) method"
            )
    # Split everything first, then swap: a refused entry leaves the model as it was.
    split = {name: style.apply(names[name], group, name) for name, style in plan.items()}
    for name, replacement in split.items():
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, replacement)
    return module
