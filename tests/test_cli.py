"""`shadow run`, `show`, `compare` and `--version`, as a user runs them: in-process through `shadow.cli.main` (the
same code as the console script, minus a Python start-up each), with one subprocess for the console entry."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import shadow
from shadow import ShadowMode, load_report
from shadow.cli import main
from shadow.cli.run import Stopped, Stops
from shadow.progress import Progress, status
from shadow.tables import MANY_ULPS, ORDER

ROOT = Path(__file__).resolve().parents[1]
TRAIN = "examples/train.py"  # a training loop that knows nothing of shadow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`shadow run` on the example (2 steps), on the CPU as it is and as TF32 would compute its matmuls."""
    out = tmp_path_factory.mktemp("runs")
    cwd = os.getcwd()
    os.chdir(ROOT)  # call sites are named relative to the working directory
    try:
        paths = {"fp32": out / "fp32.json", "tf32": out / "tf32.json"}
        assert main(["run", "-o", str(paths["fp32"]), TRAIN, "--steps", "2"]) == 0
        assert main(["run", "--emulate", "tf32", "-o", str(paths["tf32"]), TRAIN, "--steps", "2"]) == 0
    finally:
        os.chdir(cwd)
    return paths


def _train_module():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return train


# --- run ---
def test_run_writes_the_report_of_the_same_code_wrapped_in_shadowmode(runs, monkeypatch):
    monkeypatch.chdir(ROOT)
    with ShadowMode() as sm:
        _train_module().main(["--steps", "2"])
    ran, wrapped = load_report(runs["fp32"]).to_dict(), sm.report.to_dict()
    assert ran["records"] and ran["dropped_records"] == 0
    for part in ("records", "cells", "by_op", "by_module", "coverage", "events"):  # every figure, every call
        assert ran[part] == wrapped[part], part
    run = load_report(runs["fp32"]).meta["run"]
    assert run == {"argv": [TRAIN, "--steps", "2"], "emulate": None, "skip_steps": 0, "steps": None,
                   "optimizer_steps": 2, "exit_status": 0}


def test_run_gives_the_script_its_argv_main_and_folder(tmp_path, capsys, monkeypatch):
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""\
        import sys
        import helper                      # from the script's own folder
        import os
        import torch
        print("argv", sys.argv, __name__, helper.VALUE, float((torch.ones(3) * 2).sum()))
        os.chdir(os.path.dirname(helper.__file__) + "/sub")
        sys.exit(3)
    """))
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["run", "-o", "r.json", str(script), "--flag", "x"]) == 3   # -o relative to where shadow started
    assert f"argv {[str(script), '--flag', 'x']} __main__ 42 6.0" in capsys.readouterr().out
    rep = load_report(tmp_path / "r.json")
    assert rep.meta["run"]["exit_status"] == 3 and rep.by_op["aten.mul.Tensor"].calls == 1
    assert str(tmp_path) not in sys.path and sys.argv[0] != str(script)  # restored after the run


def test_run_shadows_only_the_steps_asked_for(tmp_path, monkeypatch, capsys):
    """--skip-steps 1 --steps 1: from the end of step 1 to the end of step 2: step 2's forward, backward and AdamW
    update, with module names as in a run shadowed from the start."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "window.json"
    assert main(["run", "--skip-steps", "1", "--steps", "1", "-o", str(path), TRAIN, "--steps", "3"]) == 0
    rep = load_report(path)
    phases = {str(p): a.calls for p, a in rep.by_phase.items()}
    assert phases["forward"] and phases["backward"] and phases["optimizer"]
    assert rep.by_op["aten.addmm.default"].calls == 2  # one forward: two Linear layers with a bias
    assert rep.by_op["aten.addcdiv_.default"].calls == 4  # one AdamW update of 4 parameters
    assert {"Sequential.0", "Sequential.2", "Sequential.0.weight"} <= set(rep.by_module)
    assert rep.meta["run"]["optimizer_steps"] == 3
    assert "optimizer step 2 of 3" in capsys.readouterr().err


def test_run_asked_for_steps_the_script_never_makes(tmp_path, capsys):
    script = tmp_path / "no_steps.py"
    script.write_text("import torch\nprint(float(torch.ones(2).sum()))\n")
    assert main(["run", "--skip-steps", "5", "-o", str(tmp_path / "r.json"), str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("shadow: error: run: the script made 0 optimizer steps, so shadowing (from the end of step 5) "
                   "never began: nothing was shadowed; give a smaller --skip-steps")


def test_run_a_script_that_raises_shows_its_own_traceback_and_writes_the_report(tmp_path, capsys):
    script = tmp_path / "raiser.py"
    script.write_text(textwrap.dedent("""\
        import torch


        def broken(x):
            return torch.mm(x, torch.ones(3, 5))


        x = torch.randn(4, 4)
        y = (x @ x).sum()
        broken(x)
    """))
    assert main(["run", "-o", str(tmp_path / "r.json"), str(script)]) == 1
    err = capsys.readouterr().err
    trace = err[err.index("Traceback"):err.index("shadow: report written")]
    # what `python raiser.py` prints: the script's two frames and torch's error, no frame of shadow or runpy
    assert [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")] == [
        f'File "{script}", line 10, in <module>', f'File "{script}", line 5, in broken']
    assert trace.rstrip().endswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x4 and 3x5)")
    rep = load_report(tmp_path / "r.json")  # the partial report: what ran before the error
    assert rep.by_op["aten.mm.default"].calls == 1 and rep.meta["run"]["exit_status"] == 1


ARGPARSE_SCRIPT = """\
    import argparse
    import sys

    import torch

    print("argv", sys.argv[1:])
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    print(float((torch.ones(2) * p.parse_args().lr).sum()))
"""


def test_run_names_its_own_options_given_after_a_script_that_failed(tmp_path, capsys, monkeypatch):
    """The script gets everything after it unchanged, and argparse refuses what it does not know (exit 2): the note
    names the options of run's own among them and gives the command with them before the script."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ARGPARSE_SCRIPT))
    monkeypatch.chdir(tmp_path)
    argv = ["--lr", "0.5", "--emulate", "bf16", "--no-local", "--max-records=10"]
    assert main(["run", str(script), *argv]) == 2
    out, err = capsys.readouterr()
    assert f"argv {argv}" in out  # unchanged
    assert "train.py: error: unrecognized arguments: --emulate bf16 --no-local --max-records=10" in err
    assert err.splitlines()[-1] == (
        "shadow: note: `--emulate`, `--no-local` and `--max-records` are options of shadow run, given after the "
        "script: the script got them (everything after the script is its own). shadow's options go before the "
        f"script: shadow run --emulate bf16 --no-local --max-records=10 {script} --lr 0.5")
    assert main(["run", str(script), "--lr", "0.5", "-o", "r.json"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"is an option of shadow run, given after the script: the script got it (everything after the script is "
        f"its own). shadow's options go before the script: shadow run -o r.json {script} --lr 0.5")


def test_run_says_nothing_of_options_when_the_script_succeeds_or_has_none_of_runs(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ARGPARSE_SCRIPT))
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(script), "--lr", "0.5"]) == 0
    assert main(["run", str(script), "--lr", "0.5", "--epochs", "3"]) == 2  # fails, on an option of its own
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_run_without_a_script_is_a_one_line_error(tmp_path, capsys, what):
    path = tmp_path / "nope.py" if what == "missing" else tmp_path
    assert main(["run", "-o", str(tmp_path / "r.json"), str(path)]) == 2
    out, err = capsys.readouterr()
    why = "no such file" if what == "missing" else "is a directory"
    assert out == "" and err == (f"shadow: error: run: {path}: {why}; give the path of a Python script: "
                                 "shadow run [OPTIONS] SCRIPT [ARGS...]\n")
    assert not (tmp_path / "r.json").exists()


def test_run_checks_the_report_path_before_running(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    assert main(["run", "-o", str(tmp_path / "missing" / "r.json"), str(script)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "run: -o" in err and "does not exist; give a writable path" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"shadow {shadow.__version__} (torch {torch.__version__}, Python ")


def test_console_entry_lists_every_command_and_runs_a_raising_script(tmp_path):
    """The real entry (`python -m shadow`): every command registered (html from its own module), and a raising
    script's stderr as Python's own."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    usage = subprocess.run([sys.executable, "-m", "shadow", "--help"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert usage.returncode == 0
    assert all(f"\n    {name} " in usage.stdout for name in ("demo", "run", "show", "compare", "doctor", "html"))
    script = tmp_path / "raiser.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\nraise ValueError('bad value')\n")
    proc = subprocess.run([sys.executable, "-m", "shadow", "run", "-o", str(tmp_path / "r.json"), str(script), "a"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1 and proc.stdout == "args ['a']\n"
    assert proc.stderr.startswith(f'Traceback (most recent call last):\n  File "{script}", line 3, in <module>\n'
                                  "    raise ValueError('bad value')\nValueError: bad value\nshadow: report written")
    assert load_report(tmp_path / "r.json").meta["run"]["exit_status"] == 1


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_run_stopped_by_a_signal_writes_the_calls_made_so_far(tmp_path, name):
    """A job scheduler's or a timeout's SIGTERM (a lost terminal's SIGHUP) stops `shadow run` as Ctrl-C does: the
    script unwinds, the partial report is written and loads, the exit status is 128 + the signal's number."""
    number = getattr(signal, name)
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""\
        import torch
        x, n = torch.ones(4), 0
        try:
            while True:
                x = x * 1.0
                n += 1
                if n == 50:
                    print("50 calls made", flush=True)
        finally:
            print("calls", n, flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "shadow", "run", "-o", "r.json", str(script)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "50 calls made\n"
        proc.send_signal(number)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + number, err
    made = int(out.split()[-1])
    assert f"Stopped: stopped by {name}" in err and "shadow: report written to r.json" in err
    rep = load_report(tmp_path / "r.json")
    # every call the script made: the signal may come between a multiplication and its count
    assert made >= 50 and made <= rep.by_op["aten.mul.Tensor"].calls <= made + 1
    assert rep.meta["run"]["exit_status"] == 128 + number
    assert main(["show", str(tmp_path / "r.json")]) == 0  # and it reads as any report


def test_a_signal_outside_the_script_is_held_until_the_report_is_written(tmp_path, capsys, monkeypatch):
    """A SIGTERM that comes while the report is written does not cut the write short: the report is whole, and
    the command then exits 143. Before the script starts, one stops it at once."""
    from shadow import reportformat

    dump = reportformat.dump_json

    def signalled_dump(report, f):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, between two bytecodes
        dump(report, f)

    monkeypatch.setattr(reportformat, "dump_json", signalled_dump)
    script = tmp_path / "s.py"
    script.write_text("import torch\ntorch.ones(3) * 2\n")
    before = signal.getsignal(signal.SIGTERM)
    assert main(["run", "-o", str(tmp_path / "r.json"), str(script)]) == 143
    assert "shadow: stopped by SIGTERM" in capsys.readouterr().err
    assert load_report(tmp_path / "r.json").meta["run"]["exit_status"] == 0  # the script itself ran to its end
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers found are back
    with Stops() as stops:
        os.kill(os.getpid(), signal.SIGHUP)
        assert stops.held == signal.SIGHUP
        with pytest.raises(Stopped, match="stopped by SIGHUP"):
            with stops.armed():
                pytest.fail("a script started after a signal came")


def test_run_under_torchrun_writes_one_report_per_rank(tmp_path, capsys, monkeypatch):
    """Each rank of `torchrun -m shadow run` writes its own report (the -o path with .rankN), and `shadow show`
    merges them; one rank alone writes the path as given."""
    script = tmp_path / "s.py"
    script.write_text("import torch\nx = torch.ones(3)\nfor _ in range(int(__import__('os').environ['RANK']) + 1):\n"
                      "    x = x * 2\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert main(["run", "-o", str(tmp_path / "r.json"), str(script)]) == 0
        assert f"report written to {tmp_path / f'r.rank{rank}.json'}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("r*.json")) == ["r.rank0.json", "r.rank1.json"]
    ranks = [load_report(tmp_path / f"r.rank{r}.json").by_op["aten.mul.Tensor"].calls for r in (0, 1)]
    assert ranks == [1, 2]
    assert main(["show", str(tmp_path / "r.rank0.json"), str(tmp_path / "r.rank1.json")]) == 0
    assert "2 reports merged" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["run", "-o", str(tmp_path / "alone.json"), str(script)]) == 0
    assert (tmp_path / "alone.json").exists()


# --- show ---
def test_show_prints_the_table_legend_and_verdict(runs, capsys):
    assert main(["show", str(runs["fp32"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{runs['fp32']}: shadow run {TRAIN} --steps 2; the whole script: 2 optimizer steps; "
                          "exit status 0 (torch")
    assert f"rows: {ORDER}; columns:" in out
    assert "\n  budget     worst local error / the error a correct kernel" in out
    assert "verdict: all " in out and "within their float32 budgets: nothing suspicious" in out
    assert "\ncoverage: " in out

    assert main(["show", str(runs["tf32"]), "--by", "module", "--top", "2"]) == 0
    out = capsys.readouterr().out
    rows = out.split("-\n", 1)[1].split("\n\n")[0].splitlines()
    assert [r.split()[0] for r in rows[:2]] == ["Sequential.2", "Sequential.0"] and rows[2].startswith("(2 of ")
    assert "verdict: 2 op classes over budget" in out
    assert "  aten.mm " in out and "TF32-like" in out


def test_demo_explains_every_large_figure_on_its_first_screen(tmp_path, capsys):
    """Issue 53: the demo showed aten.mm 9e+05 local ulps beside budget 0.22 and "nothing suspicious". Every figure
    over MANY_ULPS carries its mark (c: a derived budget allows it, every call within it; z: an exact zero), the
    legend that explains it comes before the verdict, and each figure is the records' own."""
    path = tmp_path / "demo.json"
    assert main(["demo", "--device", "cpu", "--steps", "1", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    rep = load_report(path)
    table = out.split("-\n", 1)[1].split("\n\n")[0].splitlines()
    large = 0
    for line in table:
        op, _, ulp, budget = re.split(r"\s{2,}", line.strip())[:4]
        records = [r for r in rep.records if r.op == op and r.local is not None]
        worst = max(records, key=lambda r: r.local.ulp_nonzero, default=None)
        figure = rep.by_op[op].max_local_ulp_nonzero
        assert figure == (worst.local.ulp_nonzero if worst is not None else 0.0)  # every record kept
        if figure > MANY_ULPS:
            large += 1
            marks = ulp.split()[1:]
            assert marks and set(marks) <= {"z", "c"}, line
            if "c" in marks:  # every call held to a derived budget, within it
                assert all(r.budget is not None and not r.budget.is_default and r.budget.used <= 1
                           for r in records if r.budget is not None), line
                assert worst.budget is not None and not worst.budget.is_default and worst.budget.used <= 1
    assert large  # the demo has them: the test bites
    words = " ".join(out.split())  # the legend wraps to the terminal's width
    assert words.index("c: over 16 ulps yet within a derived budget") < words.index(" verdict: ")
    derived = sum(1 for r in rep.records if r.budget is not None and not r.budget.is_default)
    assert (f"\nverdict: all {derived} calls held to derived budgets are within their float32 budgets: nothing "
            "suspicious\n") in out


def test_show_merges_several_reports(runs, capsys):
    """Several files (the ranks of a distributed run) are shown as one report: calls add up."""
    assert main(["show", str(runs["fp32"]), str(runs["tf32"]), "--top", "all"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"2 reports merged (ranks 0, 1): {runs['fp32']}, {runs['tf32']}")
    calls = sum(load_report(runs[k]).coverage.calls for k in ("fp32", "tf32"))
    assert f"\ncoverage: {calls} aten calls" in out


def test_show_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    for argv, message in [
        (["show", str(tmp_path / "none.json")], f"show: {tmp_path / 'none.json'}: no such file; give a report written "
                                                "by shadow run (-o PATH) or Report.save"),
        (["show", str(bad)], f"show: {bad}: not a shadow report: expected format 'shadow-report', got 'something "
                             "else'; give a report written by shadow run or Report.save"),
        (["show", str(bad), "--tree"], "show: --tree folds modules into their parents: use it with --by module"),
    ]:
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == f"shadow: error: {message}\n"


# --- compare ---
def test_compare_names_the_tf32_matmuls_as_worse(runs, capsys):
    assert main(["compare", str(runs["fp32"]), str(runs["tf32"])]) == 1  # B is worse: like diff, status 1
    out = capsys.readouterr().out
    assert re.search(r"^matched (\d+) calls in order, of A's \1 and B's \1 \(100%\)$", out, re.M)
    worse = out.split("own error worse in B, by op (A -> B):\n")[1].split("own error worse in B, by module")[0]
    assert [line.split()[0] for line in worse.splitlines()] == ["aten.mm.default", "aten.addmm.default"]
    assert "verdict: B is worse: the own error of 2 op classes grew 2x or more: aten.mm " in out


def test_compare_identical_runs_says_nothing_changed(runs, capsys):
    assert main(["compare", str(runs["fp32"]), str(runs["fp32"])]) == 0
    assert capsys.readouterr().out.endswith("verdict: nothing changed: the same calls with the same figures\n")


def test_compare_refuses_reports_of_different_programs(runs, tmp_path, capsys):
    other = tmp_path / "other.json"
    with ShadowMode() as sm:
        torch.ones(3).exp()
    sm.report.save(other)
    assert main(["compare", str(runs["fp32"]), str(other)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"shadow: error: compare: {runs['fp32']} and {other}: the reports are not of the same "
                          "program: only 0% of their op calls match in order")
    assert err.rstrip().endswith("compare two runs of the same script with the same steps")


# --- progress ---
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal_only(capsys):
    with ShadowMode() as sm:
        (torch.randn(4, 64) @ torch.randn(64, 4)).sum()
    assert status(sm.report, 3, True).startswith(f"shadow: {sm.report.coverage.calls} calls, step 3 (shadowing), "
                                                 "worst aten.")
    term, log = _Terminal(), io.StringIO()
    for stream in (term, log):
        with Progress(sm.report, step=lambda: 1, shadowing=lambda: False, stream=stream, interval=0.01):
            for _ in range(100):  # until the thread has drawn at least once
                if stream.getvalue():
                    break
                time.sleep(0.01)
            print("the script's own line")  # erases the status line first
    assert term.getvalue().startswith("shadow: ") and "step 1 (waiting)" in term.getvalue()
    assert "\r\x1b[K" in term.getvalue() and term.getvalue().endswith("\r\x1b[K")  # erased, and at the end
    assert log.getvalue() == ""
    assert capsys.readouterr().out == "the script's own line\n" * 2
