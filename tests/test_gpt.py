"""Chapter 12's GPT itself, in one process: the tied head is one parameter, the parameter count
is the one the chapter prints, and the tied weight's gradient is the sum of both of its uses.

Chapter 12's tests compare wrappers that all build the same model, so an untied GPT (53
tensors, 826,624 parameters at vocab 98, where the tied one has 52 and 814,080) would train a
different model there unnoticed. These hold the model to its own docstring.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from miniddp.models.gpt import GPT, GPTConfig


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
