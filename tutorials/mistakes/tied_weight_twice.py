"""Mistake: a tied (shared) weight collected once per module that uses it, so reduced twice.

Symptom: one more all-reduce per step for each tied weight, carrying its bytes again; for an
embedding tied to the output layer that is the model's largest tensor, sent twice. The numbers
stay right: the second all-reduce averages values that are already equal on every rank (up to
rounding at W = 3), which is why nothing else shows it. The property checks cannot see it; the
check that catches it counts the all-reduces: one per distinct gradient tensor.

Why: `for m in model.modules(): m.parameters(recurse=False)` visits a weight shared by two
modules twice. It is one tensor with one `.grad` (autograd already added both uses into it),
so it needs one slot, one reduction.

How torch avoids it: its reducer takes `named_parameters()`, which skips repeats, so a tied
weight is one variable with one bucket slot; so do MiniDDP and every rung
(`shared.trainable_parameters`). In a DDP that sums without averaging, reducing twice would
multiply it by W twice: then the property checks catch it too.

This is rung 1 (NaiveDDP) with its parameters collected module by module.
"""

from __future__ import annotations

from torch import nn

from miniddp.steps import NaiveDDP


class ReducesTiedWeightTwice(NaiveDDP):
    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__(module, bucket_cap_mb=bucket_cap_mb)
        # The mistake: each module's own parameters, so a weight two modules share comes twice.
        named = [
            (f"{prefix}.{name}".lstrip("."), param)
            for prefix, owner in module.named_modules()
            for name, param in owner.named_parameters(recurse=False)
            if param.requires_grad
        ]
        self.param_names, self.params = [n for n, _ in named], [p for _, p in named]
