"""The examples and `python -m shadow demo` run as a user runs them (subprocesses), and print sane numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shadow

ROOT = Path(__file__).resolve().parents[1]
NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|nan)"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def floats(pattern: str, text: str) -> list[tuple[float, ...]]:
    found = [tuple(float(g) for g in m.groups()) for m in re.finditer(pattern, text)]
    assert found, f"no line matches {pattern!r} in:\n{text}"
    return found


# --- examples/linear_vs_matmul.py ---
@pytest.fixture(scope="module")
def linear_vs_matmul() -> str:
    return ok(run("examples/linear_vs_matmul.py"))


def test_linear_vs_matmul_results_differ_but_each_is_accurate(linear_vs_matmul):
    out = linear_vs_matmul
    (diff_abs, diff_ulp), = floats(rf"difference between the two device results: max {NUM} abs = {NUM} ulp", out)
    # The case is built so the two float32 results visibly differ: |result| ~ 2e5, where the float32
    # spacing is 2**(17-23) = 0.015625; they differ by a whole number of those spacings.
    assert diff_abs > 0.01 and diff_ulp >= 1
    assert diff_abs / 0.015625 == pytest.approx(round(diff_abs / 0.015625))
    # each path's ops are within shadow's float32 error budgets: the matmul uses a small fraction of
    # gamma_k * |x||W|^T; the separate bias add of x @ W.T + B at most half an ulp of its 2-ulp budget
    used = floats(rf"\[ok\] .*: every op within its float32 error budget \(worst uses {NUM} of it\)", out)
    assert len(used) == 2 and all(0 < u <= 1 for (u,) in used), out
    e2e = floats(rf"result vs float64: max {NUM} abs = {NUM} ulp of \|exact\| = {NUM} ulp of sum\|terms\|", out)
    assert len(e2e) == 2
    for err_abs, err_ulp, err_ulp_terms in e2e:
        # a correct float32 summation of 8192 terms: a few ulps of sum|terms| (5.3 and 5.5 measured on
        # CPU); TF32 or fp16 accumulation would be ~2**13 or ~2**10 times more
        assert 0 < err_ulp_terms <= 32
        # every term is >= 0, so sum|terms| = |exact|: the example's ulp at sum|terms| must agree with
        # shadow.metrics' ulp at |exact|
        assert err_ulp_terms == pytest.approx(err_ulp, rel=1e-3)
    # |a - b| <= |a - exact| + |b - exact|
    assert diff_abs <= e2e[0][0] + e2e[1][0]
    assert "verdict: not suspicious" in out and "[FAIL]" not in out


def test_linear_vs_matmul_local_errors_add_up(linear_vs_matmul):
    out = linear_vs_matmul
    local = {op: (ulp, ab) for op, ulp, ab in
             ((m.group(1), float(m.group(2)), float(m.group(3)))
              for m in re.finditer(rf"local\s+(\S+)\s+max\s+{NUM} ulp\s+{NUM} abs", out))}
    assert set(local) == {"aten.addmm.default", "aten.mm.default", "aten.add.Tensor"}, out
    (lin_abs, _, _), (mat_abs, _, _) = floats(rf"result vs float64: max {NUM} abs = {NUM} ulp of \|exact\| = {NUM}", out)
    # F.linear is one addmm on exactly upcast inputs: its local error is the result's whole error
    assert local["aten.addmm.default"][1] == pytest.approx(lin_abs, rel=1e-3)
    # x @ W.T + B: the error of the sum is at most mm's own error plus add's own (a rounding: <= 0.5 ulp)
    assert 0 < local["aten.add.Tensor"][0] <= 0.5
    assert mat_abs <= (local["aten.mm.default"][1] + local["aten.add.Tensor"][1]) * (1 + 1e-3)


# --- examples/train_step.py ---
def test_train_step_example():
    out = ok(run("examples/train_step.py"))
    assert re.search(r"^op\s+calls\s+local ulp\s+budget\s+bits\s+drift rel", out, re.M)
    assert re.search(r"^aten\.addmm\.default\s+3\s", out, re.M)  # 3 Linear layers, one forward
    worst = floats(rf"#\d+\s+aten\.\S+\s+\S+\s+(?:forward|backward|optimizer|other)\s+{NUM} ulp\s+{NUM} abs", out)
    assert len(worst) == 5
    assert [u for u, _ in worst] == sorted((u for u, _ in worst), reverse=True)
    (dev, ref, rel), = floats(rf"loss: device {NUM}\s+shadow {NUM}\s+rel diff {NUM}", out)
    assert abs(dev - ref) / abs(ref) < 1e-6  # float32 loss of a small model: within a few float32 ulps
    params = floats(rf"(?m)^\s+\d\.(?:weight|bias)\s+{NUM}$", out)
    assert len(params) == 6
    # after one AdamW step every parameter carries float32 rounding (nonzero) but stays close to float64
    assert all(0 < p < 1e-4 for p, in params)


# --- python -m shadow ---
def test_demo(tmp_path):
    path = tmp_path / "demo.json"
    out = ok(run("-m", "shadow", "demo", "--device", "cpu", "--save", str(path)))
    assert re.search(r"^aten\.addmm\.default\s+6\s", out, re.M)  # 3 Linear layers x 2 steps
    losses = floats(rf"loss step \d: device {NUM}\s+shadow {NUM}\s+rel diff {NUM}", out)
    assert len(losses) == 2
    for dev, ref, rel in losses:
        assert abs(dev - ref) / abs(ref) < 1e-6
        assert rel == pytest.approx(abs(dev - ref) / abs(ref), rel=0.01, abs=1e-9)
    (param_rel,), = floats(rf"parameters after the last step: max rel_norm\(device - shadow\) {NUM}", out)
    assert 0 < param_rel < 1e-5
    (calls,), = floats(r"coverage: (\d+) aten calls", out)
    assert "0 internal errors" in out
    rep = shadow.load_report(path)
    assert rep.coverage.calls == calls
    assert rep.by_op["aten.addmm.default"].calls == 6


def test_cli_without_a_command_prints_help_and_exits_2():
    proc = run("-m", "shadow")
    assert proc.returncode == 2 and "usage: shadow" in proc.stderr and "demo" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--help"], None),
    (["demo", "--help"], None),
    (["demo", "--steps", "0"], "argument --steps: expected a whole number >= 1, got 0"),
    (["demo", "--steps", "two"], "argument --steps: expected a whole number >= 1, got 'two'"),
    (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["demo", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
])
def test_cli_arguments(argv, message, capsys):
    from shadow.cli import main

    with pytest.raises(SystemExit) as exc:  # argparse exits: 0 after --help, 2 on a usage error
        main(argv)
    out, err = capsys.readouterr()
    if message is None:
        assert exc.value.code == 0 and "usage: shadow" in out
    else:
        assert exc.value.code == 2 and message in err


def test_cli_unavailable_device_is_a_clear_error(capsys):
    from shadow.cli import main
    from shadow.devices import discover

    missing = next((b for b in discover() if not b.available), None)
    if missing is None:
        pytest.skip("every backend is available here: no device to ask for that is missing")
    assert main(["demo", "--device", missing.name]) == 2
    assert f"--device {missing.name} is not available on this machine: {missing.reason}; available: " \
        in capsys.readouterr().err


# --- README and CI agree ---
def test_readme_opens_with_the_two_commands_ci_runs():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```sh") + 1: lines.index("```")]
    assert lines.index("```sh") <= 2, "the README must open with its commands"
    assert block == [
        "python -m pip install torch==2.13.0 -e '.[test]' && python -m shadow demo",
        "python -m pip install torch==2.13.0 -e '.[test]' && python -m pytest -q",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and "python -m pip install torch==2.13.0\n" in ci
    pattern = re.search(r'grep -m1 -E "(.*?)" README\.md', ci).group(1)
    assert [ln for ln in lines if re.search(pattern, ln)][0] == block[1]


def test_pytest_config_does_not_deselect_slow_tests(request):
    # CI runs the README's plain `python -m pytest -q`: slow tests run only while no addopts filters them
    addopts = " ".join(request.config.getini("addopts"))
    assert not re.search(r"(^|\s)-m\b|--markers?\b", addopts), addopts
