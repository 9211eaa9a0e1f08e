"""Tensor-parallel layers: which slice a rank keeps, the two places the group talks (Megatron's
f and g), and the linear and embedding layers built on them (Megatron-LM, Shoeybi et al. 2019).
Read top-down, in that order.

Which slice of a full tensor a rank keeps: torch's rule, `torch.chunk(t, W, dim)[rank]`.

Keeping torch's rule (not, say, an interleaved one) is what lets one test hold MiniDDP's tensor
parallelism and torch's side by side, shard for shard. Unlike torch's DTensor, a size that W does
not divide is refused: uneven chunks would give the ranks different shapes, and a module that
infers its heads from its projection's size would then compute nonsense on some rank.

The same holds for what indexes a vocabulary split by rows: a token id or target outside it is
owned by no rank, would be read as zeros by all, and is refused instead.

Megatron's f and g: the only two places a tensor-parallel block talks to its peers.

A block split the Megatron way (chapter 13) holds, on each of the W ranks of the tensor-parallel
group, a column slice of its first weight and a row slice of its last. Its input X is the same on
every rank (replicated); its output must be too. In between, each rank works alone:

    X --f--> X A_r --...--> Z_r = Y_r B_r --g--> Z = sum_r Z_r

    f  forward: identity        (X is already on every rank)
       backward: all-reduce     (dL/dX = sum_r dL/dX_r: each rank's slice used X, so each
                                 contributed a part of X's gradient)
    g  forward: all-reduce      (Z is the sum of the ranks' partial products)
       backward: identity       (dL/dZ_r = dL/dZ: a sum passes its gradient to every term)

f and g are conjugate: each is the other with forward and backward swapped. That is why a block
costs exactly one all-reduce forward (g) and one backward (f); an attention and an MLP make a
transformer block's two each way.

A linear layer split by columns or by rows across the tensor-parallel group (Megatron, §3).

Write the layer as Y = X A^T + b with A of shape (out, in) (nn.Linear's convention):

    colwise   rank r keeps the rows A_r = chunk(A, W, 0)[r] (its output columns) and b_r:
              Y_r = X A_r^T + b_r is this rank's slice of Y's last dimension. No talking forward;
              X enters through f, so backward sums the ranks' parts of dL/dX.
    rowwise   rank r keeps A_r = chunk(A, W, 1)[r] (its input columns) and receives X_r, its
              slice of X's last dimension (a colwise layer's output): X A^T = sum_r X_r A_r^T.
              The partial products leave through g (the all-reduce); b is added once, after it,
              so it is counted once, not W times, and its gradient is the full dL/dY everywhere.

colwise then rowwise needs no communication between them, because the activation in between
(GELU, or attention per head) acts on each slice alone. That is the whole trick.

Both keep nn.Linear's names (weight, bias) so a state_dict or an optimizer sees the same keys,
with each rank's tensors its shards. in_features/out_features are the local sizes.

An embedding split across the tensor-parallel group, by vocabulary or by embedding width.

    rowwise (vocabulary-parallel)   rank r keeps the rows of tokens [r V/W, (r+1) V/W): it looks
        up the ids it owns, writes zeros for the others, and the all-reduce (g) fills each row
        in from the one rank that owns it. A vocabulary of 50k rows x width is the largest
        tensor of a small language model; this keeps 1/W of it per rank. Backward each rank's
        gradient lands only on its own rows: g passes dL/dY through unchanged.
    colwise                         rank r keeps chunk(E, W, 1)[r], the r-th slice of every
        row, and returns that slice of the width (sharded on the last dim), with no talking.

The ids are integers, with no gradient: they need no f.

Sequence parallelism (Megatron-SP, Korthikanti et al. 2022): what f and g become when the
activations between blocks are split along the sequence.

Between two blocks (LayerNorm, dropout, the residual add) a Megatron block's activation X is
replicated: every rank holds all B x S x H of it and computes LayerNorm and dropout on all of
it, W times over. Those ops act on each position alone, so they can run on S/W positions a
rank instead, [B, S/W, H], if the talking changes shape:

    f-bar  forward: all-gather along the sequence     (the colwise layer needs every position)
           backward: reduce-scatter along it          (f's all-reduce, each rank keeping only
                                                       its positions' sum)
    g-bar  forward: reduce-scatter along the sequence (g's all-reduce, each rank keeping only
                                                       torch.chunk(Z, W, 1)[rank])
           backward: all-gather along it

An all-reduce is a reduce-scatter then an all-gather, so a block sends the same bytes as
before, and the LayerNorm and dropout activations it keeps for backward shrink W times.

One more sum is needed. A replicated parameter applied on the shard (LayerNorm's weight and
bias, a rowwise bias added after g-bar) gets, on each rank, the gradient of its S/W positions
only: the whole gradient is the sum over the group. Megatron all-reduces these gradients after
backward (its `sequence_parallel` mark on them); here the parameter enters its op through f,
whose backward is that all-reduce, so when backward returns .grad is whole and the same on
every rank. The parameter stays a plain replica (miniddp/placement.py: unmarked), which is then
exactly right: clip_grad_norm_ counts it once, a checkpoint saves it once, and MiniDDP averages
it over the data-parallel group like any other replica.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from miniddp.collectives import all_gather_into_tensor, reduce_scatter_tensor
from miniddp.job.agree import gather_rows
from miniddp.job.env import size_and_rank_in
from miniddp.job.faults import wait_for
from miniddp.placement import TensorShard, mark


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """W and this rank's place in the tensor-parallel group, or a clear error without one."""
    return size_and_rank_in(
        group,
        "tensor-parallel",
        'give each rank its own group, e.g. mesh["tp"] or mesh["tp"].get_group()',
    )


def local_chunk(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None, where: str
) -> torch.Tensor:
    """This rank's chunk of `tensor` along `dim`, as its own storage (the full one can go)."""
    world_size, rank = group_size_and_rank(group)
    size = tensor.shape[dim]
    if size % world_size:
        raise ValueError(
            f"cannot split {where} of shape {tuple(tensor.shape)} along dim {dim} over "
            f"{world_size} tensor-parallel ranks: {size} is not divisible by {world_size}. "
            f"Choose a size that is a multiple of {world_size}, or a tensor-parallel group "
            f"whose size divides {size}."
        )
    return torch.chunk(tensor.detach(), world_size, dim)[rank].clone()


def local_parameter(
    param: torch.nn.Parameter, dim: int, group: dist.ProcessGroup | None, where: str
) -> torch.nn.Parameter:
    """A plain nn.Parameter holding this rank's chunk (no DTensor: the shard is the tensor),
    marked as one (miniddp/placement.py): checkpoints, clipping and MiniDDP read the mark."""
    shard = torch.nn.Parameter(local_chunk(param, dim, group, where), param.requires_grad)
    mark(shard, tensor=TensorShard(group, dim))
    return shard


def refuse_ids_outside(ids: torch.Tensor, vocab_size: int, what: str, hint: str = "") -> None:
    """An id no rank owns would be looked up by none, and read as zeros, silently: refuse it, as
    one process's nn.Embedding and cross-entropy would."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise IndexError(
            f"a {what} outside [0, {vocab_size}): got ids from {int(ids.min())} to "
            f"{int(ids.max())}. Every id must name a row of the vocabulary{hint}"
        )


class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # all_reduce writes in place and needs dense memory
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        total = x.contiguous().clone()  # x may be saved by the op that made it: never write it
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's f: enter a parallel region (its gradient is summed over `group`)."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's g: leave a parallel region (the ranks' partial results are summed)."""
    return _ReduceFromTensorParallel.apply(x, group)


def _refuse_uneven_parts(x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Each rank's positions look right alone; but torch.chunk(x, W, 1) of an S that W does
    not divide leaves the last ranks fewer, and the all-gather's pieces would not match (gloo
    aborts the process, as under torch's SequenceParallel). So every rank states its length in
    one small all-reduce before the gather (tens of microseconds beside the gather's
    (W-1)/W * B * S * H values), and all refuse together, naming S."""
    lengths = [
        row[0] for row in gather_rows([x.shape[1]], "the sequence lengths' check", group, x.device)
    ]
    other = next((r for r, length in enumerate(lengths) if length != lengths[0]), None)
    if other is None:
        return
    size, whole = len(lengths), sum(lengths)
    how = f"which W = {size} does not divide" if whole % size else "cut unevenly"
    raise ValueError(
        f"sequence parallelism needs S/W positions on every rank, but rank 0 holds "
        f"{lengths[0]} positions and rank {other} holds {lengths[other]} (S = {whole}, {how}): "
        f"pad or trim the sequence to a multiple of {size}, and give rank r "
        f"torch.chunk(x, {size}, 1)[r]"
    )


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, S/W, ...] from every rank -> [B, S, ...], rank r's positions at chunk r."""
    world_size, _ = group_size_and_rank(group)
    local = x.movedim(1, 0).contiguous()  # the sequence first: a rank's part is one block
    gathered = local.new_empty((world_size * local.shape[0], *local.shape[1:]))
    work = all_gather_into_tensor(gathered, local, group=group, async_op=True)
    wait_for(work, f"the sequence-parallel all-gather of {tuple(x.shape)}", group)
    return gathered.movedim(0, 1)


def _scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, S, ...] partial sums on every rank -> this rank's chunk of the sum, [B, S/W, ...]."""
    world_size, _ = group_size_and_rank(group)
    if x.shape[1] % world_size:
        raise ValueError(
            f"sequence parallelism splits the sequence over {world_size} ranks, but it has "
            f"{x.shape[1]} positions: use a length that is a multiple of {world_size}"
        )
    whole = x.movedim(1, 0).contiguous()
    mine = whole.new_empty((whole.shape[0] // world_size, *whole.shape[1:]))
    work = reduce_scatter_tensor(mine, whole, group=group, async_op=True)
    wait_for(work, f"the sequence-parallel reduce-scatter of {tuple(x.shape)}", group)
    return mine.movedim(0, 1)


class _GatherFromSequenceParallel(torch.autograd.Function):
    """f-bar: all-gather along the sequence forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        _refuse_uneven_parts(x, group)  # backward's gradients are even: a reduce-scatter's
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """g-bar: reduce-scatter along the sequence forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _scatter_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group), None


def gather_from_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """f-bar: enter a parallel region from a sequence shard [B, S/W, ...]."""
    return _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """g-bar: leave a parallel region into a sequence shard, torch.chunk(sum, W, 1)[rank]."""
    return _ReduceScatterToSequenceParallel.apply(x, group)


class SequenceParallelLayerNorm(nn.Module):
    """An nn.LayerNorm on this rank's positions [B, S/W, H]: the same weight and bias (whole,
    replicated), entered through f so that their gradients are summed over the group."""

    def __init__(self, norm: nn.LayerNorm, group: dist.ProcessGroup | None, name: str) -> None:
        super().__init__()
        self.group = group
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (
            None if p is None else copy_to_tensor_parallel(p, self.group)
            for p in (self.weight, self.bias)
        )
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, on this rank's positions"


class SequenceParallelRMSNorm(nn.Module):
    """An nn.RMSNorm (every Llama-style block's norm) on this rank's positions [B, S/W, H]: it
    too acts on each position alone, and its weight, whole, enters through f."""

    def __init__(self, norm: nn.RMSNorm, group: dist.ProcessGroup | None, name: str) -> None:
        super().__init__()
        self.group = group
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else copy_to_tensor_parallel(self.weight, self.group)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, on this rank's positions"


class ColwiseLinear(nn.Module):
    """This rank's output columns of an nn.Linear; its output is sharded on the last dim.
    With sequence_parallel its input is this rank's positions, gathered first (f-bar)."""

    def __init__(
        self,
        linear: nn.Linear,
        group: dist.ProcessGroup | None,
        name: str,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = local_parameter(linear.weight, 0, group, f"{name}.weight")
        self.bias = None
        if linear.bias is not None:
            self.bias = local_parameter(linear.bias, 0, group, f"{name}.bias")
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return F.linear(gather_from_sequence_parallel(x, self.group), self.weight, self.bias)
        return F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, local out_features={self.out_features}"


class RowwiseLinear(nn.Module):
    """This rank's input rows of an nn.Linear; takes a sharded input, returns the full output
    (with sequence_parallel: this rank's positions of it, and the bias through f)."""

    def __init__(
        self,
        linear: nn.Linear,
        group: dist.ProcessGroup | None,
        name: str,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = local_parameter(linear.weight, 1, group, f"{name}.weight")
        self.bias = linear.bias  # replicated: every rank keeps it whole
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.group)
            return y if self.bias is None else y + copy_to_tensor_parallel(self.bias, self.group)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"local in_features={self.in_features}, out_features={self.out_features}"


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
