"""Expert parallelism (miniddp/expert_parallel/) against one process applying the same MoE.

What equality to expect (parallel.py derives it):
    dropless: the output and every expert weight's gradient, bit for bit; the router's gradient
        summed over the ranks and the global aux loss within float32 rounding (a sum in another
        order); the tokens per expert exactly
    capacity: one process applying the MoE to each rank's tokens in turn, bit for bit, where
        every expert keeps at least 4 rows of each group (this CPU's matmul of fewer rows is
        not the same bits as those rows inside a larger one)
    beside data parallelism: within rounding, the expert gradients summed over the ranks that
        hold the same experts
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from miniddp.expert_parallel import MoE
from tests import expert_parallel_tasks as tasks
from tests.expert_parallel_tasks import Spec

ROUNDING = 1e-6  # float32, a sum of a few dozen terms in another order


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_is_one_process_bit_for_bit(rank_pools, world_size, top_k):
    for result in rank_pools(world_size).run(tasks.dropless, Spec(top_k=top_k)):
        bitwise = {k: result[k] for k in ("y", "w1", "w2", "w3", "tokens_per_expert")}
        assert all(bitwise.values()), result
        assert result["router"] < ROUNDING and result["aux"] < ROUNDING, result


@pytest.mark.parametrize(
    "spec",
    [
        Spec(empty_rank=1),
        Spec(one_expert=True, top_k=1),
        Spec(tokens=0),
        Spec(empty_rank=1, capacity_factor=4.0),  # c k / E = 1: room for all, never binds
        Spec(one_expert=True, top_k=1, capacity_factor=8.0),
    ],
    ids=[
        "a rank with no tokens",
        "no token for some rank",
        "no tokens on any rank",
        "a rank with no tokens, with a capacity of 0",
        "no token for some rank, with a capacity",
    ],
)
def test_empty_pieces_work(rank_pools, spec):
    for result in rank_pools(4).run(tasks.dropless, spec):
        assert all(result[k] for k in ("y", "w1", "w2", "w3", "tokens_per_expert")), result
        assert result["router"] < ROUNDING and result["aux"] < ROUNDING, result


@pytest.mark.parametrize("world_size", [2, 4])
def test_capacity_applies_per_rank_as_one_process_per_group(rank_pools, world_size):
    spec = Spec(num_experts=4, tokens=64, capacity_factor=0.6)
    for result in rank_pools(world_size).run(tasks.capacity_per_group, spec):
        assert result["fewest kept rows"] >= 4, "the comparison would meet the hazard"
        ours, per_group = result["dropped"]
        assert ours == per_group > 0
        assert result["y"], result


def test_beside_data_parallel_it_is_one_process(rank_pools):
    for differences in rank_pools(4).run(tasks.with_data_parallel, Spec(aux_loss_coef=0.1)):
        assert max(differences.values()) < ROUNDING, differences


@pytest.mark.parametrize(
    "case, expected",
    [
        ("top_k > num_experts", "choose 5 different experts out of 4"),
        ("top_k < 1", "choose 0 different experts out of 4"),
        ("capacity_factor <= 0", "capacity_factor must be > 0"),
        ("capacity_factor < 0", "capacity_factor must be > 0 (1.0: room for an even share)"),
        ("capacity_factor nan", "capacity_factor must be > 0"),
        ("experts not divisible by ep", "3 experts cannot be split evenly over 2"),
        ("wrong width", "MoE takes (B, T, 8) or (N, 8); got (3, 7)"),
        ("not the experts", "ExpertParallel splits a GroupedExperts (an MoE's .experts)"),
        ("split twice", "is already expert-parallel"),
    ],
)
def test_bad_input_is_refused_on_every_rank(pool2, case, expected):
    for message in pool2.run(tasks.refusal, case):
        assert expected in message


def test_a_group_without_this_rank_is_named(pool2):
    accepted, refused = pool2.run(tasks.refusal, "a group without this rank")
    assert accepted == "accepted"
    assert refused.startswith("rank 1 is not in this expert-parallel group (ranks 0)"), refused


def per_token(moe, x):
    """The MoE written out token by token, choice by choice: what the permutation must give."""
    routing = moe.router(x)
    rows = []
    for t in range(len(x)):
        row = torch.zeros(x.shape[1])
        for j in range(moe.top_k):
            e = routing.experts[t, j]
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            row = row + routing.weights[t, j] * ((F.silu(x[t] @ w1.T) * (x[t] @ w3.T)) @ w2.T)
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_one_process_is_the_moe_written_token_by_token(top_k):
    torch.manual_seed(1)
    moe = MoE(16, 24, 6, top_k)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        y = moe(x)
        expected = per_token(moe, x.reshape(-1, 16)).view_as(x)
    assert (y - expected).abs().max() < 1e-6
    assert y.shape == x.shape


def test_ties_go_to_the_lower_expert_and_uniform_routing_costs_one():
    """A gate of zeros scores every expert alike: each token takes experts 0..k-1, weighted
    equally, and the Switch loss of uniform probabilities is exactly 1, whatever f is."""
    moe = MoE(8, 8, 4, 2, aux_loss_coef=1.0)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
    routing = moe.router(torch.randn(5, 8))
    assert routing.experts.tolist() == [[0, 1]] * 5
    assert torch.equal(routing.weights, torch.full((5, 2), 0.5))
    moe(torch.randn(5, 8))
    assert moe.aux_loss.item() == pytest.approx(1.0)
    assert moe.tokens_per_expert.tolist() == [5, 5, 0, 0]


def test_capacity_keeps_first_choices_first_in_token_order():
    """Capacity ceil(0.5 * 4 tokens * 2 / 2 experts) = 2: expert 0 is every token's first
    choice, so tokens 0 and 1 keep it; every second choice (expert 1) comes after the first
    choices, so only tokens 0 and 1 fit there too."""
    moe = MoE(8, 8, 2, 2, capacity_factor=0.5)
    kept = moe.within_capacity(torch.tensor([[0, 1]] * 4))
    assert kept.tolist() == [[True, True], [True, True], [False, False], [False, False]]


@pytest.mark.parametrize(
    "factor, tokens, top_k, experts, slots",
    [(1.1, 200, 1, 4, 55), (1.25, 8, 2, 4, 5), (0.3, 10, 1, 3, 1), (1.0, 7, 2, 4, 4)],
)
def test_capacity_is_the_ceiling_of_the_exact_product(factor, tokens, top_k, experts, slots):
    """C = ceil(c N k / E) of the factor as written: 1.1 x 200 / 4 is 55 slots, where the
    float product (55.000000000000007) would give 56. Every token chooses expert 0 first."""
    moe = MoE(8, 8, experts, top_k, capacity_factor=factor)
    choices = torch.arange(top_k).repeat(tokens, 1)
    assert moe.within_capacity(choices)[:, 0].sum().item() == min(slots, tokens)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_gpt_with_experts_is_one_process(rank_pools, world_size):
    for result in rank_pools(world_size).run(tasks.gpt_with_experts, 0):
        assert result["expert blocks"] == 1
        assert result["logits"] and result["experts"], result
        assert result["others"] < ROUNDING, result
