"""The report's views (by op, module, call site, phase; the module tree), call sites, and each call's
introduced error against the drift it amplifies (shadow.report, shadow.attribution, shadow.records)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import callsite_model
from shadow import ShadowMode, load_report

pytestmark = pytest.mark.usefixtures("one_thread")


def _line(tag: str) -> str:
    """``file:line`` of the line of callsite_model.py marked ``# LINE tag``, as the report names it."""
    path = callsite_model.__file__
    with open(path) as f:
        number = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# LINE {tag}"))
    cwd = os.getcwd() + os.sep
    return f"{path[len(cwd):] if path.startswith(cwd) else path}:{number}"


def _step(**options) -> ShadowMode:
    torch.manual_seed(0)
    net, x = callsite_model.Net(), torch.randn(5, 8)
    with ShadowMode(spot_checks="off", **options) as sm:
        callsite_model.loss_of(net, x).backward()
    return sm


def test_forward_and_backward_ops_point_at_the_users_line():
    rep = _step().report
    fwd = {r.op: r.callsite for r in rep.find(phase="forward")}
    assert fwd["aten.gelu.default"] == _line("gelu")
    assert [r.callsite for r in rep.find(op="addmm", phase="forward")] == [_line("fc1"), _line("fc2")]
    assert {r.callsite for r in rep.find(op="mean")} == {_line("loss")}
    # a backward op takes the line of the forward op whose autograd node runs it
    assert {r.callsite for r in rep.find(op="gelu_backward")} == {_line("gelu")}
    bw_mm = rep.find(op="mm", phase="backward")
    assert {r.callsite for r in bw_mm} == {_line("fc1"), _line("fc2")} and len(bw_mm) == 3
    assert rep.by_callsite[_line("gelu")].calls == 2  # gelu, gelu_backward
    assert sum(a.calls for a in rep.by_callsite.values()) == rep.coverage.calls


def test_calls_autograd_gives_no_node_leave_the_backward_call_sites_alone():
    """A forward call none of whose inputs requires grad, or one under no_grad, gets no autograd node: nothing
    waits to take its line (``Attribution.where``'s ``inputs``). Its record keeps its line, and the backward calls
    still take their forward calls' lines."""
    torch.manual_seed(0)
    net, x = callsite_model.Net(), torch.randn(5, 8)
    with ShadowMode(spot_checks="off") as sm:
        x2 = x * 2
        with torch.no_grad():
            callsite_model.loss_of(net, x2)
        callsite_model.loss_of(net, x2).backward()
    rep = sm.report
    assert [r.callsite for r in rep.find(op="gelu", phase="forward")] == [_line("gelu")] * 2
    assert {r.callsite for r in rep.find(op="gelu_backward")} == {_line("gelu")}
    bw_mm = rep.find(op="mm", phase="backward")
    assert {r.callsite for r in bw_mm} == {_line("fc1"), _line("fc2")} and len(bw_mm) == 3
    assert rep.find(op="mul", phase="other")[0].callsite.endswith(f"test_views.py:{_this_line('x2 = x * 2')}")


def _this_line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip() == text)


def test_generated_code_freed_and_made_again_gets_its_own_line():
    """Code made at run time (exec, generated forwards) and dropped: a new code object may take a dead one's
    address, and call sites are looked up by id(code). Each op names its own generated file and line."""
    x = torch.randn(3)
    with ShadowMode(spot_checks="off") as sm:
        for i in range(30):
            space: dict = {}
            exec(compile("\n" * (i % 4) + "def f(x):\n    return x.exp()\n", f"<generated {i}>", "exec"), space)
            space["f"](x)
            del space  # the function and its code die here
    sites = [r.callsite for r in sm.report.find(op="exp")]
    assert sites == [f"<generated {i}>:{i % 4 + 2}" for i in range(30)]


def test_callsites_off_records_none():
    rep = _step(callsites=False).report
    assert {r.callsite for r in rep.records} == {""} and list(rep.by_callsite) == [""]


def test_phase_views_and_the_module_tree_add_up():
    rep = _step().report
    assert sum(a.calls for a in rep.by_phase.values()) == rep.coverage.calls
    assert rep.by_phase["backward"].calls == len(rep.find(phase="backward")) > 0
    back = rep.view("module", phase="backward")
    assert back["Net.fc1"].calls == len(rep.find(module="Net.fc1", phase="backward"))
    assert back["Net.fc1"].max_local_abs == max(r.local.max_abs for r in rep.find(module="Net.fc1", phase="backward")
                                                if r.local is not None)
    tree = rep.module_tree()
    # a parent holds its own calls and its children's
    assert tree["Net"].calls == rep.by_module["Net"].calls + tree["Net.fc1"].calls + tree["Net.fc2"].calls
    assert tree["Net"].max_local_abs == max(rep.by_module[k].max_local_abs for k in ("Net", "Net.fc1", "Net.fc2"))
    text = rep.table(by="module", tree=True)
    names = [line.split()[0] for line in text.splitlines()[2:]]
    assert names.index("Net") < names.index("fc1") and "\n  fc1 " in text  # children indented under Net
    assert rep.table(by="callsite").count(_line("gelu")) == 1
    assert "gelu_backward" not in rep.table(phase="forward") and "gelu_backward" in rep.table(phase="backward")
    with pytest.raises(ValueError, match="expected None .all. or one of 'forward'"):
        rep.view("op", phase="fwd")
    with pytest.raises(ValueError, match="a tree is of modules"):
        rep.table(by="op", tree=True)


def test_views_survive_save_and_load_and_old_reports_say_what_they_lack(tmp_path):
    rep = _step().report
    path = tmp_path / "r.json"
    rep.save(path)
    back = load_report(path)
    for by in ("op", "module", "callsite", "phase"):
        assert {k: a.calls for k, a in back.view(by).items()} == {k: a.calls for k, a in rep.view(by).items()}
    assert back.records[0].callsite == rep.records[0].callsite
    d = json.loads(path.read_text())
    d["version"] = 4
    del d["cells"]
    path.write_text(json.dumps(d))
    old = load_report(path)
    assert old.by_op["aten.gelu.default"].calls == 1
    with pytest.raises(ValueError, match="format version < 5"):
        old.by_callsite


def test_an_exact_op_after_a_rounding_one_amplifies_it():
    """a + 1 rounds (relative 6e-8 of ~1); (a + 1) - 1 is exact on the device's own inputs (Sterbenz) but leaves
    that absolute error on a result of size 1e-4: the drift it receives is amplified ~1e4 times, and it
    introduces nothing; doubling it then passes the drift on unchanged."""
    torch.manual_seed(0)
    a = torch.randn(1000) * 1e-4
    with ShadowMode(spot_checks="off") as sm:
        b = a + 1.0
        c = b - 1.0
        c * 2.0
    add, sub, mul = (sm.report.find(op=op)[0] for op in ("add", "sub", "mul"))
    assert add.amplification is None and add.introduced > 1e-8  # its inputs were exact: it introduces
    assert sub.introduced == 0.0 and 1e3 < sub.amplification < 1e5
    assert sub.inputs_drift == pytest.approx(add.drift.rel_norm)
    assert mul.introduced == 0.0 and mul.amplification == pytest.approx(1.0, rel=1e-9)


def test_an_exact_zero_reference_is_said_to_be_one():
    """x - x.mean() of a constant x is exactly 0 in float64 (the float64 sum of 1000 equal float32 values is exact,
    and so is its mean); float32 rounds the sum, so the device's result is small noise: an infinite relative
    drift, which the record says comes from a reference of exactly 0."""
    x = torch.full((1000,), 0.1)
    with ShadowMode(spot_checks="off") as sm:
        y = x - x.mean()
    rec = sm.report.find(op="sub")[0]
    assert float(y.abs().max()) > 0 and float(sm.shadow_of(y).abs().max()) == 0.0
    assert rec.zero_reference == 1000 and rec.drift.zero_reference == 1000 and math.isinf(rec.drift.rel_norm)
    assert rec.local.zero_reference == 0  # on the device's own (rounded) mean the float64 result is not 0
