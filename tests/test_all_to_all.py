"""The all-to-all from send/recv (miniddp/collectives/all_to_all.py) against torch's on gloo:
bitwise, with uneven pieces and empty ones, in any dtype and row shape; its autograd form against
torch's; its bytes against the cost model; bad sizes refused on every rank before any message.
"""

from __future__ import annotations

import pytest
import torch

from miniddp.collectives import CostModel, all_to_all_time, schedule
from tests import all_to_all_tasks as tasks


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "dtype, row_shape", [(torch.float32, (5,)), (torch.int64, ()), (torch.bfloat16, (2, 3))]
)
def test_all_to_all_is_bitwise_torchs(rank_pools, world_size, dtype, row_shape):
    for seed in range(2):
        for result in rank_pools(world_size).run(tasks.exchange, seed, dtype, row_shape):
            assert result["bitwise"], (seed, result)
            assert result["bytes_sent"] == result["expected_bytes_sent"]


def test_its_autograd_form_is_torchs(rank_pools):
    """At W = 4 only: torch's functional collectives cost seconds to start in each process."""
    for result in rank_pools(4).run(tasks.gradients, 5):
        assert result == {"output": True, "gradient": True}


def test_bad_sizes_are_refused_on_every_rank(pool2):
    for message in pool2.run(tasks.refused, 4, [1, 2]):
        assert "adding up to input's 4 rows" in message
    for message in pool2.run(tasks.refused, 3, None):
        assert "cannot share equally" in message


def test_the_cost_model_prices_the_slowest_step():
    """Even pieces: W-1 steps of n/W bytes, as the schedule says; uneven ones: each step as
    long as its largest piece, and a step with nothing to send costs nothing."""
    model = CostModel(alpha=1e-4, beta=1e-9)
    even = torch.full((4, 4), 10)
    steps, step_bytes = schedule("all_to_all", "pairwise", 4 * 10 * 8, 4)
    assert all_to_all_time(model, 8, even) == pytest.approx(steps * 1e-4 + step_bytes * 1e-9)
    only_to_the_right = torch.zeros(4, 4, dtype=torch.int64)
    for s in range(4):
        only_to_the_right[s, (s + 1) % 4] = 7
    assert all_to_all_time(model, 8, only_to_the_right) == pytest.approx(1e-4 + 7 * 8e-9)
