"""torch.compile under ShadowMode: each compiled graph's call is one record, judged against the float64 replay of
its aten graph and held to a budget composed from its ops' (shadow.compiled).

The compiled program computes under shadow what it computes without (the same Inductor code runs); its shadow is
the float64 program run eagerly, to the last few ulps of float64; a correct float32 graph stays within its
budget, and a graph whose lowering rounds to bfloat16 is flagged. Inductor compiles C++ with g++: the models are
tiny, the first run of a test compiles (tens of seconds on 2 cores) and later runs read Inductor's cache.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shadow
from shadow import ShadowMode, _compat
from shadow.compiled.hooks import GRAPHS_KEY
from shadow.records import KERNELS_KEY, Record
from shadow.reportdiff import diff_reports
from shadow.verdict import conclude

from corpus import build, run
from test_corpus import _run, assert_sees_everything
from test_interference import assert_identical

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten


def _graph_records(sm: ShadowMode) -> list:
    return [r for r in sm.report.records if r.op.startswith("compiled.graph")]


def _no_dropout(program):
    """The program with its dropout at p = 0: the float64 program run eagerly draws other random numbers than
    Inductor's kernels, so only a program without random draws can be compared with it."""
    for m in program.model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return program


def _assert_judged(recs: list, phases: list[str]) -> None:
    """One record per graph call, in program order, each replayed and within its composed budget, reading nearly
    float32's 23 bits (measured 21.1-23.0 on Block, the GPT and _attention; a graph's error is its ops' roundings
    passed on, so a few tenths of a bit below a single op's)."""
    assert [str(r.phase) for r in recs] == phases
    for r in recs:
        assert str(r.kind) == "replayed" and r.budget is not None and r.budget.family == "graph", r
        assert not r.over_budget and r.budget.used < 1.0, (r.op, r.budget)
        assert r.local.max_abs > 0 and r.local.effective_bits > 20, (r.op, r.local)


# --- training and evaluation: untouched, every graph judged -----------------------------------------------------
@pytest.mark.parametrize("name", ["block", pytest.param("gpt_masked_fill", marks=pytest.mark.slow)])
def test_compiled_training_is_untouched_and_judged(name):
    """Two steps of a compiled model: bit for bit what the compiled program computes without shadow (outputs,
    parameters, gradients, optimizer state, RNG: the GPT's dropout draws inside Inductor's kernels), every graph call
    judged (the forward graph, then the backward graph, each step), no ShadowWarning."""
    plain = _run(build(name, habit="compile_inductor"), None)
    sm = ShadowMode()
    shadowed = _run(build(name, habit="compile_inductor"), sm)
    assert not [w for w in shadowed["warnings"] if w[0] == shadow.ShadowWarning.__name__]
    assert_identical(plain, dict(shadowed, warnings=plain["warnings"]))
    assert_sees_everything(sm)
    recs = _graph_records(sm)
    _assert_judged(recs, ["forward", "backward"] * 2)
    if _compat.compiled_graph_operator() is not None:  # torch 2.4's dynamo compiles again at each call under a mode
        assert recs[0].op == recs[2].op and recs[1].op == recs[3].op != recs[0].op  # the same two graphs each step
    graphs = sm.report.meta[GRAPHS_KEY]
    assert all(graphs[r.op]["ops"] > 10 for r in recs)
    assert recs[0].module == type(build(name).model).__name__  # the compiled model, named as in an eager run
    if _compat.compiled_graph_operator() is not None:  # torch 2.13: each fused kernel judged alone too
        _assert_kernels_within_budget(sm, recs, every=name == "block")


def _kernel_records(sm: ShadowMode | shadow.Report) -> list[Record]:
    report = sm.report if isinstance(sm, ShadowMode) else sm
    return [Record.from_dict(d) for d in report.meta.get(KERNELS_KEY, [])]


def _assert_kernels_within_budget(sm: ShadowMode, graphs: list, every: bool) -> None:
    """Every kernel call of the graphs judged alone is within the budget composed from the nodes it fuses, reading
    over 21 bits (measured on Block's 7 kernels: budget used 0.03-0.80, 21.8-23.0 bits); the records are kept apart
    from the report's (its totals count the graphs' calls once). ``every``: each kernel is judged; else some may be
    recorded unsupported with the reason (the GPT's: a dropout kernel, kernels writing slices of a cat's output)."""
    kernels = _kernel_records(sm)
    judged = [k for k in kernels if str(k.kind) == "replayed"]
    assert len(judged) == len(kernels) if every else len(judged) > len(kernels) / 2
    assert {k.module for k in kernels} == {r.op for r in graphs}
    assert {k.index for k in kernels} <= {r.index for r in graphs}
    for k in judged:
        assert k.op.startswith("inductor.cpp_fused_") and k.budget.family == "graph", k
        # data movement alone (the GPT's transposes of the heads) is exact: no bits to read
        assert not k.over_budget and (k.local.exact or k.local.effective_bits > 21), (k.op, k.budget, k.local)
    assert all(k.reason for k in kernels if k not in judged), kernels
    assert sm.report.coverage.calls == len(sm.report.records) and sm.report.coverage.internal_errors == 0


@pytest.mark.parametrize("name", ["block", pytest.param("gpt_masked_fill", marks=pytest.mark.slow)])
def test_compiled_shadow_is_the_float64_program(name):
    """The shadow of a compiled float32 run is the float64 program run eagerly (no compile): its losses and
    parameters after two AdamW steps agree to 1e-12 relative (measured: the losses exactly, parameters within
    1e-13: the graphs' float64 replays sum in another order than the eager float64 kernels). Except the GPT's key
    biases (qkv.bias[32:64]): their gradient is 0 in exact arithmetic (a key bias adds q.b to every score of a row,
    and softmax ignores a row's shift), so both float64 runs hold rounding noise there, which Adam's update
    divides by its own size (measured 3e-12 to 5e-12 apart)."""
    program = _no_dropout(build(name, habit="compile_inductor"))
    sm = ShadowMode()
    losses = _run(program, sm)["losses"]
    reference = _no_dropout(build(name, habit="train", dtype=torch.float64))
    expected = _run(reference, None)["losses"]
    assert _graph_records(sm)
    for got, want in zip(losses[:-1], expected[:-1]):  # the last entry is the learning rates
        assert _rel(sm.shadow_of(got), want) < 1e-12
    for (n, p), (_, q) in zip(program.model.named_parameters(), reference.model.named_parameters()):
        got, want = sm.shadow_of(p), q.detach()
        if n.endswith("attn.qkv.bias"):
            keys = torch.arange(len(want)) // (len(want) // 3) == 1
            got, want = got[~keys], want[~keys]
        assert _rel(got, want) < 1e-12, n


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("name", ["block", pytest.param("gpt_masked_fill", marks=pytest.mark.slow)])
def test_compiled_evaluation_is_untouched_and_judged(name):
    """Evaluation under no_grad: one inference graph per call, judged; outputs bit for bit the compiled ones."""
    def program():
        p = build(name, habit="eval")
        p.module = torch.compile(p.model)
        return p

    plain = _run(program(), None)
    sm = ShadowMode()
    shadowed = _run(program(), sm)
    assert_identical(plain, dict(shadowed, warnings=plain["warnings"]))
    assert_sees_everything(sm)
    _assert_judged(_graph_records(sm), ["forward"] * 2)


def test_blocks_between_compiled_calls_each_see_the_graphs():
    """A compiled model stepped outside, inside, outside and inside ShadowMode blocks: each block judges its graph
    calls (its first call compiles the model again, as does the first call after it), and the four steps compute
    what a plain run of them computes."""
    def steps(shadowed: ShadowMode | None) -> list:
        torch.manual_seed(2)
        p = build("block", habit="compile_inductor", steps=1)
        losses = []
        for k in range(4):
            with shadowed if shadowed is not None and k % 2 else contextlib.nullcontext():
                losses += run(p)
        return losses + list(p.model.parameters())

    plain = steps(None)
    sm = ShadowMode()
    shadowed = steps(sm)
    assert all(torch.equal(a, b) for a, b in zip(plain, shadowed))
    _assert_judged(_graph_records(sm), ["forward", "backward"] * 2)


def test_inputs_a_graph_writes_keep_their_shadows():
    """BatchNorm in training, compiled: the forward graph writes the running statistics in place (declared writes:
    AOTAutograd moves their version counters), two steps bit for bit the compiled ones, no write unseen, and the
    statistics' shadows those of the float64 model run eagerly."""
    def model(dtype):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)).to(dtype)

    def steps(m, sm=None):
        fn = torch.compile(m) if sm is not None or m[0].weight.dtype == torch.float32 else m
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1)).to(m[0].weight.dtype)
        with sm if sm is not None else contextlib.nullcontext():
            for _ in range(2):
                fn(x).square().sum().backward()
        return [m[1].running_mean, m[1].running_var, m[0].weight.grad]

    plain, sm = steps(model(torch.float32)), ShadowMode()
    shadowed = steps(model(torch.float32), sm)
    assert all(torch.equal(a, b) for a, b in zip(plain, shadowed))
    assert sm.report.coverage.unobserved_writes == 0 and sm.report.coverage.internal_errors == 0
    _assert_judged(_graph_records(sm), ["forward", "backward"] * 2)
    for got, want in zip(shadowed, steps(model(torch.float64))):
        assert _rel(sm.shadow_of(got), want) < 1e-12


def test_random_draws_the_graph_keeps_are_unsupported():
    """Dropout under no_grad, compiled: its mask is drawn inside the kernel and not returned (no backward saves it),
    so the graph's call is recorded unsupported with the reason, its output adopted; the device computes what it
    computes without shadow (the same random draws)."""
    fn = torch.compile(lambda x: F.dropout(x, 0.5, training=True).sum(-1))
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    with torch.no_grad(), ShadowMode() as sm:
        y = fn(x)
    torch.manual_seed(3)
    with torch.no_grad():
        assert torch.equal(fn(x), y)
    (rec,) = _graph_records(sm)
    assert str(rec.kind) == "unsupported" and "random" in rec.reason, rec
    assert torch.equal(sm.shadow_of(y), y.double())


def test_attribution_sees_a_graph_as_one_call():
    """shadow.attribute by op on a compiled model's step: the forward graph is one key, as an op is, and the two
    methods agree on its share (measured -3.16 both; the drift of this tiny target cancels between the graph and
    the loss's ops)."""
    p = build("block", habit="compile_inductor")

    def step():
        return p.forward(p.module, p.batches[0])

    shares = {}
    for method in ("linear", "ablation"):
        res = shadow.attribute(step, by="op", method=method)
        shares[method] = {r.key: r.share for r in res.rows}
    assert "compiled.graph0" in shares["linear"] and "compiled.graph0" in shares["ablation"]
    assert abs(shares["linear"]["compiled.graph0"] - shares["ablation"]["compiled.graph0"]) < 0.05


# --- compiled functions -----------------------------------------------------------------------------------------
def _attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    scores = torch.softmax(x @ w @ x.transpose(-1, -2) / 4.0, dim=-1)
    return (F.gelu(F.layer_norm(scores @ x, (x.shape[-1],))) * x).sum()


def test_compiled_function_forward_and_backward():
    """torch.compile(fn) of a plain function, first called inside the block: its forward and backward graphs judged,
    its result and gradients those its compiled code computes outside the block, their shadows the float64
    function's (with its float64 gradients) to 1e-12."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, generator=g), torch.randn(8, 8, generator=g).requires_grad_()
    fn = torch.compile(_attention)
    with ShadowMode() as sm:
        y = fn(x, w)
        (grad,) = torch.autograd.grad(y, w)
    want = fn(x, w)
    (want_grad,) = torch.autograd.grad(want, w)
    assert torch.equal(y, want) and torch.equal(grad, want_grad)
    _assert_judged(_graph_records(sm), ["other", "backward"])
    w64 = w.detach().double().requires_grad_()
    y64 = _attention(x.double(), w64)
    (grad64,) = torch.autograd.grad(y64, w64)
    assert _rel(sm.shadow_of(y), y64) < 1e-12 and _rel(sm.shadow_of(grad), grad64) < 1e-12


# --- a graph less accurate than its dtypes: a lowering that truncates exp's argument to bfloat16 -------------
@contextlib.contextmanager
def _exp_of_bfloat16():
    """Inductor lowers exp with its argument truncated to bfloat16's 8 bits (its float32 bits ANDed with
    0xFFFF0000: Inductor computes a cast to bfloat16 and back in float32, folding it away), for graphs compiled
    inside the block, without Inductor's caches (their keys do not see lowerings). The graph still says exp."""
    from torch._inductor import config, lowering

    table = lowering.lowerings
    exact = table[aten.exp.default]

    def truncated(x):
        bits = table[aten.view.dtype](x, torch.int32)
        return exact(table[aten.view.dtype](table[aten.bitwise_and.Scalar](bits, -65536), torch.float32))

    table[aten.exp.default] = truncated
    try:
        with config.patch(force_disable_caches=True):
            yield
    finally:
        table[aten.exp.default] = exact


def test_graph_rounding_to_bfloat16_is_over_budget():
    """exp(x @ w / 4) + 1 compiled with exp's argument truncated to bfloat16: relative error up to |x| 2**-7 on exp,
    far over the float32 budget (measured: used 2.2e3, 8.7 bits), reading about bfloat16's bits rather than
    float32's 23; the same function compiled as Inductor lowers it stays within budget."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)

    def scores(x, w):
        return torch.exp(x @ w / 4) + 1

    with _exp_of_bfloat16(), ShadowMode() as sm:
        torch.compile(scores)(x, w)
    (rec,) = _graph_records(sm)
    assert rec.over_budget and rec.budget.used > 100, rec.budget
    assert rec.local.effective_bits < 10, rec.local

    def correct(x, w):
        return torch.exp(x @ w / 4) + 1

    with ShadowMode() as sm:
        torch.compile(correct)(x, w)
    (rec,) = _graph_records(sm)
    assert not rec.over_budget and rec.local.effective_bits > 20, rec


def _two_kernels(x, w):
    return (torch.tanh((torch.exp(x @ w / 4) + 1) @ w) * 3 + x).sum(-1)


@pytest.mark.skipif(_compat.compiled_graph_operator() is None,
                    reason="torch 2.4: shadow's graph is AOTAutograd's, from before the post-grad passes whose node "
                           "names Inductor's kernels use: kernels are not judged alone")
def test_the_fused_kernel_that_rounds_to_bfloat16_is_named(tmp_path):
    """A graph of two fused kernels between two matmuls, exp's argument truncated to bfloat16: the kernel fusing exp
    (div, exp, add, on the first matmul's output in place) is over its budget, the other (tanh, mul, add) within
    its own (measured: 8.2e3 at 7.5 bits; 0.19 at 23 bits); compiled as Inductor lowers it, both within (0.16,
    23 bits). The exp kernel's error is the one a float32 emulation of the truncated lowering makes against float64
    on the same matmul output, without shadow (max |error| 0.0285)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)
    torch._dynamo.reset()  # each compile below generates its code again (another lowering, another block)
    with _exp_of_bfloat16(), ShadowMode() as sm:
        y = torch.compile(_two_kernels)(x, w)
    (graph,) = _graph_records(sm)
    exp, tanh = _kernel_records(sm)
    assert exp.op.startswith("inductor.cpp_fused_") and "exp" in exp.op and "tanh" in tanh.op
    assert (exp.module, exp.index, str(exp.phase)) == (graph.op, graph.index, str(graph.phase))
    assert exp.over_budget and exp.budget.used > 100 and exp.local.effective_bits < 10, (exp.budget, exp.local)
    assert not tanh.over_budget and tanh.local.effective_bits > 21, (tanh.budget, tanh.local)
    assert sm.report.coverage.calls == len(sm.report.records)  # the kernels' records are not the program's calls
    (named,) = conclude(sm.report).kernels  # the verdict names the kernel that errs, and only it
    assert (named.op, named.graph, named.over_calls) == (exp.op, graph.op, 1)
    assert any(line.startswith(f"  fused kernel {exp.op} of {graph.op}: ") for line in conclude(sm.report).lines)
    sm.report.save(tmp_path / "r.json")  # kept in the saved report's meta
    assert _kernel_records(shadow.load_report(tmp_path / "r.json")) == [exp, tanh]
    scaled = (x @ w) / 4  # the first matmul is aten's mm (Inductor's extern kernel); / 4 is exact
    truncated = (scaled.view(torch.int32) & -65536).view(torch.float32)
    want = torch.exp(scaled.double()) + 1
    emulated = torch.exp(truncated) + 1
    assert abs(exp.local.max_abs / float((emulated.double() - want).abs().max()) - 1) < 1e-3
    torch._dynamo.reset()
    with _exp_of_bfloat16():
        assert torch.equal(torch.compile(_two_kernels)(x, w), y)  # the kernels compute what they do without shadow

    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), ShadowMode() as sm:
        torch.compile(_two_kernels)(x, w)
    kernels = _kernel_records(sm)
    assert len(kernels) == 2 and all(not k.over_budget and k.local.effective_bits > 21 for k in kernels), kernels
    assert conclude(sm.report).kernels == ()


def test_graph_names_are_the_order_graphs_are_first_seen():
    """A second block numbers its graphs from 0 again, in the order of their first call."""
    fn = torch.compile(lambda x: (x.sin() * 2).sum())
    x = torch.randn(5, requires_grad=True)
    for _ in range(2):
        with ShadowMode() as sm:
            fn(x).backward()
        assert [r.op for r in _graph_records(sm)] == ["compiled.graph0", "compiled.graph1"]
        assert set(sm.report.meta[GRAPHS_KEY]) == {"compiled.graph0", "compiled.graph1"}
        assert math.isfinite(sm.report.records[0].local.rel_norm)


# --- shadow compare: an eager run against a compiled run of the same program ------------------------------------
def test_compare_matches_an_eager_run_with_a_compiled_one():
    """The compiled run's graph calls are matched with the eager run's calls of the compiled module in the same
    phase (forward, backward, each step); the calls around them (the loss, the optimizer) one by one. Both runs
    are correct float32: nothing is worse."""
    runs = []
    for habit in ("train", "compile_inductor"):
        sm = ShadowMode()
        _run(build("block", habit=habit), sm)
        runs.append(sm.report)
    cmp = diff_reports(*runs)
    assert [(g.module, g.phase) for g in cmp.graphs] == [("Block", "forward"), ("Block", "backward")] * 2
    assert cmp.graphs[1].graph == "compiled.graph1"
    assert all(g.calls_a > 10 and 0 < g.own_b < 1 for g in cmp.graphs)
    assert cmp.match > 0.9 and cmp.matched > 50  # the optimizer's and the loss's calls
    assert not any(op.startswith("aten.native_layer_norm") for op in cmp.ops_only_a)  # stood for by the graphs
    assert not cmp.worse("op") and "compiled.graph1" in cmp.text and "B is worse" not in cmp.verdict


def test_compare_names_a_graph_less_accurate_than_the_eager_calls():
    """The function of the bfloat16-truncating lowering, eager against compiled: its graph is named, over budget."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)

    def scores(x, w):
        return torch.exp(x @ w / 4) + 1

    with ShadowMode() as eager:
        scores(x, w)
    with _exp_of_bfloat16(), ShadowMode() as compiled:
        torch.compile(scores)(x, w)
    cmp = diff_reports(eager.report, compiled.report)
    (change,) = cmp.graphs
    assert change.graph == "compiled.graph0" and change.calls_a == 4 and change.own_b > 100 > change.own_a
    assert cmp.verdict.startswith("verdict: B is worse: 1 compiled graph call over budget")
