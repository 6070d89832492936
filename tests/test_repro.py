"""``shadow repro`` (issue 57): the inputs of the worst calls over budget kept during a run, in one sidecar next to the
report, and the reproduction written from them (repro.py, torch alone; inputs.pt). Each figure a reproduction
prints is held against the record's (the same device: the same output bit for bit, the same error) and against a
direct float64 experiment made without shadow (another device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import shadow
from shadow import ShadowMode
from shadow.cli import main
from shadow.errors import CallNotKeptError, NoKeptInputsError, ReproError, SidecarError, ShadowOptionError
from shadow.modes.faults import FaultMode
from shadow.sidecar import PER_CLASS, sidecar_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# float64 references computed in two processes may sum in another order (threads): ~1e-16 of |r|, against errors
# of 1e-3 (float16) to 1e-7 (float32) of |r|
REL = 1e-9


def run_repro(script, *args: str, without_shadow: bool = False) -> tuple[int, str]:
    """repro.py run as a user runs it (``without_shadow``: with ``import shadow`` failing); (exit status, output)."""
    folder = os.path.dirname(script)
    if without_shadow:  # sys.modules["shadow"] = None makes every import of shadow fail
        command = [sys.executable, "-c", "import runpy, sys; sys.modules['shadow'] = None; "
                   f"sys.argv = {[script, *args]!r}; runpy.run_path({script!r}, run_name='__main__')"]
    else:
        command = [sys.executable, script, *args]
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    return done.returncode, done.stdout + done.stderr


def figures(output: str) -> dict:
    """The --json line (a backend's warnings on stderr may follow it)."""
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


def faulted(n: int = 1, rel: float = 1e-3) -> tuple[shadow.Report, torch.Tensor]:
    """A CPU run whose gelu FaultMode makes over budget (times 1 + rel), and a matmul within budget."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    with FaultMode(rel=rel, op="gelu"), ShadowMode() as sm:
        for _ in range(n):
            F.gelu(x) @ torch.ones(32, 4)
    return sm.report, x


def test_a_fault_on_the_cpu_is_kept_and_its_repro_says_the_kernel_is_correct_without_it(tmp_path):
    rep, x = faulted()
    (gelu,) = rep.find(op="gelu")
    assert gelu.over_budget and not any(r.over_budget for r in rep.records if r is not gelu)
    info = rep.meta["repro"]
    assert [k["call"] for k in info["kept"]] == [gelu.index] and info["bytes"] == x.numel() * 4
    rep.save(tmp_path / "r.json")
    assert os.path.exists(sidecar_path(tmp_path / "r.json"))
    files = shadow.load_report(tmp_path / "r.json").repro(None, tmp_path / "gelu")
    assert (files.call, files.op) == (gelu.index, "aten.gelu.default")
    status, out = run_repro(files.script, "--json", without_shadow=True)
    fig = figures(out)
    assert status == 0 and not fig["over_budget"] and not fig["output_matches"]  # the fault is not applied
    direct = (F.gelu(x).double() - F.gelu(x.double())).abs().max().item()  # the CPU kernel, without shadow
    assert fig["max_abs"] == pytest.approx(direct, rel=REL)
    status, text = run_repro(files.script, without_shadow=True)
    assert status == 0 and "FaultMode(rel=0.001, op='gelu')" in text and "shadow is not installed" in text
    assert "conclusion: within budget" in text
    status, out = run_repro(files.script, "--json")  # shadow importable: the fault applied, the record's figures
    fig = figures(out)
    assert status == 1 and fig["output_matches"] and fig["emulation_applied"] == ["FaultMode(rel=0.001, op='gelu')"]
    assert fig["budget_used"] == pytest.approx(gelu.budget.used, rel=1e-2)
    status, text = run_repro(files.script)
    assert status == 1 and "emulation applied: FaultMode(rel=0.001, op='gelu') (shadow " in text


def test_per_class_limit_and_the_cap_leave_out_what_the_report_says():
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    with FaultMode(rel=1e-3, op="gelu"), ShadowMode() as sm:
        for scale in (1.0, 3.0, 2.0, 5.0, 4.0):  # gelu(s * x) * (1 + rel): the same relative fault each call
            F.gelu(x * scale)
    info = sm.report.meta["repro"]
    used = {r.index: r.budget.used for r in sm.report.find(op="gelu")}
    worst = sorted(used, key=lambda i: -used[i])[:PER_CLASS]
    assert sorted(k["call"] for k in info["kept"]) == sorted(worst)
    assert info["left_out"] == [{"op": "aten.gelu", "why": f"not among the worst {PER_CLASS} of its op class",
                                 "calls": len(used) - PER_CLASS}]
    with FaultMode(rel=1e-3, op="gelu"), ShadowMode(max_repro_bytes=100) as sm:  # 16 x 8 float32: 512 bytes
        F.gelu(x)
    info = sm.report.meta["repro"]
    assert info["kept"] == [] and info["left_out"][0]["why"] == "left out by the cap of max_repro_bytes=100"
    with pytest.raises(NoKeptInputsError, match="max-repro-bytes"):
        sm.report.repro()


def test_nothing_is_kept_where_no_call_is_over_budget(tmp_path, capsys):
    a = torch.randn(8, 16)
    with ShadowMode() as sm:
        (a @ a.T).sum()
    rep = sm.report
    assert "repro" not in rep.meta and rep.kept is not None and not rep.kept.calls
    rep.save(tmp_path / "r.json")
    assert not os.path.exists(sidecar_path(tmp_path / "r.json"))
    with pytest.raises(NoKeptInputsError, match="no call of this run was over its budget"):
        shadow.load_report(tmp_path / "r.json").repro()
    assert main(["repro", str(tmp_path / "r.json")]) == 2
    assert "no call of this run was over its budget" in capsys.readouterr().err
    with FaultMode(rel=1e-3, op="gelu"), ShadowMode(max_repro_bytes=0) as sm:
        F.gelu(a)
    with pytest.raises(NoKeptInputsError, match=r"max_repro_bytes=0\): re-run with"):
        sm.report.repro()
    with pytest.raises(ShadowOptionError, match="max_repro_bytes"):
        ShadowMode(max_repro_bytes=-1)


def test_a_truncated_or_missing_sidecar_and_a_call_not_kept_are_clear_errors(tmp_path, capsys):
    rep, _ = faulted()
    path = tmp_path / "r.json"
    rep.save(path)
    side = sidecar_path(path)
    (gelu,), (mm,) = rep.find(op="gelu"), rep.find(op="mm")
    with pytest.raises(CallNotKeptError, match=rf"call 5000: out of range: the run made {rep.coverage.calls} calls"
                                               rf".*--call {gelu.index}"):
        shadow.load_report(path).repro(5000, tmp_path / "x")
    assert main(["repro", str(path), "--call", str(mm.index), "-o", str(tmp_path / "x")]) == 2  # within budget
    assert f"call {mm.index}: its inputs were not kept" in capsys.readouterr().err
    data = open(side, "rb").read()
    with open(side, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(SidecarError, match="truncated or damaged"):
        shadow.load_report(path).repro()
    assert main(["repro", str(path)]) == 2
    err = capsys.readouterr().err
    assert "inputs.pt: not readable (truncated or damaged" in err and "re-run the program" in err
    os.remove(side)
    with pytest.raises(SidecarError, match="missing: the kept inputs live in one file next to the report"):
        shadow.load_report(path).repro()
    rep.save(path)  # the report in memory writes its inputs again; another run's sidecar is refused
    other, _ = faulted()
    other.save(tmp_path / "other.json")
    os.replace(sidecar_path(tmp_path / "other.json"), side)
    with pytest.raises(SidecarError, match="belongs to another run"):
        shadow.load_report(path).repro()
    assert issubclass(SidecarError, ReproError)


def test_shadow_run_keeps_inputs_and_shadow_repro_names_the_emulation(tmp_path, capsys, monkeypatch):
    script = tmp_path / "mm.py"
    script.write_text(textwrap.dedent("""
        import torch
        g = torch.Generator().manual_seed(6)
        a, b = torch.randn(16, 64, generator=g), torch.randn(64, 8, generator=g)
        print(float((a @ b).sum()))
    """))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--emulate", "tf32", "-o", "r.json", str(script)]) == 0
    rep = shadow.load_report("r.json")
    (mm,) = rep.find(op="mm")
    assert mm.over_budget and rep.meta["repro"]["kept"][0]["call"] == mm.index
    assert main(["repro", "r.json"]) == 0
    folder = f"repro-mm-{mm.index}"
    assert f"wrote {folder}/repro.py" in capsys.readouterr().out
    status, text = run_repro(os.path.abspath(f"{folder}/repro.py"), without_shadow=True)
    assert status == 0 and "TF32" in text and "not applied" in text  # float32 on the CPU: within budget
    status, out = run_repro(os.path.abspath(f"{folder}/repro.py"), "--json")  # TF32 applied: the record's figures
    fig = figures(out)
    assert status == 1 and fig["output_matches"] and fig["emulation_applied"] == ["TF32Mode('tf32', TF32Options("
                                                                                  "rounding=<Rounding.NEAREST_EVEN: 'rne'>))"]
    assert fig["budget_used"] == pytest.approx(mm.budget.used, rel=1e-2)
    assert main(["run", "--emulate", "tf32", "--max-repro-bytes", "0", "-o", "none.json", str(script)]) == 0
    assert not os.path.exists("none.json.inputs.pt")
    assert main(["repro", "none.json"]) == 2
    assert "max_repro_bytes=0" in capsys.readouterr().err


@pytest.mark.privateuse1
@pytest.mark.parametrize("op", ["mm", "exp"])
def test_a_repro_on_the_device_reads_the_recorded_error_and_the_cpu_a_correct_kernel(tmp_path, op):
    """The DirectML-like device's float16-accumulating matmul and its approximate exp, over budget under shadow:
    their reproduction on the device gives the recorded output bit for bit and the recorded error, exit 1; on the
    CPU, the CPU kernel's own error (measured here without shadow), within budget, exit 0."""
    from tests.privateuse1 import device

    dml = device()
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(16, 256, generator=g).half(), torch.randn(256, 8, generator=g).half()
    x = torch.linspace(-80, 80, 257)
    with ShadowMode() as sm:
        if op == "mm":
            a.to(dml) @ b.to(dml)
        else:
            torch.exp(x.to(dml))
    (rec,) = sm.report.find(op=op)
    assert rec.over_budget and sm.report.coverage.internal_errors == 0
    sm.report.save(tmp_path / "r.json")
    files = shadow.load_report(tmp_path / "r.json").repro(rec.index, tmp_path / op)
    status, out = run_repro(files.script, "--setup", "tests.privateuse1:device", "--json")
    fig = figures(out)
    assert status == 1 and fig["output_matches"] and fig["device"] == "privateuseone:0", out
    assert fig["max_abs"] == pytest.approx(rec.local.max_abs, rel=REL)
    assert fig["max_ulp"] == pytest.approx(rec.local.max_ulp, rel=REL)
    assert fig["budget_used"] == pytest.approx(rec.budget.used, rel=REL)
    assert fig["effective_bits"] == pytest.approx(rec.local.effective_bits, rel=REL)
    status, out = run_repro(files.script, "--device", "cpu", "--json", without_shadow=True)
    fig = figures(out)
    cpu = (a @ b).double() - a.double() @ b.double() if op == "mm" else torch.exp(x).double() - torch.exp(x.double())
    assert status == 0 and not fig["over_budget"] and not fig["output_matches"]
    assert fig["max_abs"] == pytest.approx(cpu.abs().max().item(), rel=REL)
    status, text = run_repro(files.script)  # no backend imported: what to do instead
    assert status == 2 and "--setup MODULE[:FUNCTION]" in text


def test_keeping_changes_nothing_of_the_programs_tensors():
    """A kept call's output stays the program's: same values, still resizable (the checksum reads a copy)."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    with FaultMode(rel=1e-3, op="gelu"), ShadowMode() as sm:
        y = F.gelu(x)
    with FaultMode(rel=1e-3, op="gelu"):
        plain = F.gelu(x)
    assert sm.report.meta["repro"]["kept"] and torch.equal(y, plain)
    y.resize_(64)  # numpy's view of a storage would refuse: "Trying to resize storage that is not resizable"


class Planted:
    """A pickled object whose loading runs code (writes ``marker``): what weights_only=True must refuse."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_sidecar_or_inputs_pt_carrying_a_pickled_object_is_refused_and_runs_nothing(tmp_path):
    rep, _ = faulted()
    path = tmp_path / "r.json"
    rep.save(path)
    files = shadow.load_report(path).repro(None, tmp_path / "gelu")
    marker = str(tmp_path / "ran")
    for planted in (sidecar_path(path), files.inputs):
        torch.save({"format": "shadow-inputs", "version": 1, "calls": [Planted(marker)]}, planted)
    with pytest.raises(SidecarError, match="holds a pickled object other than tensors and plain values.*re-run the"):
        shadow.load_report(path).repro()
    status, text = run_repro(files.script)
    assert status == 2 and "holds a pickled object other than tensors and plain values" in text, text
    assert "Traceback" not in text and "shadow repro" in text
    assert not os.path.exists(marker)
    torch.load(files.inputs, weights_only=False)  # the file is armed: an unsafe load runs its code
    assert os.path.exists(marker)
