"""Chapter 15: long sequences. Split the sequence itself: ring attention (context parallelism),
load-balanced for causal masks, and sequence parallelism inside tensor parallelism.

    torchrun --nproc_per_node=2 tutorials/15_long_sequences.py [--link alpha=1ms,bandwidth=1gbit]

Data, tensor and pipeline parallelism all leave every rank holding activations for the whole
sequence. Doubling the context doubles them (quadruples them, for a naive attention); past some
length no split of the model helps. Context parallelism gives each of W ranks S/W positions of
every activation. Everything but attention acts on each position alone and runs unchanged; only
attention needs every key, and the keys go round a ring.

    1. why activations grow with S     the S x S scores, and a block's bytes per token, measured
    2. ring attention, step by step    who holds which K/V when; the blocks each rank computes
    3. the bytes and who wins          counted against the formula; the ring vs all-gathering K/V,
                                       in the model and timed on the simulated link (--link)
    4. sequence parallelism in TP      LayerNorm's activations divided by W, measured
    5. a whole model on the ring       what the GPT needs, and where chapter 16c trains it
    6. checks                          output and gradients against one process's SDPA

Exercise: tutorials/exercises/lse_merge.py, the log-sum-exp merge of two partial attentions,
checked by tests/test_lse_merge.py. The library is miniddp/context_parallel/ (attention.py has
the maths); the picture is docs/figures/15_ring_attention.png (`python -m miniddp.figures --only
15b`), and `python -m miniddp.bench cp` times the ring against one process and torch's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import end_chapter, fmt_bytes, say, say_all_ranks, say_prose, section
from torch import nn

from miniddp.collectives import all_gather_into_tensor, traffic
from miniddp.collectives.cost_model import CostModel
from miniddp.context_parallel import (
    count_blocks,
    ring_attention,
    ring_bytes,
    ring_seconds,
    shard_sequence,
    stats_for,
    step_blocks,
)
from miniddp.instruments.activation_memory import SavedActivations
from miniddp.instruments.link_group import simulated_link
from miniddp.job.env import init_distributed
from miniddp.observe.link import Link
from miniddp.tensor_parallel import SequenceParallel, TransformerBlock, parallelize_module, plan_for

HEADS, HEAD_DIM = 4, 32
LENGTHS = (256, 512, 1024)
RING_LENGTH = 2048  # section 3's sequence: S/W positions a rank
# Section 3's link, chapter 13's: 1 ms a message, 1 Gbit/s (beta = 8 ns a byte).
LINK = CostModel(alpha=1e-3, beta=8e-9)
LINK_REPEATS = 5  # timed runs of each design on the simulated link
FIGURE = "docs/figures/15_ring_attention.png"
# Section 5: chapter 12's GPT at its size, a few steps of its text.


def saved_bytes(function, *inputs) -> int:
    """The bytes autograd keeps for backward from `function(*inputs)`, each storage once; a
    module's weights are the model's, not activations (miniddp/instruments/activation_memory.py)."""
    model = function if isinstance(function, nn.Module) else nn.Module()
    with SavedActivations(model) as saved:
        function(*inputs)
    return saved.total


def explicit_attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v, written out: autograd keeps the S x S probabilities."""
    return ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1) @ v


def qkv(length: int, dtype=torch.float32, batch: int = 1, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, length, HEAD_DIM)
    return [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(3)]


def section_growth(checks: dict[str, bool]) -> None:
    section("1. Why activations grow with the sequence")
    say_prose("""\
        Attention's scores are one number per query and key: B·H·S² of them a layer. Written
        out, softmax(q kᵀ/√D) v keeps for backward q, k, v and the S x S probabilities:

            explicit    (3·B·H·S·D + B·H·S²) · itemsize
            flash       (4·B·H·S·D + B·H·S) · itemsize     q, k, v, out and the row's lse

        A flash kernel (FlashAttention; the CPU's _scaled_dot_product_flash_attention_for_cpu)
        never stores the S x S matrix: it recomputes it block by block in backward from q, k
        and the per-row log-sum-exp. Measured with autograd's saved-tensor hooks, B = 1,
        H = 4, D = 32, float32:""")
    say(f"  {'S':>5}  {'explicit':>10}  {'formula':>10}  {'flash':>10}  {'formula':>10}")
    for length in LENGTHS:
        q, k, v = (t.requires_grad_() for t in qkv(length))
        bh, bhsd = HEADS, HEADS * length * HEAD_DIM
        explicit = saved_bytes(explicit_attention, q, k, v)
        flash = saved_bytes(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v)
        formulas = (4 * (3 * bhsd + bh * length**2), 4 * (4 * bhsd + bh * length))
        cells = [fmt_bytes(n) for n in (explicit, formulas[0], flash, formulas[1])]
        say(f"  {length:>5}  " + "  ".join(f"{cell:>10}" for cell in cells))
        checks[f"S = {length}: saved bytes are the formulas'"] = (explicit, flash) == formulas
    per_token = []
    for length in LENGTHS[:2]:
        torch.manual_seed(0)
        block = TransformerBlock(HEADS * HEAD_DIM, HEADS)
        x = torch.randn(1, length, HEADS * HEAD_DIM, requires_grad=True)
        per_token.append(saved_bytes(block, x) / length)
    say_prose(f"""\
        Flash makes attention linear in S, not small. A whole transformer block (width
        {HEADS * HEAD_DIM}, flash attention, a 4x MLP) keeps {per_token[0]:,.0f} bytes a token
        at S = {LENGTHS[0]} and {per_token[1]:,.0f} at S = {LENGTHS[1]}: a constant times B·S·width,
        every layer. At S = 128k, H = 32 and bfloat16 the explicit scores alone would be
        {fmt_bytes(32 * (128 * 1024) ** 2 * 2)} a layer; the flash block's activations, linear,
        still grow with every token, and no split of the weights (TP, PP) or of the batch (DP)
        divides them. Splitting the sequence does.""")
    checks["a block's activations are linear in S"] = abs(per_token[1] / per_token[0] - 1) < 0.01


def say_ring_plan(world: int) -> None:
    """Which K/V block each rank holds at each step, and what it computes, causal."""
    say(f"  W = {world}: the K/V each rank holds at each step (rank r - i at step i)")
    say("    step  " + "  ".join(f"rank {r}" for r in range(world)))
    for step in range(world):
        row = "  ".join(f"{f'K/V {(r - step) % world}':>6}" for r in range(world))
        say(f"    {step:>4}  {row}")
    say(f"  W = {world}, causal, S = 64·W: chunk pairs computed (skipped), q·k scores kept")
    say(f"    {'':<14} " + "  ".join(f"{f'rank {r}':>14}" for r in range(world)))
    for load_balance in (False, True):
        name = "load-balanced" if load_balance else "plain"
        chunk = 64 // (1 + load_balance)
        stats = [stats_for(r, world, True, load_balance, chunk) for r in range(world)]
        cells = "  ".join(f"{s.blocks:>3} ({s.skipped:>2}) {s.scores:>6,}" for s in stats)
        say(f"    {name:<14} {cells}")
    say("    (a pair: S/W x S/W plain, S/2W x S/2W load-balanced; the same scores in all)")


def section_ring(world: int, rank: int, checks: dict[str, bool]) -> None:
    section("2. Ring attention, step by step")
    say_prose("""\
        Rank r holds its S/W queries, keys and values. At step i it holds the K/V block of rank
        r - i: it computes its queries against that block while sending the block on to rank
        r + 1 and receiving the next one from rank r - 1, so the transfer hides behind the
        compute. After W steps every query has met every key, and no rank ever held more than
        two K/V blocks. Each step's partial result (out_b, lse_b) folds into the running one:

            lse = logaddexp(lse_1, lse_2),   out = e^(lse_1 - lse)·out_1 + e^(lse_2 - lse)·out_2

        (the exercise: tutorials/exercises/lse_merge.py). With a causal mask, query chunk a
        against key chunk b is whole (a > b), masked within the block (a = b) or skipped
        (a < b). Plain chunks make rank r do r + 1/2 blocks' worth: the last rank works 2W - 1
        times as long as the first, and the ring waits for it at every step. Load-balanced,
        rank r holds chunks r and 2W-1-r of 2W (torch's head-tail layout): the same work each.
        From the ring's plan (step_blocks), per rank:""")
    for size in sorted({world, 4}):
        say_ring_plan(size)
    say(f"  (drawn for W = 4: {FIGURE}, python -m miniddp.figures --only 15)")
    length = 64 * world
    for load_balance in (False, True):
        q, k, v = (shard_sequence(t, 2, load_balance=load_balance) for t in qkv(length))
        with count_blocks() as recorded:
            ring_attention(q, k, v, is_causal=True, load_balance=load_balance)
        planned = stats_for(rank, world, True, load_balance, q.shape[2] // (1 + load_balance), 4)
        checks[f"ring ran its plan (load_balance={load_balance})"] = recorded == [planned]
    say_all_ranks(
        f"ran {len(step_blocks(rank, world, 0, True, True))} kernel calls at step 0, "
        f"load-balanced; counted = planned: {recorded == [planned]}"
    )
    balanced = [stats_for(r, world, True, True, 32).scores for r in range(world)]
    checks["load-balanced: every rank the same scores"] = len(set(balanced)) == 1


def timed_block(length: int, world: int) -> float:
    """Seconds of one flash call, S/W queries against S/W keys (median of 5)."""
    q, k, v = (t[:, :, : length // world] for t in qkv(length))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def section_bytes(world: int, checks: dict[str, bool]) -> None:
    section("3. The bytes, and who wins against all-gathering K/V")
    q, k, v = (t.requires_grad_() for t in (shard_sequence(t, 2) for t in qkv(RING_LENGTH)))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    traffic.reset()
    out = ring_attention(q, k, v)
    forward = traffic.bytes_sent
    traffic.reset()
    out.sum().backward()
    backward = traffic.bytes_sent
    formula, backward_formula = ring_bytes(RING_LENGTH, HEADS, HEAD_DIM, world, 4)
    say_prose(f"""\
        Per rank and call, B = 1: K and V, S/W positions each, travel W - 1 hops forward
        (with one number more, the block's is_causal and load_balance, which every rank checks
        it shares); backward sends them round again and brings dK and dV home the same way,
        twice that. Counted by MiniDDP's traffic, S = {RING_LENGTH}, H = {HEADS}, D = {HEAD_DIM},
        float32:

            forward    {forward:>10,} bytes    (W-1)·(2·S/W·H·D + 1)·4 = {formula:,}
            backward   {backward:>10,} bytes    twice K and V's         = {backward_formula:,}

        All-gathering K/V first (torch's context_parallel with rotate_method="allgather")
        sends the same bytes. What differs is when they move and what is held. The ring sends
        step i + 1's block during step i's compute; the all-gather must finish before the
        first score. On chapter 13's link (alpha = 1 ms, 1 Gbit/s), with t the time of one
        S/W x S/W block measured here (scaled as S² past the measured length) and m = alpha
        + block bytes · beta, one non-causal forward takes:

            ring         (W-1)·max(t, m) + t      holds 2 K/V blocks of S/W (current, next)
            all-gather   (W-1)·m + W·t            holds all S keys and values""")
    measured_t = timed_block(RING_LENGTH, world)
    header = ("S", "t ms", "m ms", "ring ms", "all-gather ms", "K/V held: ring / all-gather")
    say("  {:>6}  {:>8}  {:>7}  {:>9}  {:>13}  {:>27}".format(*header))
    wins = []
    for length in (RING_LENGTH, 4 * RING_LENGTH, 16 * RING_LENGTH):
        t = measured_t * (length / RING_LENGTH) ** 2
        block = 2 * length // world * HEADS * HEAD_DIM * 4
        m = LINK.alpha + block * LINK.beta
        ring, gather = ring_seconds(world, t, m)
        held = f"{fmt_bytes(2 * block)} / {fmt_bytes(world * block)}"
        say(
            f"  {length:>6}  {t * 1e3:>8.1f}  {m * 1e3:>7.1f}  {ring * 1e3:>9.1f}  "
            f"{gather * 1e3:>13.1f}  {held:>27}"
        )
        wins.append(ring <= gather)
    say_prose("""\
        The ring never loses in this model: it saves min(t, m) a hop, most when compute and
        transfer are alike, and it holds two K/V blocks, 2/W of what the all-gather holds (at
        W = 2 that is all of it; at W = 8 a quarter). Since t grows as S² and m as S, a long
        sequence hides the transfer either way and the gain shrinks to a few percent, as
        above. The all-gather's case lies outside the model: K/V made small by grouped-query
        attention (H_kv heads of H), and one library collective in place of W - 1 launches
        and waits, each paying its own overhead.""")
    checks["bytes: forward (W-1)·(2·S/W·H·D + 1)·itemsize"] = forward == formula
    checks["bytes: backward twice the forward's K and V"] = backward == backward_formula
    checks["the ring never slower than all-gather (model)"] = all(wins)


def all_gathered_attention(q, k, v):
    """The other design: gather every rank's K and V (two all-gathers, MiniDDP's ring, on the
    same sends as the ring attention's), then attend at once."""
    world = dist.get_world_size()
    whole = []
    for part in (k, v):
        batch, heads, length, dim = part.shape
        gathered = part.new_empty(world * batch, heads, length, dim)  # rank after rank
        all_gather_into_tensor(gathered, part.contiguous())
        rows = gathered.view(world, batch, heads, length, dim).permute(1, 2, 0, 3, 4)
        whole.append(rows.reshape(batch, heads, world * length, dim))  # the sequence's order
    return F.scaled_dot_product_attention(q, *whole)


def section_link(world: int, link: Link, checks: dict[str, bool]) -> None:
    """Both designs timed on the simulated link (the ring's sends and the all-gathers alike
    cross its process group), interleaved, against the model above."""
    q, k, v = (shard_sequence(t, 2) for t in qkv(RING_LENGTH))
    designs = {"ring": ring_attention, "all-gather": all_gathered_attention}
    times: dict[str, list[float]] = {name: [] for name in designs}
    outputs: dict[str, torch.Tensor] = {}
    with simulated_link(link):
        for _ in range(LINK_REPEATS):
            for name, design in designs.items():
                dist.barrier()
                start = time.perf_counter()
                outputs[name] = design(q, k, v)
                times[name].append(time.perf_counter() - start)
    t = timed_block(RING_LENGTH, world)
    block = 2 * RING_LENGTH // world * HEADS * HEAD_DIM * 4  # K and V: two messages
    m = 2 * link.alpha + block / link.bandwidth
    model = {"ring": (world - 1) * max(t, m) + t, "all-gather": (world - 1) * m + world * t}
    measured = {name: statistics.median(seconds) for name, seconds in times.items()}
    say_prose(f"""\
        Timed, S = {RING_LENGTH}, non-causal, on the simulated link {link} (every send
        and collective crosses the link's process group,
        miniddp/instruments/link_group.py), median of {LINK_REPEATS}, the two
        interleaved; t = {t * 1e3:.1f} ms measured here, m = 2 alpha + block bytes /
        bandwidth = {m * 1e3:.1f} ms (K and V, two messages):""")
    for name in designs:
        times_ms = f"measured {measured[name] * 1e3:7.1f} ms   model {model[name] * 1e3:7.1f} ms"
        say(f"    {name:<10}  {times_ms}")
    say_prose(f"""\
        The ring's transfer hides behind its compute as the model says when the measured time
        is near (W-1)·max(t, m) + t rather than the sum (W-1)(t + m) + t =
        {((world - 1) * (t + m) + t) * 1e3:.1f} ms. (Timings on a shared machine move by more
        than the models' gap; the chapter reports them and checks only what does not move.)""")
    gap = (outputs["ring"] - outputs["all-gather"]).abs().max().item()
    checks["on the link: the ring and the all-gather attend alike"] = gap <= 1e-5


def section_sequence_parallel(world: int, rank: int, checks: dict[str, bool]) -> None:
    section("4. Sequence parallelism inside tensor parallelism")
    width, length = HEADS * HEAD_DIM, 256
    torch.manual_seed(rank)  # a different dropout mask on each rank's positions
    norm_dropout = nn.Sequential(nn.LayerNorm(width), nn.Dropout(0.1))
    x = torch.randn(4, length, width, requires_grad=True)
    whole = saved_bytes(norm_dropout, x)
    sp_plan = {"0": SequenceParallel(), "1": SequenceParallel()}
    parallelize_module(norm_dropout, None, sp_plan)
    positions = shard_sequence(x, 1).detach().clone().requires_grad_()
    shard = saved_bytes(norm_dropout, positions)
    torch.manual_seed(0)
    reference = TransformerBlock(width, HEADS).double()
    block = TransformerBlock(width, HEADS).double()
    block.load_state_dict(reference.state_dict())
    parallelize_module(block, None, plan_for(block, sequence_parallel=True))
    inputs = torch.randn(2, 64, width, dtype=torch.float64)
    gap = (block(shard_sequence(inputs, 1)) - shard_sequence(reference(inputs), 1)).abs().max()
    say_prose(f"""\
        Tensor parallelism (chapter 13) splits the matmuls, but between them LayerNorm and
        Dropout run on every position, whole, on every rank: W copies of the same activations.
        Megatron-SP cuts those along the sequence instead: each rank's LayerNorm and Dropout
        see [B, S/W, H], and the column-parallel linear all-gathers the sequence before it
        (reduce-scatter in backward) while the row-parallel one reduce-scatters its output in
        place of the all-reduce: the same bytes on the wire (an all-gather plus a
        reduce-scatter is an all-reduce, cut in two). Measured, LayerNorm then Dropout on
        [4, {length}, {width}] float32, the bytes autograd keeps:

            plain TP, every rank        {whole:>9,} bytes
            sequence parallel, rank 0   {shard:>9,} bytes    1/{whole / shard:g}, W = {world}

        A TransformerBlock under plan_for(block, sequence_parallel=True) takes and gives this
        rank's positions; against one process's block on the whole sequence, float64, the
        largest difference on this rank's positions: {gap:.1e}. The LayerNorm weight's
        gradient is the sum of every rank's positions' parts, summed over the TP group
        (miniddp/tensor_parallel/layers.py, SequenceParallelLayerNorm).""")
    checks["SP: LayerNorm + Dropout activations / W"] = whole == world * shard
    checks["SP: a block equals one process's"] = gap.item() <= 1e-12


def section_gpt(world: int) -> None:
    section("5. A whole model on the ring")
    say_prose(f"""\
        The model need not change: everything but attention acts on each position alone, so
        chapter 12's GPT runs on a rank's S/W positions of each window as it is. Three things
        are given to it. Its attention calls go onto the ring (context_parallel/model.py's
        sdpa_on_the_ring swaps F.scaled_dot_product_attention for ring_attention, as torch's
        context_parallel does). Its position embedding reads the global positions of the
        rank's head and tail chunks (positions_of), not 0..S/W-1. And the gradients are
        averaged over the context-parallel group (over CP x DP, with data parallelism too):
        each rank's loss is the mean over its own positions, the sequence's mean is the mean
        of these equal parts, and ring attention's backward has already sent every dK and dV
        home, so that average is the whole loss's gradient. A loss summed locally and divided
        by the global token count would need a sum instead: the classic trap
        (tests/test_context_parallel.py plants it). Chapter 16c does all three through
        miniddp.parallelize on a 4-D mesh, (pp, dp, cp, tp), and trains as one process does;
        here, on {world} ranks, the ring itself is checked against one process below.""")


def differences(world: int, is_causal: bool, load_balance: bool) -> float:
    """Ring attention against one process's SDPA on the whole sequence, float64: the largest
    difference of this rank's output and of its parts of dq, dk, dv."""
    whole = [t.requires_grad_() for t in qkv(16 * world, torch.float64, batch=2, seed=1)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=is_causal)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2)).double()
    expected.backward(grad)
    local = [shard_sequence(t, 2, load_balance=load_balance).detach() for t in whole]
    local = [t.requires_grad_() for t in local]
    out = ring_attention(*local, is_causal=is_causal, load_balance=load_balance)
    out.backward(shard_sequence(grad, 2, load_balance=load_balance))
    pairs = [(out, expected)] + [(t.grad, w.grad) for t, w in zip(local, whole)]
    gaps = [(a - shard_sequence(b, 2, load_balance=load_balance)).abs().max() for a, b in pairs]
    gap = torch.stack(gaps).max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 15: long sequences.")
    parser.add_argument(
        "--link",
        type=Link.parse,
        default=Link.parse("alpha=1ms,bandwidth=1gbit"),  # LINK, the model's
        help="the simulated link section 3 times both designs on (none: the bare machine)",
    )
    args = parser.parse_args()
    env = init_distributed()
    world, rank = env.world_size, env.rank
    torch.set_num_threads(1)
    checks: dict[str, bool] = {}
    say(f"Chapter 15: long sequences on W = {world} ranks")
    section_growth(checks)
    section_ring(world, rank, checks)
    section_bytes(world, checks)
    if args.link is not None:
        section_link(world, args.link, checks)
    section_sequence_parallel(world, rank, checks)
    section_gpt(world)

    section("6. Checks")
    say("  Ring attention against one process's SDPA on the whole sequence, float64:")
    for is_causal in (False, True):
        for load_balance in (False, True):
            gap = differences(world, is_causal, load_balance)
            name = f"causal={is_causal}, load_balance={load_balance}"
            say(f"    {name:<36} out, dq, dk, dv: largest difference {gap:.1e}")
            checks[f"ring = SDPA ({name})"] = gap <= 1e-12
    failed = [name for name, passed in checks.items() if not passed]
    say(
        f"  {len(checks) - len(failed)} of {len(checks)} claims hold"
        + (f"; FAILED: {failed}" if failed else "")
    )
    assert not failed, failed
    dist.barrier()
    say(f"Verified on {world} ranks: ring attention is one process's, at the formula's bytes;")
    say("load-balanced ranks do equal causal work; sequence parallelism divides LayerNorm's by W.")
    end_chapter()


if __name__ == "__main__":
    main()
