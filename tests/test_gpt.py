"""Chapter 12's GPT itself, in one process: the tied head is one parameter, the parameter count
is the one the chapter prints, and the tied weight's gradient is the sum of both of its uses.

Chapter 12's tests compare wrappers that all build the same model, so an untied GPT (53
tensors, 826,624 parameters at vocab 98, where the tied one has 52 and 814,080) would train a
different model there unnoticed. These hold the model to its own docstring.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from miniddp.expert_parallel import MoE
from miniddp.models.gpt import (
    GPT,
    MLP,
    GPTConfig,
    MoEConfig,
    moe_aux_loss,
    next_character_loss,
    parameter_groups,
)


def test_the_head_is_the_token_embedding_and_counted_once():
    model = GPT(GPTConfig(vocab_size=98))
    assert model.head.weight is model.token.weight
    parameters = list(model.parameters())
    assert len(parameters) == 52
    assert sum(p.numel() for p in parameters) == 814_080


def test_the_tied_gradient_is_the_sum_of_the_embedding_and_the_head():
    """Against a reference untied by hand: the same forward with two copies of the matrix, E_in
    looked up and E_out multiplied by. The tied gradient must be dL/dE_in + dL/dE_out."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, context=8, width=16, layers=1, heads=2, dropout=0.0)
    model = GPT(config).double()
    windows = torch.randint(config.vocab_size, (3, config.context + 1))
    inputs, targets = windows[:, :-1], windows[:, 1:].flatten()
    F.cross_entropy(model(inputs).flatten(0, 1), targets).backward()

    looked_up, multiplied = (model.token.weight.detach().clone().requires_grad_() for _ in "ab")
    x = F.embedding(inputs, looked_up) + model.position(torch.arange(config.context))
    for block in model.blocks:
        x = block(x)
    F.cross_entropy(F.linear(model.norm(x), multiplied).flatten(0, 1), targets).backward()

    assert multiplied.grad.abs().sum() > 0 and looked_up.grad.abs().sum() > 0  # both uses count
    both = looked_up.grad + multiplied.grad
    torch.testing.assert_close(model.token.weight.grad, both, rtol=0, atol=1e-12)


def test_experts_go_in_every_other_block_and_their_aux_loss_is_added():
    config = GPTConfig(vocab_size=11, context=8, width=16, layers=4, heads=2)
    model = GPT(GPTConfig(**{**config.__dict__, "moe": MoEConfig(num_experts=4, top_k=2)}))
    assert [type(block.mlp) for block in model.blocks] == [MLP, MoE, MLP, MoE]
    windows = torch.randint(0, 11, (3, 9))
    loss = next_character_loss(model, windows)
    aux = moe_aux_loss(model)
    layers = [block.mlp for block in model.blocks if isinstance(block.mlp, MoE)]
    assert aux.item() == pytest.approx(sum(m.aux_loss.item() for m in layers)) and aux > 0
    (loss + aux).backward()
    assert all(m.router.gate.weight.grad.abs().sum() > 0 for m in layers)
    decayed = {id(p) for p in parameter_groups(model, 0.1)[0]["params"]}
    assert all(id(m.experts.w2) in decayed for m in layers)  # the experts are matrices too


def test_a_dense_gpt_has_no_aux_loss_and_every_must_be_positive():
    model = GPT(GPTConfig(vocab_size=11, context=8, width=16, layers=2, heads=2))
    assert moe_aux_loss(model).item() == 0.0
    with pytest.raises(ValueError, match="every must be >= 1"):
        MoEConfig(num_experts=4, every=0)
