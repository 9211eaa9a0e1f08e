"""Expert parallelism from scratch: the mixture-of-experts layer, and its experts split over ranks.

The vocabulary (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021):
    expert          one of E feed-forward networks (here SwiGLU MLPs); each token uses k of them
    router          the linear gate that scores the experts for each token and picks its top k
    capacity        the most rows an expert takes from one batch: ceil(factor N k / E)
    ep group        the ranks that share one copy of the experts, each holding E/ep of them
    dispatch        the all-to-all that sends each token to the rank of its expert; combine,
                    the one that brings the outputs back

    router.py       Router: softmax, top-k with ties to the lower index; the Switch aux loss
    experts.py      GroupedExperts: E SwiGLUs with stacked weights, on rows sorted by expert
    moe.py          MoE: route, permute (stably), drop past capacity, compute, combine
    parallel.py     ExpertParallel: this rank's experts, and the all-to-all dispatch
    gradients.py    beside data parallelism: experts summed over their own group

    moe = MoE(dim=64, hidden_dim=128, num_experts=8, top_k=2, aux_loss_coef=0.01)
    parallelize_module(moe.experts, mesh["ep"], ExpertParallel())  # tensor_parallel's
    y = moe(x)                       # this rank's tokens; the same y as one process on all
    loss = task(y) + moe.aux_loss    # the whole group's aux loss, with this rank's gradient

The all-to-all itself is one of the collectives (miniddp/collectives/all_to_all.py).
"""

from miniddp.expert_parallel.experts import GroupedExperts
from miniddp.expert_parallel.gradients import all_reduce_gradients
from miniddp.expert_parallel.moe import MoE
from miniddp.expert_parallel.parallel import ExpertParallel
from miniddp.expert_parallel.router import Router, Routing, load_balancing_loss

__all__ = [
    "ExpertParallel",
    "GroupedExperts",
    "MoE",
    "Router",
    "Routing",
    "all_reduce_gradients",
    "load_balancing_loss",
]
