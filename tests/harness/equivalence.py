"""How a DDP's results are compared: with torch's DDP (bit for bit), with one process (up to
rounding), and between its own replicas; and what a difference usually means, so that a failure
tells a learner where to look ("off by a factor of W: did you divide by the world size?").

tests/test_ddp_equivalence.py says which DDP must pass which of these checks.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from tests.harness.measurements import record_max
from tests.workloads import ModelSpec, TrainSpec, claims_of, reference_training, train_both

# Tolerances against single-process training. Not zero, because the two sum the same terms in a
# different order: DDP sums each rank's batch, scales by 1/W and sums across ranks; one process
# sums the whole global batch inside one matmul. Floating-point addition is not associative, so
# results differ by a few units in the last place (float32: ~1e-7 relative), amplified a little by
# a few optimizer steps. BatchNorm amplifies them a lot: it divides by the standard deviation of
# the 2-5 samples a rank holds, which can be tiny (seen in float32: 1.3e-4 absolute, 8e-4
# relative). A real bug (a missing 1/W, another rank's data, a stale gradient) is off by O(1).
TOLERANCE = {
    (torch.float32, False): {"rtol": 1e-4, "atol": 2e-5},
    (torch.float32, True): {"rtol": 2e-3, "atol": 1e-3},
    (torch.float64, False): {"rtol": 1e-10, "atol": 1e-12},
    (torch.float64, True): {"rtol": 1e-9, "atol": 1e-10},
}


# One small example with every awkward part a claim can allow (the parts a DDP does not claim
# are dropped by `fit_to_claims`): checked before the random ones, it fails fast and reads easily.
FIXED_SPEC = TrainSpec(
    model=ModelSpec(seed=1, widths=(6, 5), tied=True, batchnorm=True, dtype="mixed"),
    bucket_cap_mb=1e-4,  # 104 bytes: a few parameters per bucket
    accumulation=2,
    steps=2,
    seed_by_rank=True,
)


@st.composite
def train_specs(draw, max_width: int = 12) -> TrainSpec:
    """A random model with the awkward parts, a bucket cap from "every parameter alone" to
    "one bucket", accumulation, a few steps, and ranks that may start from different seeds."""
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.integers(1, max_width)) for _ in range(depth))
    unused = draw(st.sampled_from(["none", "none", "all_ranks", "some_ranks"]))
    batchnorm = draw(st.booleans())
    model = ModelSpec(
        seed=draw(st.integers(0, 2**16)),
        in_features=draw(st.integers(1, 6)),
        widths=widths,
        out_features=draw(st.integers(1, 4)),
        frozen=tuple(i for i in range(depth) if draw(st.integers(0, 3)) == 0),
        tied=draw(st.booleans()),
        unused=unused,
        batchnorm=batchnorm,
        dtype=draw(st.sampled_from(["float32", "float64", "mixed"])),
    )
    cap = draw(
        st.one_of(
            st.none(),
            st.sampled_from([1e-6, 1e-4, 4e-4, 1e-3, 25.0]),  # one param per bucket .. one bucket
            st.floats(1e-6, 2e-3),
        )
    )
    return TrainSpec(
        model=model,
        bucket_cap_mb=cap,
        accumulation=draw(st.integers(1, 4)),
        steps=draw(st.integers(1, 3)),
        micro_batch=draw(st.integers(2, 5)),  # BatchNorm needs two samples per rank
        gradient_as_bucket_view=draw(st.booleans()),
        set_grads_to_none=draw(st.booleans()),
        broadcast_buffers=draw(st.booleans()) if batchnorm else True,
        find_unused_parameters=unused != "none" or draw(st.integers(0, 4)) == 0,
        data_seed=draw(st.integers(0, 2**16)),
        seed_by_rank=draw(st.booleans()),
        # none, some or all gradients batched: the bits must not depend on it
        small_gradient_numel=draw(st.sampled_from([0, 4, 16, 10**9])),
    )


def fit_to_claims(spec: TrainSpec, implementation: str, claims: frozenset[str]) -> TrainSpec:
    """Keep only what a DDP claims to support (miniddp.steps.CLAIMS) of a drawn spec; a DDP
    that does not claim no_sync always broadcasts buffers (broadcast_buffers comes with it)."""
    model = spec.model
    if "batchnorm" not in claims:
        model = dataclasses.replace(model, batchnorm=False)
    if "mixed-dtypes" not in claims and model.dtype == "mixed":
        model = dataclasses.replace(model, dtype="float32")
    if "find-unused-parameters" not in claims:
        model = dataclasses.replace(model, unused="none")
    return dataclasses.replace(
        spec,
        model=model,
        implementation=implementation,
        find_unused_parameters=spec.find_unused_parameters and "find-unused-parameters" in claims,
        gradient_as_bucket_view=spec.gradient_as_bucket_view
        and "gradient-as-bucket-view" in claims,
        broadcast_buffers=spec.broadcast_buffers or "no-sync" not in claims,
        accumulate_with_no_sync="no-sync" in claims,
        comm_hook=spec.comm_hook if "comm-hook" in claims else None,
    )


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


def what_it_usually_means(
    got: torch.Tensor, expected: torch.Tensor, spec: TrainSpec, world_size: int
) -> str:
    """Name the classic mistake a wrong gradient looks like, from the factor it is off by."""
    scale = float((got * expected).sum() / (expected * expected).sum().clamp_min(1e-30))
    k = spec.accumulation
    for factor, meaning in [
        (world_size, "off by a factor of W: summed over ranks but never divided by the world size"),
        (1 / world_size, "off by a factor of 1/W: divided by the world size twice?"),
        (k, "off by a factor of the accumulation steps: is the loss divided by them?"),
    ]:
        if factor != 1 and abs(scale - factor) < 0.02 * abs(factor):
            return meaning
    return "not a simple factor: another rank's data, a stale gradient, or a missing wait?"


def describe(
    kind: str, step: int, name: str, got: torch.Tensor | None, expected: torch.Tensor | None
) -> str:
    if got is None or expected is None:
        return f"step {step}, {kind} of '{name}': expected {_show(expected)}, got {_show(got)}"
    gap = (got.double() - expected.double()).abs().max().item()
    return (
        f"step {step}, {kind} of '{name}': expected {_show(expected)}, got {_show(got)} "
        f"(max |difference| {gap:.3g})"
    )


def _show(tensor: torch.Tensor | None) -> str:
    if tensor is None:
        return "None (no gradient)"
    values = ", ".join(f"{v:.6g}" for v in tensor.flatten()[:3].tolist())
    return f"[{values}{', ...' if tensor.numel() > 3 else ''}]"


def check_replicas_identical(results: list[dict]) -> None:
    """Every replica holds the same parameters and gradients after every step."""
    first, names = results[0]["ours"], results[0]["ours"]["names"]
    for rank, result in enumerate(results[1:], start=1):
        for step in range(len(first["params"])):
            pairs = zip(names, first["grads"][step], result["ours"]["grads"][step])
            for name, a, b in pairs:
                assert same(a, b), (
                    f"rank {rank} differs from rank 0: {describe('gradient', step, name, b, a)}. "
                    "The gradients were not averaged across ranks: no all-reduce, one not waited "
                    "for, a hook that reduced the parameter instead of its gradient, or "
                    "collectives launched in a different order on each rank."
                )
            for name, a, b in zip(names, first["params"][step], result["ours"]["params"][step]):
                assert torch.equal(a, b), (
                    f"rank {rank}'s replica differs from rank 0's: "
                    f"{describe('parameter', step, name, b, a)}. Did construction copy rank 0's "
                    "parameters and buffers to every rank (ranks may start from different seeds)?"
                )


def check_against_single_process(spec: TrainSpec, results: list[dict], world_size: int) -> None:
    """Gradients and parameters equal single-process training with accumulation, up to
    rounding (TOLERANCE)."""
    reference = reference_training(spec, world_size)
    dtype = torch.float64 if spec.model.dtype == "float64" else torch.float32
    tolerance = TOLERANCE[dtype, spec.model.batchnorm]
    label = f"{dtype}, {'with' if spec.model.batchnorm else 'no'} BatchNorm"
    ours = results[0]["ours"]
    for kind in ("grads", "params"):
        for step, (mine, ref) in enumerate(zip(ours[kind], reference[kind])):
            for name, a, b in zip(ours["names"], mine, ref):
                where = describe(kind[:-1], step, name, a, b)
                assert (a is None) == (b is None), f"{where}, unlike one process"
                if a is None:
                    continue
                if not torch.allclose(a, b, **tolerance):
                    meaning = what_it_usually_means(a, b, spec, world_size)
                    raise AssertionError(f"{where}, unlike one process: {meaning}")
                record_max(f"max |DDP - single process| ({label})", (a - b).abs().max())


def check_against_torch(results: list[dict], one_dtype: bool = True, layout: bool = True) -> None:
    """Every gradient, parameter and buffer equals torch DDP's, bit for bit, on every rank;
    and with `layout`, so do the buckets.

    With several dtypes, torch launches the partly filled buckets left at the end of the layout
    (one per dtype) in hash-map order; then only their membership and inner order must match.
    """
    for rank, result in enumerate(results):
        ours, theirs = result["ours"], result["torch"]
        if layout:
            assert sorted(ours["layout"]) == sorted(theirs["layout"]), (
                f"rank {rank}: bucket layout {ours['layout']} is not torch's {theirs['layout']}"
            )
        if layout and one_dtype:
            assert ours["layout"] == theirs["layout"], f"rank {rank}: bucket order differs"
        for step, (g_ours, g_theirs) in enumerate(zip(ours["grads"], theirs["grads"])):
            for name, a, b in zip(ours["names"], g_ours, g_theirs):
                assert same(a, b), (
                    f"rank {rank}: {describe('gradient', step, name, a, b)}, not torch's bits. "
                    "torch multiplies each gradient by the float 1/W, then all-reduces with SUM; "
                    "dividing by W, or after the sum, changes the last bits when W = 3."
                )
        for step, (s_ours, s_theirs) in enumerate(zip(ours["states"], theirs["states"])):
            for name, a, b in zip(ours["state_names"], s_ours, s_theirs):
                buffer = name in ours["buffer_names"]
                assert same(a, b), f"rank {rank} step {step}: '{name}' differs from torch's" + (
                    ". A buffer (BatchNorm's running statistics): torch's DDP overwrites every "
                    "buffer with rank 0's at the start of a forward that follows a synced one "
                    "(outside no_sync, with grad enabled), and only then: inside no_sync each "
                    "rank's statistics run on alone until the step's synced forward, and with "
                    "broadcast_buffers=False they are never broadcast after construction. Does "
                    "yours broadcast them in the same forwards?"
                    if buffer
                    else ""
                )


def check_claims(
    rank_pools,
    implementation: str,
    world_size: int,
    spec: TrainSpec,
    claims: frozenset[str] | None = None,
) -> list[dict]:
    """What every DDP of the ladder promises, for the parts of `spec` it claims (by default
    the class's own `claims`): identical replicas; one process's results up to rounding; and
    torch's bits at W = 2 (a + b = b + a: the layout cannot matter). With "torch-layout",
    torch's bits and buckets at any W. Returns each rank's results, for further checks."""
    claims = claims_of(implementation) if claims is None else claims
    spec = fit_to_claims(spec, implementation, claims)
    results = rank_pools(world_size).run(train_both, spec, timeout=120)
    check_replicas_identical(results)
    check_against_single_process(spec, results, world_size)
    torch_layout = "torch-layout" in claims
    if world_size == 2 or torch_layout:
        one_dtype = spec.model.dtype != "mixed"
        check_against_torch(results, one_dtype=one_dtype, layout=torch_layout)
    return results
