"""An embedding split across the tensor-parallel group, by vocabulary or by embedding width.

    rowwise (vocabulary-parallel)   rank r keeps the rows of tokens [r V/W, (r+1) V/W): it looks
        up the ids it owns, writes zeros for the others, and the all-reduce (g) fills each row
        in from the one rank that owns it. A vocabulary of 50k rows x width is the largest
        tensor of a small language model; this keeps 1/W of it per rank. Backward each rank's
        gradient lands only on its own rows: g passes dL/dY through unchanged.
    colwise                         rank r keeps chunk(E, W, 1)[r], the r-th slice of every
        row, and returns that slice of the width (sharded on the last dim), with no talking.

The ids are integers, with no gradient: they need no f.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from miniddp.tensor_parallel.communications import reduce_from_tensor_parallel
from miniddp.tensor_parallel.shards import group_size_and_rank, local_parameter, refuse_ids_outside


def _refuse_options(embedding: nn.Embedding, name: str) -> None:
    options = {"padding_idx": None, "max_norm": None, "sparse": False}
    used = [o for o, default in options.items() if getattr(embedding, o) != default]
    if used:
        raise ValueError(
            f"{name} sets {', '.join(used)}, which tensor parallelism does not split: build "
            f"the nn.Embedding without {' or '.join(used)}, or leave {name} out of the plan"
        )


class VocabParallelEmbedding(nn.Module):
    """This rank's block of vocabulary rows; the output is the full lookup on every rank."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup | None, name: str):
        super().__init__()
        _refuse_options(embedding, name)
        self.group = group
        self.weight = local_parameter(embedding.weight, 0, group, f"{name}.weight")
        world_size, rank = group_size_and_rank(group)
        self.num_embeddings, self.embedding_dim = self.weight.shape
        self.vocab_size = world_size * self.num_embeddings
        self.vocab_start = rank * self.num_embeddings  # this rank owns [start, start + rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        refuse_ids_outside(ids, self.vocab_size, "token id")
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return reduce_from_tensor_parallel(
            rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group
        )

    def extra_repr(self) -> str:
        end = self.vocab_start + self.num_embeddings
        return f"rows [{self.vocab_start}, {end}) of the vocabulary, width {self.embedding_dim}"


class ColwiseEmbedding(nn.Module):
    """This rank's slice of every row; the output is sharded on the last dim."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup | None, name: str):
        super().__init__()
        _refuse_options(embedding, name)
        self.weight = local_parameter(embedding.weight, 1, group, f"{name}.weight")
        self.num_embeddings, self.embedding_dim = self.weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
