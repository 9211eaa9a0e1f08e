"""The proof: MiniDDP's send/recv collectives compute what torch.distributed's compute, on 2, 3
and 4 gloo ranks, and every rank moves exactly the bytes its algorithm promises.

Each hypothesis example draws a collective's input (length from 0 up, shorter than W included,
dtype, op, root, contiguous or strided) and runs every algorithm we have and torch's on a pool of
W ranks. Three checks per result:

- against a serial re-statement of our own order of operations (`tree_reduce`, `ring_reduce`...):
  bit for bit, for every dtype and op, since the same operations in the same order round alike;
- against torch.distributed on gloo: integers and MAX/MIN exactly; W = 2 bit for bit (a + b and
  b + a round alike, so the order cannot differ); otherwise within the bound below;
- every rank holds the same bits, and elements outside a strided view are untouched.

The bound. Adding W numbers in any order makes W-1 roundings, each off by at most u times the
partial sum, itself at most sum|x_i| (u, the unit roundoff: 2^-24 float32, 2^-53 float64, 2^-8
bfloat16). So each result is within (W-1) u sum|x_i| of the exact sum, and two orders within
2(W-1) u sum|x_i| of each other. We allow 2 W u sum|x_i|, whose extra 2 u sum|x_i| covers the
second-order terms and AVG's division (one more rounding per side, of at most u |sum|); AVG's
bound is that over W. A product of W numbers is off by at most about (W-1) u |product|, so two
orders differ by at most 2 W u |product|.
"""

from __future__ import annotations

import math
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from miniddp import collectives
from miniddp.collectives.comm_thread import submit
from tests.collective_tasks import (
    DTYPES,
    Case,
    async_collectives_in_flight,
    count_traffic,
    labelled_gathers,
    make_input,
    run_case,
    single_rank_collectives,
    subgroup_collectives,
)
from tests.harness.measurements import record_max
from tests.harness.processes import child_env, run_in_own_session, tail
from tests.harness.properties import property_settings
from tests.harness.your_code import count_ring, run_ring

WORLD_SIZES = [2, 3, 4]
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MAX", "MIN"]
INTEGER_OPS = ["SUM", "PRODUCT", "MAX", "MIN", "BAND", "BOR", "BXOR"]
COMBINE = {
    "SUM": torch.add,
    "AVG": torch.add,
    "PRODUCT": torch.mul,
    "MAX": torch.maximum,
    "MIN": torch.minimum,
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def finish(result: torch.Tensor, op: str, world_size: int) -> torch.Tensor:
    return result / world_size if op == "AVG" else result


def naive_reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """The root folds in the others one by one: ((x0 op x1) op x2) op ... (relative ranks)."""
    result = values[0]
    for value in values[1:]:
        result = COMBINE[op](result, value)
    return result


def tree_reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """The broadcast tree backwards: rank v folds in v + d, for d = ..., 4, 2, 1."""
    values = list(values)
    steps = math.ceil(math.log2(len(values))) if len(values) > 1 else 0
    for step in range(1, steps + 1):
        distance = 1 << (steps - step)
        for v in range(min(distance, len(values) - distance)):
            values[v] = COMBINE[op](values[v], values[v + distance])
    return values[0]


def recursive_doubling(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """Ranks from the largest power of two P on fold into rank r - P; then, for d = 1, 2, 4, ...
    each rank r < P combines with r XOR d as (lower rank's partial) op (higher rank's)."""
    inner = 1 << (len(values).bit_length() - 1)
    values = list(values)
    for r in range(inner, len(values)):
        values[r - inner] = COMBINE[op](values[r - inner], values[r])
    distance = 1
    while distance < inner:
        values = [
            COMBINE[op](values[min(r, r ^ distance)], values[max(r, r ^ distance)])
            for r in range(inner)
        ]
        distance *= 2
    return values[0]


def ring_reduce(inputs: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    """Chunk c starts at rank c+1 and each next rank folds its own values in: own op partial."""
    world_size = len(inputs)
    chunks = [list(x.tensor_split(world_size)) for x in inputs]
    reduced = []
    for c in range(world_size):
        partial = chunks[(c + 1) % world_size][c]
        for k in range(2, world_size + 1):
            partial = COMBINE[op](chunks[(c + k) % world_size][c], partial)
        reduced.append(finish(partial, op, world_size))
    return reduced


def relative(values: list[torch.Tensor], root: int) -> list[torch.Tensor]:
    return values[root:] + values[:root]


def assert_close_to_torch(
    ours: torch.Tensor, theirs: torch.Tensor, inputs: list[torch.Tensor], op: str, label: str
) -> None:
    world_size, dtype = len(inputs), ours.dtype
    if op == "AVG":
        theirs = theirs / world_size  # gloo has no AVG: SUM / W
    if not dtype.is_floating_point or op in ("MAX", "MIN") or world_size == 2:
        assert torch.equal(ours, theirs), f"{label}: differs from torch.distributed's"
        return
    u = torch.finfo(dtype).eps / 2
    stacked = torch.stack([x.double() for x in inputs])
    if op == "PRODUCT":
        bound = 2 * world_size * u * stacked.prod(0).abs()
    else:
        bound = 2 * world_size * u * stacked.abs().sum(0) / (world_size if op == "AVG" else 1)
    bound = bound + torch.finfo(dtype).tiny
    difference = (ours.double() - theirs.double()).abs()
    assert (difference <= bound).all(), (
        f"{label}: differs from torch.distributed's by {difference.max().item():.3g}, "
        f"more than the bound allows"
    )
    if difference.numel():
        record_max(f"collectives: |ours - gloo| / bound, {dtype}", (difference / bound).max())


@st.composite
def cases(draw, collective: str, world_size: int) -> Case:
    dtype = draw(st.sampled_from(list(DTYPES)))
    return Case(
        collective=collective,
        numel=draw(st.one_of(st.integers(0, 2 * world_size), st.integers(0, 3000))),
        dtype=dtype,
        op=draw(st.sampled_from(INTEGER_OPS if dtype == "int64" else FLOAT_OPS)),
        root=draw(st.integers(0, world_size - 1)),
        strided=draw(st.booleans()),
        seed=draw(st.integers(0, 2**20)),
    )


def run_on_pool(rank_pools, world_size: int, case: Case) -> list[dict]:
    return rank_pools(world_size).run(run_case, case, timeout=60)


def assert_strided_untouched(results: list[dict], name: str, case: Case) -> None:
    if case.strided:
        for rank, result in enumerate(results):
            storage = result[f"{name} storage"]
            assert (storage[1::2] == -1).all(), f"rank {rank}: {name} wrote outside its view"


def all_inputs(case: Case, world_size: int) -> list[torch.Tensor]:
    return [make_input(case, rank) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@property_settings(max_examples=40)
@given(data=st.data())
def test_all_reduce_matches_torch(rank_pools, world_size, data):
    case = data.draw(cases("all_reduce", world_size))
    results = run_on_pool(rank_pools, world_size, case)
    inputs = all_inputs(case, world_size)
    expected = {
        "reduce_broadcast": finish(tree_reduce(inputs, case.op), case.op, world_size),
        "recursive_doubling": finish(recursive_doubling(inputs, case.op), case.op, world_size),
        "ring": torch.cat(ring_reduce(inputs, case.op)),
    }
    nbytes = case.numel * inputs[0].element_size()
    expected["auto"] = expected[collectives.choose_all_reduce_algorithm(nbytes, world_size)]
    for name in collectives.ALL_REDUCE_ALGORITHMS:
        for rank, result in enumerate(results):
            label = f"rank {rank}, all_reduce/{name}"
            assert torch.equal(result[name], expected[name]), f"{label}: not our own order's bits"
            assert_close_to_torch(result[name], result["torch"], inputs, case.op, label)
        assert_strided_untouched(results, name, case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@property_settings(max_examples=25)
@given(data=st.data())
def test_reduce_matches_torch(rank_pools, world_size, data):
    case = data.draw(cases("reduce", world_size))
    results = run_on_pool(rank_pools, world_size, case)
    inputs = all_inputs(case, world_size)
    in_order = relative(inputs, case.root)
    expected = {
        "naive": finish(naive_reduce(in_order, case.op), case.op, world_size),
        "tree": finish(tree_reduce(in_order, case.op), case.op, world_size),
    }
    for name in collectives.REDUCE_ALGORITHMS:
        root_result = results[case.root]
        label = f"reduce/{name} to rank {case.root}"
        assert torch.equal(root_result[name], expected[name]), f"{label}: not our order's bits"
        assert_close_to_torch(root_result[name], root_result["torch"], inputs, case.op, label)
        for rank, result in enumerate(results):
            if rank != case.root:
                assert torch.equal(result[name], inputs[rank]), f"rank {rank}'s input changed"
        assert_strided_untouched(results, name, case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@property_settings(max_examples=15)
@given(data=st.data())
def test_broadcast_matches_torch(rank_pools, world_size, data):
    case = data.draw(cases("broadcast", world_size))
    results = run_on_pool(rank_pools, world_size, case)
    source = make_input(case, case.root)
    for rank, result in enumerate(results):
        assert torch.equal(result["torch"], source)
        for name in collectives.BROADCAST_ALGORITHMS:
            assert torch.equal(result[name], source), f"rank {rank}: broadcast/{name} differs"
    for name in collectives.BROADCAST_ALGORITHMS:
        assert_strided_untouched(results, name, case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@property_settings(max_examples=20)
@given(data=st.data())
def test_reduce_scatter_matches_torch(rank_pools, world_size, data):
    case = data.draw(cases("reduce_scatter", world_size))
    results = run_on_pool(rank_pools, world_size, case)
    inputs = [make_input(case, rank, case.numel * world_size) for rank in range(world_size)]
    expected = ring_reduce(inputs, case.op)
    for rank, result in enumerate(results):
        label = f"rank {rank}, reduce_scatter"
        mine = [x.tensor_split(world_size)[rank] for x in inputs]
        assert torch.equal(result["inputs after"], inputs[rank]), f"{label}: changed its inputs"
        for name in ("ring", "ring (tensor form)"):
            assert torch.equal(result[name], expected[rank]), f"{label}: not our order's bits"
            assert_close_to_torch(result[name], result["torch"], mine, case.op, label)
    assert_strided_untouched(results, "ring", case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@property_settings(max_examples=10)
@given(data=st.data())
def test_all_gather_matches_torch(rank_pools, world_size, data):
    case = data.draw(cases("all_gather", world_size))
    results = run_on_pool(rank_pools, world_size, case)
    expected = torch.cat(all_inputs(case, world_size))
    for rank, result in enumerate(results):
        assert torch.equal(result["torch"], expected)
        for name in ("ring", "ring (tensor form)"):
            assert torch.equal(result[name], expected), f"rank {rank}: all_gather {name} differs"


def tree_children(v: int, world_size: int) -> int:
    """How many ranks relative rank v sends to in the broadcast tree (and receives from in the
    reduce tree): v + d for each power of two d > v with v + d < W."""
    powers_of_two = (1 << k for k in range(world_size.bit_length()))
    return sum(1 for d in powers_of_two if v < d < world_size - v)


def expected_traffic(
    collective: str, algorithm: str, numel: int, rank: int, root: int, world_size: int
) -> tuple[int, int]:
    """(bytes sent, bytes received) by `rank`, worked out from each algorithm's description."""
    n, w = numel * 4, world_size  # float32
    v = (rank - root) % w
    if collective == "broadcast":
        sent = {"naive": (w - 1) * n if v == 0 else 0, "tree": tree_children(v, w) * n}[algorithm]
        return sent, 0 if v == 0 else n
    if collective == "reduce":
        received = {"naive": (w - 1) * n if v == 0 else 0, "tree": tree_children(v, w) * n}
        return 0 if v == 0 else n, received[algorithm]
    if collective == "all_reduce" and algorithm == "reduce_broadcast":
        one_way = tree_children(rank, w) * n + (n if rank else 0)  # up the tree, then down
        return one_way, one_way
    if collective == "all_reduce" and algorithm == "recursive_doubling":
        inner = 1 << (w.bit_length() - 1)
        if rank >= inner:  # hands its tensor over, gets the result back
            return n, n
        swaps = (inner.bit_length() - 1) * n + (n if rank + inner < w else 0)
        return swaps, swaps
    chunk = [4 * len(c) for c in torch.arange(numel).tensor_split(w)]  # tensor_split's sizes
    if collective == "all_reduce":  # ring: every chunk but two, each way
        return 2 * n - chunk[rank] - chunk[(rank + 1) % w], 2 * n - chunk[rank - 1] - chunk[rank]
    return (w - 1) * n, (w - 1) * n  # reduce_scatter, all_gather: n bytes per rank's piece


TRAFFIC_CASES = [
    ("broadcast", "naive"),
    ("broadcast", "tree"),
    ("reduce", "naive"),
    ("reduce", "tree"),
    ("all_reduce", "reduce_broadcast"),
    ("all_reduce", "recursive_doubling"),
    ("all_reduce", "ring"),
    ("reduce_scatter", "ring"),
    ("all_gather", "ring"),
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(("collective", "algorithm"), TRAFFIC_CASES)
def test_every_rank_moves_exactly_the_promised_bytes(rank_pools, world_size, collective, algorithm):
    pool = rank_pools(world_size)
    for numel in (1, 12 * world_size, 12 * world_size + 1):  # shorter than W, divisible, not
        root = world_size - 1
        counts = pool.run(count_traffic, collective, algorithm, numel, root)
        for rank, count in enumerate(counts):
            sent, received = expected_traffic(collective, algorithm, numel, rank, root, world_size)
            assert (count["bytes_sent"], count["bytes_received"]) == (sent, received), (
                f"rank {rank}, {collective}/{algorithm}, {numel} floats"
            )
        if numel >= world_size:  # no empty message skipped: every step shows in the logs
            steps = sorted(set().union(*(count["steps"] for count in counts)))
            expected_steps, _ = collectives.schedule(collective, algorithm, numel * 4, world_size)
            assert steps == list(range(1, expected_steps + 1))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_reduce_is_bandwidth_optimal(rank_pools, world_size):
    """Every rank sends and receives 2(W-1)/W of the tensor, the lower bound for any all-reduce
    (Patarasuk and Yuan, 2009); the tree's busiest rank moves more as soon as W > 2."""
    numel = 1000 * world_size
    n = 4 * numel
    pool = rank_pools(world_size)
    ring = pool.run(count_traffic, "all_reduce", "ring", numel, 0)
    lower_bound = 2 * (world_size - 1) * n // world_size
    for count in ring:
        assert count["bytes_sent"] == count["bytes_received"] == lower_bound
    tree = pool.run(count_traffic, "all_reduce", "reduce_broadcast", numel, 0)
    busiest = max(count["bytes_sent"] for count in tree)
    assert busiest == math.ceil(math.log2(world_size)) * n  # the root broadcasts to log2 W ranks
    assert busiest > lower_bound or world_size == 2


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_async_collectives_complete_in_issue_order(rank_pools, world_size, seed):
    count = 12
    results = rank_pools(world_size).run(async_collectives_in_flight, seed, count, timeout=60)
    for rank, result in enumerate(results):
        assert result["completed"] == list(range(count)), f"rank {rank}: out of issue order"
        assert result["futures_hold_the_tensors"], "get_future().value() must be [tensor]"
        assert result["meanwhile"] == sum(range(world_size))
        midway = float(sum(range(1, world_size + 1)))
        assert torch.equal(result["blocking_midway"], torch.full((1000,), midway))
        for (kind, *_), a, b in zip(result["plan"], result["async"], result["blocking"]):
            assert torch.equal(a, b), f"rank {rank}: async {kind} differs from the blocking one"


def sums_waited_for_by_faults_wait_for() -> dict[str, list[float]]:
    from miniddp.faults import wait_for

    rank = dist.get_rank()
    ours, theirs = torch.full((3,), rank + 1.0), torch.full((3,), rank + 1.0)
    returned = wait_for(collectives.all_reduce(ours, async_op=True), "MiniDDP's all-reduce")
    wait_for(dist.all_reduce(theirs, async_op=True), "torch's all-reduce")
    return {"ours": ours.tolist(), "returned": returned[0].tolist(), "theirs": theirs.tolist()}


def test_faults_wait_for_takes_a_work_of_these_collectives_as_one_of_torchs(pool2):
    for result in pool2.run(sums_waited_for_by_faults_wait_for):
        assert result == {"ours": [3.0] * 3, "returned": [3.0] * 3, "theirs": [3.0] * 3}


def test_a_subgroup_uses_global_ranks(rank_pools):
    results = rank_pools(3).run(subgroup_collectives, [0, 2])
    assert results[1] is None
    for rank in (0, 2):
        for name, (ours, theirs) in results[rank].items():
            assert torch.equal(ours, theirs), f"rank {rank}: {name} on the subgroup differs"


def test_one_rank_leaves_everything_as_it_is(tmp_path):
    """In this process, in a group of one (a pool of one would cost seconds to start)."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        results = single_rank_collectives()
    finally:
        dist.destroy_process_group()
    model = results.pop("model")
    assert (model.alpha, model.beta) == (0.0, 0.0)
    for name, tensor in results.items():
        assert torch.equal(tensor, torch.arange(7, dtype=torch.float32)), name


def test_wait_reraises_and_the_thread_serves_on():
    """A failing collective fails its own Work; the ones after it still run."""

    def fail() -> None:
        raise ZeroDivisionError("the algorithm failed")

    failed = submit(fail, [], async_op=True)
    after = submit(lambda: None, [torch.ones(1)], async_op=True)
    with pytest.raises(ZeroDivisionError, match="the algorithm failed"):
        failed.wait()
    with pytest.raises(ZeroDivisionError):
        failed.get_future().value()
    assert after.wait() and after.get_future().value()[0].item() == 1
    with pytest.raises(ZeroDivisionError):
        submit(fail, [], async_op=False)


def test_a_blocking_collective_inside_a_callback_is_refused():
    """Callbacks run on the communication thread, which cannot wait for itself."""
    release = threading.Event()
    first = submit(release.wait, [], async_op=True)  # still running when...
    chained = first.get_future().then(lambda _: submit(lambda: None, [], False))
    release.set()  # ...the callback is attached, so it runs on the communication thread
    with pytest.raises(RuntimeError, match="wait for itself"):
        chained.wait()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: collectives.all_reduce(torch.arange(2), dist.ReduceOp.AVG), "AVG"),
        (lambda: collectives.all_reduce(torch.ones(2), dist.ReduceOp.BAND), "integer"),
        (lambda: collectives.all_reduce(torch.ones(2), dist.ReduceOp.PREMUL_SUM), "op must"),
        (lambda: collectives.all_reduce(torch.ones(2), algorithm="tree"), "algorithm"),
        (lambda: collectives.broadcast(torch.ones(2), 0, algorithm="ring"), "algorithm"),
    ],
)
def test_bad_arguments_are_refused_before_any_message(call, message):
    with pytest.raises(ValueError, match=message):
        call()


EXIT_PROBE = """
import atexit, sys, threading, torch, torch.distributed as dist
# Registered first, so it runs last: after MiniDDP's own exit handler.
atexit.register(lambda: print("alive at exit:", any(
    t.name == "miniddp-comm" and t.is_alive() for t in threading.enumerate())))
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
from miniddp import collectives
collectives.all_reduce(torch.ones(3), async_op=True).wait()
"""


def test_the_communication_thread_has_ended_before_python_shuts_down(tmp_path):
    """Python kills daemon threads where they stand at shutdown; killed inside torch's C++, the
    communication thread aborted the whole process ("terminate called without an active
    exception"), in about a third of 2-rank runs that ended right after an async collective."""
    command = [sys.executable, "-c", EXIT_PROBE, str(tmp_path / "store")]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=60)
    assert returncode == 0, tail(output)
    assert "alive at exit: False" in output, tail(output)


def test_a_collective_without_a_process_group_says_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        collectives.all_reduce(torch.ones(2))


def test_auto_follows_the_measured_crossovers():
    for world_size, choices in collectives.AUTO_CHOICES.items():
        assert choices[0][0] == 0, "every size needs an algorithm"
        for (from_bytes, algorithm), (next_from, _) in zip(choices, [*choices[1:], (2**40, "")]):
            for nbytes in (from_bytes, next_from - 1):
                assert collectives.choose_all_reduce_algorithm(nbytes, world_size) == algorithm
    largest = max(collectives.AUTO_CHOICES)
    for nbytes in (0, 2**30):
        assert collectives.choose_all_reduce_algorithm(nbytes, 2 * largest) == (
            collectives.choose_all_reduce_algorithm(nbytes, largest)
        )


def test_cost_model_charges_latency_per_step_and_bytes_on_the_critical_path():
    model = collectives.CostModel(alpha=1.0, beta=0.0)
    assert model.predict("all_reduce", "ring", 10**6, 8) == 14  # 2(W-1) steps
    assert model.predict("all_reduce", "reduce_broadcast", 10**6, 8) == 6  # 2 log2 W
    assert model.predict("all_reduce", "recursive_doubling", 10**6, 8) == 3  # log2 W
    assert model.predict("all_reduce", "recursive_doubling", 10**6, 6) == 4  # log2 4, + 2
    assert model.predict("broadcast", "naive", 10**6, 5) == 4
    assert model.predict("broadcast", "tree", 10**6, 5) == 3
    model = collectives.CostModel(alpha=0.0, beta=1.0)
    assert model.predict("all_reduce", "ring", 8000, 8) == 2 * 7 * 1000
    assert model.predict("all_reduce", "reduce_broadcast", 8000, 8) == 6 * 8000


# Your own ring, with `--ring FILE.py:FUNCTION` (tutorials/exercises/ring.py): the checks above,
# on your function. Without --ring these are skipped; with it, only these run.


def check_ring_values(rank_pools, where: str, world_size: int, case: Case) -> None:
    """A ring's result: the same bits on every rank, torch.distributed's within rounding."""
    results = rank_pools(world_size).run(run_ring, case, where, timeout=60)
    inputs = all_inputs(case, world_size)
    for rank, result in enumerate(results):
        label = f"rank {rank}, your ring ({case.numel} {case.dtype}, {case.op})"
        assert torch.equal(result["yours"], results[0]["yours"]), (
            f"{label}: holds other bits than rank 0; an all-reduce leaves every rank the same "
            "result (each chunk is reduced once, on one rank, then copied round the ring)"
        )
        assert_close_to_torch(result["yours"], result["torch"], inputs, case.op, label)


def check_ring_promise(rank_pools, where: str, world_size: int) -> None:
    """A ring's messages: each to the right neighbour, each one of W chunks, 2(W-1) of them
    per rank, and each rank sending 2(W-1)/W of the tensor (the lower bound) when W divides it.
    Over all ranks, every element travels 2(W-1) times whatever the length."""
    pool = rank_pools(world_size)
    for numel in (1, 12 * world_size, 12 * world_size + 1):
        n, chunk = 4 * numel, 4 * math.ceil(numel / world_size)
        counts = pool.run(count_ring, where, numel, timeout=60)
        for rank, count in enumerate(counts):
            assert torch.equal(count["result"], torch.full((numel,), float(world_size))), (
                f"rank {rank}: a SUM of ones over {world_size} ranks is not {world_size} everywhere"
            )
            for _, src, dst, nbytes in count["messages"]:
                assert dst == (src + 1) % world_size, (
                    f"rank {src} sent to rank {dst}: in a ring each rank sends only to its right "
                    f"neighbour, rank {(src + 1) % world_size} (the idea of the ring)"
                )
                assert nbytes <= chunk, (
                    f"rank {src} sent {nbytes} bytes of a {n}-byte tensor at once: a ring's "
                    f"message is one of W = {world_size} chunks, at most {chunk} bytes"
                )
            if numel >= world_size:
                assert count["messages_sent"] == 2 * (world_size - 1), (
                    f"rank {rank} sent {count['messages_sent']} messages; a ring all-reduce "
                    f"takes 2(W-1) = {2 * (world_size - 1)} steps of one message each"
                )
            if numel % world_size == 0:
                promise = 2 * (world_size - 1) * n // world_size
                assert count["bytes_sent"] == count["bytes_received"] == promise, (
                    f"rank {rank} sent {count['bytes_sent']} and received "
                    f"{count['bytes_received']} bytes of a {n}-byte tensor; the ring's promise "
                    f"is 2(W-1)/W n = {promise} each way, the least any all-reduce can"
                )
        total = sum(count["bytes_sent"] for count in counts)
        assert total == 2 * (world_size - 1) * n, (
            f"{total} bytes sent over all ranks for {numel} floats; in a ring every element "
            f"travels 2(W-1) times: {2 * (world_size - 1) * n}"
        )


@pytest.mark.parametrize("world_size", [2, 3])
def test_your_ring_on_one_fixed_example(rank_pools, your_ring, world_size):
    case = Case("all_reduce", numel=10, dtype="float32", op="SUM", seed=1)
    check_ring_values(rank_pools, your_ring, world_size, case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_your_ring_keeps_the_rings_promise(rank_pools, your_ring, world_size):
    check_ring_promise(rank_pools, your_ring, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@property_settings(max_examples=30)
@given(data=st.data())
def test_your_ring_matches_torch(rank_pools, your_ring, world_size, data):
    check_ring_values(rank_pools, your_ring, world_size, data.draw(cases("all_reduce", world_size)))


@pytest.mark.parametrize("odd_numel", [3, 8], ids=["shorter", "longer"])
def test_a_labelled_all_gather_shows_every_label_and_survives_pieces_of_other_sizes(
    rank_pools, odd_numel
):
    """fully_shard's gathers (sharding/units.py): on 3 ranks, rank 1 gathers something else,
    of another size. gloo would abort on a message longer than its receive; with room for the
    largest, every rank sees every label, copies only the pieces labelled as its own, and the
    next gather, where all agree again, is whole."""
    results = rank_pools(3).run(labelled_gathers, 1, odd_numel, timeout=60)
    for rank, result in enumerate(results):
        assert result["labels"] == [[7, 7, 7], [7, 9, 7], [7, 7, 7]], rank
        whole = [torch.arange(5.0) + 10 * r + 200 for r in range(3)]
        assert torch.equal(result["outputs"][2], torch.cat(whole))
        if rank != 1:  # the odd piece is not copied; the agreeing ones are
            odd = result["outputs"][1].view(3, 5)
            assert torch.equal(odd[1], torch.full((5,), -1.0))
            assert torch.equal(odd[2 - rank], torch.arange(5.0) + 10 * (2 - rank) + 100)


def received_through_a_host_buffer() -> dict:
    """Rank 0 sends four numbers; rank 1 receives them into a buffer of their own and lands them
    in its tensor (peers.landing, what a GPU tensor's receive on gloo does: test_cuda runs it)."""
    from miniddp.collectives.peers import landing, on_the_wire

    tensor = torch.zeros(4)
    if dist.get_rank() == 0:
        dist.send(torch.arange(4.0) + 1, 1)
        return {}
    wire = torch.empty(4)
    work = landing(dist.irecv(wire, 0), wire, tensor)
    before = tensor.clone()
    work.wait()
    return {
        "before": before,
        "after": tensor,
        "completed": work.is_completed(),
        "host tensors travel as they are": on_the_wire(tensor, None, incoming=True) is tensor,
        "a receive into its own tensor is its work": landing(work, tensor, tensor) is work,
    }


def test_a_receive_through_a_host_buffer_lands_when_waited_for(pool2):
    result = pool2.run(received_through_a_host_buffer)[1]
    assert torch.equal(result.pop("before"), torch.zeros(4))  # untouched until the wait
    assert torch.equal(result.pop("after"), torch.arange(4.0) + 1)
    assert all(result.values()), result
