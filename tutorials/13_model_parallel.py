"""Chapter 13: data parallelism against model parallelism, on one model.

    torchrun --nproc_per_node=2 tutorials/13_model_parallel.py [--link alpha=1ms,bandwidth=1gbit]

The video course opens with "Data Parallelism vs Model Parallelism". Everything before this
chapter was the first: every rank holds the whole model and a slice of the batch. This chapter
splits the model instead, the Megatron way (tensor parallelism, miniddp/tensor_parallel/), and
puts the two side by side on the same stack of transformer blocks:

    1. what each rank holds     the parameters a rank keeps, counted, against the formulas
    2. the split, checked       tensor-parallel outputs and gradients against one process
    3. what crosses the wire    per block, TP: 2 all-reduces forward + 2 backward of B·T·H;
                                per step, DP: one all-reduce of the Ψ gradients
    4. who wins, measured       both on the same simulated link, at two model and batch sizes
    5. the vocabulary           the embedding and the loss split by vocabulary, logits never
                                gathered
    6. both at once             DP x TP on a mesh, and why TP wants the fast link
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from common import add_link_option, end_chapter, fmt_bytes, say, say_all_ranks, say_prose, section
from torch import nn
from torch.nn import functional as F

from miniddp import MiniDDP
from miniddp.instruments.bench.paired import time_interleaved
from miniddp.instruments.bench.workloads import Workload
from miniddp.instruments.link_group import simulated_link
from miniddp.job.env import init_distributed
from miniddp.mesh import DeviceMesh, init_device_mesh
from miniddp.observe.link import Link, wire_bytes
from miniddp.sharding import MemoryPerRank, ddp_buckets, measure_memory
from miniddp.tensor_parallel import (
    TinyGPT,
    TransformerBlock,
    parallelize_module,
    plan_for,
    vocab_parallel_cross_entropy,
)

# A fast-ish network: 1 ms a collective, 1 Gbit/s. Latency matters, because tensor parallelism
# talks four times a block; bandwidth matters, because data parallelism sends every gradient.
CHAPTER_LINK = "alpha=1ms,bandwidth=1gbit"
HEADS = 4
FIGURE = Path("docs/figures/13_tensor_parallel.png")
TOLERANCE = 1e-5  # shard-shaped matmuls and W-term sums round differently (tests say more)
ITERS = 4


@dataclass(frozen=True)
class Size:
    """One model and one global batch: `layers` blocks of width H, batch x length tokens."""

    name: str
    width: int
    layers: int
    batch: int
    length: int

    @property
    def tokens(self) -> int:
        return self.batch * self.length


def build(size: Size) -> nn.Sequential:
    """The same blocks on every rank: seeded, with fused q/k/v (one f per attention)."""
    torch.manual_seed(0)
    blocks = (TransformerBlock(size.width, HEADS, fused_qkv=True) for _ in range(size.layers))
    return nn.Sequential(*blocks)


def global_batch(size: Size) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (size.batch, size.length, size.width)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def tensor_parallel(size: Size, mesh: DeviceMesh | None = None) -> nn.Sequential:
    """The blocks, each split the Megatron way over `mesh` (None: every rank)."""
    model = build(size)
    plan: dict = {}
    for index, block in enumerate(model):
        plan |= plan_for(block, str(index))
    return parallelize_module(model, mesh, plan)


def data_parallel(size: Size) -> MiniDDP:
    return MiniDDP(build(size))


def step_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """TP computes the whole global batch on every rank; DP its own 1/W of the rows."""
    x, y = batch
    if isinstance(model, MiniDDP):
        share = len(x) // dist.get_world_size()
        rows = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
        x, y = x[rows], y[rows]
    return F.mse_loss(model(x), y)


@contextmanager
def counting_all_reduces(sizes: list[int]) -> Iterator[None]:
    """Append the element count of every dist.all_reduce this rank issues inside the block."""
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def local_elements(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def block_formulas(width: int, layers: int, world: int) -> tuple[int, int]:
    """Elements per rank, DP and TP. A block: qkv 3H² + 3H, out H² + H, up 4H² + 4H, down 4H² +
    H, two LayerNorms 4H: Ψ = 12H² + 13H. TP splits the weights and the colwise biases
    (12H² + 7H) and replicates the rest (the rowwise biases and the LayerNorms: 6H)."""
    h = width
    return layers * (12 * h * h + 13 * h), layers * ((12 * h * h + 7 * h) // world + 6 * h)


def memory_in_training(size: Size, design: str) -> MemoryPerRank:
    """This rank's bytes before its second AdamW step (Adam's state exists from the first),
    counted from the storages (miniddp.sharding.measure_memory, chapter 11)."""
    module = data_parallel(size) if design == "DP" else tensor_parallel(size)
    model = module.module if design == "DP" else module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        step_loss(module, global_batch(size)).backward()
        memory = measure_memory(model.parameters(), optimizer, ddp_buckets(module))
        optimizer.step()
        optimizer.zero_grad()
    return memory


def adam_formula(elements: int, tensors: int, buckets: bool) -> MemoryPerRank:
    """fp32 AdamW: 4 bytes of weight, 4 of gradient, (DP) 4 of bucket, 8 of moments an element,
    and a 4-byte step count a tensor."""
    return MemoryPerRank(
        4 * elements, 4 * elements, 4 * elements * buckets, 8 * elements + 4 * tensors
    )


def section_holdings(size: Size, world: int) -> bool:
    section("1. What each rank holds")
    say_prose("""\
        Data parallelism (DP, chapters 02-10) gives every rank the whole model and 1/W of the
        batch. Tensor parallelism (TP) gives every rank the whole batch and 1/W of every big
        weight: q, k, v and the MLP's first layer keep a block of output rows (colwise), the
        attention's output projection and the MLP's second layer a block of input columns
        (rowwise); the LayerNorms and the rowwise biases stay whole on every rank.""")
    dp_formula, tp_formula = block_formulas(size.width, size.layers, world)
    tensors = len(list(build(size).parameters()))  # the same count split or not
    say(
        f"  {size.layers} blocks of width H = {size.width}, {HEADS} heads, W = {world}; "
        "elements of parameters per rank, and bytes in AdamW training, counted:"
    )
    exact = True
    for design, formula, what in (
        ("DP", dp_formula, "L(12H² + 13H)"),
        ("TP", tp_formula, "L((12H² + 7H)/W + 6H)"),
    ):
        counted = local_elements(tensor_parallel(size) if design == "TP" else build(size))
        memory = memory_in_training(size, design)
        expected = adam_formula(formula, tensors, buckets=design == "DP")
        exact &= counted == formula and memory == expected
        say(f"  {design}  {counted:>9,} elements (formula {what} = {formula:,})")
        say(
            f"      parameters {fmt_bytes(memory.parameters)}, gradients "
            f"{fmt_bytes(memory.gradients)}, buckets {fmt_bytes(memory.buckets)}, Adam "
            f"{fmt_bytes(memory.optimizer_state)}: {fmt_bytes(memory.total)} "
            f"({'=' if memory == expected else '!='} the formula's {fmt_bytes(expected.total)})"
        )
    say_prose("""\
        TP also splits the activations inside a block (the MLP's B·T·4H hidden is B·T·4H/W a
        rank), where DP splits them by batch; but TP keeps the residual stream B·T·H whole on
        every rank. ZeRO-3 (chapter 11) shards the parameters too, but gathers each layer whole
        to compute it; TP never does: each rank multiplies by its own block only, so no rank
        ever holds a whole weight, and needs no bucket to send its gradients in.""")
    return exact


def scaled_difference(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """max |mine - reference| / (1 + max |reference|): rounding, in units of the tensor's size."""
    mine, reference = mine.detach(), reference.detach()
    return float((mine - reference).abs().max() / (1 + reference.abs().max()))


def gradient_difference(split: nn.Module, whole: nn.Module, shards: int, index: int) -> float:
    """The largest scaled difference of `split`'s gradients from `whole`'s: a sharded one
    against the chunk `index` of `shards` of the whole one, along the dim that shrank."""
    worst, full = 0.0, dict(whole.named_parameters())
    for name, param in split.named_parameters():
        reference = full[name].grad
        if param.shape != reference.shape:
            dim = next(d for d in range(param.dim()) if param.shape[d] != reference.shape[d])
            reference = torch.chunk(reference, shards, dim)[index]
        worst = max(worst, scaled_difference(param.grad, reference))
    return worst


def section_checked(size: Size, world: int, rank: int) -> float:
    section("2. The split, checked against one process")
    say_prose("""\
        Y = X A^T splits by A's rows: rank r computes Y_r = X A_r^T, its slice of Y's columns,
        alone. GELU acts elementwise and attention head by head, so each rank goes on with its
        slice; then Z = Y B^T splits by B's columns: Z = sum_r Y_r B_r^T, one all-reduce (g).
        Backward mirrors it: X fed every rank's slice, so dL/dX is the sum of their parts, one
        all-reduce (f) where X entered. A rank's weight gradients are its chunks of the whole
        ones. Compared with one process computing the whole model (chunk by chunk):""")
    whole, split = build(size), tensor_parallel(size)
    x, y = global_batch(size)
    F.mse_loss(whole(x), y).backward()
    output = split(x)
    F.mse_loss(output, y).backward()
    worst = max(scaled_difference(output, whole(x)), gradient_difference(split, whole, world, rank))
    say(
        f"  largest difference, outputs and every gradient shard: {worst:.1e} of the tensor's "
        f"size (BLAS rounds a shard-shaped matmul differently: not bitwise, within {TOLERANCE})"
    )
    return worst


def section_wire(size: Size, world: int) -> dict[str, list[int]]:
    section("3. What crosses the wire")
    x, y = global_batch(size)
    counted: dict[str, list[int]] = {"TP forward": [], "TP backward": [], "DP step": []}
    split = tensor_parallel(size)
    with counting_all_reduces(counted["TP forward"]):
        loss = F.mse_loss(split(x), y)
    with counting_all_reduces(counted["TP backward"]):
        loss.backward()
    ddp = data_parallel(size)
    with counting_all_reduces(counted["DP step"]):
        step_loss(ddp, (x, y)).backward()
    activation, psi = size.tokens * size.width, local_elements(build(size))
    say(f"  all-reduces a rank issues in one step ({size.tokens} tokens, Ψ = {psi:,}):")
    for name, sizes in counted.items():
        noun = "all-reduce" if len(sizes) == 1 else "all-reduces"
        say(
            f"  {name:<12} {len(sizes):>3} {noun:<11} "
            f"{fmt_bytes(4 * sum(sizes)):>9} "
            f"({', '.join(f'{n:,}' for n in sizes[:4])}{' ...' if len(sizes) > 4 else ''})"
        )
    say_prose(f"""\
        TP: per block g twice forward (after attention, after the MLP) and f twice backward,
        each B·T·H = {activation:,} numbers; DP: the Ψ gradients once a step, in buckets. TP's
        traffic grows with the tokens, DP's with the parameters:

            TP  4 L · B·T·H · 4 bytes     DP  Ψ · 4 ≈ 12 L H² · 4 bytes

        so TP sends fewer bytes exactly when B·T < 3H: few tokens per model copy, a wide
        model. But each TP all-reduce stops the layer that waits for it, 4L times a step,
        while DP's buckets leave during backward (chapter 04). Each rank sends 2(W-1)/W of
        every payload on a ring (chapter 01), for both.""")
    return counted


def predicted_seconds(link: Link, sizes: list[int], world: int) -> float:
    """Time the link is busy for these all-reduces, one after another (no overlap)."""
    return sum(link.seconds(wire_bytes("all_reduce", 4 * n, world)) for n in sizes)


def section_speed(sizes: list[Size], link: Link | None, world: int) -> dict[str, bool]:
    section("4. Who wins, measured on the simulated link")
    if link is None:
        say("  The bare machine (--link none): no speed claims; run with a link to see them.")
        return {}
    say_prose(f"""\
        Both designs on the link {link} (miniddp/observe/link.py: each collective runs, and
        completes when such a link would have delivered it), timed over {ITERS} interleaved steps.
        Predicted: the link's busy time for each design's all-reduces, counted as in section
        3. The rest of a step is compute, and TP's holds one more cost: what it does not split
        (the LayerNorms, the residual adds) every rank repeats on the whole batch, where DP's
        ranks share it.""")
    winners = {}
    for size in sizes:
        x, y = global_batch(size)
        tp_sizes: list[int] = []
        dp_sizes: list[int] = []
        with counting_all_reduces(tp_sizes):
            F.mse_loss(tensor_parallel(size)(x), y).backward()
        with counting_all_reduces(dp_sizes):
            step_loss(data_parallel(size), (x, y)).backward()
        with simulated_link(link):
            models = {"TP": tensor_parallel(size), "DP": data_parallel(size)}
            workload = Workload(size.name, size.name, lambda: None, (x, y), step_loss)
            times = time_interleaved(models, workload, ITERS, warmup=2)
        median_ms = {name: statistics.median(t["wall"]) * 1e3 for name, t in times.items()}
        predicted_ms = {
            "TP": predicted_seconds(link, tp_sizes, world) * 1e3,
            "DP": predicted_seconds(link, dp_sizes, world) * 1e3,
        }
        faster = min(median_ms, key=median_ms.get)
        expected = "TP" if size.tokens < 3 * size.width else "DP"
        winners[size.name] = faster == expected
        say(
            f"  {size.name}: H = {size.width}, L = {size.layers}, B·T = {size.tokens} "
            f"({'<' if expected == 'TP' else '>'} 3H = {3 * size.width}): {expected} expected"
        )
        for name in ("TP", "DP"):
            say(
                f"    {name}  step {median_ms[name]:7.1f} ms   link busy {predicted_ms[name]:6.1f} "
                "ms predicted"
            )
        say(f"    {faster} wins, {max(median_ms.values()) / min(median_ms.values()):.1f}x")
    return winners


def section_vocabulary(world: int) -> float:
    section("5. The vocabulary: embedding and loss, split by rows of V")
    vocab, width, batch, length = 64 * world, 16, 2, 8
    torch.manual_seed(0)
    whole = TinyGPT(vocab, width, HEADS, layers=1, length=length)
    split = TinyGPT(vocab, width, HEADS, layers=1, length=length)
    split.load_state_dict(whole.state_dict())
    parallelize_module(split, None, plan_for(split))
    tokens = torch.randint(vocab, (batch, length + 1), generator=torch.Generator().manual_seed(2))
    reference = F.cross_entropy(whole(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    logits = split(tokens[:, :-1])
    sent: list[int] = []
    with counting_all_reduces(sent):
        loss = vocab_parallel_cross_entropy(logits, tokens[:, 1:])
    say_prose(f"""\
        The token embedding is rowwise: rank r keeps the rows of tokens [r V/W, (r+1) V/W),
        looks up the ones it owns, zeros the rest, and g fills every row in. The output
        projection is colwise: rank r computes the logits of its V/W tokens only, here
        {tuple(logits.shape)} of ({batch}, {length}, {vocab}). The loss
        log sum_v exp(z_v) - z_target is a max, a sum and a pick over v: three all-reduces of
        one number a token ({sent}), never the B·T·V = {batch * length * vocab:,} logits.""")
    difference = scaled_difference(loss, reference)
    say(
        f"  loss {loss.item():.6f}, one process {reference.item():.6f}: difference "
        f"{difference:.1e} of its size (the sum of exp added in W pieces)"
    )
    return difference if sent == [batch * length] * 3 else float("inf")


def dp_by_tp(size: Size, world: int) -> float:
    """Train one step on a (W/2) x 2 mesh: TP in each pair, MiniDDP across the pairs, each pair
    on its rows of the global batch; the largest difference from one process on all of it."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    say_all_ranks(
        f"mesh row {dp_rank} (a replica), column {tp_rank} (a shard): TP with ranks "
        f"{mesh['tp'].mesh.tolist()}, DP with {mesh['dp'].mesh.tolist()}"
    )
    whole, split = build(size), tensor_parallel(size, mesh["tp"])
    replica = MiniDDP(split, process_group=mesh["dp"].get_group())
    x, y = global_batch(size)
    share = len(x) // (world // 2)
    rows = slice(dp_rank * share, (dp_rank + 1) * share)
    F.mse_loss(whole(x), y).backward()
    F.mse_loss(replica(x[rows]), y[rows]).backward()
    return gradient_difference(split, whole, 2, tp_rank)  # a shard: its chunk of the TP column


def section_mesh(size: Size, world: int) -> float | None:
    section("6. Both at once: DP x TP on a mesh")
    grid = torch.arange(8).view(2, 4)  # init_device_mesh's layout: the last axis fastest
    tp_rows, dp_columns = grid.tolist(), grid.T.tolist()
    say_prose(f"""\
        Eight GPUs on two machines, init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp",
        "tp")) (miniddp.mesh, torch's call and layout): ranks are numbered row by row, the
        last axis fastest, and torchrun puts consecutive ranks on one machine.

            machine 0:  {tp_rows[0]}    TP groups {tp_rows}
            machine 1:  {tp_rows[1]}    DP groups {dp_columns}

        A TP group talks 4 times a block, forward and backward, and every layer waits for it:
        it goes inside a machine, on NVLink (hundreds of GB/s). The ranks with the same TP
        index hold the same shards, so they are the replicas DP averages: MiniDDP(model,
        process_group=dp_group), one gradient all-reduce a step that hides behind backward,
        can cross the slower network between machines.""")
    say(f"  The split, drawn: {FIGURE} (python -m miniddp.figures --only 13)")
    if world < 4 or world % 2:
        say("  With 4 ranks (NPROC=4 ./launch.sh tutorials/13_model_parallel.py) this section")
        say("  trains a 2 x 2 mesh; tests/test_tensor_parallel.py does it on every run.")
        return None
    difference = dp_by_tp(size, world)
    say(
        f"  One step on the {world // 2} x 2 mesh, against one process on the whole batch: "
        f"gradient shards within {difference:.1e}"
    )
    return difference


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 13: data vs model parallelism.")
    add_link_option(parser, default_link=CHAPTER_LINK)
    args = parser.parse_args()
    env = init_distributed()
    world = env.world_size
    if HEADS % world:
        raise SystemExit(f"Chapter 13 splits {HEADS} heads: run it on 1, 2 or 4 ranks")
    torch.set_num_threads(1)
    say(f"Chapter 13: data parallelism vs model parallelism on {world} ranks.")
    model_size = Size("model", width=64, layers=2, batch=world, length=8)
    fits = section_holdings(model_size, world)
    difference = section_checked(model_size, world, env.rank)
    counted = section_wire(model_size, world)
    speeds = [
        Size("wide model, few tokens", width=384, layers=2, batch=world, length=4),
        Size("narrow model, many tokens", width=32, layers=2, batch=8 * world, length=64),
    ]
    winners = section_speed(speeds, args.link, world)
    loss_difference = section_vocabulary(world)
    mesh_difference = section_mesh(model_size, world)

    section("Checks")
    activation = model_size.tokens * model_size.width
    assert fits, "a rank's parameters differ from the formulas"
    assert difference <= TOLERANCE, f"TP differs from one process by {difference}"
    assert counted["TP forward"] == [activation] * 2 * model_size.layers
    assert counted["TP backward"] == [activation] * 2 * model_size.layers
    assert sum(counted["DP step"]) == local_elements(build(model_size))
    assert loss_difference <= 1e-6, "the vocabulary-parallel loss is not one process's"
    assert all(winners.values()), f"the byte count did not name the faster design: {winners}"
    assert mesh_difference is None or mesh_difference <= TOLERANCE, "DP x TP is not one process"
    dist.barrier()  # every rank has passed its own checks
    claims = "and where each wins, as the bytes predict" if winners else "(speed: needs --link)"
    say(
        f"Verified on {world} ranks: what each rank holds, what it sends, TP equal to one "
        f"process, {claims}."
    )
    end_chapter()


if __name__ == "__main__":
    main()
