"""Torch 2.13's DDP arguments, each checked bit for bit against torch's DDP given the same ones:

- `forward_sync_buffers`, and `broadcast_buffers` kept as torch keeps it (deprecated, with a
  FutureWarning; the new one wins when both are given). `broadcast_buffers=False` also leaves
  the buffers rank-local at construction, `forward_sync_buffers=False` does not;
- `init_sync=False`: no check and no copy at construction, each rank keeps its own weights;
- `device_mesh`: a 1-D mesh (torch's or miniddp's) names the group; with process_group too, or
  with two axes, it is refused;
- torch's params-to-ignore (`_set_params_and_buffers_to_ignore_for_model`, which expert
  parallelism uses to sum the experts over another group): those parameters and buffers are
  neither broadcast nor averaged, each rank keeps its own;
- `skip_all_reduce_unused_params`: with find_unused_parameters, a bucket that no parameter of
  this backward reaches is not all-reduced, and its `.grad`s stay as they are (what no_sync
  accumulated there too, as torch leaves it).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from miniddp import MiniDDP
from miniddp.mesh import init_device_mesh

WRAPPERS = {"torch": nn.parallel.DistributedDataParallel, "miniddp": MiniDDP}


def both(task, *args) -> dict:
    return {wrapper: task(wrapper, *args) for wrapper in WRAPPERS}


def rank_local_model() -> nn.Module:
    """A BatchNorm model whose weights and buffers differ on every rank."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    torch.manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randint(0, 5, tensor.shape).to(tensor.dtype))
    return model


def states_under(wrapper: str, keywords: dict, ignore: tuple[str, ...] = ()) -> dict:
    """The state after construction and after two training steps, and the warnings raised."""
    model = rank_local_model()
    if ignore:
        WRAPPERS[wrapper]._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = WRAPPERS[wrapper](model, **keywords)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    generator = torch.Generator().manual_seed(dist.get_rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        ddp(torch.randn(6, 3, generator=generator)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    states.append({k: v.clone() for k, v in model.state_dict().items()})
    warned = sorted(str(w.category.__name__) for w in caught if "buffers" in str(w.message))
    return {"states": states, "warned": warned, "forward_sync": ddp.forward_sync_buffers}


BUFFER_KEYWORDS = [
    {},
    {"broadcast_buffers": False},
    {"broadcast_buffers": True},
    {"forward_sync_buffers": False},
    {"broadcast_buffers": False, "forward_sync_buffers": True},
    {"broadcast_buffers": True, "forward_sync_buffers": False},
    {"init_sync": False},
    {"init_sync": False, "forward_sync_buffers": False},
]


@pytest.mark.parametrize("keywords", BUFFER_KEYWORDS, ids=str)
def test_buffer_and_init_sync_keywords_do_what_torchs_do(pool2, keywords):
    results = pool2.run(both, states_under, keywords)
    for rank, result in enumerate(results):
        ours, theirs = result["miniddp"], result["torch"]
        assert ours["warned"] == theirs["warned"], f"rank {rank}: warnings differ"
        assert ours["forward_sync"] == theirs["forward_sync"]
        for step, (mine, reference) in enumerate(zip(ours["states"], theirs["states"])):
            for name in reference:
                assert torch.equal(mine[name], reference[name]), f"rank {rank} {step}: {name}"
    # The claims are not vacuous: say what each choice left on the two ranks.
    at_start = [result["miniddp"]["states"][0] for result in results]
    same = {name: torch.equal(at_start[0][name], at_start[1][name]) for name in at_start[0]}
    init_sync = keywords.get("init_sync", True)
    buffers_at_start = init_sync and (
        "forward_sync_buffers" in keywords or keywords.get("broadcast_buffers", True)
    )
    assert same["0.weight"] == init_sync
    assert same["1.running_mean"] == buffers_at_start
    assert results[0]["miniddp"]["warned"] == (
        ["FutureWarning"] if "broadcast_buffers" in keywords else []
    )


def test_parameters_and_buffers_to_ignore_stay_each_ranks_own_as_in_torch(pool2):
    ignored = ("0.weight", "1.running_mean")
    results = pool2.run(both, states_under, {}, ignored)
    for rank, result in enumerate(results):
        for mine, reference in zip(result["miniddp"]["states"], result["torch"]["states"]):
            for name in reference:
                assert torch.equal(mine[name], reference[name]), f"rank {rank}: {name}"
    built = [result["miniddp"]["states"][0] for result in results]
    for name in built[0]:  # rank 0's copied everywhere but the ignored ones
        assert torch.equal(built[0][name], built[1][name]) == (name not in ignored), name
    trained = [result["miniddp"]["states"][1]["2.weight"] for result in results]
    assert torch.equal(*trained)  # averaged, where 0.weight's gradient was not


def trained_over_a_mesh(wrapper: str, mesh_kind: str) -> list[torch.Tensor]:
    """One step over the default group named three ways (torch's DDP takes torch's mesh only)."""
    model = rank_local_model()
    if mesh_kind == "process_group":
        ddp = WRAPPERS[wrapper](model, process_group=dist.group.WORLD)
    else:
        make = init_device_mesh if mesh_kind == "miniddp mesh" else torch_init_device_mesh
        ddp = WRAPPERS[wrapper](model, device_mesh=make("cpu", (2,), mesh_dim_names=("dp",)))
    generator = torch.Generator().manual_seed(dist.get_rank())
    ddp(torch.randn(6, 3, generator=generator)).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def through_every_mesh() -> dict:
    return {
        "torch over a process group": trained_over_a_mesh("torch", "process_group"),
        "torch over torch's mesh": trained_over_a_mesh("torch", "torch mesh"),
        "miniddp over torch's mesh": trained_over_a_mesh("miniddp", "torch mesh"),
        "miniddp over miniddp's mesh": trained_over_a_mesh("miniddp", "miniddp mesh"),
    }


def test_a_1d_device_mesh_names_the_group(pool2):
    for rank, result in enumerate(pool2.run(through_every_mesh)):
        reference = result.pop("torch over a process group")
        for how, grads in result.items():
            assert all(map(torch.equal, grads, reference)), f"rank {rank}: {how}"


def refusals() -> list[str]:
    """Each refusal, from MiniDDP with miniddp's mesh and from torch's DDP with torch's."""
    model, world = nn.Linear(2, 2), dist.group.WORLD
    messages = []
    for make, wrapper in ((init_device_mesh, MiniDDP), (torch_init_device_mesh, WRAPPERS["torch"])):
        with pytest.raises(RuntimeError, match="process_group and device_mesh") as error:
            wrapper(model, process_group=world, device_mesh=make("cpu", (2,)))
        messages.append(str(error.value))
        with pytest.raises(RuntimeError, match="1D|1-D") as error:
            wrapper(model, device_mesh=make("cpu", (1, 2), mesh_dim_names=("a", "b")))
        messages.append(str(error.value))
    return messages


def test_a_mesh_with_a_group_or_two_axes_is_refused_on_every_rank(pool2):
    for messages in pool2.run(refusals):
        ours = messages[:2]
        assert all("mesh['dp']" in message for message in ours), ours  # they name the fix


class SometimesUnused(nn.Module):
    """`a` every step; `b` only on even steps; `c` never."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        y = self.a(x)
        return (y + self.b(x)).sum() if self.step % 2 else y.sum()


def counted_all_reduce(counts: list[int], state, bucket) -> torch.futures.Future:
    """Torch's plain all-reduce, averaged, counting each bucket that travels."""
    counts.append(bucket.index())
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def skipping(wrapper: str, skip: bool) -> dict:
    """Four steps, one bucket per parameter; steps 1 and 3 accumulate inside no_sync."""
    net = SometimesUnused()
    ddp = WRAPPERS[wrapper](
        net, find_unused_parameters=True, skip_all_reduce_unused_params=skip, bucket_cap_mb=1e-5
    )
    counts: list[int] = []
    ddp.register_comm_hook(None, lambda state, bucket: counted_all_reduce(counts, state, bucket))
    generator = torch.Generator().manual_seed(dist.get_rank())
    launched, grads = [], []
    for step in range(4):
        counts.clear()
        x = torch.randn(2, 4, generator=generator)
        if step % 2 == 0:
            with ddp.no_sync():
                ddp(x).backward()
        else:
            ddp(x).backward()
        launched.append(len(counts))
        grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
    return {"launched": launched, "grads": grads}


def skipping_or_not() -> dict:
    return {skip: both(skipping, skip) for skip in (False, True)}


def test_skip_all_reduce_unused_params_skips_torchs_buckets(pool2):
    results = pool2.run(skipping_or_not)
    for rank, result in enumerate(results):
        for skip, runs in result.items():
            ours, theirs = runs["miniddp"], runs["torch"]
            assert ours["launched"] == theirs["launched"], (rank, skip)
            for step, (mine, reference) in enumerate(zip(ours["grads"], theirs["grads"])):
                for a, b in zip(mine, reference):
                    assert (a is None) == (b is None), (rank, skip, step)
                    assert a is None or torch.equal(a, b), (rank, skip, step)
        # `b` (two buckets) is unused in synced steps 1 and 3, `c` (two) always: 6 go, or 2.
        assert result[False]["miniddp"]["launched"] == [0, 6, 0, 6]
        assert result[True]["miniddp"]["launched"] == [0, 2, 0, 2]
    # What no_sync accumulated in `b` stays on its rank when its buckets are skipped.
    b_weight = [result[True]["miniddp"]["grads"][1][2] for result in results]
    assert not torch.equal(*b_weight)


def join_with_skipping() -> str:
    model = MiniDDP(
        SometimesUnused(), find_unused_parameters=True, skip_all_reduce_unused_params=True
    )
    with pytest.raises(RuntimeError, match="cannot train under Join") as error:
        with model.join():
            pass
    return str(error.value)


def test_join_with_skipped_buckets_is_refused_on_every_rank(pool2):
    assert all("not both" in message for message in pool2.run(join_with_skipping))
