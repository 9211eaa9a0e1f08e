"""The proof: miniddp.local_sgd's DiLoCo is torchft's DiLoCo bit for bit, its LocalSGD is torch's
PostLocalSGDOptimizer bit for bit, and both say no, clearly, to what they cannot do.

- DiLoCo against torchft 0.2.0's DiLoCo (init_sync=False, a lighthouse on 127.0.0.1, replicas as
  threads: tests/torchft_reference.py), on the same model and data, after several outer steps:
  at 2 and 4 replicas, and streaming (2 fragments, with and without a delay). Inner AdamW, outer
  Nesterov SGD (lr 0.7, momentum 0.9): the paper's. Each replica's parameters, bitwise.
- H = 1 with an outer SGD of lr 1 and no momentum is synchronous data parallelism (inner SGD).
- Streaming with one fragment given, and no delay, is DiLoCo itself.
- LocalSGD against torch's PostLocalSGDOptimizer + PeriodicModelAverager at W = 2 (the averager
  needs an explicit group on CPU).

What each catches, planted bugs checked: the sign of the pseudo-gradient, the global copy not
restored before the outer step, averaging over the wrong group (the torchft comparisons); a
fragment synced twice (the sync counts, and the streaming comparison).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import local_sgd_tasks
from tests.local_sgd_tasks import Spec

REPO = Path(__file__).resolve().parents[1]
torchft = pytest.importorskip("torchft", reason="torchft==0.2.0 is a test dependency")


W2 = Spec(replicas=2, sync_every=3, outer_steps=3)
AGAINST_TORCHFT = {
    "W2": W2,
    "W4": Spec(replicas=4, sync_every=3, outer_steps=3),
    "W2-streaming": Spec(replicas=2, sync_every=4, outer_steps=3, fragments=2),
    "W2-streaming-delay1": Spec(replicas=2, sync_every=4, outer_steps=3, fragments=2, delay=1),
}


@pytest.fixture(scope="module")
def torchfts(tmp_path_factory) -> dict[str, list[list[torch.Tensor]]]:
    """torchft's runs of every spec above, in one subprocess (one import of torch and torchft)."""
    out = tmp_path_factory.mktemp("torchft") / "torchft.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
    specs = [repr(spec) for spec in AGAINST_TORCHFT.values()]
    done = subprocess.run(
        [sys.executable, "-m", "tests.torchft_reference", str(out), *specs],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"torchft's run failed:\n{done.stderr[-3000:]}"
    return dict(zip(AGAINST_TORCHFT, torch.load(out)))


def assert_bitwise(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        difference = (a - b).abs().max().item()
        assert torch.equal(a, b), f"{what}: parameter {index} differs by {difference:.3g}"


@pytest.mark.parametrize("name", AGAINST_TORCHFT)
def test_diloco_is_torchfts_bit_for_bit(rank_pools, torchfts, name):
    spec, theirs = AGAINST_TORCHFT[name], torchfts[name]
    ours = rank_pools(spec.replicas).run(local_sgd_tasks.diloco, spec)
    for replica, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        assert_bitwise(mine["params"], reference, f"replica {replica} against torchft")
        # every fragment synced once per outer step: not twice, not skipped
        assert mine["syncs_each"] == [spec.outer_steps] * spec.fragments


def test_diloco_averages_over_its_group_only(rank_pools, torchfts):
    """Four ranks, two DiLoCo groups of two (a mesh's "diloco" axis, ranks 0+2 and 1+3): each
    group trains as torchft's two replicas do, untouched by the other group."""
    ours = rank_pools(4).run(local_sgd_tasks.diloco, W2, [[0, 2], [1, 3]])
    for rank, mine in enumerate(ours):
        reference = torchfts["W2"][rank // 2]
        assert_bitwise(mine["params"], reference, f"rank {rank} against torchft's replica")


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_the_courses_all_reduces_give_torchfts_bits_at_two_replicas(pool2, torchfts, algorithm):
    """At W = 2 every all-reduce adds a + b, so the course's own (miniddp/collectives) are
    torchft's bits too; at W >= 3 only gloo's order is (exchange.py)."""
    spec = Spec(**{**W2.__dict__, "algorithm": algorithm})
    for replica, mine in enumerate(pool2.run(local_sgd_tasks.diloco, spec)):
        assert_bitwise(mine["params"], torchfts["W2"][replica], f"{algorithm}, replica {replica}")


def test_the_replicas_agree_after_every_sync_and_send_one_model_per_outer_step(pool2):
    spec = Spec(sync_every=3, outer_steps=2)
    results = pool2.run(local_sgd_tasks.diloco, spec)
    assert_bitwise(results[0]["params"], results[1]["params"], "replica 0 against replica 1")
    model = local_sgd_tasks.build_model(spec)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert results[0]["sent_bytes"] == spec.outer_steps * model_bytes


def test_bf16_exchange_sends_half_the_bytes_and_lands_near_float32(pool2):
    full = pool2.run(local_sgd_tasks.diloco, Spec(outer_steps=2))[0]
    half = pool2.run(local_sgd_tasks.diloco, Spec(outer_steps=2, exchange_dtype="bfloat16"))[0]
    assert half["sent_bytes"] * 2 == full["sent_bytes"]
    for a, b in zip(half["params"], full["params"]):
        assert not torch.equal(a, b) or a.numel() == 0
        torch.testing.assert_close(a, b, rtol=0, atol=0.02)


def test_diloco_with_h1_and_outer_sgd_lr1_is_synchronous_data_parallelism(pool2):
    spec = Spec(sync_every=1, outer_steps=4, inner="sgd", inner_lr=0.1, outer_lr=1.0)
    spec = Spec(**{**spec.__dict__, "outer_momentum": 0.0})
    diloco = pool2.run(local_sgd_tasks.diloco, spec)
    synchronous = pool2.run(local_sgd_tasks.synchronous_data_parallel, spec)
    for replica in range(2):
        # θ_g − mean(θ_g − θ_r) against θ − lr mean(g_r): the same sum, rounded differently
        for a, b in zip(diloco[replica]["params"], synchronous[replica]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_streaming_with_one_fragment_and_no_delay_is_diloco_itself(pool2):
    spec = Spec(sync_every=3, outer_steps=2)
    plain = pool2.run(local_sgd_tasks.diloco, spec)
    streaming = pool2.run(local_sgd_tasks.diloco_with_fragments_given, spec)
    for replica in range(2):
        assert_bitwise(streaming[replica], plain[replica]["params"], "one fragment")


def test_a_checkpoint_of_global_params_both_optimizers_and_the_step_resumes_bitwise(pool2):
    spec = Spec(sync_every=4, outer_steps=4, fragments=2)
    for result in pool2.run(local_sgd_tasks.diloco_resumes_bitwise, spec):
        assert_bitwise(result["resumed"], result["straight"], "resumed against straight")


def test_diloco_across_replicas_each_running_miniddp_is_the_run_written_by_hand(rank_pools):
    spec = Spec(sync_every=3, outer_steps=3)
    ours = rank_pools(4).run(local_sgd_tasks.diloco_across_ddp_replicas, spec, False)
    by_hand = rank_pools(4).run(local_sgd_tasks.diloco_across_ddp_replicas, spec, True)
    for rank in range(4):
        assert_bitwise(ours[rank], by_hand[rank], f"rank {rank} against the run by hand")
    assert_bitwise(ours[0], ours[3], "replica 0 against replica 1")


@pytest.mark.slow  # ~10 s on 4 ranks; the MiniDDP-inside test covers the mesh by default
def test_diloco_across_replicas_each_fully_sharded_trains_as_with_miniddp_inside(rank_pools):
    """fully_shard inside each replica: DiLoCo averages each rank's flat piece with the same
    piece of the other replica. Against MiniDDP inside: the same maths, other sums (the
    reduce-scatter, the sharded clipping norm), so within 1e-6, not bitwise."""
    spec = Spec(sync_every=3, outer_steps=3)
    sharded = rank_pools(4).run(
        local_sgd_tasks.diloco_across_ddp_replicas, spec, False, 0.5, "fully_shard"
    )
    ddp = rank_pools(4).run(local_sgd_tasks.diloco_across_ddp_replicas, spec, False)
    for rank in range(4):
        for a, b in zip(sharded[rank], ddp[rank], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_local_sgd_is_torchs_post_local_sgd_bit_for_bit_at_w2(pool2):
    spec = Spec(sync_every=3, outer_steps=3)
    for result in pool2.run(local_sgd_tasks.local_sgd_against_torch, spec):
        assert result["syncs"] == spec.outer_steps
        assert_bitwise(result["ours"], result["theirs"], "LocalSGD against PostLocalSGDOptimizer")


@pytest.mark.parametrize(
    "build, words",
    [
        ("sync_every_0", "sync_every must be a whole number"),
        ("local_sgd_sync_every_0", "sync_every must be a whole number"),
        ("outer_over_other_params", "outer optimizer must hold exactly the model's parameters"),
        ("tensor_parallel_group", "tensor-parallel shard"),
        ("fragments_not_covering", "fragments must cover the model"),
        ("fragments_overlapping", "fragments must not overlap"),
        ("delay_too_long", "fragment_sync_delay (2) must be less than"),
        ("replicas_start_apart", "replicas start from different parameters"),
        ("step_outside_with", "only inside `with diloco:`"),
    ],
)
def test_bad_input_is_refused_on_every_rank_naming_the_fix(pool2, build, words):
    for outcome in pool2.run_expecting_errors(local_sgd_tasks.refused, build):
        assert words in outcome.message, outcome.message


def test_a_replica_that_dies_is_named_and_the_others_go_on_as_if_it_never_was(tmp_path):
    """Three replicas; replica 2 dies between syncs 1 and 2. The survivors finish, agree with
    each other, and equal the run whose replicas were 0 and 1 alone from sync 2 on."""
    from tests.diloco_replica_dies import VICTIM, launch

    died, named = launch("death", 3, tmp_path)
    reference, _ = launch("reference", 3, tmp_path)
    assert VICTIM not in died
    for rank in (0, 1):
        assert named.get(rank, "").startswith("survivors [0, 1]\n"), named
        assert f"rank {VICTIM} is missing" in named[rank], named
        assert isinstance(died.get(rank), list), f"rank {rank}: {died.get(rank)}"
        assert_bitwise(died[rank], reference[rank], f"survivor {rank} against the reference")
    assert_bitwise(died[0], died[1], "survivor 0 against survivor 1")


@pytest.mark.slow
def test_at_four_replicas_a_slow_one_is_waited_for_and_only_the_dead_one_left_out(tmp_path):
    """Replica 3 dies; replica 0 is slow (0.5 s more a step), and its neighbours' view of the
    ring fails before it arrives. The three survivors go on together; their first sync without
    replica 3 runs the course's ring, whose sums are gloo's to rounding only."""
    from tests.diloco_replica_dies import launch

    died, named = launch("death", 4, tmp_path, victim=3, slow=0)
    reference, _ = launch("reference", 4, tmp_path, victim=3)
    assert 3 not in died
    for rank in (0, 1, 2):
        assert isinstance(died.get(rank), list), f"rank {rank}: {died.get(rank)}"
        # wait_for's first view may name slow replica 0 too; the agreement does not
        assert named.get(rank, "").startswith("survivors [0, 1, 2]\n"), named
        assert "rank 3: posted nothing" in named[rank], named
        assert_bitwise(died[rank], died[0], f"survivor {rank} against survivor 0")
        for a, b in zip(died[rank], reference[rank]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
