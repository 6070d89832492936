"""shadow.explain: every per-op table's answer for one op, held to what the tables and the engine do; op families
named once across the tables; an emulated format registered in one place (emulate(), the audit, explain)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shadow
from shadow import ShadowMode
from shadow.budgets import BUDGETS, budget_for
from shadow.cli import main
from shadow.errors import ShadowOptionError
from shadow.explanation import Explanation, Explanations, explain, resolve
from shadow.modes.emulate import EMULATIONS, Emulation, emulate, round_to
from shadow.modes.emulate._mode import AuditFormat, register
from shadow.modes.emulate._utils import overloads, transform_io

import unjudged
from shadow.modes.emulate.formats import Format
from shadow.opsets import CONVOLUTIONS, MATMUL_LIKE, MATMULS, Family
from shadow.precision import PRECISIONS
from shadow.references import reference_for
from shadow.replay import REPLAY
from shadow.rules import RuleTable, rule_name

aten = torch.ops.aten
FAMILIES = {f.value for f in Family}


# --- one op: each answer is the table's, and the engine does what it says ---
def test_mm_answers_every_table():
    e = explain(aten.mm.default)
    assert isinstance(e, Explanation) and e.op == "aten.mm.default" and e is not None
    assert [a.name for a in e.replay] == [rule_name(r) for r in REPLAY.chain(aten.mm.default)] == ["default_rule"]
    assert [a.name for a in e.budget][0] == "mm_budget" and e.budget[0].via == "op"
    assert (e.budget[0].family, e.budget[-1].family, e.budget[-1].via) == ("matmul", "default", "default")
    assert e.budget[0].module == "shadow.budgets.linalg" and "A @ B" in e.budget[0].doc
    assert e.reference.family == "matmul" and e.reference.module == "shadow.references.linalg"
    assert rule_name(reference_for(aten.mm.default).rule) == e.reference.name
    assert e.defined == () and "MATMULS (a=self, b=mat2)" in e.opsets and "MATMUL_LIKE" in e.opsets
    devices = {d.name: d for d in e.devices}
    assert set(devices) == set(EMULATIONS)
    assert devices["tf32"].claims[0].via == "op" and devices["tf32"].audit == "tf32, 10 bits"
    assert devices["bf16"].claims[0].via == "predicate computes"
    text = str(e)
    assert text == e.render() and text.startswith("aten.mm.default: aten::mm(Tensor self, Tensor mat2) -> Tensor")
    assert "matmul: mm_budget" in text and "tf32: _tf32_factors" in text


def test_a_view_a_random_op_the_default_budget_and_a_defined_region():
    t = explain("aten.t.default")
    assert (t.replay[0].name, t.replay[0].family, t.replay[0].via) == \
        ("view_rule", "view", "predicate views_and_metadata")
    assert t.reference is None and "not spot-checked" in t.render()
    assert all(not d.claims for d in t.devices) and "passes it through" in t.render()
    dropout = explain("native_dropout.default")
    assert [(a.name, a.family) for a in dropout.replay] == [
        ("native_dropout_rule", "random"), ("random_rule", "random"), ("default_rule", None)]
    guessed = explain(unjudged.OP)  # no budget rule: the default guess, flagged
    assert [(a.name, a.family) for a in guessed.budget] == [("InUlps", "default")] and \
        "a guess" in guessed.budget[0].doc
    ctc = explain(aten._ctc_loss.default)
    assert ctc.defined[0].name == "ctc_loss_defined" and "every element" not in ctc.render()


def test_foreach_ops_say_which_op_answers_for_each_element():
    e = explain(aten._foreach_addcdiv_.Scalar)
    assert e.budget[0].family == "foreach" and "aten.addcdiv.default" in e.budget[0].doc


def _recorded(fn) -> list:
    with ShadowMode(spot_checks="off") as sm:
        fn()
    return sm.report.records


def test_the_engine_does_what_explain_says():
    """Each call's recorded budget family and kind are the explanation's first answers (every call here is one a
    first rule answers), and its spot-check availability the reference's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 3, generator=g)
    img, k = torch.randn(1, 2, 6, 6, generator=g), torch.randn(3, 2, 3, 3, generator=g)
    records = _recorded(lambda: (x @ w, x.exp(), x.sum(), x.relu(), x.t(), F.layer_norm(x, (8,)),
                                 x.softmax(-1), F.conv2d(img, k), torch.linalg.solve(w[:3] @ w[:3].T + 3 * torch.eye(3),
                                                                                    w[:3])))
    seen = set()
    for rec in records:
        e = explain(rec.op)
        if rec.kind == "view":
            assert e.replay[0].family == "view", rec.op
            continue
        if rec.budget is None:  # nothing to hold to a budget: eye's result is exact
            continue
        assert rec.budget.family == e.budget[0].family, (rec.op, rec.budget, e.budget)
        assert (e.reference is not None) == (reference_for(resolve(rec.op)) is not None)
        seen.add(e.budget[0].family)
    assert {"matmul", "elementwise", "reduction", "movement", "norm", "conv", "unbounded"} <= seen


def test_budget_for_builds_the_family_explain_names():
    """Without the engine: budget_for on exact float64 inputs gives the family of the first rule explain lists."""
    a = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    for op, args in ((aten.mm.default, (a, a)), (aten.addmm.default, (a, a, a)), (aten.exp.default, (a,)),
                     (aten.sum.default, (a,)), (aten.amax.default, (a, [1]))):
        out = op(*args)
        assert budget_for(op, args, {}, [out], torch.float32).family == explain(op).budget[0].family


# --- names ---
def test_packets_and_names_resolve():
    packet = explain(aten.mm)
    assert isinstance(packet, Explanations) and packet.op == "aten.mm"
    assert [e.op for e in packet] == [f"aten.mm.{o}" for o in aten.mm.overloads()] and len(packet) >= 2
    assert packet["out"].op == "aten.mm.out" and packet[0].op == "aten.mm.default"
    assert explain("mm").op == explain("aten.mm").op == explain("aten::mm").op == "aten.mm"
    for name in ("aten.mm.default", "mm.default", "aten::mm.default", "torch.ops.aten.mm.default", " aten.mm.default "):
        assert explain(name) == explain(aten.mm.default), name
    assert explain("add.Tensor").op == "aten.add.Tensor"
    assert "aten.mm.out" in packet.render() and packet.render().count("\n\n") == len(packet) - 1
    with pytest.raises(KeyError, match="has no overload 'nope'"):
        packet["nope"]


def test_an_unknown_op_names_the_closest():
    with pytest.raises(ShadowOptionError, match=r"no such op.*did you mean aten\.mm\b"):
        explain("aten.mmx")
    with pytest.raises(ShadowOptionError, match=r"did you mean aten\.matmul"):
        explain("matmull")
    with pytest.raises(ShadowOptionError, match="aten.add has no overload 'Tnsor'; its overloads: Tensor, Scalar"):
        explain("add.Tnsor")
    with pytest.raises(ShadowOptionError, match="expected an aten op"):
        explain(torch.mm)


def test_the_public_name_and_the_command_line(capsys):
    assert shadow.explain is explain and "explain" in shadow.__all__
    assert main(["explain", "aten.mm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("aten.mm.default:") and "aten.mm.out:" in out and "matmul: mm_budget" in out
    assert main(["explain", "aten.mmx"]) == 2
    assert "did you mean aten.mm" in capsys.readouterr().err


# --- every op of op_db ---
def _check(e: Explanation) -> None:
    """A replay rule, a budget family and a reference or none; every family named is one of Family's."""
    assert e.replay and e.replay[-1].name == "default_rule", e.op
    assert e.budget and e.budget[0].family in FAMILIES, e.op
    for a in (*e.replay, *e.budget, *((e.reference,) if e.reference else ()), *e.defined):
        assert a.via == "default" or a.family in FAMILIES, (e.op, a)  # every registration names its family
    assert e.render()


def _op_db():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def _packets(op) -> list:
    """An OpInfo's aten packets: the one its aten_name names and its in-place twin (some OpInfos have none:
    Python-level functions, see the slow sweep)."""
    return [p for p in (getattr(aten, n, None) for n in (op.aten_name, op.aten_name + "_"))
            if isinstance(p, torch._ops.OpOverloadPacket)]


def test_every_op_db_packet_is_explained():
    ops = {getattr(p, o) for op in _op_db() for p in _packets(op) for o in p.overloads()}
    assert len(ops) > 1000
    for func in ops:
        _check(explain(func))


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_every_op_db_entry_is_explained_by_what_it_dispatches():
    """Every OpInfo, those without an aten packet of their name included: the ops its first float32 sample
    dispatches."""
    seen = _Seen()
    for op in _op_db():
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        sample = next(iter(op.sample_inputs("cpu", torch.float32)), None)
        if sample is None:
            continue
        try:
            with seen:
                op(sample.input, *sample.args, **sample.kwargs)
        except Exception:  # noqa: BLE001 -- a sample the op refuses: what it dispatched is still seen
            pass
    assert len(seen.ops) > 400  # 452 distinct overloads on torch 2.13
    for func in seen.ops:
        if isinstance(func, torch._ops.OpOverload):
            _check(explain(func))


# --- families: one vocabulary ---
def test_budget_and_reference_name_the_same_family():
    """Where an op has a budget rule of its own and a reference, both registrations name one family."""
    both = 0
    for op in _op_db():
        for p in _packets(op):
            for o in p.overloads():
                e = explain(getattr(p, o))
                if e.reference is not None and e.budget[0].via != "default":
                    assert e.reference.family == e.budget[0].family, e.op
                    both += 1
    assert both > 50


def test_family_values_are_the_saved_strings():
    # what reports saved before the vocabulary was one Enum (tests/reports/v*.json hold them)
    assert {"elementwise", "movement", "reduction", "matmul", "conv", "norm", "loss", "attention", "unbounded",
            "default", "empty", "fft", "foreach"} <= FAMILIES
    assert f"{Family.MATMUL}" == "matmul" and Family("norm") is Family.NORM


def test_matmul_like_is_stated_once():
    assert set(MATMULS) | set(CONVOLUTIONS) <= MATMUL_LIKE
    assert {"convolution_backward", "conv2d", "_scaled_mm"} <= MATMUL_LIKE and "add" not in MATMUL_LIKE


# --- an emulated format is one registration ---
FP4 = Format("fp4_e2m1", 2, 0, 2)  # OCP MX FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6


def _fp4(t: torch.Tensor) -> torch.Tensor:
    return round_to(t, FP4)


def test_a_new_format_is_one_registration():
    """A toy FP4 device, registered once (undone after), is among emulate()'s names, the audit's precisions and
    explain's devices; its mode computes what rounding by hand gives."""
    table: RuleTable = RuleTable("fp4")
    table.register(*overloads("mm"))(functools.partial(transform_io, _fp4))
    with mock.patch.dict(EMULATIONS):
        @register("fp4", table, audit=AuditFormat(FP4, scaled=True))
        class FP4Mode(Emulation):
            """float32 matmuls on FP4 operands and results."""

            def __init__(self):
                super().__init__(self.name)

        assert isinstance(emulate("fp4"), FP4Mode)
        assert list(PRECISIONS)[0] == "fp4" and PRECISIONS["fp4"].bits == 1 and PRECISIONS["fp4"].scaled
        assert isinstance(PRECISIONS["fp4"].mode(None), FP4Mode)
        device = {d.name: d for d in explain(aten.mm.default).devices}["fp4"]
        assert device.claims[0].name == "transform_io(_fp4)" and device.audit == "fp4_e2m1, 1 bits, scaled per tensor"
        assert "fp4: transform_io(_fp4)" in explain(aten.mm.default).render()
        assert not {d.name: d for d in explain(aten.exp.default).devices}["fp4"].claims
        a = torch.tensor([[0.3, 1.2], [0.7, -0.9]])
        with emulate("fp4"):
            y = a @ a
        # by hand: a rounds to [[0.5, 1], [0.5, -1]], its square [[0.75, -0.5], [-0.25, 1.5]] to FP4 (ties to even)
        assert y.tolist() == _fp4(_fp4(a) @ _fp4(a)).tolist() == [[1.0, -0.5], [0.0, 1.5]]
        with pytest.raises(ValueError, match="already registered"):
            register("fp4", table)(FP4Mode)
    assert "fp4" not in EMULATIONS and "fp4" not in PRECISIONS
    assert "fp4" not in {d.name for d in explain(aten.mm.default).devices}
    with pytest.raises(ShadowOptionError, match="expected one of"):
        emulate("fp4")


def test_the_audit_runs_a_new_format():
    """The audit takes the toy format by its name alone: its matmul part's change is measured, tanh's is not
    touched."""
    table: RuleTable = RuleTable("fp4")
    table.register(*overloads("mm", "addmm"))(functools.partial(transform_io, _fp4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with mock.patch.dict(EMULATIONS):
        @register("fp4", table, audit=AuditFormat(FP4))
        class FP4Mode(Emulation):
            def __init__(self):
                super().__init__(self.name)

        aud = shadow.audit(lambda: model(x).square().sum(), precisions=("fp4",), verify=3)
    assert aud.precisions == ("fp4",)
    lin, tanh = aud.row("Sequential.0", "fp4"), aud.row("Sequential.1", "fp4")
    assert lin.applies and lin.estimate > 1e-3 and lin.verified > 1e-3 and not tanh.applies
