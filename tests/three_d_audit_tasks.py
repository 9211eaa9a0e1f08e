"""What the ranks run for tests/test_three_d_audit.py: chapter 16's GPT through `parallelize` on
4 or 8 ranks, one layout after another, two AdamW steps each, the second measured on every rank
(figures.three_d.measure_step): the storages it holds, the activations at their peak, and
every all-reduce and send it issues, with the axis of its group."""

from __future__ import annotations

from typing import Any

import torch

from miniddp import MixedPrecision
from miniddp.instruments.figures.three_d import CONFIG, measure_step, messages_sent
from miniddp.instruments.link_group import link_groups
from miniddp.mesh import init_device_mesh
from miniddp.models.gpt import GPT
from miniddp.parallelize import AXES, parallelize
from miniddp.parallelize_formulas import MeshLayout
from miniddp.sharding import ddp_compute_copies

WINDOWS = 8  # a step's windows over all replicas: with a pipeline, one window a microbatch


def windows_of(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(CONFIG.vocab_size, (WINDOWS, CONFIG.context + 1), generator=generator)


def audit(shapes: list[tuple[int, int, int]], precision: str = "fp32") -> dict[tuple, Any]:
    """Per (pp, dp, tp): this rank's stage, elements, memory, activations, microbatches held,
    what it sent, and the dtypes of its masters and of its compute copies."""
    mixed_precision = MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" else None
    torch.set_num_threads(1)
    with link_groups():  # groups that log what crosses them (recording_the_wire reads it)
        return {shape: audit_one(shape, mixed_precision) for shape in shapes}


def audit_one(shape: tuple[int, int, int], mixed_precision: MixedPrecision | None) -> Any:
    """One layout: two AdamW steps, the second measured on this rank."""
    layout = MeshLayout.of(*shape, windows=WINDOWS, context=CONFIG.context)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=AXES)
    torch.manual_seed(0)
    model = GPT(CONFIG)  # the same weights on every rank: parallelize keeps this rank's
    parts = parallelize(
        model, mesh, n_microbatches=layout.microbatches, mixed_precision=mixed_precision
    )
    optimizer = torch.optim.AdamW(parts.parameters(), lr=1e-2)
    replica = mesh["dp"].get_local_rank()
    for number in range(2):
        batch = windows_of(number).tensor_split(layout.dp)[replica]
        if number == 0:
            parts.train_step(batch)
        else:
            measured = measure_step(parts, optimizer, batch)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "stage": mesh["pp"].get_local_rank(),
        "elements": sum(p.numel() for p in parts.parameters()),
        "memory": measured.memory,
        "activations": measured.activations,
        "held": measured.held,
        "sent": messages_sent(measured.step),
        "masters": {p.dtype for p in parts.parameters()},
        "copies": {t.dtype for t in ddp_compute_copies(parts.module)},
    }
