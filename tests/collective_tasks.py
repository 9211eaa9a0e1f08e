"""Task functions for tests/test_collectives.py. They run inside the rank pool's workers, which
import them by module name, so they live here rather than in the test file.

Every input is a function of (case, rank) alone, so the test process can rebuild all ranks'
inputs and compute its own references without asking the workers for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from miniddp import collectives

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}


@dataclass(frozen=True)
class Case:
    """One example: which collective, on what, and how the tensor is laid out."""

    collective: str  # "broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather"
    numel: int
    dtype: str
    op: str = "SUM"  # a ReduceOp member's name
    root: int = 0  # src or dst, a global rank
    strided: bool = False  # operate on every other element of a larger tensor
    seed: int = 0


def make_input(case: Case, rank: int, numel: int | None = None) -> torch.Tensor:
    """Rank `rank`'s contiguous input: small integers, or normal floats (no zeros, no NaN)."""
    generator = torch.Generator().manual_seed(case.seed * 1009 + rank)
    numel = case.numel if numel is None else numel
    dtype = DTYPES[case.dtype]
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)
    low = -(2**40) if case.op in ("BAND", "BOR", "BXOR") else -30
    return torch.randint(low, -low, (numel,), generator=generator, dtype=dtype)


def _in_layout(values: torch.Tensor, strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor to pass, its storage). Strided: the even elements of a twice-as-long tensor whose
    odd elements are -1, which an in-place collective must leave alone."""
    if not strided:
        return values.clone(), values.clone()
    storage = torch.full((2 * values.numel(),), -1, dtype=values.dtype)
    view = storage[::2]
    view.copy_(values)
    return view, storage


def _torch_op(name: str) -> dist.ReduceOp.RedOpType:
    # gloo's all_reduce has no AVG: the test compares AVG against SUM / W.
    return getattr(dist.ReduceOp, "SUM" if name == "AVG" else name)


def run_case(case: Case) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Run `case` with each of our algorithms and with torch.distributed, on this rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    values = make_input(case, rank)
    op = getattr(dist.ReduceOp, case.op)
    results: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    if case.collective in ("broadcast", "reduce", "all_reduce"):
        algorithms = {
            "broadcast": collectives.BROADCAST_ALGORITHMS,
            "reduce": collectives.REDUCE_ALGORITHMS,
            "all_reduce": collectives.ALL_REDUCE_ALGORITHMS,
        }[case.collective]
        for algorithm in algorithms:
            tensor, storage = _in_layout(values, case.strided)
            if case.collective == "broadcast":
                collectives.broadcast(tensor, case.root, algorithm=algorithm)
            elif case.collective == "reduce":
                collectives.reduce(tensor, case.root, op, algorithm=algorithm)
            else:
                collectives.all_reduce(tensor, op, algorithm=algorithm)
            results[algorithm] = tensor.clone()
            results[f"{algorithm} storage"] = storage if case.strided else tensor
        reference = values.clone()
        if case.collective == "broadcast":
            dist.broadcast(reference, case.root)
        elif case.collective == "reduce":
            dist.reduce(reference, case.root, _torch_op(case.op))
        else:
            dist.all_reduce(reference, _torch_op(case.op))
        results["torch"] = reference
    elif case.collective == "reduce_scatter":
        pieces = list(make_input(case, rank, case.numel * world_size).tensor_split(world_size))
        output, storage = _in_layout(torch.zeros(case.numel, dtype=values.dtype), case.strided)
        collectives.reduce_scatter(output, pieces, op)
        results["ring"], results["ring storage"] = output.clone(), storage
        flat_output = torch.zeros(case.numel, dtype=values.dtype)
        collectives.reduce_scatter_tensor(flat_output, torch.cat(pieces), op)
        results["ring (tensor form)"] = flat_output
        results["inputs after"] = torch.cat(pieces)
        reference = torch.zeros(case.numel, dtype=values.dtype)
        dist.reduce_scatter(reference, [p.clone() for p in pieces], _torch_op(case.op))
        results["torch"] = reference
    elif case.collective == "all_gather":
        outputs = [_in_layout(torch.zeros_like(values), case.strided)[0] for _ in range(world_size)]
        collectives.all_gather(outputs, values)
        results["ring"] = torch.cat(outputs)
        flat_output = torch.zeros(world_size * case.numel, dtype=values.dtype)
        collectives.all_gather_into_tensor(flat_output, values)
        results["ring (tensor form)"] = flat_output
        references = [torch.zeros_like(values) for _ in range(world_size)]
        dist.all_gather(references, values)
        results["torch"] = torch.cat(references)
    else:
        raise ValueError(case.collective)
    return results


def count_traffic(collective: str, algorithm: str, numel: int, root: int) -> dict:
    """Bytes and messages this rank sent and received in one float32 collective, and its log."""
    values = torch.ones(numel)
    collectives.traffic.reset()
    with collectives.record_messages() as log:
        if collective == "broadcast":
            collectives.broadcast(values, root, algorithm=algorithm)
        elif collective == "reduce":
            collectives.reduce(values, root, algorithm=algorithm)
        elif collective == "all_reduce":
            collectives.all_reduce(values, algorithm=algorithm)
        elif collective == "reduce_scatter":
            output = torch.empty(numel)
            collectives.reduce_scatter(output, [values] * dist.get_world_size())
        elif collective == "all_gather":
            collectives.all_gather([torch.empty(numel)] * dist.get_world_size(), values)
    counts = vars(collectives.traffic).copy()
    return {**counts, "steps": sorted({message.step for message in log})}


def async_collectives_in_flight(seed: int, count: int) -> dict:
    """Issue `count` mixed async collectives at once (and a torch all_reduce on this thread while
    they run), then wait for them in reverse order. Returns the results, the order in which they
    completed, and the same collectives run one by one, blocking, for comparison."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(seed)
    plan = []
    for index in range(count):
        kind = ["all_reduce/ring", "all_reduce/reduce_broadcast", "broadcast", "reduce"][
            int(torch.randint(4, (1,), generator=generator))
        ]
        numel = int(torch.randint(0, 3000, (1,), generator=generator))
        root = int(torch.randint(world_size, (1,), generator=generator))
        plan.append((kind, numel, root, index))

    def issue(kind: str, tensor: torch.Tensor, root: int, async_op: bool):
        if kind.startswith("all_reduce"):
            algorithm = kind.split("/")[1]
            return collectives.all_reduce(tensor, algorithm=algorithm, async_op=async_op)
        if kind == "broadcast":
            return collectives.broadcast(tensor, root, async_op=async_op)
        return collectives.reduce(tensor, root, async_op=async_op)

    def input_for(numel: int, index: int) -> torch.Tensor:
        return torch.arange(numel, dtype=torch.float64) * (rank + 1) + index

    completed: list[int] = []
    tensors = [input_for(numel, index) for _, numel, _, index in plan]
    works, noted = [], []
    blocking_midway = torch.full((1000,), float(rank + 1))
    for (kind, _, root, index), tensor in zip(plan, tensors):
        work = issue(kind, tensor, root, async_op=True)
        # then(): a future that completes once the callback has run, so we can wait for it.
        noted.append(work.get_future().then(lambda _, i=index: completed.append(i)))
        works.append(work)
        if index == count // 2:  # must wait its turn behind the async ones issued before it
            collectives.all_reduce(blocking_midway, algorithm="ring")
    meanwhile = torch.tensor([float(rank)])
    dist.all_reduce(meanwhile)  # gloo's own collective, while ours are in flight
    for work in reversed(works):
        work.wait()
    torch.futures.wait_all(noted)
    in_futures = [work.get_future().value()[0] is tensor for work, tensor in zip(works, tensors)]
    blocking = []
    for kind, numel, root, index in plan:
        tensor = input_for(numel, index)
        assert issue(kind, tensor, root, async_op=False) is None
        blocking.append(tensor)
    return {
        "async": tensors,
        "blocking": blocking,
        "completed": completed,
        "futures_hold_the_tensors": all(in_futures),
        "meanwhile": meanwhile.item(),
        "blocking_midway": blocking_midway,
        "plan": plan,
    }


def subgroup_collectives(members: list[int]) -> dict | None:
    """Our collectives on a subgroup, against torch's, with src/dst given as global ranks."""
    group = dist.new_group(members)  # every rank must call new_group, members or not
    if dist.get_rank() not in members:
        return None
    root = members[-1]
    base = torch.arange(10, dtype=torch.float64) * (dist.get_rank() + 1)
    results = {}
    for name in ("broadcast", "reduce", "ring", "reduce_broadcast"):
        ours, theirs = base.clone(), base.clone()
        if name == "broadcast":
            collectives.broadcast(ours, root, group=group)
            dist.broadcast(theirs, root, group=group)
        elif name == "reduce":
            collectives.reduce(ours, root, group=group)
            dist.reduce(theirs, root, group=group)
            if dist.get_rank() != root:
                theirs = base  # torch's non-root tensor is scratch; ours must be left unchanged
        else:
            collectives.all_reduce(ours, group=group, algorithm=name)
            dist.all_reduce(theirs, group=group)
        results[name] = (ours, theirs)
    dist.destroy_process_group(group)
    return results


def single_rank_collectives() -> dict:
    """With one rank every collective leaves the data as it is (AVG divides by 1)."""
    values = torch.arange(7, dtype=torch.float32)
    results = {}
    for algorithm in collectives.ALL_REDUCE_ALGORITHMS:
        tensor = values.clone()
        collectives.all_reduce(tensor, dist.ReduceOp.AVG, algorithm=algorithm)
        results[f"all_reduce/{algorithm}"] = tensor
    for algorithm in collectives.BROADCAST_ALGORITHMS:
        tensor = values.clone()
        collectives.broadcast(tensor, 0, algorithm=algorithm)
        results[f"broadcast/{algorithm}"] = tensor
        tensor = values.clone()
        collectives.reduce(tensor, 0, dist.ReduceOp.MAX, algorithm=algorithm)
        results[f"reduce/{algorithm}"] = tensor
    output = torch.empty(7)
    collectives.reduce_scatter(output, [values])
    results["reduce_scatter"] = output
    gathered = [torch.empty(7)]
    collectives.all_gather(gathered, values)
    results["all_gather"] = gathered[0]
    results["model"] = collectives.fit_cost_model()
    return results


def labelled_gathers(odd_rank: int, odd_numel: int) -> dict:
    """Three labelled all-gathers on every rank: one where all agree (label 7, 5 elements
    each), then one where `odd_rank` sends label 9 and `odd_numel` elements, shorter or longer
    than the others' 5 (room for 8: the largest any may send), then all agree again."""
    seen = []
    rank, world = dist.get_rank(), dist.get_world_size()
    outputs = []
    for round, odd in enumerate((False, True, False)):
        numel = odd_numel if odd and rank == odd_rank else 5
        label = 9 if odd and rank == odd_rank else 7
        output = torch.full((world * numel,), -1.0)
        mine = torch.arange(numel, dtype=torch.float32) + 10 * rank + 100 * round
        labelled = collectives.Labelled(label, room_bytes=8 * 4, check=seen.append)
        collectives.all_gather_into_tensor(output, mine, labelled=labelled)
        outputs.append(output)
    return {"labels": seen, "outputs": outputs}
