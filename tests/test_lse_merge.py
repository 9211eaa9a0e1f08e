"""The log-sum-exp merge (tutorials/exercises/lse_merge.py; the answer: `merge` in
miniddp/context_parallel/attention.py): two partial attentions over disjoint key blocks, merged,
are one process's attention over the concatenated keys, and their lse its log-sum-exp.

Your own merge goes through the same check:

    MINIDDP_LSE_MERGE=tutorials/exercises/lse_merge.py python -m pytest tests/test_lse_merge.py -x

The check names the idea a merge misses: adding the partial outputs without weighting each by
exp(lse_b - lse) (each was normalised by its own block's sum), or leaving log space, where
exp(lse) overflows at scores real models reach. Both wrong merges are planted below and must
fail naming it; the stub must fail naming the exercise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from miniddp.context_parallel import attention
from tests.harness.processes import child_env, run_in_own_session, tail
from tests.workloads import load_implementation

REPO = Path(__file__).resolve().parents[1]
LEARNERS_MERGE = "MINIDDP_LSE_MERGE"  # a file with a learner's merge(out_a, lse_a, out_b, lse_b)
STUB = REPO / "tutorials" / "exercises" / "lse_merge.py"
LEARNERS = os.environ.get(LEARNERS_MERGE)
ours_only = pytest.mark.skipif(bool(LEARNERS), reason="checks the stub and planted bugs")
NOT_RESCALED = (
    "the merge is not attention over the concatenated keys: out_a and out_b were each "
    "normalised by their own block's sum Z_b = exp(lse_b); weight each by exp(lse_b - lse) "
    "before adding (the log-sum-exp merge, chapter 15)"
)
OVERFLOWED = (
    "the merge overflows at large scores (lse ~ 1e3): exp(lse) is inf in any float. Stay in "
    "log space: lse = logaddexp(lse_a, lse_b), weights exp(lse_a - lse) <= 1"
)


def partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """One block's (out, lse) from the flash kernel ring attention calls."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[:2]
    return out, lse


def blocks(sizes: tuple[int, ...], scale: float = 1.0, seed: int = 0):
    """Queries [B, H, Sq, D] and len(sizes) key/value blocks of those lengths, float64."""
    generator = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    keys = [torch.randn(2, 3, n, 8, generator=generator, dtype=torch.float64) for n in sizes]
    values = [torch.randn(2, 3, n, 8, generator=generator, dtype=torch.float64) for n in sizes]
    return q, keys, values


def check_merge(merge) -> None:
    """Raise AssertionError, naming the idea missed, unless `merge` folds partial attentions
    into the attention over all their keys, in any order, at any size of score."""
    for sizes, scale in (((4, 6), 1.0), ((1, 9), 1.0), ((3, 4, 5), 1.0), ((4, 6), 400.0)):
        q, keys, values = blocks(sizes, scale)
        k, v = torch.cat(keys, 2), torch.cat(values, 2)
        expected = F.scaled_dot_product_attention(q, k, v)
        expected_lse = torch.logsumexp(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1)
        parts = [partial(q, kb, vb) for kb, vb in zip(keys, values)]
        out, lse = parts[0]
        for block_out, block_lse in parts[1:]:
            out, lse = merge(out, lse, block_out, block_lse)
        if scale > 1 and not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            raise AssertionError(OVERFLOWED)
        gap = (out - expected).abs().max().item()
        if gap > 1e-10:
            raise AssertionError(f"{NOT_RESCALED}; blocks of {sizes} keys: off by {gap:.1e}")
        lse_gap = (lse - expected_lse).abs().max().item()
        assert lse_gap <= 1e-8 * max(1.0, scale), (
            f"the merged lse is not the log-sum-exp of all the scores (off by {lse_gap:.1e}): "
            "it is log(Z_a + Z_b) = logaddexp(lse_a, lse_b)"
        )
    q, keys, values = blocks((3, 7))
    (a, la), (b, lb) = (partial(q, kb, vb) for kb, vb in zip(keys, values))
    one, other = merge(a, la, b, lb), merge(b, lb, a, la)
    assert torch.allclose(one[0], other[0]) and torch.allclose(one[1], other[1]), (
        "merge(a, b) differs from merge(b, a): the union of two blocks has no order"
    )


def test_the_merge_is_attention_over_the_concatenated_keys():
    check_merge(load_implementation(f"{LEARNERS}:merge") if LEARNERS else attention.merge)


@ours_only
def test_the_stub_fails_naming_the_exercise():
    with pytest.raises(NotImplementedError, match="TODO exercise 12 "):
        check_merge(load_implementation(f"{STUB}:merge"))


WRONG = {
    "adds without rescaling": (
        "def merge(out_a, lse_a, out_b, lse_b):\n"
        "    return out_a + out_b, torch.logaddexp(lse_a, lse_b)\n",
        "normalised by their own block's sum",
    ),
    "averages without weights": (
        "def merge(out_a, lse_a, out_b, lse_b):\n"
        "    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)\n",
        "weight each by exp",
    ),
    "leaves log space": (
        "def merge(out_a, lse_a, out_b, lse_b):\n"
        "    z_a, z_b = lse_a.exp(), lse_b.exp()\n"
        "    out = (z_a[..., None] * out_a + z_b[..., None] * out_b) / (z_a + z_b)[..., None]\n"
        "    return out, (z_a + z_b).log()\n",
        "Stay in log space",
    ),
}


@ours_only
@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_merge_fails_naming_the_idea(name: str, tmp_path: Path):
    source, idea = WRONG[name]
    path = tmp_path / "wrong_merge.py"
    path.write_text("import torch\n\n\n" + source)
    with pytest.raises(AssertionError, match=idea):
        check_merge(load_implementation(f"{path}:merge"))


@ours_only
@pytest.mark.slow  # 19 s here (a pytest in a subprocess); the stub's failure is checked above
def test_the_learners_command_fails_on_the_stub_and_says_why(tmp_path: Path):
    command = [sys.executable, "-m", "pytest", "tests/test_lse_merge.py", "-x", "-q"]
    command += ["-p", "no:cacheprovider"]
    env = child_env(tmp_path, **{LEARNERS_MERGE: str(STUB)})
    returncode, output = run_in_own_session(command, env, 120)
    assert returncode == 1, tail(output)
    assert "TODO exercise 12 " in output, tail(output)
