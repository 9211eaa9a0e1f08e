"""Our MoE against another implementation: DeepSpeed-MoE (deepspeed.moe.layer.MoE), on one
process and at ep_size = 2 on 2 gloo ranks, top-1 and top-2 gating with a capacity factor.

Configured alike (miniddp/instruments/bench/deepspeed_moe.py): the same gate weights, E SwiGLU
experts with our expert weights, the same capacity factor applied to each rank's own tokens
(DeepSpeed's rule, and ours). Each difference in semantics, and what the tests do about it:

    switched off
    1. Random Token Selection (use_rts, on by default): which tokens an expert keeps is drawn
       at random. use_rts=False.
    2. top-2's second expert sampled with Gumbel noise (top2_2nd_expert_sampling, on by
       default): the second choice is not the second-best expert. Off.
    3. Noise on the gate (noisy_gate_policy 'Jitter' or 'RSample'): None.
    4. min_capacity (4 by default): capacity is max(ceil(...), min_capacity). 0, so it never
       binds.

    cannot be switched off; tested where the two agree, or with the difference undone
    5. The capacity's arithmetic: DeepSpeed computes ceil((N / E) * (c k)) in float32, we
       ceil(c N k / E) in float64. Where the exact value is a whole number, float32 rounds some
       of them up (c = 0.6, N = 50, E = 2, k = 1: theirs 16, ours 15; so for c = 0.6, 1.1, 1.2
       ...). The tests use c = 1.0, where both are exact, and check the capacities are equal.
    6. top-1's drop order: without RTS DeepSpeed keeps the C tokens that torch.topk picks among
       the equal ones of a 0/1 mask. torch does not promise an order among ties, and on this
       CPU it is not token order (nine tokens all choosing one expert, C = 2: it keeps tokens
       5 and 7, not 0 and 1). Ours keeps tokens in order (GShard's position priority, and
       DeepSpeed's own top-2 order). Tested: the same expert chosen for every token DeepSpeed
       keeps, the same number kept per expert, and, given DeepSpeed's kept tokens, our layer's
       outputs.
    7. top-2's weights: DeepSpeed renormalises the two weights over the choices kept after
       capacity (a token whose second choice was dropped weighs its first by 1); we renormalise
       over the two chosen, before any drop, and do not raise the kept one (moe.py). Tested by
       dividing our output by the token's kept weight.
    8. top-2's aux loss: DeepSpeed's f counts first choices only, E sum_i P_i (first_i / N)
       (GShard's); ours counts both, E sum_i P_i (choices_i / (2 N)) (Switch's with k choices).
       Tested: theirs equals the first-choice formula. For top-1 the two are one formula, and
       equal within rounding.
    9. Under expert parallelism DeepSpeed's l_aux and exp_counts are this rank's tokens'; ours
       are the whole group's (Megatron's global aux loss). Tested: theirs is ours applied to
       this rank's tokens alone, and their counts summed over the ranks are ours.
   10. DeepSpeed sends E x C slots, the empty ones too, and its experts run on them; ours send
       and run only the rows kept. Outputs are then equal within rounding (a matmul over other
       rows), not bit for bit.

    the same in both, and checked
    - routing: the first expert is the most probable one, ties to the lower index (torch.argmax
      returns the first maximum; we sort stably). DeepSpeed picks the second expert by argmax
      of the logits with the first masked, we by probability: the same order, except where
      softmax rounds two different logits to one probability (ours then takes the lower index).
    - top-2's drop order: every first choice before any second choice, each in token order
      (DeepSpeed offsets the second choices' places by the first choices' count): the same
      tokens dropped, asserted.
    - top-1's weight: the probability itself, not renormalised.
    - tokens per expert: counted before any drop.

DeepSpeed's dropless mode (drop_tokens=False) is not compared. Everything runs in a pool of its
own: importing DeepSpeed and making its groups changes the process, and other tests share theirs.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests import expert_parallel_deepspeed_tasks as tasks
from tests.expert_parallel_deepspeed_tasks import Spec
from tests.harness.pool import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (the test extra)"
)

ROUNDING = 1e-6  # float32, the experts' matmuls over other rows
SETTINGS = {"one process": False, "ep_size=2 on 2 ranks": True}


@pytest.fixture(scope="module")
def deepspeed_pool():
    pool = RankPool(2)
    try:
        yield pool
    finally:
        pool.shutdown()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_same_routing_and_outputs_as_deepspeed(deepspeed_pool, top_k, setting):
    for result in deepspeed_pool.run(tasks.compare, Spec(top_k, SETTINGS[setting])):
        assert result["dropped"] > 0, "capacity must bind, or the test shows nothing"
        ours, theirs = result["capacity"]
        assert ours == theirs, result
        assert result["chosen alike"] and result["kept per expert alike"], result
        if top_k == 2:
            assert result["one of two dropped"] > 0, "difference 7 must be met"
            assert result["routes alike"], result
        assert result["y, the difference undone"] < ROUNDING, result
        assert result["counts alike"], result


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_aux_loss_against_deepspeeds(deepspeed_pool, top_k, setting):
    for result in deepspeed_pool.run(tasks.compare, Spec(top_k, SETTINGS[setting])):
        theirs = result["their l_aux"]
        assert theirs == pytest.approx(result["E sum P f(first choices)"], abs=ROUNDING)
        if top_k == 1:
            assert theirs == pytest.approx(result["our aux, this rank's tokens"], abs=ROUNDING)
        if not SETTINGS[setting]:
            assert result["our aux, global"] == result["our aux, this rank's tokens"]
