"""Chapter 16c: 4-D parallelism. Chapter 16's GPT on 8 ranks as (pp, dp, cp, tp) = (2, 1, 2, 2):
the sequence split too, by context parallelism on the mesh (chapter 15's ring attention).

    torchrun --nproc_per_node=8 tutorials/16c_four_d.py     (or NPROC=8 ./launch.sh ...)

Chapter 16 cut the model three ways: every rank still read whole windows. Long contexts need the
fourth cut, the sequence itself (Llama 3's 405B ran TP 8 x CP 16 x PP 16 x DP 8 at 128k tokens).
One call does it all, `parallelize(gpt, mesh)` with a "cp" axis (miniddp/parallelize.py):

    1. the mesh                      four axes, torchtitan's order, and the group over dp x cp
    2. what each rank holds          its stage's TP slices, and T/cp positions of every window
    3. what each rank sends          the ring's K/V per attention layer, and the gradients over
                                     dp x cp: counted against the formulas
    4. the same training             step by step against one process

Any other number of ranks is refused, naming the command.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from char_corpus import Windows, load_corpus
from common import end_chapter, fmt_bytes, say, say_prose, section
from three_d_setup import one_process, refuse_other_world_sizes

from miniddp.collectives import traffic
from miniddp.context_parallel import ring_bytes
from miniddp.job.env import init_distributed
from miniddp.mesh import init_device_mesh
from miniddp.models.gpt import GPT, GPTConfig
from miniddp.observe.link import wire_bytes
from miniddp.parallelize import CP_AXES, ParallelGPT, parallelize
from miniddp.sharding import ddp_buckets

WORLD, SHAPE = 8, (2, 1, 2, 2)  # (pp, dp, cp, tp)
# T = 32 characters, a multiple of 2 cp = 4 (load-balanced: two chunks a cp rank); 2 blocks of
# 4 heads, so each stage holds one block and each TP rank 2 heads.
CONTEXT, WIDTH, LAYERS, HEADS = 32, 32, 2, 4
WINDOWS, MICROBATCHES, STEPS, LEARNING_RATE = 8, 2, 4, 1e-2
CHARACTERS = 20_000
# One process and the 4-D run add in other orders (split matmuls, the ring's log-sum-exp merge,
# sums over ranks): float32 rounding, a little magnified by AdamW's division by the root of its
# second moment.
LOSS_TOLERANCE, PARAMETER_TOLERANCE = 1e-5, 1e-4


def section_mesh(parts: ParallelGPT) -> bool:
    section("1. The mesh: (pp, dp, cp, tp) = (2, 1, 2, 2)")
    mesh = parts.mesh
    say_prose("""\
        init_device_mesh("cpu", (2, 1, 2, 2), ("pp", "dp", "cp", "tp")) lays the ranks out as
        torch.arange(8).view(2, 1, 2, 2): rank = 4 pp + 2 cp + tp. The axes that talk most
        move fastest, so that their ranks share a machine: TP all-reduces inside every layer,
        the ring sends K and V at every attention layer; DP's once-a-step average and the
        pipeline's one activation a microbatch cross machines (torchtitan's order). Gradients
        are averaged over dp x cp at once, on the group of every rank with this rank's pp and
        tp coordinates, mesh["dp", "cp"]._flatten("dp_cp") (torchtitan's "dp_shard_cp"). Each
        rank's groups:""")
    names = (*CP_AXES, "dp_cp")
    mine = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in names}
    rows: list = [None] * WORLD
    dist.all_gather_object(rows, (mesh.get_coordinate(), mine))
    say(f"  {'rank':>4}  {'(pp,dp,cp,tp)':>13}  " + "  ".join(f"{n:>8}" for n in names))
    for rank, (where, groups) in enumerate(rows):
        cells = "  ".join(f"{str(groups[n]):>8}" for n in names)
        say(f"  {rank:>4}  {str(tuple(where)):>13}  {cells}")
    grid = torch.arange(WORLD).view(SHAPE)
    drawn = all(
        groups["cp"] == grid[p, d, :, t].tolist()
        and groups["tp"] == grid[p, d, c, :].tolist()
        and groups["pp"] == grid[:, d, c, t].tolist()
        and groups["dp_cp"] == grid[p, :, :, t].flatten().tolist()
        for (p, d, c, t), groups in rows
    )
    return drawn


def section_holdings(parts: ParallelGPT, windows: torch.Tensor) -> dict[str, bool]:
    section("2. What each rank holds")
    cp, rank = parts.context.size, parts.context.rank
    inputs, _ = parts.context.cut(windows)
    positions = parts.context.positions(inputs.shape[1], inputs.device)
    chunk = CONTEXT // (2 * cp)
    expected = [*range(rank * chunk, (rank + 1) * chunk)]
    expected += range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    elements = sum(p.numel() for p in parts.parameters())
    mine = (tuple(parts.mesh.get_coordinate()), tuple(inputs.shape), positions.tolist(), elements)
    rows: list = [None] * WORLD
    dist.all_gather_object(rows, mine)
    say_prose(f"""\
        Every rank of the replica is given its whole windows, ({WINDOWS}, T + 1) with T =
        {CONTEXT}; train_step cuts each into 2 cp = {2 * cp} chunks of {chunk} positions, and
        cp rank r keeps chunks r and 2cp - 1 - r (load-balanced: under the causal mask an
        early chunk is cheap and a late one dear, so each rank gets one of each, chapter 15).
        Its position embedding reads those chunks' global positions. Its parameters are its
        stage's block, cut by TP: the cp ranks hold the same ones, as replicas do.""")
    say(f"  {'rank':>4}  {'(pp,dp,cp,tp)':>13}  {'tokens':>7}  {'parameters':>10}  positions")
    for number, (where, shape, held, count) in enumerate(rows):
        spans = f"{held[0]}-{held[chunk - 1]}, {held[chunk]}-{held[-1]}"
        say(f"  {number:>4}  {str(where):>13}  {str(shape):>7}  {count:>10,}  {spans}")
    held = inputs.shape[1] == CONTEXT // cp and positions.tolist() == expected
    return {"a rank holds its two chunks, T/cp positions of each window": held}


def section_sends(parts: ParallelGPT, windows: torch.Tensor) -> dict[str, bool]:
    section("3. What each rank sends")
    cp, tp, pp = parts.context.size, parts.mesh["tp"].size(), parts.mesh["pp"].size()
    traffic.reset()
    parts.train_step(windows)  # its gradients are dropped below: this step only counts
    ring = traffic.bytes_sent  # Peers' messages: only the ring's, here (the rest is gloo's)
    tokens = WINDOWS * CONTEXT // cp  # B·T/cp positions, over all microbatches
    microbatches = MICROBATCHES if pp > 1 else 1  # ring_attention is called per microbatch
    forward, backward = ring_bytes(  # one call (the library's formula): K and V, W - 1 hops
        CONTEXT, HEADS // tp, WIDTH // HEADS, cp, 4, batch=WINDOWS // microbatches
    )
    formula = microbatches * LAYERS // pp * (forward + backward)
    gradients = sum(bucket.numel() for bucket in ddp_buckets(parts.module))
    elements = sum(p.numel() for p in parts.parameters())
    dp_cp = parts.mesh["dp_cp"].size()
    say_prose(f"""\
        The ring, per attention layer and rank, sends K and V of its B·T/cp = {tokens}
        positions, {WIDTH // tp} columns of its heads, W - 1 hops forward, and twice that
        backward (K/V again, then dK/dV home): on this stage's {LAYERS // pp} layer(s),

            ring      3 (cp - 1) · 2 · B·T/cp · H/tp · 4 · L/pp
                      + (cp - 1) · 4 a call (the settings)     = {formula:,} bytes a step
            counted   {ring:,} bytes (MiniDDP's traffic counter, around one train_step)

        Once a step, MiniDDP all-reduces the rank's gradients over dp x cp = {dp_cp} ranks: its
        buckets hold {gradients:,} elements, all {elements:,} of its parameters, and a ring of
        {dp_cp} puts {fmt_bytes(wire_bytes("all_reduce", 4 * gradients, dp_cp))} of them on the
        wire. TP's all-reduces and the pipeline's sends are chapter 16's with N = B·T/cp
        tokens: context parallelism divides them by cp, as it divides every activation.""")
    for param in parts.parameters():
        param.grad = None
    return {
        "the ring's bytes = the formula's": ring == formula,
        "dp x cp averages every gradient, once": gradients == elements,
    }


def section_training(parts: ParallelGPT, c: GPTConfig, batches: list) -> dict[str, bool]:
    section("4. The same training as one process")
    reference, model = one_process(c, batches)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=LEARNING_RATE)
    losses = []
    for windows in batches:
        loss = parts.train_step(windows)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    reported: list = [None] * WORLD
    dist.all_gather_object(reported, [None if x is None else x.item() for x in losses])
    last = [r for r in reported if r[0] is not None]  # the last stage's cp and tp ranks
    say("    step   one process        4-D")
    for step, expected in enumerate(reference):
        say(f"    {step:>4}   {expected:>11.6f}   {last[0][step]:>8.6f}")
    whole = dict(model.named_parameters())
    tp, shard = parts.mesh["tp"].size(), parts.mesh["tp"].get_local_rank()
    gap = 0.0
    for name, param in parts.model.named_parameters():
        expected = whole["token.weight" if name == "head.weight" else name].detach()
        if param.shape != expected.shape:  # a TP slice: cut the reference as TP cut it
            dim = next(d for d in range(param.dim()) if param.shape[d] != expected.shape[d])
            expected = torch.chunk(expected, tp, dim)[shard]
        gap = max(gap, (param.detach() - expected).abs().max().item())
    gaps = torch.tensor(gap)
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    flat = torch.cat([p.detach().flatten() for p in parts.parameters()])
    both = [torch.empty_like(flat) for _ in range(parts.context.size)]
    dist.all_gather(both, flat, group=parts.mesh["cp"].get_group())
    same = torch.tensor(float(all(torch.equal(both[0], other) for other in both)))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    loss_gap = max(abs(r[step] - e) for r in last for step, e in enumerate(reference))
    say_prose(f"""\
        Each cp rank's loss is its mean over its B·T/cp tokens; they hold equally many, so
        the whole sequence's mean is the mean of theirs (train_step reports it), and its
        gradient the average of theirs: the average over dp x cp that MiniDDP takes. The
        largest difference from one process: {loss_gap:.1e} in the loss, {gaps.item():.1e}
        in any parameter after {len(batches)} AdamW steps (float32, other orders of sums).
        The cp ranks, each of which saw half of every window, hold the same parameters bit
        for bit: {bool(same.item())}.""")
    return {
        "the cp ranks hold the same parameters, bit for bit": bool(same.item()),
        f"4-D loss within {LOSS_TOLERANCE:g} of one process's": loss_gap <= LOSS_TOLERANCE,
        f"parameters within {PARAMETER_TOLERANCE:g}": gaps.item() <= PARAMETER_TOLERANCE,
    }


def main() -> None:
    refuse_other_world_sizes("16c_four_d.py", "16c", f"(pp, dp, cp, tp) = {SHAPE}")
    init_distributed(backend="gloo")
    torch.set_num_threads(1)
    corpus = load_corpus(max_characters=CHARACTERS)
    windows = Windows(corpus.train, CONTEXT)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [windows[order[s * WINDOWS : (s + 1) * WINDOWS]] for s in range(STEPS)]
    vocabulary = -(-len(corpus.vocabulary) // 2) * 2  # TP cuts the vocabulary in two
    c = GPTConfig(vocabulary, CONTEXT, WIDTH, LAYERS, HEADS, dropout=0.0)  # the ring: none
    say(f"Chapter 16c: 4-D parallelism, (pp, dp, cp, tp) = {SHAPE} on {WORLD} ranks")
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=CP_AXES)
    torch.manual_seed(0)
    parts = parallelize(GPT(c), mesh, n_microbatches=MICROBATCHES)
    checks = {"every rank's groups are the ones drawn": section_mesh(parts)}
    checks |= section_holdings(parts, batches[0])
    checks |= section_sends(parts, batches[0])
    checks |= section_training(parts, c, batches)

    section("Checks")
    for name, passed in checks.items():
        say(f"  {'ok ' if passed else 'FAILED'} {name}")
    assert all(checks.values()), [name for name, passed in checks.items() if not passed]
    dist.barrier()
    say(f"Verified on {WORLD} ranks: each rank holds and sends what the formulas say, and 4-D")
    say("trains as one process does.")
    end_chapter()


if __name__ == "__main__":
    main()
