"""What the ranks of the test pool run for tests/test_sharding_prefetch.py: a chain of fully_shard
units, each with a probe that counts, while the unit computes (forward and backward), how many
units' full parameters exist: gathered, or arriving (their all-gather in flight).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp import full_state_dict, fully_shard
from miniddp.collectives import traffic
from miniddp.observe.events import NO_OBSERVER

WIDTHS = (6, 9, 7, 8, 5)  # four units: enough for "the next one" to differ from "all the rest"


class _Count(torch.autograd.Function):
    """Identity; its backward runs inside the unit's backward, after the Linear's own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, probe: Probe) -> torch.Tensor:
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.probe.count("backward")
        return grad, None


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list[int]] = {"forward": [], "backward": []}
        self.watched: list[nn.Module] = []  # the sharded model (a list: not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count("forward")
        return _Count.apply(x, self)

    def count(self, phase: str) -> None:
        model = self.watched[0]
        units = [m._sharded for m in model.modules() if getattr(m, "_sharded", None)]
        arriving = {id(u) for u in model._prefetcher.units_gathering()}
        full = [u for u in units if any(t.untyped_storage().nbytes() for t in u.full)]
        self.seen[phase].append(len({id(u) for u in full} | arriving))


def build(reshard_after_forward: bool = True) -> tuple[nn.Sequential, Probe]:
    torch.manual_seed(0)
    probe = Probe()
    blocks = [nn.Sequential(probe, nn.Linear(a, b), nn.Tanh()) for a, b in zip(WIDTHS, WIDTHS[1:])]
    model = nn.Sequential(*blocks)
    for block in model:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    probe.watched.append(model)
    return model, probe


def train(
    steps: int = 3,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
    explicit: str | None = None,
) -> dict:
    """The full parameters after each step, the bytes sent in each, and the most units' full
    parameters alive at once in each step's forward and backward. `explicit`: "all" sets each
    unit to prefetch every later unit in forward and every earlier one in backward."""
    model, probe = build(reshard_after_forward)
    model.set_prefetch(prefetch)
    if explicit == "all":
        for i, block in enumerate(model):
            block.set_modules_to_forward_prefetch(list(model)[i + 1 :])
            block.set_modules_to_backward_prefetch(list(model)[:i][::-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    params, sent, alive = [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(dist.get_rank() * 100 + step)
        x, y = torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)
        probe.seen = {"forward": [], "backward": []}
        traffic.reset()
        nn.functional.mse_loss(model(x), y).backward()
        sent.append(traffic.bytes_sent)
        alive.append({phase: max(counts) for phase, counts in probe.seen.items()})
        optimizer.step()
        optimizer.zero_grad()
        params.append([t.clone() for t in full_state_dict(model).values()])
    shard_elements = [sum(p.numel() for p in block.parameters()) for block in model]
    return {"params": params, "sent": sent, "alive": alive, "shard_elements": shard_elements}


def torch_with_explicit_prefetch(steps: int = 3) -> list:
    """The same model and data under torch's fully_shard, with every unit set to prefetch all
    later units in forward and all earlier ones in backward: the full parameters per step."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    pairs = zip(WIDTHS, WIDTHS[1:])
    blocks = [nn.Sequential(nn.Identity(), nn.Linear(a, b), nn.Tanh()) for a, b in pairs]
    model = nn.Sequential(*blocks)
    for block in model:
        torch_fully_shard(block)
    torch_fully_shard(model)
    for i, block in enumerate(model):
        block.set_modules_to_forward_prefetch(list(model)[i + 1 :])
        block.set_modules_to_backward_prefetch(list(model)[:i][::-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    params = []
    for step in range(steps):
        g = torch.Generator().manual_seed(dist.get_rank() * 100 + step)
        x, y = torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        params.append([t.full_tensor().detach().clone() for t in model.state_dict().values()])
    return params


def record_lanes(prefetch: bool = True) -> dict:
    """Two steps, the second recorded (miniddp/sharding/unit_lanes.py): its spans as (lane, name,
    start, end), its peak of full parameters, and each unit's full and gathered (padded) bytes,
    in forward order."""
    from miniddp.sharding.unit_lanes import recording, unit_timeline

    model, _ = build(reshard_after_forward=True)
    model.set_prefetch(prefetch)
    x = torch.randn(4, WIDTHS[0])
    model(x).sum().backward()
    with recording(model) as recorded:
        model(x).sum().backward()
    spans = [(s.lane, s.name, s.start, s.end) for s in unit_timeline(recorded.events).spans]
    units = [block._sharded for block in model]
    world = dist.get_world_size()
    return {
        "spans": spans,
        "peak": recorded.peak_full_bytes,
        "numbers": [unit.number for unit in units],
        "full_bytes": [sum(shape.numel() for shape in unit.shapes) * 4 for unit in units],
        "gathered_bytes": [world * sum(s.numel() for s in unit.shards) * 4 for unit in units],
        "recording_after": model._prefetcher.observer is not NO_OBSERVER,
    }
