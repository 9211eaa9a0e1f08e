"""Exercise 12 (chapter 15): the log-sum-exp merge of two partial attentions.

Ring attention (miniddp/context_parallel/attention.py) never sees all the keys at once: at each step
a rank attends its queries to one block of keys, and must fold that block's result into what it
has so far. Fill in `merge`, then check it against one process's attention over all the keys:

    MINIDDP_LSE_MERGE=tutorials/exercises/lse_merge.py python -m pytest tests/test_lse_merge.py -x

What you are given, for the same queries and two disjoint blocks of keys a and b (s_j is the
score scale·q·k_j of key j):

    out_a = sum_{j in a} exp(s_j) v_j / Z_a      [..., D], the block's attention alone
    lse_a = log Z_a,   Z_a = sum_{j in a} exp(s_j)    [...], out_a's shape without its last dim

and the same for b. Return (out, lse) as if a and b were one block: the attention over their
union and its log-sum-exp. Two traps: out_a and out_b were each divided by their own Z, so they
cannot simply be added; and exp(lse) overflows for large scores, so stay in log space
(torch.logaddexp, and weights exp(lse_a - lse) that never exceed 1).

Stuck? Chapter 15 (tutorials/15_long_sequences.py), section 2, and the module docstring of
miniddp/context_parallel/attention.py derive it; the answer is `merge` there.
"""

from __future__ import annotations

import torch


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of blocks a and b, from each block's (out, lse)."""
    # TODO: lse of the union, from lse_a and lse_b without leaving log space; then out as the
    # two partial outputs, each weighted by its block's share of the union's sum of exp(s_j).
    raise NotImplementedError(
        "TODO exercise 12 (tutorials/exercises/lse_merge.py, chapter 15): return the "
        "merged (out, lse) of two partial attentions"
    )
