"""miniddp.plan's terms are the library's formulas, the ones the chapters verify; and a planted
error in any of them (the bubble without v, TP's bytes without 2(t-1)/t, the activations
without sequence parallelism's 1/t) is caught. Then the command line: its JSON, its refusals.

Pure Python, one process, no timing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from miniddp.models.gpt import GPT, GPTConfig
from miniddp.models.gpt_activations import korthikanti_bytes, megatron_layer_bytes
from miniddp.observe.link import wire_bytes
from miniddp.pipeline.bubble import bubble_formula, bubble_fraction, held_formula, peak_held, replay
from miniddp.pipeline.interleaved import interleaved_order
from miniddp.pipeline.schedule import Schedule1F1B
from miniddp.plan import Layout, evaluate
from miniddp.plan import memory_terms as memory_module
from miniddp.plan import time_terms as time_module
from miniddp.plan.__main__ import main
from miniddp.plan.clusters import A100, H100
from miniddp.plan.shapes import PRESETS, Transformer, gpt
from miniddp.sharding.memory import Formula

GPT_1T = gpt("1T", 128, 25600, 160, 51_200)
SMALL = gpt("small", 8, 1024, 16, 51_200)


def terms(plan, kind: str) -> dict[str, float]:
    return {term.name: term for term in getattr(plan, kind)}


# The activations: Korthikanti's, as chapter 11c prints them, split by TP and by SP's 1/t.


def activation_errors(model: Transformer, seq: int, batch: int) -> list[str]:
    """Where the plan's activations a layer differ from the verified ones: korthikanti_bytes
    (chapter 11c) at t = 1; divided by t with sequence parallelism; Korthikanti's equation 2,
    sbh(10 + 24/t + 5as/ht), without it."""
    config = GPTConfig(model.vocab, seq, model.hidden, 1, model.heads)
    whole = korthikanti_bytes(config, batch)
    s, b, h, a = seq, batch, model.hidden, model.heads
    errors = []
    for tp in (1, 2, 4, 8):
        layout = Layout(tp, 1, 1, 1, microbatch=batch, recompute="none")
        for cluster, expected in (
            (replace(H100, causal_half=False), whole / tp),
            (A100, s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))),
        ):
            got = memory_module.layer_activations(model, cluster, layout, seq, "none")
            if not got == pytest.approx(expected, rel=1e-12):
                errors.append(f"tp={tp} sp={cluster.sequence_parallel}: {got} != {expected}")
    return errors


def test_activations_are_korthikantis_with_sequence_parallelisms_one_over_t():
    assert activation_errors(GPT_1T, 2048, 1) == []
    assert activation_errors(SMALL, 1024, 2) == []


def test_activations_without_sequence_parallelisms_one_over_t_are_caught(monkeypatch):
    def planted(*args, **kwargs):
        return megatron_layer_bytes(*args, **{**kwargs, "sequence_parallel": False})

    monkeypatch.setattr(memory_module, "megatron_layer_bytes", planted)
    assert activation_errors(GPT_1T, 2048, 1)


def test_flash_and_selective_recomputation_keep_no_scores_and_full_keeps_the_input():
    s, b, h, a = 2048, 1, 4096, 32
    with_scores = megatron_layer_bytes(s, b, h, a)
    assert with_scores - megatron_layer_bytes(s, b, h, a, flash=True) == 5 * a * s * s * b
    assert megatron_layer_bytes(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert megatron_layer_bytes(s, b, h, a, tp=8, sequence_parallel=True, recompute="full") == (
        2 * s * b * h / 8
    )


# The pipeline: the bubble and what a rank holds, from the schedules' own orders.


def test_held_formula_is_peak_held_of_the_schedules_orders():
    for p in range(2, 7):
        for m in range(1, 19):
            for rank in range(p):
                stage = SimpleNamespace(num_stages=p, stage_index=rank)
                order = Schedule1F1B.order(SimpleNamespace(n_microbatches=m, stage=stage))
                assert peak_held(order) == held_formula(p, m, 1, rank)
                for v in (2, 3):
                    if m <= p or m % p == 0:
                        assert peak_held(interleaved_order(rank, p, v, m)) == held_formula(
                            p, m, v, rank
                        )


def bubble_errors() -> list[str]:
    """Where the plan's bubble share differs from the replayed interleaved orders'."""
    errors = []
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 4, 4), (8, 16, 2)):
        orders = [interleaved_order(rank, p, v, m) for rank in range(p)]
        replayed = bubble_fraction(replay(orders))
        layers = p * v * 2
        model = gpt("pipe", layers, 512, 8, 1024)
        layout = Layout(1, p, 1, 1, v=v, microbatch=1)
        plan = evaluate(model, H100, layout, 512, m, p)
        idle = terms(plan, "time")["bubble"].value
        busy = terms(plan, "time")["compute"].value
        if not idle / (idle + busy) == pytest.approx(replayed, abs=1e-12):
            errors.append(f"p={p} m={m} v={v}: {idle / (idle + busy)} != replayed {replayed}")
    return errors


def test_the_bubble_is_the_replayed_schedules():
    assert bubble_errors() == []


def test_a_bubble_without_v_is_caught(monkeypatch):
    monkeypatch.setattr(time_module, "bubble_formula", lambda p, m, v=1: bubble_formula(p, m))
    assert bubble_errors()


# TP's bytes: the ring's 2(t-1)/t n (chapters 13 and 16 count them on the simulated link).


def tp_errors() -> list[str]:
    errors = []
    cluster = replace(H100, nvlink_latency=0.0, tp_overlap=False)
    for tp in (2, 4, 8):
        layout = Layout(tp, 1, 1, 1, microbatch=1)
        plan = evaluate(SMALL, cluster, layout, 1024, 4, tp)
        token_bytes, loss_bytes = 2 * 1024 * SMALL.hidden, 4 * 1024
        # 4 microbatches: 4 all-reduces a layer; at the ends the embedding's and the output
        # layer's of a token's width, and the vocabulary-parallel loss's 3 of a number a token
        a_microbatch = (4 * SMALL.layers + 2) * wire_bytes("all_reduce", token_bytes, tp)
        a_microbatch += 3 * wire_bytes("all_reduce", loss_bytes, tp)
        expected = 4 * a_microbatch
        got = terms(plan, "time")["tp"].value * cluster.nvlink_bandwidth
        if not got == pytest.approx(expected, rel=1e-9):
            errors.append(f"tp={tp}: {got} bytes on the wire != {expected}")
    return errors


@pytest.mark.parametrize("tied", [True, False])
def test_a_pipeline_pays_its_step_check_and_a_tied_embeddings_all_reduce(tied):
    """Besides 2·v·m sends, once a step: the pipeline's check of its inputs, each stage's
    CheckRow of int64s in one all-reduce (pipeline/step_checks.py), and a tied embedding's
    gradient (GPT's, not Llama's) all-reduced between the first and last stage; what bench
    plan counted crossing the link."""
    from miniddp.pipeline.step_checks import CheckRow

    model = SMALL if tied else replace(SMALL, biases=False)
    cluster = replace(H100, nvlink_latency=0.0, overlap=False)
    plan = evaluate(model, cluster, Layout(1, 2, 1, 1, microbatch=1), 1024, 4, 2)
    token_bytes = 2 * 1024 * model.hidden
    wire = 2 * 4 * token_bytes  # 2 sends a microbatch, 4 microbatches
    wire += wire_bytes("all_reduce", 8 * len(CheckRow._fields) * 2, 2)
    wire += wire_bytes("all_reduce", 4 * model.embedding_parameters, 2) if tied else 0
    got = terms(plan, "time")["pp"].value * cluster.nvlink_bandwidth
    assert got == pytest.approx(wire, rel=1e-9)


def test_element_bytes_are_what_tp_sends_a_token():
    """This machine's bench runs float32: its TP messages are twice bf16's."""
    cluster = replace(H100, nvlink_latency=0.0, tp_overlap=False)
    layout = Layout(2, 1, 1, 1, microbatch=1)
    bf16, fp32 = (
        terms(evaluate(SMALL, replace(cluster, element_bytes=n), layout, 1024, 4, 2), "time")
        for n in (2, 4)
    )
    loss = 4 * 3 * wire_bytes("all_reduce", 4 * 1024, 2) / cluster.nvlink_bandwidth  # fp32 both
    assert fp32["tp"].value - loss == pytest.approx(2 * (bf16["tp"].value - loss), rel=1e-9)


def test_the_hosts_time_outside_the_layers_is_paid_once_a_microbatch():
    layout = Layout(1, 2, 1, 4, microbatch=4)
    base = terms(evaluate(SMALL, H100, layout, 1024, 64, 8), "time")["compute"].value
    slow = replace(H100, ends_overhead=1e-3)
    compute = terms(evaluate(SMALL, slow, layout, 1024, 64, 8), "time")["compute"].value
    assert compute - base == pytest.approx((64 // 4 // 4) * 1e-3)


def test_alpha_once_pays_one_alpha_a_collective_where_a_ring_pays_one_a_step():
    """The simulated link charges alpha once a collective (observe/link.py); NCCL's ring, once a
    step: 2(t-1) for an all-reduce."""
    cluster = replace(H100, nvlink_bandwidth=1e30, tp_overlap=False)
    layout = Layout(4, 1, 1, 1, microbatch=1)
    for once, steps in ((False, 2 * (4 - 1)), (True, 1)):
        plan = evaluate(SMALL, replace(cluster, alpha_once=once), layout, 1024, 4, 4)
        collectives = 4 * (4 * SMALL.layers + 5)  # 4 a layer and 5 at the ends, 4 microbatches
        alpha = cluster.nvlink_latency
        assert terms(plan, "time")["tp"].value == pytest.approx(collectives * steps * alpha)


def test_a_layers_host_time_is_paid_per_layer_and_microbatch():
    layout = Layout(1, 2, 1, 4, microbatch=1)
    base = terms(evaluate(SMALL, H100, layout, 1024, 16, 8), "time")["compute"].value
    slow = replace(H100, layer_overhead=1e-3)
    compute = terms(evaluate(SMALL, slow, layout, 1024, 16, 8), "time")["compute"].value
    microbatches, layers = 16 // 4, SMALL.layers // 2
    assert compute - base == pytest.approx(microbatches * layers * 1e-3)


def test_tp_sends_the_rings_two_t_minus_one_over_t():
    assert tp_errors() == []


def test_tp_bytes_without_two_t_minus_one_over_t_are_caught(monkeypatch):
    def planted(collective, algorithm, nbytes, world_size):
        return 1, nbytes  # the whole tensor once: no ring

    monkeypatch.setattr(time_module, "schedule", planted)
    assert tp_errors()


# The states: sharding.memory.Formula, which chapters 11, 11c, 13 and 16 measure to the byte.


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_are_the_sharding_formula(zero):
    layout = Layout(2, 1, 1, 4, zero=zero)
    plan = evaluate(SMALL, replace(A100, max_zero=3), layout, 1024, 8, 8)  # MiniDDP's ZeRO
    held = terms(plan, "memory")
    stage = memory_module.ZERO_STAGES[zero]
    elements = memory_module.stage_elements(SMALL, layout)
    tensors = memory_module.TENSORS_PER_LAYER * SMALL.layers + 2
    dtype = None if zero == 3 else torch.bfloat16
    formula = Formula(stage, int(elements), tensors, 4, zero < 2, dtype).expected()
    states = ("parameters", "gradients", "optimizer_state")
    assert sum(held[name].value for name in states) == formula.total - formula.compute_copies
    if zero < 3:
        assert held["compute_copies"].value == formula.compute_copies


def test_a_gpt_layer_is_chapter_13s_twelve_h_squared_plus_thirteen_h_and_the_models():
    h = 128
    assert PRESETS["chapter12"].layer_parameters == 12 * h * h + 13 * h
    real = GPT(GPTConfig(128, 64, h, 4, 4))
    assert PRESETS["chapter12"].layer_parameters == sum(
        p.numel() for p in real.blocks[0].parameters()
    )


def test_flops_are_megatrons_72_and_96_forms():
    model, b, s = GPT_1T, 3072, 2048
    h, n, v = model.hidden, model.layers, model.vocab
    assert model.model_flops(b, s) == pytest.approx(
        72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)), rel=1e-12
    )
    assert model.hardware_flops(b, s, "full") == pytest.approx(
        96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)), rel=1e-12
    )


# The command line: the JSON's keys, and every refusal named.

KEYS = set(
    "tp pp cp dp ep v microbatch zero recompute memory_gib fits step_s tflops_per_gpu "
    "hardware_tflops_per_gpu mfu terms".split()
)


def run(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out + out.err


def test_json_has_the_issues_keys_and_every_term_names_its_source(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["--model", "gpt3-175b", "--seq", "2048", "--global-batch", "1536", "--gpus", "1024"]
    layout_flag = ["--layout", "tp=8,pp=8,cp=1,dp=16"]
    code, out = run(capsys, *argv, "--gpu", "a100", *layout_flag, "--json", str(path))
    assert code == 0, out
    (layout,) = json.loads(path.read_text())["layouts"]
    assert KEYS <= set(layout)
    assert (layout["tp"], layout["pp"], layout["cp"], layout["dp"]) == (8, 8, 1, 16)
    for kind in ("memory", "time"):
        assert all(term["source"] for term in layout["terms"][kind].values())
    assert "not verified by a chapter" in out


@pytest.mark.parametrize(
    "layout, gpus, seq, says",
    [
        ("tp=8,pp=8,cp=1,dp=8", 1024, 2048, "not the 1024 GPUs"),
        ("tp=5,pp=8,cp=1,dp=16", 640, 2048, "does not divide 96 heads"),
        ("tp=8,pp=5,cp=1,dp=16", 640, 2048, "do not divide into pp·v"),
        ("tp=8,pp=8,cp=3,dp=4", 768, 2048, "not divisible by 2·cp"),
        ("tp=1,pp=1,cp=1,dp=1024,zero=0,recompute=none", 1024, 2048, "does not fit"),
    ],
)
def test_bad_layouts_are_refused_with_the_fix(capsys, layout, gpus, seq, says):
    argv = ["--model", "gpt3-175b", "--seq", str(seq), "--global-batch", "3072"]
    code, out = run(capsys, *argv, "--gpus", str(gpus), "--gpu", "h100", "--layout", layout)
    assert code == 2 and says in out, out
    if says == "does not fit":
        assert "GiB over" in out and "largest term is" in out


def test_bench_plan_refuses_a_run_it_cannot_price():
    from miniddp.instruments.bench.plan import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--link", "none"])
    with pytest.raises(SystemExit):
        parse_args(["--global-batch", "12"])  # not divisible by dp = 8
