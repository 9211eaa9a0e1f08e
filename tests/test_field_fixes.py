"""Cases a hostile user found giving a wrong result, hanging, or going unchecked (issue 45), each
against its reference: one process, or torch's own implementation."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miniddp.job.faults import CollectiveFailed
from tests import field_fixes_tasks as tasks
from tests.harness.pool import RankFailure
from tests.test_pipeline_faults import run_processes

PIPELINE_FAULT_DEADLINE_S = 60.0  # a hang lasts the process group's timeout, 10 times this

ACCUMULATING_MESHES = {  # name: ((pp, dp, tp), data parallelism)
    "pp": ((2, 1, 1), "ddp"),
    "pp x dp": ((2, 2, 1), "ddp"),
    "pp x fsdp": ((2, 2, 1), "fsdp"),
}


@pytest.mark.parametrize("name", ACCUMULATING_MESHES)
def test_two_pipeline_steps_before_the_optimizer_sum_as_one_process_accumulating(rank_pools, name):
    """The tied embedding's two copies (first and last stage) are summed after each step; what
    the earlier step left in .grad must not be summed again."""
    shape, data_parallel = ACCUMULATING_MESHES[name]
    world = shape[0] * shape[1] * shape[2]
    steps = 2
    results = rank_pools(world).run(tasks.parallel_accumulating, shape, data_parallel, steps)
    reference = tasks.one_process_accumulating(replicas=shape[1], steps=steps)
    for rank, params in enumerate(results):
        for name_, tensor in params.items():
            expected = reference["token.weight" if name_ == "head.weight" else name_]
            difference = (tensor - expected).abs().max().item()
            assert difference < 1e-12, f"rank {rank}'s {name_} is off by {difference:.3g}"


@pytest.mark.parametrize(
    "setting", [{"is_causal": True}, {"load_balance": True}], ids=["is_causal", "load_balance"]
)
def test_ring_attention_refuses_settings_that_differ_across_ranks_on_every_rank(pool2, setting):
    """One rank causal and the other not would compute two different attentions, each rank's
    part of its own: refused on both, naming each rank's settings."""
    found = pool2.run(tasks.ring_attention_with_settings_per_rank, [setting, {}])
    (name,) = setting
    for rank, message in enumerate(found):
        rank_0, rank_1 = message.split("rank 0: ")[1].split("rank 1: ")
        assert f"{name}=True" in rank_0 and f"{name}=False" in rank_1, (rank, message)
        assert "pass the same is_causal and load_balance on every rank" in message, message


def test_mixed_precision_casts_a_floating_point_keyword_input(pool2):
    """torch's DDP casts every floating-point input, positional or keyword, to param_dtype; a
    keyword input left in float32 would meet bf16 weights in a matmul and fail."""
    for result in pool2.run(tasks.keyword_input_under_mixed_precision):
        assert result["keyword output"].dtype == torch.bfloat16
        assert torch.equal(result["keyword output"], result["position output"])
        assert torch.equal(result["keyword grad"], result["position grad"])


def test_optimizer_in_backward_under_mixed_precision_steps_as_torch_s_fully_shard(pool2):
    """Hooks on the fp32 masters run once each master's gradient is written, the average: as
    torch's fully_shard runs them on each reduced shard. The same bits after two steps."""
    ours = pool2.run(tasks.optimizer_in_backward, "miniddp")
    torch_s = pool2.run(tasks.optimizer_in_backward, "torch")
    for rank in range(2):
        for mine, theirs in zip(ours[rank], torch_s[rank], strict=True):
            assert torch.equal(mine, theirs), (rank, (mine - theirs).abs().max())


def test_a_checkpoint_after_a_validation_forward_holds_the_fp32_masters(pool2, tmp_path):
    """A forward with grad enabled and no backward leaves the bf16 copies in the module's slots;
    the checkpoint must still hold the masters, and the resume equal the run that went on."""
    for result in pool2.run(tasks.validation_then_checkpoint, str(tmp_path / "checkpoint.pt")):
        assert set(result["saved dtypes"].values()) == {torch.float32}, result["saved dtypes"]
        assert result["loaded directly"]
        for went_on, resumed in zip(result["uninterrupted"], result["resumed"], strict=True):
            assert torch.equal(went_on, resumed)


def test_compute_copies_under_zero_bubble_give_interleaved_1f1b_s_bits(pool2):
    """The zero-bubble split computes each weight gradient apart, later, through the same graph:
    its leaves are the bf16 copies, whose gradients fold into the masters as in one backward."""
    zero_bubble = pool2.run(tasks.compute_copies_under, "zero bubble")
    interleaved = pool2.run(tasks.compute_copies_under, "interleaved 1F1B")
    for rank in range(2):
        assert zero_bubble[rank].keys() == interleaved[rank].keys()
        for stage, grads in interleaved[rank].items():
            for expected, got in zip(grads, zero_bubble[rank][stage], strict=True):
                assert got is not None, f"stage {stage} got no gradient"
                assert got.dtype == torch.float32
                assert torch.equal(got, expected), f"stage {stage}"


@pytest.mark.parametrize("which", ["miniddp", "torch"])
def test_fully_sharded_stages_are_refused_by_zero_bubble_on_every_rank(rank_pools, which):
    """fully_shard gathers and reduces around one whole backward, which the zero-bubble split
    runs in two passes: refused before any message, on every rank, naming the way out. Seen
    from the mark MiniDDP's fully_shard leaves, or torch's FSDPModule."""
    outcomes = rank_pools(4).run_expecting_errors(
        tasks.fully_sharded_stages_under_zero_bubble, which
    )
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} trained: {outcome}"
        assert "fully_shard" in outcome.message, outcome.message
        assert "ScheduleInterleaved1F1B" in outcome.message, outcome.message


def stage_that_raises_in_forward(rank: int, store_path: str, out_dir: str) -> None:
    """Two stages of 1F1B; in the second step the first stage's layer raises, and its script
    catches that and calls cleanup(). Each rank writes what it raised last. The process group's
    timeout is long: waiting it out would outlast the run's deadline."""
    from miniddp import cleanup
    from miniddp.pipeline import PipelineStage, Schedule1F1B

    class Breaks(torch.nn.Linear):
        broken = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.broken:
                raise RuntimeError("the layer broke")
            return super().forward(x)

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    timeout = timedelta(seconds=10 * PIPELINE_FAULT_DEADLINE_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    layer = Breaks(4, 4)
    stage = PipelineStage(layer, rank, 2, "cpu")
    schedule = Schedule1F1B(stage, 2, lambda output, target: (output - target).pow(2).mean())
    x = torch.randn(4, 4)
    said = "no error"
    for step in range(2):
        layer.broken = rank == 0 and step == 1
        try:
            schedule.step(x) if rank == 0 else schedule.step(target=x)
        except RuntimeError as error:
            said = f"{type(error).__name__}: {error}"
            if isinstance(error, CollectiveFailed):
                break
            try:
                cleanup()
            except CollectiveFailed as failure:
                said = f"{type(failure).__name__}: {failure}"
            break
    Path(out_dir, f"rank{rank}.txt").write_text(said)
    os._exit(0)


def test_a_stage_that_raises_and_cleans_up_is_named_on_both_ranks(tmp_path: Path) -> None:
    """The stage that raised leaves through cleanup(); the one waiting for its activation hears
    of it through the store, as MiniDDP's ranks do, instead of waiting out the timeout."""
    raised, waiting = run_processes(
        stage_that_raises_in_forward, 2, tmp_path, PIPELINE_FAULT_DEADLINE_S
    )
    assert waiting.startswith(
        "CollectiveFailed: the receive of activation 0 from stage 0 could not finish on rank 1: "
        "rank 0 is missing"
    ), waiting
    assert "rank 0: it called cleanup() while handling RuntimeError: the layer broke" in waiting
    assert raised.startswith("CollectiveFailed: cleanup() on rank 0 cannot go on"), raised
    assert "the receive of activation 0 from stage 0" in raised, raised
    assert "This rank left a step with RuntimeError: the layer broke" in raised, raised


def test_hooks_on_the_masters_run_once_with_the_final_gradient(pool2):
    """Inside no_sync() (the fold is the last write), synced (the average), and under
    ComputeInCopies (no reduction): each master's hook runs once, and sees its fp32 .grad."""
    for found in pool2.run(tasks.master_hooks_under_mixed_precision):
        for case, each_master in found.items():
            assert all(each_master), (case, each_master)
