"""ColwiseParallel and RowwiseParallel: how to split one module, named as torch names them.

A style is a small object with one method, `apply(module, group, name)`, that returns the module
split across `group`. They take no options: torch's defaults are the only layouts they produce
(colwise: replicated input, output sharded on the last dim; rowwise: input sharded on the last
dim, replicated output), and the outputs are plain local tensors, as with torch's
`use_local_output=True`.

    module         ColwiseParallel()              RowwiseParallel()
    nn.Linear      ColwiseLinear: rows of A       RowwiseLinear: columns of A, bias after g
    nn.Embedding   ColwiseEmbedding: width        VocabParallelEmbedding: vocabulary rows
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from miniddp.tensor_parallel.embedding import ColwiseEmbedding, VocabParallelEmbedding
from miniddp.tensor_parallel.linear import ColwiseLinear, RowwiseLinear


class ParallelStyle:
    """Split one module: the kinds of module a style knows, and the class that splits each."""

    splits: dict[type[nn.Module], type[nn.Module]] = {}

    def apply(self, module: nn.Module, group: dist.ProcessGroup | None, name: str) -> nn.Module:
        for kind, split in self.splits.items():
            if type(module) is kind:  # a subclass may compute something else with its weight
                return split(module, group, name)
        known = " and ".join(k.__name__ for k in self.splits)
        raise TypeError(
            f"{type(self).__name__} splits {known} only, but {name or 'the module'} is a "
            f"{type(module).__name__}: name its {known} submodules in the plan instead"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ColwiseParallel(ParallelStyle):
    """Keep chunk(weight, W, 0)[rank] of an nn.Linear (chunk(weight, W, 1) of an nn.Embedding)."""

    splits = {nn.Linear: ColwiseLinear, nn.Embedding: ColwiseEmbedding}


class RowwiseParallel(ParallelStyle):
    """Keep chunk(weight, W, 1)[rank] of an nn.Linear (chunk(weight, W, 0) of an nn.Embedding)."""

    splits = {nn.Linear: RowwiseLinear, nn.Embedding: VocabParallelEmbedding}
