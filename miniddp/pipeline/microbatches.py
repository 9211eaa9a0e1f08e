"""A step's batch as m microbatches, and the last stage's outputs as the batch's again.

The first stage is given the batch's tensors, `step(x)` or `step(x, mask)`; each is split along
dim 0 into m equal parts (`tensor_split`, torch's default chunking), and microbatch i is the
tuple of every tensor's part i, the stage's arguments `submodule(*inputs)`. The last stage
splits its target the same way, and hands back what it computed for each microbatch,
concatenated along dim 0 (torch's default merge), with the losses of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from miniddp.pipeline.stage import Activation


@dataclass
class StepData:
    """One step's microbatches, and what the last stage collects from them. `backward`: a
    training step; False: forward only (eval(), or a schedule without a loss_fn)."""

    backward: bool
    inputs: list[Activation | None]  # the first stage's, each microbatch's arguments
    targets: list[torch.Tensor | None]  # the last stage's; None elsewhere, or in eval without
    outputs: list[torch.Tensor | Activation] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def split(
        cls, args: tuple[torch.Tensor, ...], target: torch.Tensor | None, m: int, backward: bool
    ) -> StepData:
        """The batch's `args` (none but on the first stage) and `target` (the last), in m."""
        return cls(
            backward,
            inputs=list(zip(*(a.tensor_split(m) for a in args))) or [None] * m,
            targets=[None] * m if target is None else list(target.tensor_split(m)),
        )

    def keep_output(self, output: torch.Tensor | Activation) -> None:
        """A microbatch's output, as a value: nothing of its graph is kept with it."""
        detached = tuple(t.detach() for t in output) if isinstance(output, tuple) else None
        self.outputs.append(output.detach() if detached is None else detached)

    def merged_outputs(self) -> torch.Tensor | Activation:
        """The microbatches' outputs as the batch's, each tensor concatenated along dim 0."""
        if isinstance(self.outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*self.outputs))
        return torch.cat(self.outputs)
