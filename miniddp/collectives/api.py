"""The collectives a user calls, with torch.distributed's names, arguments and in-place behaviour.

    broadcast(tensor, src)             src's tensor everywhere
    reduce(tensor, dst, op)            op over all ranks' tensors, into dst's tensor
    all_reduce(tensor, op)             op over all ranks' tensors, into every rank's tensor
    reduce_scatter(output, inputs, op) rank r gets op over everyone's inputs[r]
    all_gather(outputs, tensor)        every rank gets every rank's tensor
    all_to_all_single(output, input,   rank r's piece d of input becomes rank d's piece r of
        output_splits, input_splits)   output (and its autograd form, for expert parallelism)

Chapter 01 (tutorials/01_collectives.py) calls them throughout, side by side with torch's. Each
one checks its arguments first, so that bad input is refused before any message leaves (a rank
that failed half-way through a collective would leave the others waiting), picks its algorithm
(naive.py, tree.py, doubling.py, ring.py, all_to_all.py), and hands the run to the communication
thread (comm_thread.py): `async_op=True` returns a `Work` at once, as torch.distributed's does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from miniddp.collectives import all_to_all, doubling, naive, ring, tree
from miniddp.collectives.comm_thread import Work, submit
from miniddp.collectives.cost_model import choose_all_reduce_algorithm
from miniddp.collectives.peers import COMBINE, INTEGER_ONLY, Peers, finish_average, wait_all

BROADCAST_ALGORITHMS = ("naive", "tree")
REDUCE_ALGORITHMS = ("naive", "tree")
ALL_REDUCE_ALGORITHMS = ("reduce_broadcast", "recursive_doubling", "ring", "auto")


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: ProcessGroup | None = None,
    algorithm: str = "tree",
    async_op: bool = False,
) -> Work | None:
    """Overwrite `tensor` on every rank with global rank `src`'s."""
    _check_choice(algorithm, BROADCAST_ALGORITHMS)
    peers = Peers(group, f"broadcast/{algorithm}")
    root = peers.group_rank_of(src)
    run = naive.broadcast if algorithm == "naive" else tree.broadcast
    return _issue(lambda flat: run(peers, flat, root), tensor, [tensor], async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    algorithm: str = "tree",
    async_op: bool = False,
) -> Work | None:
    """Combine every rank's `tensor` with `op` into global rank `dst`'s `tensor`.

    The other ranks' tensors are left unchanged (gloo's reduce uses them as scratch space).
    """
    _check_choice(algorithm, REDUCE_ALGORITHMS)
    _check_op(op, tensor.dtype)
    peers = Peers(group, f"reduce/{algorithm}")
    root = peers.group_rank_of(dst)
    run = naive.reduce if algorithm == "naive" else tree.reduce

    def reduce_into_root(flat: torch.Tensor) -> None:
        if peers.rank == root:
            run(peers, flat, root, op)
            finish_average(flat, op, peers.size)
        else:
            wait_all(run(peers, flat.clone(), root, op))

    return _issue(reduce_into_root, tensor, [tensor], async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Work | None:
    """Combine every rank's `tensor` with `op`; every rank ends with the same bits."""
    _check_choice(algorithm, ALL_REDUCE_ALGORITHMS)
    _check_op(op, tensor.dtype)
    peers = Peers(group, "")
    if algorithm == "auto":
        algorithm = choose_all_reduce_algorithm(tensor.numel() * tensor.element_size(), peers.size)
    peers.collective = f"all_reduce/{algorithm}"
    run = {
        "reduce_broadcast": tree.all_reduce,
        "recursive_doubling": doubling.all_reduce,
        "ring": ring.all_reduce,
    }[algorithm]
    return _issue(lambda flat: run(peers, flat, op), tensor, [tensor], async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Group rank r's `output` becomes `op` over every rank's `input_list[r]` (ring algorithm).

    The inputs are first copied into one flat buffer, which the ring reduces in place, so they
    stay unchanged.
    """
    _check_op(op, output.dtype)
    peers = Peers(group, "reduce_scatter/ring")
    _check_pieces(input_list, output, peers.size, "input_list")

    def scatter(out: torch.Tensor) -> None:
        chunks = list(torch.cat([t.reshape(-1) for t in input_list]).tensor_split(peers.size))
        ring.run(peers, chunks, op, ring.reduce_scatter_steps(peers))
        out.copy_(chunks[peers.rank])

    return _issue(scatter, output, [output], async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """`reduce_scatter` with the inputs concatenated in one tensor of W times output's size."""
    pieces = list(input.reshape(-1).tensor_split(dist.get_world_size(group)))
    return reduce_scatter(output, pieces, op, group, async_op)


def all_gather(
    tensor_list: Sequence[torch.Tensor],
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """`tensor_list[r]` becomes group rank r's `tensor`, on every rank (ring algorithm)."""
    peers = Peers(group, "all_gather/ring")
    _check_pieces(tensor_list, tensor, peers.size, "tensor_list")

    def gather() -> None:
        chunks = [piece.contiguous().view(-1) for piece in tensor_list]
        chunks[peers.rank].copy_(tensor.reshape(-1))
        ring.run(peers, chunks, ReduceOp.SUM, ring.all_gather_steps(peers))
        for piece, chunk in zip(tensor_list, chunks):
            if chunk.data_ptr() != piece.data_ptr():  # a contiguous copy of a strided piece
                piece.copy_(chunk.view(piece.shape))

    return submit(gather, list(tensor_list), async_op)


@dataclass(frozen=True)
class Labelled:
    """MiniDDP's, not torch's: an all-gather whose every input travels with its rank's `label`,
    in the same message, each receive with room for `room_bytes` (the largest input any rank
    may send instead: ring.labelled_all_gather says why). Once every input has arrived,
    `check(labels)` sees every rank's label in rank order, and raises to refuse the gather:
    on every rank, since they all see the same labels. fully_shard labels each gather with its
    unit's number (sharding/units.py)."""

    label: int
    room_bytes: int
    check: Callable[[list[int]], None]


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    labelled: Labelled | None = None,
) -> Work | None:
    """`all_gather` into one tensor of W times the input's size, in group rank order."""
    peers = Peers(group, "all_gather/ring")
    if output_tensor.numel() != peers.size * input_tensor.numel():
        raise ValueError(
            f"output_tensor needs {peers.size} x {input_tensor.numel()} elements, one input per "
            f"rank; got {output_tensor.numel()}"
        )

    def gather(flat: torch.Tensor) -> None:
        chunks = list(flat.tensor_split(peers.size))
        chunks[peers.rank].copy_(input_tensor.reshape(-1))
        if labelled is None:
            ring.run(peers, chunks, ReduceOp.SUM, ring.all_gather_steps(peers))
        else:
            labels = ring.labelled_all_gather(peers, chunks, labelled.label, labelled.room_bytes)
            labelled.check(labels)

    return _issue(gather, output_tensor, [output_tensor], async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Cut `input` along dim 0 into W pieces of `input_split_sizes` rows (None: equal), send
    piece d to group rank d, and fill `output` with the pieces received, rank s's at the s-th
    place of `output_split_sizes` rows. Sizes may be zero; every rank's sizes must agree with
    its peers' (what r sends to d is what d expects from r), as torch's requires and, like
    torch's, does not check: that would cost a message more.
    """
    peers = Peers(group, "all_to_all/pairwise")
    if output.dim() == 0 or input.dim() == 0 or output.dtype != input.dtype:
        raise ValueError(
            f"output and input must be tensors of rows (dim >= 1) of one dtype; got "
            f"{tuple(output.shape)} {output.dtype} and {tuple(input.shape)} {input.dtype}"
        )
    if math.prod(output.shape[1:]) != math.prod(input.shape[1:]):
        raise ValueError(
            f"output rows {tuple(output.shape[1:])} and input rows {tuple(input.shape[1:])} "
            "must hold as many elements: a row travels whole"
        )
    output_sizes = _piece_sizes(output, output_split_sizes, peers.size, "output")
    input_sizes = _piece_sizes(input, input_split_sizes, peers.size, "input")
    inputs = input.contiguous().view(-1).split(input_sizes)

    def exchange(flat: torch.Tensor) -> None:  # the output, flat and contiguous (_issue)
        all_to_all.pairwise(peers, list(flat.split(output_sizes)), list(inputs))

    return _issue(exchange, output, [output], async_op)


def _piece_sizes(
    tensor: torch.Tensor, split_sizes: Sequence[int] | None, world_size: int, name: str
) -> list[int]:
    """The W pieces' sizes in elements: `split_sizes` rows each (None: equal), checked."""
    rows = tensor.shape[0]
    if split_sizes is None:
        if rows % world_size:
            raise ValueError(
                f"{name} has {rows} rows, which {world_size} ranks cannot share equally: give "
                f"{name}_split_sizes"
            )
        split_sizes = [rows // world_size] * world_size
    split_sizes = [int(size) for size in split_sizes]
    if len(split_sizes) != world_size or min(split_sizes) < 0 or sum(split_sizes) != rows:
        raise ValueError(
            f"{name}_split_sizes must be {world_size} sizes, one per rank, none negative, "
            f"adding up to {name}'s {rows} rows (dim 0); got {split_sizes}"
        )
    row = math.prod(tensor.shape[1:])
    return [size * row for size in split_sizes]


class _AllToAll(torch.autograd.Function):
    """Forward the all-to-all; backward the same with the sizes swapped: a gradient row goes
    back to the rank its row came from. The backward of expert parallelism's dispatch is the
    combine's all-to-all, and the combine's is the dispatch's."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = (output_split_sizes, input_split_sizes), group
        ctx.input_rows = input.shape[0]
        rows = input.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        output = input.new_empty((rows, *input.shape[1:]))
        all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        output_split_sizes, input_split_sizes = ctx.sizes
        grad_input = grad.new_empty((ctx.input_rows, *grad.shape[1:]))
        all_to_all_single(grad_input, grad, input_split_sizes, output_split_sizes, ctx.group)
        return grad_input, None, None, None


def all_to_all_single_autograd(
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """`all_to_all_single` that returns a new tensor and passes gradients back (torch's
    `_functional_collectives.all_to_all_single_autograd`)."""
    return _AllToAll.apply(input, output_split_sizes, input_split_sizes, group)


def _issue(
    algorithm: Callable[[torch.Tensor], None],
    tensor: torch.Tensor,
    result: list[torch.Tensor],
    async_op: bool,
) -> Work | None:
    """Run `algorithm` on `tensor` as one flat, contiguous 1-D tensor, updated in place."""

    def job() -> None:
        if tensor.is_contiguous():
            algorithm(tensor.view(-1))
        else:
            flat = tensor.contiguous().view(-1)
            algorithm(flat)
            tensor.copy_(flat.view(tensor.shape))

    return submit(job, result, async_op)


def _check_choice(algorithm: str, choices: Sequence[str]) -> None:
    if algorithm not in choices:
        raise ValueError(f"algorithm must be one of {', '.join(choices)}; got {algorithm!r}")


def _check_op(op: ReduceOp.RedOpType, dtype: torch.dtype) -> None:
    if op not in COMBINE:
        names = ", ".join(o.name for o in COMBINE)
        raise ValueError(f"op must be one of ReduceOp.{{{names}}}; got {op!r}")
    if op == ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"ReduceOp.AVG needs a floating-point tensor, got {dtype}: an integer mean would have "
            "to round. Reduce with SUM and divide yourself."
        )
    if op in INTEGER_ONLY and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.{op.name} works on integer or bool tensors only, got {dtype}")


def _check_pieces(
    pieces: Sequence[torch.Tensor], like: torch.Tensor, world_size: int, name: str
) -> None:
    if len(pieces) != world_size:
        raise ValueError(f"{name} needs one tensor per rank ({world_size}), got {len(pieces)}")
    for piece in pieces:
        if piece.numel() != like.numel() or piece.dtype != like.dtype:
            raise ValueError(
                f"every tensor in {name} must have {like.numel()} elements of {like.dtype}, as "
                f"the other argument does; got {piece.numel()} of {piece.dtype}"
            )
