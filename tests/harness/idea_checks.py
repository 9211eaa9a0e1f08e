"""The checks that test an exercise's idea, not only its numbers.

The property checks (equivalence.py) look at gradients, and a DDP can get the gradients right
without the idea an exercise teaches: one all-reduce per gradient is right, and it is rung 2, not
buckets. So each idea that the numbers cannot see gets a check of its own, selected with
`--ddp-claims`, and a failure names the idea and the chapter that teaches it (those of rungs 6
and 7, find-unused-parameters, comm-hook and gradient-as-bucket-view, are in option_checks.py):

    overlap       an all-reduce launched from a gradient's hook is still in flight (not waited
                  for) when a later gradient's hook runs: communication during backward
    buckets       every synced step sends exactly one all-reduce per bucket of rung 3's layout
                  for the cap (gradients walked in reverse registration order, each (dtype,
                  device) filling its own bucket until it holds the cap), all-reduce i
                  carries exactly bucket i's gradients, end to end, and the first one leaves
                  before backward ends (a full bucket launches at once)
    torch-layout  besides torch's bits at any W on small models: a model over 1 MiB at
                  bucket_cap_mb=None gets torch's two caps, a 1 MiB first bucket then 25 MiB;
                  and where the ranks' gradients come ready in different orders, every rank
                  rebuilds from rank 0's, as torch's DDP (and gets torch's bits)
    no-sync       besides one process's gradients: no all-reduce inside no_sync(), the
                  synced micro-step sends the usual count, and the decision is made at forward,
                  as torch's: a forward inside no_sync() with its backward outside sends
                  nothing, a forward outside with its backward inside reduces

The all-reduces are counted by wrapping `torch.distributed.all_reduce` on each rank while the
learner's class trains: the class itself need not count anything. For overlap the wrapper also
hands back a watched Work (a `dist.Work` subclass, so it passes for torch's) that notes when it
is waited for, and a hook of the check's own, registered after the learner's on every
parameter, notes each gradient ready: the order of launches, waits and ready gradients is the
timeline the idea is about.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from miniddp.data_parallel.layout import bucket_caps
from miniddp.steps.buckets import assign_buckets
from tests.workloads import (
    ModelSpec,
    RandomNet,
    TrainSpec,
    grads_of,
    load_implementation,
    micro_batch,
    train_both,
    uses_extra,
    wrap,
)

# Claims that only an exercise's idea check tests (the others are miniddp.steps.CLAIMS).
IDEA_CLAIMS = frozenset({"buckets", "overlap"})

# Two hidden layers, a tied pair, a float64 layer: at this cap rung 3's rule packs the 14
# gradients into fewer buckets than there are gradients, some holding several.
BUCKETS_SPEC = TrainSpec(
    model=ModelSpec(seed=1, widths=(6, 5), tied=True, dtype="mixed"),
    bucket_cap_mb=4e-4,  # 419 bytes
    accumulation=1,
    steps=2,
)
# 300 -> 600 -> 600 -> 300 floats: 2.9 MB of gradients, so torch's default caps give a 1 MiB
# first bucket and a second one; three steps, so that the layout is rebuilt after the first.
LARGE_SPEC = TrainSpec(
    model=ModelSpec(in_features=300, widths=(600, 600), out_features=300), steps=3
)
# Twin layers of one shape, run in the other order on odd ranks, so that their gradients come
# ready in another order there. At this cap (60 bytes) the head fills one bucket and each twin
# one more, of the same size: a rank that rebuilt from its own order would launch twins.0 where
# rank 0 launches twins.1, and gloo, seeing two tensors of one size, would add the two.
TWINS_SPEC = TrainSpec(
    model=ModelSpec(seed=5, widths=(4,), twins=True),
    bucket_cap_mb=5.8e-5,
    accumulation=1,
    steps=2,
)
# Several layers and a cap below one gradient: every gradient its own bucket, so a bucket
# launched from one hook is still travelling when the next gradients arrive. Two steps: the
# first of torch's layout is one bucket (chapter 03e), the second the rebuilt ones.
OVERLAP_SPEC = TrainSpec(
    model=ModelSpec(seed=3, widths=(6, 5, 4)), bucket_cap_mb=1e-6, accumulation=1, steps=2
)
# Three micro-steps per optimizer step: two inside no_sync(), then the synced one.
NO_SYNC_SPEC = TrainSpec(model=ModelSpec(seed=2, widths=(6, 5)), accumulation=3, steps=2)


@contextlib.contextmanager
def all_reduces_recorded() -> Iterator[list[torch.Tensor]]:
    """Every tensor passed to `dist.all_reduce` while inside, in call order."""
    calls: list[torch.Tensor] = []
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args, **kwargs):
        calls.append(tensor)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        yield calls
    finally:
        dist.all_reduce = original


class _WatchedFuture(torch.futures.Future):
    """The future of a watched all-reduce: completes with it, and notes the first wait."""

    def __init__(self, note_wait) -> None:
        super().__init__()
        self._note_wait = note_wait

    def wait(self):
        self._note_wait()
        return super().wait()


class _WatchedWork(dist.Work):
    """An all-reduce's Work that notes, in the timeline, when it is first waited for."""

    def __init__(self, inner: dist.Work, timeline: list[tuple[str, int]], index: int) -> None:
        super().__init__()
        self._inner, self._timeline, self._index, self._future = inner, timeline, index, None

    def _note_wait(self) -> None:
        if ("wait", self._index) not in self._timeline:
            self._timeline.append(("wait", self._index))

    def wait(self, timeout=None):
        self._note_wait()
        return self._inner.wait() if timeout is None else self._inner.wait(timeout)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = _WatchedFuture(self._note_wait)
            watched = self._future

            def done(inner: torch.futures.Future) -> None:
                try:
                    watched.set_result(inner.value())
                except Exception as error:  # noqa: BLE001 - handed on to whoever waits
                    watched.set_exception(error)

            self._inner.get_future().add_done_callback(done)
        return self._future


@contextlib.contextmanager
def timeline_recorded(params: list[nn.Parameter]) -> Iterator[list[tuple[str, int]]]:
    """("launch", i), ("wait", i) for each all-reduce i, ("ready", k) for each gradient k, in
    the order they happen. A blocking all-reduce is launched and waited for at once."""
    timeline: list[tuple[str, int]] = []
    original = dist.all_reduce
    launched = [0]

    def watching(tensor: torch.Tensor, *args, **kwargs):
        index = launched[0]
        launched[0] += 1
        timeline.append(("launch", index))
        work = original(tensor, *args, **kwargs)
        if work is None:  # async_op=False: it finished before returning
            timeline.append(("wait", index))
            return None
        return _WatchedWork(work, timeline, index)

    handles = [
        p.register_post_accumulate_grad_hook(lambda _, k=k: timeline.append(("ready", k)))
        for k, p in enumerate(params)
    ]
    dist.all_reduce = watching
    try:
        yield timeline
    finally:
        dist.all_reduce = original
        for handle in handles:
            handle.remove()


def in_flight_across_a_later_gradient(timeline: list[tuple[str, int]]) -> bool:
    """Is some all-reduce still unwaited when a gradient after the one that launched it is
    ready? Its own gradient's ready note comes right after the launching hook (the check's hook
    runs after the learner's), so that takes two ready notes between launch and wait."""
    for position, (kind, index) in enumerate(timeline):
        if kind != "launch":
            continue
        readies = 0
        for later_kind, later_index in timeline[position + 1 :]:
            if later_kind == "wait" and later_index == index:
                break
            readies += later_kind == "ready"
        if readies >= 2:
            return True
    return False


def launched_before_backward_ended(timeline: list[tuple[str, int]]) -> bool:
    """Does the first all-reduce leave before the last gradient is ready?"""
    kinds = [kind for kind, _ in timeline]
    last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
    return "launch" in kinds and kinds.index("launch") < last_ready


def train_recording_timeline(spec: TrainSpec) -> list[list[tuple[str, int]]]:
    """Runs on each rank: each synced step's timeline of launches, waits and ready gradients."""
    rank = dist.get_rank()
    net = RandomNet(spec.model)
    model = wrap(net, spec, use_torch=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=spec.lr)
    _, params = trainable(net)
    timelines = []
    for step in range(spec.steps):
        x, y = micro_batch(spec, rank, step, 0)
        with timeline_recorded(params) as timeline:
            output = model(x, use_extra=uses_extra(spec.model, rank))
            nn.functional.mse_loss(output, y).backward()
            model.finish_gradient_synchronization()
        timelines.append(timeline)
        optimizer.step()
        optimizer.zero_grad()
    return timelines


def check_overlap(rank_pools, implementation: str, world_size: int = 2) -> None:
    """Exercise 3's idea: all-reduces travel while backward still computes (in the last step:
    torch's layout sends the first step as one bucket)."""
    spec = dataclasses.replace(OVERLAP_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_recording_timeline, spec, timeout=120)
    for rank, timelines in enumerate(results):
        step, timeline = len(timelines) - 1, timelines[-1]
        assert in_flight_across_a_later_gradient(timeline), (
            f"overlap, rank {rank} step {step}: no all-reduce was still in flight when a "
            "later gradient became ready, so backward and communication never overlapped. "
            "The idea of overlap (exercise 3, chapter 02b) is to launch each all-reduce "
            "from its gradient's hook with async_op=True and return at once, keeping the "
            "Work, and to wait for all of them only when backward has ended: "
            "dist.all_reduce(grad) or dist.all_reduce(grad, async_op=True).wait() inside "
            f"the hook waits there. Timeline: {short_timeline(timeline)}"
        )


def short_timeline(timeline: list[tuple[str, int]]) -> str:
    return " ".join(f"{kind[0]}{index}" for kind, index in timeline[:40])


def trainable(net: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    """The parameters a DDP averages: those that require grad, a tied one once."""
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


def train_recording_all_reduces(spec: TrainSpec) -> dict:
    """Runs on each rank: the learner's class trains `spec`; for each micro-step, the
    all-reduces it sent, and after each synced one what each carried and the gradients."""
    rank = dist.get_rank()
    net = RandomNet(spec.model)
    model = load_implementation(spec.implementation)(net, bucket_cap_mb=spec.bucket_cap_mb)
    optimizer = torch.optim.SGD(net.parameters(), lr=spec.lr)
    names, params = trainable(net)
    _, cap = bucket_caps(spec.bucket_cap_mb)
    layout = assign_buckets(params, list(range(len(params)))[::-1], cap)
    steps = []
    for step in range(spec.steps):
        micro_steps = []
        for micro in range(spec.accumulation):
            synced = micro == spec.accumulation - 1
            x, y = micro_batch(spec, rank, step, micro)
            with all_reduces_recorded() as calls:
                with contextlib.nullcontext() if synced else model.no_sync():
                    loss = nn.functional.mse_loss(model(x), y) / spec.accumulation
                    loss.backward()
                if synced:
                    model.finish_gradient_synchronization()
            carried = [(tuple(t.shape), t.dtype, t.detach().clone()) for t in calls]
            micro_steps.append({"synced": synced, "carried": carried})
        micro_steps[-1]["grads"] = grads_of(net)
        steps.append(micro_steps)
        optimizer.step()
        optimizer.zero_grad()
    return {"names": names, "layout": layout, "steps": steps}


def check_buckets(rank_pools, implementation: str, world_size: int = 2) -> None:
    """Exercise 4's idea: one all-reduce per bucket of rung 3's layout, each carrying exactly its
    bucket's gradients."""
    spec = dataclasses.replace(BUCKETS_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_recording_all_reduces, spec, timeout=120)
    idea = (
        "the idea of buckets (exercise 4, chapter 03) is one all-reduce per bucket: walk the "
        "gradients in reverse registration order, each (dtype, device) filling a flat tensor "
        "until it holds bucket_cap_mb, and all-reduce each flat tensor once"
    )
    timelines = rank_pools(world_size).run(train_recording_timeline, spec, timeout=120)
    for rank, steps in enumerate(timelines):
        for step, timeline in enumerate(steps):
            assert launched_before_backward_ended(timeline), (
                f"buckets, rank {rank} step {step}: the first all-reduce left only after every "
                "gradient was ready, at the end of backward: nothing overlapped. A bucket "
                "launches as soon as it is full, from the hook that filled it (chapter 03), "
                f"while backward goes on. Timeline: {short_timeline(timeline)}"
            )
    for rank, result in enumerate(results):
        layout, names = result["layout"], result["names"]
        for step, (micro,) in enumerate(result["steps"]):
            carried = micro["carried"]
            assert len(carried) == len(layout), (
                f"buckets, rank {rank} step {step}: {len(carried)} all-reduces for "
                f"{len(names)} gradients, but at bucket_cap_mb={spec.bucket_cap_mb} rung 3's "
                f"rule gives {len(layout)} buckets: {_named(layout, names)}. {idea}."
            )
            for number, ((shape, dtype, tensor), bucket) in enumerate(zip(carried, layout)):
                grads = [micro["grads"][i] for i in bucket]
                expected = torch.cat([g.reshape(-1) for g in grads])
                members = _named([bucket], names)
                what = f"all-reduce {number} should carry bucket {number}, {members}"
                assert tensor.dtype == expected.dtype and tensor.numel() == expected.numel(), (
                    f"buckets, rank {rank} step {step}: {what}: {expected.numel()} values of "
                    f"{expected.dtype}, but it carried {tensor.numel()} of {dtype} "
                    f"(shape {list(shape)}). {idea}."
                )
                assert torch.equal(tensor.reshape(-1), expected), (
                    f"buckets, rank {rank} step {step}: {what}, end to end in that order, and "
                    "hold the averaged gradients that .grad ends with; it holds other values. "
                    "Is each gradient copied, scaled by 1/W, into its own slice of the flat "
                    "tensor, and copied back after the wait?"
                )


def check_torch_layout(rank_pools, implementation: str, world_size: int = 2) -> None:
    """Exercise 5's idea, where small identical ranks cannot show it: torch's two default caps,
    and the rebuild from rank 0's order."""
    check_torch_layout_at_default_caps(rank_pools, implementation, world_size)
    check_torch_layout_from_rank_0s_order(rank_pools, implementation, world_size)


def check_torch_layout_at_default_caps(rank_pools, implementation: str, world_size: int = 2):
    """At bucket_cap_mb=None: torch's 1 MiB first bucket, then 25 MiB."""
    spec = dataclasses.replace(LARGE_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_both, spec, timeout=120)
    for rank, result in enumerate(results):
        ours, theirs = result["ours"]["layout"], result["torch"]["layout"]
        assert ours == theirs, (
            f"torch-layout, rank {rank}: on a 2.9 MB model at bucket_cap_mb=None the buckets "
            f"after the rebuild are {ours}, torch's are {theirs}. torch caps the first bucket "
            "at 1 MiB, so that the first all-reduce leaves early in backward, and every later "
            "one at 25 MiB (exercise 5, chapter 03e): at the default, the two caps differ."
        )
        _assert_torchs_bits(result, f"rank {rank}", "on a 2.9 MB model at bucket_cap_mb=None")


def check_torch_layout_from_rank_0s_order(rank_pools, implementation: str, world_size: int = 2):
    """Where each rank's gradients come ready in another order: every rank's buckets are
    rebuilt from rank 0's order (torch's, on every rank), and the gradients are torch's bits."""
    spec = dataclasses.replace(TWINS_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_both, spec, timeout=120)
    rank_0s = results[0]["torch"]["layout"]
    for rank, result in enumerate(results):
        ours, theirs = result["ours"]["layout"], result["torch"]["layout"]
        assert theirs == rank_0s, (rank, theirs, rank_0s)  # torch's rule
        assert ours == theirs, (
            f"torch-layout, rank {rank}: the twin layers' gradients come ready in another order "
            f"on odd ranks, and your buckets after the rebuild are {ours}, but rank 0's order "
            f"gives {theirs} (torch's layout, on every rank). Every rank rebuilds from rank 0's "
            "order, broadcast to the others (exercise 5, chapter 03e): a rank that uses its own "
            "launches other gradients where rank 0 launches these, and the all-reduce adds "
            "the wrong gradients together."
        )
        _assert_torchs_bits(result, f"rank {rank}", "with the ranks' ready orders differing")


def _assert_torchs_bits(result: dict, who: str, where: str) -> None:
    for step, (a, b) in enumerate(zip(result["ours"]["grads"], result["torch"]["grads"])):
        for name, mine, torchs in zip(result["ours"]["names"], a, b):
            assert torch.equal(mine, torchs), (
                f"torch-layout, {who} step {step}: the gradient of '{name}' is not torch's bits "
                f"{where}"
            )


def split_forward_and_backward(spec: TrainSpec) -> dict[str, dict[str, int]]:
    """Chapter 05's pitfall, both ways, on the learner's class and on torch's DDP: the
    all-reduces one backward sends when its forward ran inside no_sync() and it did not
    ("forward in"), and the other way round ("backward in"). Torch's are counted by a comm hook
    that counts buckets (its reducer's all-reduces are not Python calls)."""
    rank = dist.get_rank()
    counts: dict[str, dict[str, int]] = {}
    for who in ("yours", "torch"):
        counts[who] = {}
        for pattern in ("forward in", "backward in"):
            net = RandomNet(spec.model)
            if who == "yours":
                model = load_implementation(spec.implementation)(net, bucket_cap_mb=None)
            else:
                model = nn.parallel.DistributedDataParallel(net)
                buckets = [0]

                def counting(state, bucket, buckets=buckets):
                    buckets[0] += 1
                    return (
                        dist.all_reduce(bucket.buffer(), async_op=True)
                        .get_future()
                        .then(lambda f: f.value()[0] / dist.get_world_size())
                    )

                model.register_comm_hook(None, counting)
            x, y = micro_batch(spec, rank, 0, 0)
            with all_reduces_recorded() as calls:
                if pattern == "forward in":
                    with model.no_sync():
                        loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                else:
                    loss = nn.functional.mse_loss(model(x), y)
                    with model.no_sync():
                        loss.backward()
                    if who == "yours":
                        model.finish_gradient_synchronization()
            counts[who][pattern] = len(calls) if who == "yours" else buckets[0]
    return counts


def check_no_sync(rank_pools, implementation: str, world_size: int = 2) -> None:
    """no_sync's idea: nothing sent inside it; the synced micro-step sends the usual count;
    whether a backward reduces is decided at its forward, as torch decides it."""
    spec = dataclasses.replace(NO_SYNC_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_recording_all_reduces, spec, timeout=120)
    for rank, result in enumerate(results):
        synced_counts = set()
        for step, micro_steps in enumerate(result["steps"]):
            for micro, record in enumerate(micro_steps):
                count = len(record["carried"])
                if record["synced"]:
                    synced_counts.add(count)
                    continue
                assert count == 0, (
                    f"no-sync, rank {rank} step {step}: micro-step {micro} ran inside no_sync() "
                    f"and sent {count} all-reduces. The idea of no_sync (chapter 05) is that "
                    "gradients only accumulate locally in .grad: nothing is sent until the "
                    "synced micro-step, which all-reduces the sum of the k micro-steps at once."
                )
        assert min(synced_counts) > 0, (
            f"no-sync, rank {rank}: a synced micro-step sent no all-reduce: the accumulated "
            "gradients were never averaged across ranks"
        )
    for rank, counts in enumerate(
        rank_pools(world_size).run(split_forward_and_backward, spec, timeout=120)
    ):
        yours, torchs = counts["yours"], counts["torch"]
        assert torchs["forward in"] == 0 and torchs["backward in"] > 0, torchs  # torch's rule
        for pattern, says in (
            ("forward in", "forward inside no_sync(), backward outside: torch sends nothing"),
            ("backward in", "forward outside no_sync(), backward inside: torch reduces"),
        ):
            assert (yours[pattern] > 0) == (torchs[pattern] > 0), (
                f"no-sync, rank {rank}: {says}, and yours sent {yours[pattern]} all-reduces. "
                "Whether a backward synchronizes is decided at forward (chapter 05): the "
                "forward reads the flag no_sync() sets and arms, or not, the backward that "
                "follows; hooks that read the flag at backward time decide too late."
            )


def _named(layout: list[list[int]], names: list[str]) -> str:
    return "; ".join("[" + ", ".join(names[i] for i in bucket) + "]" for bucket in layout)
