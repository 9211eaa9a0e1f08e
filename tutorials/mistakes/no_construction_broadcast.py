"""Mistake: no broadcast of rank 0's weights at construction, with ranks seeded differently.

Symptom: the replicas differ from the start and never meet. Their gradients are averaged, so
every rank takes the same step, but from different weights: W different models, each trained on
a gradient computed partly at the others' weights. The property checks catch it at step 0: the
replicas' parameters differ ("did construction copy rank 0's parameters?").

Why: the script seeds each rank differently (for data augmentation, say) before building the
model, or loads a checkpoint on rank 0 only. Averaging gradients keeps equal replicas equal; it
cannot make unequal ones equal.

How torch avoids it: DDP's constructor broadcasts every parameter and buffer from rank 0 (after
checking that every rank has the same parameter shapes). So does every rung of the ladder.

This is rung 1 (NaiveDDP) with its constructor minus that broadcast.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from miniddp.steps import NaiveDDP, shared


class NoConstructionBroadcast(NaiveDDP):
    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        nn.Module.__init__(self)
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, type(self).__name__)
        self.all_reduce_count = 0
        self._start_event_log()
        # The mistake: no shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
