"""Chapter 18: experts. Expert parallelism, the fifth dimension: a mixture of experts whose
experts live on different ranks, and the tokens travel to them.

    NPROC=4 ./launch.sh tutorials/18_experts.py [--steps 200] [--plot DIR]

A mixture-of-experts layer (Shazeer et al. 2017; GShard; Switch) replaces a transformer's MLP by
E MLPs, the experts, and a router that sends each token to k of them. The parameters grow E
times; the work per token stays k MLPs. Data parallelism would copy all E experts to every rank;
expert parallelism gives each of W ranks E/W of them, and moves the tokens instead: an
all-to-all out (the dispatch), the experts, an all-to-all back (the combine).

    1. where the tokens go          each rank routes its own; tokens per expert per rank
    2. the all-to-all's bytes       counted, against the pairwise exchange's formula
    3. capacity                     drops against the capacity factor, per rank and global
    4. memory per rank              the experts' bytes, EP against DP
    5. training the MoE GPT         through parallelize with an ep axis, with and without the
                                    auxiliary loss: load and loss
    6. checks                       the layer against one process, bit for bit

The library is miniddp/expert_parallel/ (moe.py, parallel.py have the maths) and the all-to-all
miniddp/collectives/all_to_all.py; `python -m miniddp.bench ep` times it against the model.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from char_corpus import Windows, load_corpus
from common import add_plot_option, end_chapter, fmt_bytes, say, say_prose, section

from miniddp.collectives import all_gather_into_tensor, all_reduce, traffic
from miniddp.expert_parallel import ExpertParallel, MoE
from miniddp.job.env import init_distributed
from miniddp.mesh import init_device_mesh
from miniddp.models import GPT, GPTConfig, MoEConfig
from miniddp.parallelize import parallelize
from miniddp.parallelize_experts import EP_AXES
from miniddp.tensor_parallel import parallelize_module

DIM, HIDDEN, EXPERTS, TOP_K = 64, 128, 8, 2  # the layer of sections 1 to 4 and 6
TOKENS = 256  # per rank
FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
# Section 5: chapter 12's GPT, small, with experts in its second block (every other block).
CONTEXT, WIDTH, LAYERS, HEADS, BATCH, LR = 32, 64, 2, 4, 16, 3e-3  # BATCH: windows a step
AUX_LOSS_COEF = 0.01


def layer(seed: int = 0, **options) -> MoE:
    """The same MoE on every rank (one seed), whole: split it with ExpertParallel."""
    torch.manual_seed(seed)
    return MoE(DIM, HIDDEN, EXPERTS, TOP_K, **options)


def tokens_of(rank: int) -> torch.Tensor:
    """Rank `rank`'s tokens: a different draw on every rank, each rank leaning its own way (its
    own mean), as the documents of one rank's batch share a topic: so each rank crowds its own
    experts."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS, DIM, generator=g) + torch.randn(DIM, generator=g)


def split(moe: MoE) -> MoE:
    parallelize_module(moe.experts, dist.group.WORLD, ExpertParallel())
    return moe


def gathered(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's `tensor`, stacked in rank order."""
    out = tensor.new_empty((world, *tensor.shape))
    all_gather_into_tensor(out, tensor.contiguous())
    return out


def section_routing(world: int, rank: int, checks: dict) -> torch.Tensor:
    section("1. Where the tokens go")
    moe = split(layer())
    with torch.no_grad():
        choices = moe.router(tokens_of(rank)).experts
        moe(tokens_of(rank))
    mine = torch.bincount(choices.reshape(-1), minlength=EXPERTS)
    every = gathered(mine, world)
    totals = moe.tokens_per_expert.tolist()
    say_prose(f"""\
        Each of the {world} ranks routes its own {TOKENS} tokens: the router (a linear gate,
        softmax, the top {TOP_K}) is replicated, a copy on every rank. Rank r holds experts
        {EXPERTS // world}r to {EXPERTS // world}r+{EXPERTS // world - 1}. Choices per expert,
        by the rank that made them:""")
    say("  rank " + "".join(f"{f'e{e}':>6}" for e in range(EXPERTS)))
    for r, counts in enumerate(every.tolist()):
        say(f"  {r:>4} " + "".join(f"{c:>6}" for c in counts))
    say_prose(f"""\
        No rank's tokens are even over the experts, and every rank sends most of its choices
        elsewhere: ({world}-1)/{world} of them on average, for experts placed at random. The
        layer's tokens_per_expert is the column sums, the same on every rank: {totals}.""")
    checks["tokens_per_expert is global"] = torch.equal(moe.tokens_per_expert, every.sum(0))
    return every


def section_bytes(world: int, rank: int, every: torch.Tensor, checks: dict) -> None:
    section("2. The all-to-all's bytes")
    moe = split(layer())
    with torch.no_grad():
        counts = every[rank]  # this rank's rows for each expert, sorted by expert
        rows = torch.randn(int(counts.sum()), DIM)
        traffic.reset()
        moe.experts.dispatch(lambda rows, counts: rows, rows, counts)
    local = EXPERTS // world
    to_ranks = every.view(world, world, local).sum(2)  # [s, d]: rows s sends d
    row = DIM * 4
    out = int(to_ranks[rank].sum() - to_ranks[rank, rank])
    back = int(to_ranks[:, rank].sum() - to_ranks[rank, rank])
    expected = (world - 1) * local * 8 + (out + back) * row
    sent = gathered(torch.tensor([traffic.bytes_sent, expected]), world)
    say_prose(f"""\
        The dispatch is a pairwise exchange (miniddp/collectives/all_to_all.py): at step s of
        W-1, rank r sends its piece for rank r+s and receives rank r-s's, so each piece goes
        straight to its rank, and a rank's own piece never leaves. First each rank tells every
        other how many rows to expect per expert ({local} int64 each), then the rows go out,
        the experts run, and the outputs come back by the same exchange reversed. A rank
        sends (W-1) x {local} x 8 bytes of counts, then {row} bytes per row for every row it
        sends away and every row it sends back:""")
    for r, (measured, formula) in enumerate(sent.tolist()):
        say(f"  rank {r}: sent {fmt_bytes(measured)}, the formula {fmt_bytes(formula)}")
    say_prose("""\
        With even pieces that is (W-1)/W of the input each way, the ring all-gather's bytes in
        W-1 steps; python -m miniddp.bench ep times it against the alpha-beta model, every step
        as long as its largest piece.""")
    checks["all-to-all bytes = formula"] = bool((sent[:, 0] == sent[:, 1]).all())


def section_capacity(world: int, rank: int, checks: dict) -> dict:
    section("3. Capacity")
    everyone = torch.cat([tokens_of(r) for r in range(world)])
    drops = {}
    for factor in FACTORS:
        ours = split(layer(capacity_factor=factor))
        whole = layer(capacity_factor=factor)
        with torch.no_grad():
            ours(tokens_of(rank))
            whole(everyone)  # one process, one capacity for the whole batch
        choices = world * TOKENS * TOP_K
        drops[factor] = (ours.dropped / choices, whole.dropped / choices)
    say_prose(f"""\
        An expert may take at most C = ceil(c N k / E) rows of a batch of N tokens: c is the
        capacity factor (1: room for an even share). Past C a choice is dropped: it adds
        nothing to its token, whose residual carries it on. Here capacity applies per rank, to
        the rank's own {TOKENS} tokens (DeepSpeed's rule): no rank waits for another's counts
        before it drops. One global capacity for all {world * TOKENS} tokens would drop fewer:
        a crowded expert on one rank could use the slots another left empty. Share of the
        choices dropped:""")
    say("  factor   per rank   global")
    for factor, (per_rank, overall) in drops.items():
        say(f"  {factor:>6}   {per_rank:>8.1%}   {overall:>6.1%}")
    most = max(a - b for a, b in drops.values())
    say_prose(f"""\
        Each rank here leans towards its own experts, so per rank, a rank's crowded expert
        drops what another rank's slots could have taken: up to {most:.1%} of the choices more
        than one global capacity. What one global capacity would cost: every rank's counts
        before any rank could drop, and an order among the ranks' tokens.""")
    checks["per-rank capacity drops at least the global's"] = all(a >= b for a, b in drops.values())
    checks["fewer drops as c grows"] = all(
        drops[a][0] >= drops[b][0] for a, b in zip(FACTORS, FACTORS[1:])
    )
    return drops


def section_memory(world: int, checks: dict) -> None:
    section("4. Memory per rank")
    whole, ours = layer(), split(layer())
    experts = sum(p.numel() * 4 for p in whole.experts.parameters())
    held = sum(p.numel() * 4 for p in ours.experts.parameters())
    router = sum(p.numel() * 4 for p in whole.router.parameters())
    say_prose(f"""\
        The experts are 3 x E x dim x hidden weights, {fmt_bytes(experts)} in float32; the
        router dim x E, {fmt_bytes(router)}. With Adam a weight costs 16 bytes (itself, its
        gradient, two moments). Data parallelism keeps all of it on every rank; expert
        parallelism keeps E/W experts:""")
    say(f"  DP: {fmt_bytes(4 * (experts + router))} per rank with Adam")
    say(f"  EP: {fmt_bytes(4 * (held + router))} per rank with Adam ({world} ranks)")
    say_prose("""\
        What EP pays instead is the all-to-all of activations, twice forward and twice
        backward in every MoE layer, and no gradient all-reduce for the experts (each rank
        alone holds its experts, unless data parallelism copies them too).""")
    checks["EP holds 1/W of the experts"] = held * world == experts


def train(windows: torch.Tensor, vocabulary: int, coef: float, mesh) -> tuple:
    """Steps of the MoE GPT through parallelize on `mesh` (pp, dp, ep, tp), each replica its
    BATCH/(dp ep) windows; the loss of the whole batch and the busiest expert's share, step by
    step."""
    torch.manual_seed(0)
    moe = MoEConfig(EXPERTS, TOP_K, aux_loss_coef=coef)
    config = GPTConfig(vocabulary, CONTEXT, WIDTH, LAYERS, HEADS, dropout=0.0, moe=moe)
    parts = parallelize(GPT(config), mesh)
    layers = [m for m in parts.model.modules() if isinstance(m, MoE)]
    optimizer = torch.optim.AdamW(parts.parameters(), lr=LR)
    losses, shares = [], []
    for step_windows in windows:
        loss = parts.train_step(step_windows.chunk(parts.replicas)[parts.replica])
        optimizer.step()
        optimizer.zero_grad()
        all_reduce(loss)  # the replicas' means: tp = pp = 1, so every rank is one
        losses.append(loss.item() / parts.replicas)
        counts = layers[0].tokens_per_expert
        shares.append((counts.max() / counts.sum()).item())
    return losses, shares


def section_training(world: int, rank: int, steps: int, checks: dict) -> tuple[dict, dict]:
    section("5. Training the MoE GPT, with and without the auxiliary loss")
    ep = 2 if world > 1 else 1  # the experts over 2 ranks, copied over the rest (dp)
    mesh = init_device_mesh("cpu", (1, world // ep, ep, 1), mesh_dim_names=EP_AXES)
    corpus = load_corpus(max_characters=200_000)
    windows = Windows(corpus.train, CONTEXT)
    g = torch.Generator().manual_seed(1)
    picks = torch.randint(0, len(windows), (steps, BATCH), generator=g)
    batches = torch.stack([windows[p.tolist()] for p in picks])
    runs = {
        f"aux loss x {coef}": train(batches, len(corpus.vocabulary), coef, mesh)
        for coef in (0.0, AUX_LOSS_COEF)
    }
    say_prose(f"""\
        Chapter 12's GPT ({LAYERS} blocks, width {WIDTH}) with {EXPERTS} experts, top {TOP_K},
        in its second block, through parallelize on a (pp, dp, ep, tp) = (1, {world // ep},
        {ep}, 1) mesh: the experts cut over ep, copied over dp, every rank a replica with
        {BATCH // world} of each step's {BATCH} windows. After backward an expert's gradient
        holds its ep group's tokens already (the combine brought them home), so it is summed
        over dp, the ranks with the same experts, and divided by the {world} replicas;
        everything else is averaged over them (miniddp/parallelize_experts.py).

        A router left alone feeds the experts that already answer best, which then learn
        most, and get fed more. The Switch loss, E sum_i f_i P_i, is 1 at an even load and
        grows as it concentrates; times {AUX_LOSS_COEF}, it pushes back. It is computed from
        the whole batch's statistics (one all-reduce), so it is one process's loss, and its
        gradient enters in the backward, scaled so that the replicas' average is one
        process's. The busiest expert's share of the choices ({1 / EXPERTS:.3f} when even),
        and the loss, averaged over the steps:""")
    tail = max(1, steps // 5)
    say(f"  {'run':<18} {'first fifth':>12} {'last fifth':>11} {'loss at the end':>16}")
    ends = {}
    for name, (losses, shares) in runs.items():
        first, last = sum(shares[:tail]) / tail, sum(shares[-tail:]) / tail
        ends[name] = last
        say(f"  {name:<18} {first:>12.3f} {last:>11.3f} {sum(losses[-tail:]) / tail:>16.3f}")
    without, with_aux = ends.values()
    say_prose(f"""\
        With the auxiliary loss the busiest expert ends with {with_aux:.2f} of the choices
        against {without:.2f} without, at the same loss: the experts' parameters are used
        more evenly, and with capacity fewer tokens would be dropped.""")
    checks["the aux loss evens the load"] = with_aux < without
    return {n: r[1] for n, r in runs.items()}, {n: r[0] for n, r in runs.items()}


def section_checks(world: int, rank: int, checks: dict) -> None:
    section("6. Checks against one process")
    everyone = torch.cat([tokens_of(r) for r in range(world)])
    grad = torch.randn(everyone.shape, generator=torch.Generator().manual_seed(7))
    results = []
    for moe, x, dy in (
        (layer(aux_loss_coef=0.01), everyone, grad),
        (split(layer(aux_loss_coef=0.01)), tokens_of(rank), grad.chunk(world)[rank]),
    ):
        y = moe(x)
        ((y * dy).sum() + moe.aux_loss).backward()
        results.append((y.detach(), moe))
    (y_one, one), (y_ep, ep) = results
    router = ep.router.gate.weight.grad.clone()
    all_reduce(router)
    same = {
        "output": torch.equal(y_ep, y_one.chunk(world)[rank]),
        **{
            f"d{w}": torch.equal(getattr(ep.experts, w).grad, g.grad.chunk(world)[rank])
            for w, g in (("w1", one.experts.w1), ("w2", one.experts.w2), ("w3", one.experts.w3))
        },
    }
    every = gathered(torch.tensor([all(same.values())]), world)
    reference = one.router.gate.weight.grad
    router_gap = ((router - reference).abs().max() / reference.abs().max()).item()
    aux_gap = abs(ep.aux_loss.item() - one.aux_loss.item())
    say_prose(f"""\
        One process applies the same MoE to all {world * TOKENS} tokens; the ranks, each its
        own {TOKENS}, in rank order. Every expert sees the same rows in the same order (the
        permutation is a stable sort by expert, and the dispatch regroups what arrives by
        expert, then by source rank), and runs the same matmul on them.""")
    say(f"  output and dw1, dw2, dw3, bit for bit, on every rank: {bool(every.all())}")
    say(f"  the router's gradient summed over ranks: within {router_gap:.1e} (relative)")
    say(f"  the aux loss, global, against one process's: within {aux_gap:.1e}")
    checks["EP = one process, bit for bit"] = bool(every.all())
    checks["router gradient within rounding"] = router_gap < 1e-5
    checks["global aux loss = one process's"] = aux_gap < 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="section 5's (default 200)")
    add_plot_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    world, rank = env.world_size, env.rank
    if EXPERTS % world:
        raise SystemExit(f"run on a number of ranks that divides {EXPERTS}: 1, 2, 4 or 8")
    torch.set_num_threads(1)
    checks: dict[str, bool] = {}
    say(f"Chapter 18: experts, on W = {world} ranks")
    every = section_routing(world, rank, checks)
    section_bytes(world, rank, every, checks)
    drops = section_capacity(world, rank, checks)
    section_memory(world, checks)
    loads, losses = section_training(world, rank, args.steps, checks)
    section_checks(world, rank, checks)
    if args.plot and env.is_main:
        from miniddp.instruments.figures.experts import experts

        path = experts(every.tolist(), drops, loads, losses, args.plot / "18_experts.png")
        say(f"  drawn: {path}")
    for name, passed in checks.items():
        say(f"  {'ok ' if passed else 'FAILED'} {name}")
    assert all(checks.values()), [name for name, passed in checks.items() if not passed]
    dist.barrier()
    say(f"Verified on {world} ranks: expert parallelism is one process's MoE, bit for bit;")
    say("its all-to-all sends the formula's bytes; the aux loss evens the experts' load.")
    end_chapter()


if __name__ == "__main__":
    main()
