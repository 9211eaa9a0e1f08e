"""Chapter 16: 3-D parallelism, what each rank holds. Chapter 12's GPT on 8 ranks as (pp, dp, tp)
= (2, 2, 2): tensor parallelism inside each pair, a pipeline of two stages, two data-parallel
replicas of it all.

    NPROC=8 ./launch.sh tutorials/16_three_d_parallel.py     (torchrun --nproc_per_node=8 ...)
    ... --steps 2                                               the quick run
    ... --precision bf16                                        and the 3-D run in bf16 too

Chapters 13 and 14 each cut the model one way. Real training cuts it three ways at once, on one
grid of ranks (the Ultra-Scale Playbook's "3-D parallelism", torchtitan's `parallelize_llama`):

    1. the mesh and its groups      init_device_mesh("cpu", (2, 2, 2), ("pp", "dp", "tp"))
    2. what each rank holds         parameters, gradients, buckets, Adam, activations: counted
                                    against the formulas
    3. the same training            the loss of one process and of DP alone, step by step
    4. bf16 (--precision bf16)      the 3-D run again, bf16 compute on fp32 masters

All of it through one call, miniddp.parallelize.parallelize (tensor parallelism, then the
pipeline split, then MiniDDP; read it first). The formulas are the library's,
miniddp/parallelize_formulas.py; tests/test_three_d_audit.py checks every term of them on every
rank of every way to cut 4 ranks, and (-m slow) 8. Chapter 16b goes on with what each rank
sends, and which layout wins.

Any other number of ranks is refused, naming the command. Measured on 2 cores shared with other
jobs (load average 30-50): the default run with --precision bf16 took 25 s from the first line
to the last, 47 s with torchrun and 8 processes importing torch; --steps 2 without bf16, 19 s.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import fmt_bytes, say, say_all_ranks, say_prose, section
from three_d_setup import (
    DP_ONLY,
    FIGURE,
    LEARNING_RATE,
    THREE_D,
    WINDOWS,
    WORLD,
    Run,
    end_with_checks,
    gather,
    global_losses,
    mesh_of,
    one_process,
    start,
    train,
)

from miniddp import MixedPrecision
from miniddp.instruments.bench.options import whole_number
from miniddp.instruments.figures.three_d import groups_of
from miniddp.models.gpt import GPT, GPTConfig
from miniddp.parallelize import AXES
from miniddp.parallelize_formulas import activation_formula, memory_formula, stage_elements
from miniddp.sharding import ddp_compute_copies

# One process and the parallel runs add in other orders (split matmuls, sums over ranks):
# float32 rounding, a little magnified by AdamW's division by the root of its second moment.
LOSS_TOLERANCE = 1e-5
PARAMETER_TOLERANCE = 1e-4
# --precision bf16: its loss against the fp32 run's, each step. bf16 keeps 8 significant bits,
# so the logits round by up to 2^-9 relative, about 8e-3 nats at the first step's loss near
# 4.4; the runs then take slightly other AdamW steps. Measured over 8 steps: at most 2.1e-3.
BF16_LOSS_TOLERANCE = 0.01


def ascii_mesh(groups: dict[str, list[list[int]]]) -> str:
    """The grid as mesh.py's docstring draws it, with every axis's groups beside it."""
    labels = {"tp": "TP groups, a row:", "dp": "DP groups, a column:", "pp": "PP groups, pages:"}
    beside = [
        f"{labels[axis]:<21}" + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[axis])
        for axis in ("tp", "dp", "pp")
    ]
    lines = [" " * len("    pp=0  dp=0 [") + "".join(f"{f'tp={t}':>5}" for t in range(THREE_D.tp))]
    for p, page in enumerate(torch.arange(WORLD).view(THREE_D.shape).tolist()):
        for d, row in enumerate(page):
            cells = "".join(f"{rank:>5}" for rank in row)
            lines.append(f"    {f'pp={p}' if d == 0 else '':<4}  dp={d} [{cells}  ]")
    for number, text in enumerate(beside, start=1):
        lines[number] += f"      {text}"
    return "\n".join(lines)


def section_mesh(mesh) -> bool:
    section("1. The mesh and its groups")
    groups = groups_of(THREE_D.shape)
    say_prose("""\
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp")) lays the
        8 ranks out as torch does, torch.arange(8).view(2, 2, 2), the last axis fastest: rank
        = 4 pp + 2 dp + tp. Along an axis, a rank's group is the ranks that differ from it in
        that coordinate only:
        """)
    say(f"\n{ascii_mesh(groups)}\n")
    say_prose("""\
        parts = parallelize(gpt, mesh, n_microbatches=4) then applies, in this order: tensor
        parallelism over mesh["tp"] (Megatron's plan, chapter 13), the pipeline split over
        mesh["pp"] (1F1B, chapter 14: stage s keeps blocks 2s and 2s + 1, the first stage the
        embeddings too, the last the final norm and the head), and MiniDDP over mesh["dp"],
        around exactly what the rank holds. TP takes the fastest axis: consecutive ranks share
        a machine and its fast link, and TP talks inside every layer. Every rank, asked for its
        groups:""")
    stage = mesh.get_coordinate()[0]
    mine = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in AXES}
    ends = "the embeddings" if stage == 0 else "the final norm, the head"
    say_all_ranks(
        f"{tuple(mesh.get_coordinate())}: TP {mine['tp']}, DP {mine['dp']}, PP {mine['pp']}; "
        f"blocks {2 * stage} and {2 * stage + 1}, {ends}"
    )
    say(f"  (the mesh and one step on it, drawn by chapter 16b: {FIGURE})")
    return all(gather(all(mine[name] in groups[name] for name in AXES)))


def section_holdings(c: GPTConfig, characters: int, run: Run, dp_only: Run) -> bool:
    section("2. What each rank holds")
    h, v, t, p, layers = c.width, c.vocab_size, THREE_D.tp, THREE_D.pp, c.layers
    block = (12 * h * h + 7 * h) // t + 6 * h
    first, last = (stage_elements(c, THREE_D, s) for s in (0, 1))
    whole = stage_elements(c, DP_ONLY, 0)
    say_prose(f"""\
        The GPT: V = {v} (the text's {characters} characters, padded to a multiple of 8 so that
        any TP size splits it), T = {c.context}, H = {h}, L = {layers} blocks of {c.heads}
        heads. A block is Ψ_b = 12H² + 13H = {12 * h * h + 13 * h:,} elements; TP splits
        12H² + 7H of it over t ranks and keeps 6H whole (rowwise biases, LayerNorms), and the
        pipeline gives each stage L/p blocks. So a rank of stage s holds, with t = {t}, p = {p}:

            first stage  VH/t + TH + (L/p)((12H² + 7H)/t + 6H) = {first:,}
            last stage   (L/p)((12H² + 7H)/t + 6H) + 2H + VH/t = {last:,}
                         (L/p = {layers // p} blocks of {block:,} on either)
            DP alone     VH + TH + L Ψ_b + 2H = {whole:,}, on every rank

        The last stage's VH/t is its own copy of the tied embedding: the first stage embeds,
        the last projects, and after backward their gradients are summed. In bytes, as chapter
        08 counts them from the storages: 4 of weight, 4 of gradient, 4 of MiniDDP's bucket and
        8 of Adam's two moments an element, and a 4-byte step count a tensor
        (memory_formula). Activations: the bytes autograd saves for backward, counted while
        the step runs, at their peak (PeakSavedActivations); per microbatch of
        N = {THREE_D.tokens} tokens and per block

            4N(4H + 4) + 4N(12H + a)/t bytes     (what TP keeps whole, then this rank's heads
                                                   and 4H/t of the MLP; a = {c.heads} heads)

        plus the token ids on the first stage and the loss's softmax slice on the last
        (activation_formula), times the microbatches 1F1B holds at once, min(m, p - s)
        (chapter 14). Measured on every rank, in the step after the first:""")
    stage, measured = run.stage, run.measured
    per_microbatch, held = activation_formula(c, THREE_D, stage)
    elements = sum(param.numel() for param in run.parts.parameters())
    exact = (
        elements == stage_elements(c, THREE_D, stage)
        and measured.memory == memory_formula(c, THREE_D, stage)
        and (measured.activations, measured.held) == (per_microbatch * held, held)
        and dp_only.measured.memory == memory_formula(c, DP_ONLY, 0)
    )
    where = tuple(run.parts.mesh.get_coordinate())
    rows = gather((where, elements, measured.memory, measured.activations, measured.held, exact))
    say(
        f"  {'rank':>4} {'(pp,dp,tp)':>10} {'elements':>9} {'weights':>9} {'grads':>9} "
        f"{'bucket':>9} {'Adam':>9} {'activations (B)':>19} formula"
    )
    for rank, (where, elements, memory, activations, peak, same) in enumerate(rows):
        say(
            f"  {rank:>4} {str(where):>10} {elements:>9,} {fmt_bytes(memory.parameters):>9} "
            f"{fmt_bytes(memory.gradients):>9} {fmt_bytes(memory.buckets):>9} "
            f"{fmt_bytes(memory.optimizer_state):>9} {activations:>8,} = {peak} x "
            f"{activations // peak:>6,} {'=' if same else 'differs':>7}"
        )
    alone = dp_only.measured
    say(
        f"  DP alone, (1, 8, 1), every rank: {whole:,} elements, {fmt_bytes(alone.memory.total)} "
        f"of state (3-D: {fmt_bytes(rows[0][2].total)} and {fmt_bytes(rows[-1][2].total)}),\n"
        f"  {alone.activations:,} B of activations for its one window"
    )
    kept = 4 * (4 * h + 4)
    say_prose(f"""\
        Each 3-D rank keeps about a quarter of the model (half of each block's matrices, half
        of the blocks) and of its gradients and optimizer state, where DP alone keeps all of it
        on every rank. Activations per microbatch shrink less: what TP keeps whole, 4N(4H + 4)
        a block, is {kept} of the {kept + 4 * (12 * h + c.heads) // t:,} bytes a token (it is
        what sequence parallelism would split next, chapter 15). The first stage holds two
        microbatches at 1F1B's peak, the last one: its backward starts as soon as its forward
        ends. Every rank's bytes are the formula's, to the byte.""")
    return all(row[-1] for row in rows)


def parameter_gap(run: Run, reference: GPT) -> float:
    """The largest difference between this rank's parameters and the reference's (its TP
    chunk of them; the last stage's tied copy against the embedding)."""
    whole = dict(reference.named_parameters())
    tp, shard = run.layout.tp, run.parts.mesh["tp"].get_local_rank()
    gap = 0.0
    for name, param in run.parts.model.named_parameters():
        expected = whole["token.weight" if name == "head.weight" else name].detach()
        if param.shape != expected.shape:  # a TP shard: cut the reference as TP cut it
            dim = next(d for d in range(param.dim()) if param.shape[d] != expected.shape[d])
            expected = torch.chunk(expected, tp, dim)[shard]
        gap = max(gap, (param.detach() - expected).abs().max().item())
    return gap


def section_training(run: Run, dp_only: Run, reference: tuple[list[float], GPT]) -> dict:
    section("3. The same training")
    say_prose(f"""\
        Dropout is 0.0 here, and must be for this comparison: under TP a rank computes only its
        own heads, so the attention's dropout draws masks of shape (b, a/t, T, T) where one
        process draws (b, a, T, T), from another point of the random stream; a TP run with
        dropout trains as well, but on other masks than one process's. Without dropout, the
        3-D run, DP alone on (1, 8, 1) (MiniDDP over all 8 ranks, a window each) and one
        process on the whole batch of {WINDOWS} windows take the same AdamW steps (lr
        {LEARNING_RATE:g}), up to rounding. The loss of each step, over the whole batch (on
        3-D, the mean of the last stage's replicas):""")
    three, alone = global_losses(run), global_losses(dp_only)
    losses, model = reference
    say(
        f"  {'step':>4} {'one process':>12} {'3-D':>10} {'DP alone':>10}   "
        f"{'|3-D - one|':>11} {'|DP - one|':>10} {'|3-D - DP|':>10}"
    )
    for step, (one, a, b) in enumerate(zip(losses, three, alone)):
        say(
            f"  {step:>4} {one:>12.6f} {a:>10.6f} {b:>10.6f}   {abs(a - one):>11.1e} "
            f"{abs(b - one):>10.1e} {abs(a - b):>10.1e}"
        )
    to_one = max(abs(a - one) for a, one in zip(three, losses))
    to_dp = max(abs(a - b) for a, b in zip(three, alone))
    gaps = gather(parameter_gap(run, model))
    say(
        f"  after {len(losses)} steps, every rank's parameters (its shards) against one "
        f"process's:\n  largest difference {max(gaps):.1e} "
        f"(ranks 0-7: {', '.join(f'{gap:.0e}' for gap in gaps)})"
    )
    say_prose(f"""\
        The 3-D run and one process agree within {to_one:.0e} a step, the 3-D run and DP alone
        within {to_dp:.0e}: the same training, cut three ways. The differences are float32's
        rounding: TP's matmuls on split shapes, sums over ranks in another order.""")
    return {
        f"3-D loss within {LOSS_TOLERANCE:g} of one process's, each step": to_one <= LOSS_TOLERANCE,
        f"3-D loss within {LOSS_TOLERANCE:g} of DP alone's, each step": to_dp <= LOSS_TOLERANCE,
        f"parameters within {PARAMETER_TOLERANCE:g} of one process's": max(gaps)
        <= PARAMETER_TOLERANCE,
    }


def section_bf16(c: GPTConfig, mesh, batches: list[torch.Tensor], run: Run) -> dict[str, bool]:
    section("4. The same 3-D run in bf16, on fp32 masters")
    say_prose("""\
        parallelize(gpt, mesh, n_microbatches=4, mixed_precision=MixedPrecision(torch.bfloat16))
        trains the same layout in bf16 (miniddp/parallelize.py's docstring): the masters stay
        fp32, and every forward computes with a bf16 copy of them. TP's all-reduces then sum
        bf16 partial products, the activations between the stages travel in bf16, the loss is
        computed in fp32 from the logits cast up, and the gradients are summed in fp32: over
        the microbatches, the replicas, and for the tied embedding over the first and last
        stage. The loss of each step, the same windows in both runs:""")
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    bf16 = train(THREE_D, mesh, c, batches, policy)
    fp32_losses, bf16_losses = global_losses(run), global_losses(bf16)
    say(f"  {'step':>4} {'fp32':>10} {'bf16':>10} {'bf16 - fp32':>12}")
    for step, (a, b) in enumerate(zip(fp32_losses, bf16_losses)):
        say(f"  {step:>4} {a:>10.6f} {b:>10.6f} {b - a:>+12.2e}")
    gap = max(abs(a - b) for a, b in zip(fp32_losses, bf16_losses))
    expected = memory_formula(c, THREE_D, bf16.stage, policy)
    masters = {str(p.dtype) for p in bf16.parts.parameters()}
    copies = {str(t.dtype) for t in ddp_compute_copies(bf16.parts.module)}
    fp32_held, bf16_held = run.measured, bf16.measured
    same = bf16_held.memory == expected
    mine = (bf16.stage, fp32_held.memory, bf16_held.memory, same, masters, copies)
    rows = gather((*mine, fp32_held.activations, bf16_held.activations))
    say_prose("""\
        The bytes of one rank, from the storages in the step after the first: bf16 keeps all
        of fp32's and adds 2 bytes of bf16 copy an element (memory_formula with the policy); it
        saves in activations, which autograd holds in bf16:""")
    say(
        f"  {'rank':>4} {'stage':>5} {'fp32 total':>11} {'bf16 total':>11} {'of it copies':>13} "
        f"{'formula':>8} {'activations fp32':>17} {'bf16':>9}"
    )
    for rank, (s, m32, m16, same, _, _, a32, a16) in enumerate(rows):
        say(
            f"  {rank:>4} {s:>5} {fmt_bytes(m32.total):>11} {fmt_bytes(m16.total):>11} "
            f"{fmt_bytes(m16.compute_copies):>13} {'=' if same else 'differs':>8} "
            f"{fmt_bytes(a32):>17} {fmt_bytes(a16):>9}"
        )
    say_prose(f"""\
        The largest difference in the loss is {gap:.1e} nats, within the {BF16_LOSS_TOLERANCE}
        a step that bf16's 8-bit rounding allows here: what bf16 costs, for the bytes it saves
        in activations (and, on hardware with bf16 units, time; this CPU has none). Outside
        forward and backward every parameter is its fp32 master: the optimizer, clipping and
        a checkpoint never see bf16.""")
    return {
        f"bf16 loss within {BF16_LOSS_TOLERANCE} of fp32's, each step": gap <= BF16_LOSS_TOLERANCE,
        "bf16 memory per rank = the formula (fp32's + 2 bytes of copy an element)": all(
            row[3] for row in rows
        ),
        "bf16: parameters fp32 outside forward, copies bf16": all(
            row[4] == {"torch.float32"} and row[5] == {"torch.bfloat16"} for row in rows
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 16: 3-D parallelism on 8 ranks.")
    parser.add_argument(
        "--steps", type=whole_number(at_least=2), default=8, help="AdamW steps (default 8)"
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: train the 3-D layout again, bf16 on fp32 masters, beside fp32 (section 4)",
    )
    args = parser.parse_args()
    batches, corpus, c, started = start("16_three_d_parallel.py", "15", args.steps)
    say_prose(f"""\
        Chapter 16: 3-D parallelism, chapter 12's GPT on {WORLD} ranks as (pp, dp, tp) =
        {THREE_D.shape}: {args.steps} steps of {WINDOWS} windows of {c.context} characters each,
        from chapter 12's text ({corpus.source}).""")
    mesh = mesh_of(THREE_D)
    checks = {"every rank's groups are the ones drawn": section_mesh(mesh)}
    reference = one_process(c, batches)  # on every rank: it is small
    run = train(THREE_D, mesh, c, batches)
    dp_only = train(DP_ONLY, mesh_of(DP_ONLY), c, batches)
    characters = len(corpus.vocabulary)
    checks["memory per rank = the formulas"] = section_holdings(c, characters, run, dp_only)
    checks |= section_training(run, dp_only, reference)
    if args.precision == "bf16":
        checks |= section_bf16(c, mesh, batches, run)

    end_with_checks(
        checks,
        started,
        "each rank holds what the formulas say, and 3-D trains as one process and as DP alone "
        "do. Chapter 16b: what each rank sends, and which layout wins on which link.",
    )


if __name__ == "__main__":
    main()
