"""The checks that test an exercise's idea, not only its numbers.

The property checks (equivalence.py) look at gradients, and a DDP can get the gradients right
without the idea an exercise teaches: one all-reduce per gradient is right, and it is rung 2, not
buckets. So each idea that the numbers cannot see gets a check of its own, selected with
`--ddp-claims`, and a failure names the idea and the chapter that teaches it:

    buckets       every synced step sends exactly one all-reduce per bucket of rung 3's layout
                  for the cap (gradients walked in reverse registration order, each (dtype,
                  device) filling its own bucket until it holds the cap), and all-reduce i
                  carries exactly bucket i's gradients, end to end
    torch-layout  besides torch's bits at any W on small models: a model over 1 MiB at
                  bucket_cap_mb=None gets torch's two caps, a 1 MiB first bucket then 25 MiB
    no-sync       besides one process's gradients: no all-reduce inside no_sync(), and the
                  synced micro-step sends the usual count

The all-reduces are counted by wrapping `torch.distributed.all_reduce` on each rank while the
learner's class trains: the class itself need not count anything.
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
)

# Claims that only an exercise's idea check tests (the others are miniddp.steps.CLAIMS).
IDEA_CLAIMS = frozenset({"buckets"})

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
    """Exercise 3's idea: one all-reduce per bucket of rung 3's layout, each carrying exactly its
    bucket's gradients."""
    spec = dataclasses.replace(BUCKETS_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_recording_all_reduces, spec, timeout=120)
    idea = (
        "the idea of buckets (exercise 3, chapter 03) is one all-reduce per bucket: walk the "
        "gradients in reverse registration order, each (dtype, device) filling a flat tensor "
        "until it holds bucket_cap_mb, and all-reduce each flat tensor once"
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


def check_torch_layout_at_default_caps(rank_pools, implementation: str, world_size: int = 2):
    """Exercise 4's idea at bucket_cap_mb=None: torch's 1 MiB first bucket, then 25 MiB."""
    spec = dataclasses.replace(LARGE_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_both, spec, timeout=120)
    for rank, result in enumerate(results):
        ours, theirs = result["ours"]["layout"], result["torch"]["layout"]
        assert ours == theirs, (
            f"torch-layout, rank {rank}: on a 2.9 MB model at bucket_cap_mb=None the buckets "
            f"after the rebuild are {ours}, torch's are {theirs}. torch caps the first bucket "
            "at 1 MiB, so that the first all-reduce leaves early in backward, and every later "
            "one at 25 MiB (exercise 4, chapter 03e): at the default, the two caps differ."
        )
        for step, (a, b) in enumerate(zip(result["ours"]["grads"], result["torch"]["grads"])):
            for name, mine, torchs in zip(result["ours"]["names"], a, b):
                assert torch.equal(mine, torchs), (
                    f"torch-layout, rank {rank} step {step}: the gradient of '{name}' is not "
                    "torch's bits on a 2.9 MB model at bucket_cap_mb=None"
                )


def check_no_sync(rank_pools, implementation: str, world_size: int = 2) -> None:
    """no_sync's idea: nothing sent inside it; the synced micro-step sends the usual count."""
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


def _named(layout: list[list[int]], names: list[str]) -> str:
    return "; ".join("[" + ", ".join(names[i] for i in bucket) + "]" for bucket in layout)


def check_ideas(rank_pools, implementation: str, claims: frozenset[str]) -> list[str]:
    """Run the idea check of every claim that has one; return the names of those run."""
    checks = {
        "buckets": check_buckets,
        "torch-layout": check_torch_layout_at_default_caps,
        "no-sync": check_no_sync,
    }
    ran = []
    for claim, check in checks.items():
        if claim in claims:
            check(rank_pools, implementation)
            ran.append(claim)
    return ran
