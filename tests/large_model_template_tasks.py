"""What the ranks run for tests/test_large_model_template.py: chapter 12's GPT, small and in
float64, trained twice on one (dp, tp) mesh from the same weights on the same windows: through
chapter 16d's own functions (torch's fully_shard, parallelize_module, loss_parallel, its clip)
and through `miniddp.parallelize` (MiniDDP's fully_shard and TP, miniddp.sharding's clip)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch.distributed.tensor import DTensor

from miniddp.parallelize import parallelize
from miniddp.sharding import clip_grad_norm_
from tests.mesh_tasks import mesh_once
from tests.parallelize_tasks import build_gpt, full_tensors, windows

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
CHAPTER = TUTORIALS / "16d_large_model_template.py"
STEPS, LR = 4, 1e-2
_TORCH_MESHES: dict = {}


def chapter() -> ModuleType:
    """Chapter 16d as a module (its name starts with a digit); it imports its neighbours
    (common, char_corpus, gpt_settings) as torchrun would, from its own folder."""
    if str(TUTORIALS) not in sys.path:
        sys.path.insert(0, str(TUTORIALS))
    spec = importlib.util.spec_from_file_location("large_model_template", CHAPTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_mesh(template: ModuleType, shape: tuple[int, int]):
    """The chapter's mesh, built once per worker (new_group is collective, groups never freed)."""
    if shape not in _TORCH_MESHES:
        _TORCH_MESHES[shape] = template.build_mesh(*shape, "cpu")
    return _TORCH_MESHES[shape]


def train_both(shape: tuple[int, int], clip: float, dtype: torch.dtype = torch.float64) -> dict:
    """This rank's replica loss at each step, under torch's composition and under MiniDDP's,
    and every parameter after the last step, whole (gathered over "tp" and "dp")."""
    dp, tp = shape
    template = chapter()
    replica_windows = [windows(step, dp).tensor_split(dp) for step in range(STEPS)]

    mesh = torch_mesh(template, shape)
    model = template.parallelize(build_gpt().to(dtype), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    replica = mesh["dp"].get_local_rank()
    theirs = [
        template.train_step(model, optimizer, replica_windows[step][replica], clip).item()
        for step in range(STEPS)
    ]

    ours_mesh = mesh_once((1, dp, tp), ("pp", "dp", "tp"))
    parts = parallelize(build_gpt().to(dtype), ours_mesh, data_parallel="fsdp")
    optimizer = torch.optim.AdamW(parts.parameters(), lr=LR)
    assert ours_mesh["dp"].get_local_rank() == replica  # the same replica, the same windows
    ours = []
    for step in range(STEPS):
        ours.append(parts.train_step(replica_windows[step][replica]).item())
        clip_grad_norm_(parts.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    whole = {  # TP's DTensors and FSDP2's alike; with tp = dp = 1, plain tensors
        n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
        for n, p in model.named_parameters()
    }
    mine = full_tensors(parts.model, ours_mesh, sharded=dp > 1)
    # A sharded model's state dict names the tied matrix twice; named_parameters, once.
    tied = mine.pop("head.weight", mine["token.weight"])
    assert torch.equal(tied, mine["token.weight"])
    return {
        "losses": {"torch": theirs, "miniddp": ours},
        "params": {"torch": whole, "miniddp": mine},
    }
