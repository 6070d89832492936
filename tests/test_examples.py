"""The examples and `python -m shadow demo` run as a user runs them (subprocesses), and print sane numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
def test_linear_vs_matmul_runs_and_concludes():
    out = ok(run("examples/linear_vs_matmul.py"))
    assert out.count("[ok]") == 5 and "[FAIL]" not in out and "verdict: not suspicious" in out


def test_linear_vs_matmul_results_differ_but_each_is_accurate():
    """The example's figures, computed in-process (never parsed from how they round in print)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import linear_vs_matmul as ex
    finally:
        sys.path.remove(str(ROOT / "examples"))
    x, w, b = ex.make_case(64, 8192, 256, 10.0, 0)
    terms = x.double().abs() @ w.double().abs().T + b.double().abs()
    paths = [ex.run_path("linear", lambda x, w, b: torch.nn.functional.linear(x, w, b), x, w, b, terms),
             ex.run_path("matmul", lambda x, w, b: x @ w.T + b, x, w, b, terms)]
    diff = (paths[0].y.double() - paths[1].y.double()).abs().max().item()
    # The case is built so the two float32 results visibly differ: |result| ~ 2e5, where the float32
    # spacing is 2**(17-23) = 0.015625; they differ by a whole number of those spacings.
    assert diff > 0.01 and diff / 0.015625 == round(diff / 0.015625)
    for p in paths:
        # each path's ops within shadow's float32 error budgets: the matmul uses a small fraction of
        # gamma_k * |x||W|^T (its error is not 0: a float32 sum of 8192 terms rounds)
        assert 0 < p.budget_used <= 1
        # a correct float32 summation of 8192 terms: a few ulps of sum|terms|; TF32 or fp16 accumulation
        # would be ~2**13 or ~2**10 times more
        assert 0 < p.err_ulp_terms <= 32 and p.err_abs > 0
        # every term is >= 0, so sum|terms| = |exact| (up to the ulp's binade): the two ulp figures agree
        assert p.err_ulp == pytest.approx(p.err_ulp_terms, rel=1.0)


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


def test_demo_save_path_is_checked_before_the_run(tmp_path, capsys):
    from shadow.cli import main

    assert main(["demo", "--device", "cpu", "--save", str(tmp_path / "nonexistent" / "x.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"--save {tmp_path / 'nonexistent' / 'x.json'}: the folder" in err and "does not exist" in err
    assert main(["demo", "--device", "cpu", "--save", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


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
        "python -m pip install torch==2.13.0 -e '.[test]' && python -m pytest -q -n 2",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and "python -m pip install torch==2.13.0\n" in ci
    pattern = re.search(r'grep -m1 -E "(.*?)" README\.md', ci).group(1)
    assert [ln for ln in lines if re.search(pattern, ln)][0] == block[1]


def test_pytest_config_does_not_deselect_slow_tests(request):
    # CI runs the README's plain `python -m pytest -q`: slow tests run only while no addopts filters them
    addopts = " ".join(request.config.getini("addopts"))
    assert not re.search(r"(^|\s)-m\b|--markers?\b", addopts), addopts
