"""Mistake: a parameter that gets no gradient, under DDP with find_unused_parameters=False.

Symptom in torch's DDP: nothing at first. The bucket holding the unused parameter never fills,
so it is never launched, and `loss.backward()` returns with that bucket's gradients, used ones
included, silently unaveraged: each rank holds its own. Only the next forward raises "Expected
to have finished reduction in the prior iteration before starting a new one", listing parameter
indices; by then one optimizer step has been taken on unsynchronized gradients. (In iteration 0
everything is in one bucket, so no gradient at all was averaged.)

Why: DDP waits for a hook from every parameter before launching its bucket, and a parameter
that did not take part in the loss gets no gradient, hence no hook. A head registered but not
called, a branch taken on some batches only, a frozen-by-accident layer: common in real models.

How torch avoids it: `find_unused_parameters=True` walks the autograd graph after each forward
and marks unreached parameters ready at once, at some cost per step. MiniDDP raises instead of
staying silent: at the end of that very backward, naming the parameters and the fix. The
property checks therefore do not need to see it: the check that catches it is MiniDDP raising.

`SpareHead` is a small model with the one change: a second head registered and never used.
"""

from __future__ import annotations

import torch
from torch import nn


class SpareHead(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.spare_head = nn.Linear(8, 1)  # the mistake: registered, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))
