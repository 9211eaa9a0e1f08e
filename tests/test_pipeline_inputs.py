"""What a pipeline takes besides one tensor (issue 37): activations that are tuples of tensors,
masks and ids among them; forward-only runs (`loss_fn=None`, `schedule.eval`); `step()` under
`torch.no_grad()`; and a group without this rank.

The bar is tests/test_pipeline.py's: bitwise one process and torch's own
torch.distributed.pipelining on gloo, every stage's gradients each step, the parameters at the
end and every loss (or, forward only, every output and loss).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miniddp.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
from miniddp.pipeline.interleaved import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
from tests.test_pipeline import PipeSpec, assert_stage_equal, batch, build_model, mean_share, mse

OURS = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero-bubble": 2}


def torch_schedule(name: str):
    from torch.distributed import pipelining

    classes = {
        "gpipe": pipelining.ScheduleGPipe,
        "1f1b": pipelining.Schedule1F1B,
        "interleaved": pipelining.ScheduleInterleaved1F1B,
        "zero-bubble": pipelining.ScheduleInterleavedZeroBubble,
    }
    return classes[name]


def spec_for(name: str) -> PipeSpec:
    """Two ranks; v = 1 (two stages) or v = 2 (four), every border its own width; m = 4."""
    widths = (6, 5, 3) if STAGES_PER_RANK[name] == 1 else (7, 6, 5, 4, 3)
    return PipeSpec(widths=widths, n_microbatches=4, steps=2)


def my_stages(spec: PipeSpec, model: nn.Sequential, torchs: bool = False) -> list:
    """This rank's stages, rank + i W, built in that order (ours, or torch's PipelineStage)."""
    from torch.distributed.pipelining import PipelineStage as TorchStage

    rank, ranks = dist.get_rank(), dist.get_world_size()
    cls = TorchStage if torchs else PipelineStage
    return [cls(model[s], s, spec.stages, "cpu") for s in range(rank, spec.stages, ranks)]


def schedule_for(name: str, kind: str, stages: list, m: int, with_loss: bool = True):
    """`kind` "ours" or "torch": the schedule `name` over this rank's stages; torch's given
    each microbatch's share of the mean loss, as in tests/test_pipeline.py."""
    stages_arg = stages if STAGES_PER_RANK[name] > 1 else stages[0]
    if kind == "torch":
        loss_fn = partial(mean_share, m=m) if with_loss else None
        return torch_schedule(name)(stages_arg, m, loss_fn=loss_fn, scale_grads=False)
    return OURS[name](stages_arg, m, mse if with_loss else None)


def run_on_my_rank(call, spec: PipeSpec, inputs: tuple, target, losses: list):
    """`call` (step or eval) with what each rank gives it: the inputs on rank 0 (the first
    stage), the target on the last stage's rank, nothing in between."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        return call(*inputs)
    if rank == (spec.stages - 1) % ranks:
        return call(target=target, losses=losses) if target is not None else call()
    return call()


# A tuple between stages: a hidden state and what travels with it.


class MaskedBlock(nn.Module):
    """Block s of an MLP whose stages hand each other five tensors: the hidden state h; a float
    `gate` per sample, made from h (a second tensor whose gradient must come back; the last
    block does not use it: a float input with no gradient, for which zeros go back, as in
    torch); a float `scale` given with the batch and passed on as it came (on stage 0 it needs
    no gradient, so the gradient that comes back for it leads nowhere); a bool mask `keep` and
    int64 `ids` (which carry no gradient). The last block returns h alone."""

    def __init__(self, width_in: int, width_out: int, last: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.last = last

    def forward(self, h, gate, scale, keep, ids):
        z = self.linear(h) * scale
        h = torch.tanh(z if self.last else z + gate) * keep + 0.01 * ids[:, None]
        return h if self.last else (h, h.mean(1, keepdim=True), scale, keep, ids + 1)


def masked_model(spec: PipeSpec) -> nn.Sequential:
    torch.manual_seed(spec.seed)
    pairs = list(zip(spec.widths, spec.widths[1:]))
    return nn.Sequential(
        *[MaskedBlock(a, b, s == len(pairs) - 1) for s, (a, b) in enumerate(pairs)]
    )


def masked_batch(spec: PipeSpec, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * spec.seed + step)
    size = spec.n_microbatches * spec.microbatch
    x = torch.randn(size, spec.widths[0], generator=generator)
    gate = torch.randn(size, 1, generator=generator)
    scale = torch.rand(size, 1, generator=generator) + 0.5
    keep = torch.rand(size, 1, generator=generator) > 0.3
    ids = torch.randint(0, 5, (size,), generator=generator)
    return (x, gate, scale, keep, ids), torch.randn(size, spec.widths[-1], generator=generator)


def masked_one_process(spec: PipeSpec) -> dict:
    """The whole masked MLP in one process: the same microbatches, each loss divided by m."""
    model = masked_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    m = spec.n_microbatches
    grads, losses = [], []
    for step in range(spec.steps):
        inputs, y = masked_batch(spec, step)
        step_losses = []
        for i, ym in enumerate(y.tensor_split(m)):
            output = tuple(t.tensor_split(m)[i] for t in inputs)
            for block in model:
                output = block(*output)
            loss = mse(output, ym)
            (loss / m).backward()
            step_losses.append(loss.detach())
        grads.append([[p.grad.clone() for p in block.parameters()] for block in model])
        losses.append(step_losses)
        optimizer.step()
        optimizer.zero_grad()
    params = [[p.detach().clone() for p in block.parameters()] for block in model]
    return {"grads": grads, "losses": losses, "params": params}


def train_masked(spec: PipeSpec, name: str, kind: str) -> dict[int, dict]:
    """On every rank: its stages of the masked MLP trained with schedule `name` (ours or
    torch's); per stage, its gradients each step, its parameters, and the losses."""
    model = masked_model(spec)
    stages = my_stages(spec, model, torchs=kind == "torch")
    schedule = schedule_for(name, kind, stages, spec.n_microbatches)
    blocks = [model[stage.stage_index] for stage in stages]
    optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=spec.lr)
    grads, losses = [], []
    for step in range(spec.steps):
        inputs, y = masked_batch(spec, step)
        step_losses: list[torch.Tensor] = []
        run_on_my_rank(schedule.step, spec, inputs, y, step_losses)
        grads.append([[p.grad.clone() for p in block.parameters()] for block in blocks])
        losses.append([loss.detach() for loss in step_losses])
        optimizer.step()
        optimizer.zero_grad()
    return {
        stage.stage_index: {
            "grads": [step[k] for step in grads],
            "params": [p.detach().clone() for p in blocks[k].parameters()],
            "losses": losses if stage.is_last else [],
        }
        for k, stage in enumerate(stages)
    }


@pytest.mark.parametrize("name", list(OURS))
def test_a_tuple_with_masks_between_stages_is_bitwise_one_process_and_torchs(pool2, name):
    """Stages that take and return (h, gate, scale, keep, ids): the float tensors' gradients go
    back (the gate's crosses the middle borders of the four-stage runs; zeros come back for it
    from the last stage, which ignores it), the bool mask and the int ids travel forward only;
    the first stage takes five arguments.
    Bitwise one process, and torch's schedule of the same name given the same stages."""
    spec = spec_for(name)
    reference = masked_one_process(spec)
    ours, theirs = ({} for _ in range(2))
    for result in pool2.run(train_masked, spec, name, "ours"):
        ours.update(result)
    for result in pool2.run(train_masked, spec, name, "torch"):
        theirs.update(result)
    m = spec.n_microbatches
    for s in range(spec.stages):
        assert_stage_equal(ours[s], reference, s, spec, f"{name} against one process")
        shares = [[loss / m for loss in step] for step in ours[s]["losses"]]  # what torch reports
        assert_stage_equal({**ours[s], "losses": shares}, theirs[s], s, spec, f"{name}/torch")


# Forward only: eval(), and a schedule without a loss.


def forward_only(spec: PipeSpec, name: str, kind: str, how: str) -> dict:
    """On every rank: one forward-only pass of batch 0 through schedule `name` (ours or torch's),
    `how` = "eval" (a schedule with a loss, its eval(), the target given) or "no loss_fn"
    (step() of a schedule built without one). The last stage's outputs and losses; whether any
    parameter's .grad was touched; and what our stages held."""
    model = build_model(spec)
    stages = my_stages(spec, model, torchs=kind == "torch")
    schedule = schedule_for(name, kind, stages, spec.n_microbatches, with_loss=how == "eval")
    x, y = batch(spec, 0)
    losses: list[torch.Tensor] = []
    call = schedule.eval if how == "eval" else schedule.step
    output = run_on_my_rank(call, spec, (x,), y if how == "eval" else None, losses)
    return {
        "output": None if output is None else output.detach(),
        "losses": [loss.detach() for loss in losses],
        "grads touched": any(p.grad is not None for p in model.parameters()),
        "held": None if kind == "torch" else schedule.peak_held,
    }


def forward_one_process(spec: PipeSpec) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = build_model(spec)
    x, y = batch(spec, 0)
    m = spec.n_microbatches
    with torch.no_grad():
        outputs = [model(xm) for xm in x.tensor_split(m)]
        losses = [mse(out, ym) for out, ym in zip(outputs, y.tensor_split(m))]
    return torch.cat(outputs), losses


@pytest.mark.parametrize("how", ["eval", "no loss_fn"])
@pytest.mark.parametrize("name", list(OURS))
def test_forward_only_runs_are_one_processs_outputs_and_torchs(pool2, name, how):
    """torch's two forward-only runs: schedule.eval(...) of a training schedule, and step() of
    one built with loss_fn=None. The last stage returns one process's outputs and (eval, given
    the target) losses, bitwise, as torch's schedules do; no backward runs, no .grad is
    touched, nothing is held for a backward."""
    spec = replace(spec_for(name), steps=1)
    outputs, losses = forward_one_process(spec)
    last = (spec.stages - 1) % 2
    ours = pool2.run(forward_only, spec, name, "ours", how)
    theirs = pool2.run(forward_only, spec, name, "torch", how)
    assert torch.equal(ours[last]["output"], outputs), f"{name} {how}: outputs"
    assert torch.equal(theirs[last]["output"], outputs), f"{name} {how}: torch's outputs"
    assert ours[1 - last]["output"] is None
    expected = losses if how == "eval" else []
    m = spec.n_microbatches
    assert len(ours[last]["losses"]) == len(expected)
    for ours_loss, torch_share, loss in zip(ours[last]["losses"], theirs[last]["losses"], expected):
        assert torch.equal(ours_loss, loss) and torch.equal(ours_loss / m, torch_share)
    assert [r["grads touched"] for r in ours] == [False, False]
    assert [r["held"] for r in ours] == [0, 0]


def train_then_eval(spec: PipeSpec) -> list[torch.Tensor]:
    """A training step, eval() on the next batch, another training step: eval leaves .grad as
    the first step left it, and the second step runs as if eval had not happened."""
    model = build_model(spec)
    stage = PipelineStage(model[dist.get_rank()], dist.get_rank(), 2, "cpu")
    schedule = Schedule1F1B(stage, spec.n_microbatches, mse)
    for call, step in [(schedule.step, 0), (schedule.eval, 1), (schedule.step, 1)]:
        x, y = batch(spec, step)
        run_on_my_rank(call, spec, (x,), y, [])
    return [p.grad.clone() for p in stage.submodule.parameters()]


def test_eval_between_training_steps_leaves_the_gradients_alone(pool2):
    spec = PipeSpec(n_microbatches=2)
    model = build_model(spec)
    for step in range(2):  # one process: two batches accumulated, nothing for the eval
        x, y = batch(spec, step)
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)):
            (mse(model(xm), ym) / 2).backward()
    for stage, grads in enumerate(pool2.run(train_then_eval, spec)):
        for ours, param in zip(grads, model[stage].parameters(), strict=True):
            assert torch.equal(ours, param.grad), f"stage {stage}"


# Refusals.


def step_without_grad(who: str) -> str:
    """A GPipe step under torch.no_grad(), on every rank or on rank 1 alone: what it raised."""
    rank = dist.get_rank()
    spec = PipeSpec()
    stage = PipelineStage(build_model(spec)[rank], rank, 2, "cpu")
    schedule = ScheduleGPipe(stage, 2, mse)
    x, y = batch(spec, 0)
    grad_mode = torch.no_grad() if who == "every rank" or rank == 1 else torch.enable_grad()
    try:
        with grad_mode:
            run_on_my_rank(schedule.step, spec, (x,), y, [])
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("who", ["every rank", "rank 1"])
def test_a_training_step_under_no_grad_says_call_eval_on_every_rank(pool2, who):
    """Not autograd's 'element 0 of tensors does not require grad' on the last stage, with the
    first left waiting for a gradient: one line on every rank, naming the fix."""
    messages = pool2.run(step_without_grad, who, timeout=30)
    under = "0, 1" if who == "every rank" else "1"
    for message in messages:
        assert message.startswith(
            f"schedule.step() was called under torch.no_grad() (on stage {under})"
        )
        assert "call schedule.eval(...) instead" in message and "\n" not in message, message


def misuse(mistake: str) -> None:
    """Two stages, a forward-only mistake on the last one."""
    rank = dist.get_rank()
    spec = PipeSpec()
    stage = PipelineStage(build_model(spec)[rank], rank, 2, "cpu")
    schedule = ScheduleGPipe(stage, 2, mse if mistake == "losses without target" else None)
    x, y = batch(spec, 0)
    if rank == 0:
        schedule.eval(x) if mistake == "losses without target" else schedule.step(x)
    elif mistake == "target without loss_fn":
        schedule.step(target=y)
    else:
        schedule.eval(losses=[])


@pytest.mark.parametrize(
    "mistake, says",
    [
        ("target without loss_fn", "stage 1 was given a target, but its schedule has no loss_fn"),
        ("losses without target", "stage 1 was given a losses list but no target"),
    ],
)
def test_a_forward_only_misuse_is_refused_on_every_stage(pool2, mistake, says):
    for outcome in pool2.run_expecting_errors(misuse, mistake):
        assert outcome is not None and outcome.type_name == "ValueError", outcome
        assert says in outcome.message, outcome.message


def stage_over_a_group_without_this_rank() -> str | None:
    """Rank 1 builds a stage over the group of rank 0 alone."""
    group = dist.new_group([0])  # every rank creates it; rank 1 is not in it
    if dist.get_rank() == 0:
        return None
    try:
        PipelineStage(nn.Linear(2, 2), 0, 2, "cpu", group=group)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_group_without_this_rank_is_named(pool2):
    message = pool2.run(stage_over_a_group_without_this_rank)[1]
    assert message.startswith("rank 1 is not in this pipeline group (ranks 0)"), message
    assert 'mesh["pp"].get_group()' in message, message
