"""Models written in the project, to be read: what chapter 12 and the step benchmark train."""

from miniddp.models.gpt import (
    GPT,
    GPTConfig,
    MoEConfig,
    moe_aux_loss,
    next_character_loss,
    parameter_groups,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "MoEConfig",
    "moe_aux_loss",
    "next_character_loss",
    "parameter_groups",
]
