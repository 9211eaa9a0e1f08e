"""fully_shard at the size users train at, on a busy machine: torch's fully_shard bit for bit.

The other sharding tests use models of a few hundred parameters, whose gathers finish within
one look of the fault watcher (faults.py). Here each unit's all-gather is 16.8 MB and the
reduce-scatter as much, with a CPU-burning process competing for the two cores: the waits are
long and complete at any moment, and none may be taken for a failure. Correctness only: speed
is `python -m miniddp.bench sharding`'s job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from miniddp import full_state_dict, fully_shard
from miniddp.sharding import clip_grad_norm_
from tests.harness.cpu_hog import cpu_hog

WIDTH, DEPTH = 2048, 6  # 6 x (2048 x 2048 + 2048) = 25.2M parameters, 100.7 MB of float32
STEPS = 2  # the second step reads the Adam state the first wrote


def big_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def train(library: str) -> dict:
    """Every layer a unit, then the root; AdamW; clipping (at a bound the norm stays under, so
    the factor is exactly 1 and the bits stay comparable); the losses, the norms and the full
    parameters at the end."""
    if library == "ours":
        apply, clip = fully_shard, clip_grad_norm_
    else:
        from torch.distributed.fsdp import fully_shard as apply  # slow import

        clip = torch.nn.utils.clip_grad_norm_
    model = big_model()
    for layer in model:
        apply(layer)
    apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    losses, norms = [], []
    for _ in range(STEPS):
        loss = model(torch.randn(8, WIDTH, generator=generator)).square().mean()
        loss.backward()
        norm = clip(model.parameters(), max_norm=1e6)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if library == "ours":
        params = list(full_state_dict(model).values())
    else:
        params = [t.full_tensor() for t in model.state_dict().values()]
    return {"losses": losses, "norms": torch.stack(norms), "params": params}


def ours_against_torchs() -> dict:
    ours = train("ours")
    theirs = train("torch")
    differ = [
        i for i, (a, b) in enumerate(zip(ours["params"], theirs["params"])) if not torch.equal(a, b)
    ]
    return {
        "differ": differ,
        "elements": sum(p.numel() for p in ours["params"]),
        "losses": (ours["losses"], theirs["losses"]),
        "norms": (ours["norms"], theirs["norms"]),
    }


def test_a_25m_parameter_model_fully_sharded_is_torchs_on_a_busy_machine(pool2):
    with cpu_hog():
        results = pool2.run(ours_against_torchs, timeout=150)
    for rank, result in enumerate(results):
        assert result["elements"] >= 25_000_000
        assert result["differ"] == [], f"rank {rank}: parameters differ from torch's fully_shard"
        ours, theirs = result["losses"]
        assert ours == theirs, f"rank {rank}: losses differ"
        torch.testing.assert_close(*result["norms"], rtol=1e-6, atol=0)
