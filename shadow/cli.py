"""The ``shadow`` command line (also ``python -m shadow``):

    shadow run [OPTIONS] SCRIPT [ARGS...]   run a script unchanged under ShadowMode, write shadow-report.json
    shadow show REPORT                      the tables, their legend and the verdict
    shadow compare A B                      which ops and modules got worse in B than in A
    shadow demo | doctor                    a small model's step; the device backends
    shadow explain OP                       what shadow knows about an op: every table's answer
    shadow --version

Exit status:
    0    success; ``compare``: nothing got worse in B
    1    ``run``: the script raised (its traceback shown, the partial report written); ``compare``: B is worse
    2    a usage error or unusable input, with a one-line message naming the problem and the fix: a bad option, a
         missing script or report, an unwritable ``-o``, a report that cannot be read, two reports not of the same
         program, optimizer steps asked for that the script never made
    N    ``run``: the script's own ``sys.exit(N)``; 128 + the signal's number when a signal stopped it: 130 on
         Ctrl-C (SIGINT), 143 on SIGTERM (a timeout, a job scheduler, CI), 129 on SIGHUP; the partial report written

The CLI is the one place that prints; library code returns objects and leaves rendering to its caller.
Each subcommand is a function registered with ``@command``; ``main`` builds the parser from that table.

>>> main(["run", "examples/train.py", "--steps", "1"])   # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import runpy
import shutil
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

import torch

from . import __version__
from . import devices as _devices
from .modes.emulate import EMULATIONS
from .options import FOLLOW
from .distributed import rank_path
from .records import Phase
from .report import VIEWS, Report
from .scratch import copy

DEVICES = ("auto",) + _devices.BACKENDS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class _Command:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int]  # returns the exit status
    arguments: Callable[[argparse.ArgumentParser], None]  # adds the subcommand's own arguments


_COMMANDS: dict[str, _Command] = {}


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] | None = None):
    """Register ``run(args) -> int`` as the subcommand ``name``; ``arguments(parser)`` adds its options.

    >>> @command("hello", "say hello")
    ... def _hello(args): print("hello"); return 0      # doctest: +SKIP
    """

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in _COMMANDS:
            raise ValueError(f"shadow command {name!r} is already registered (by {_COMMANDS[name].run.__qualname__})")
        _COMMANDS[name] = _Command(name, help, run, arguments or (lambda parser: None))
        return run

    return register


# --- argument types: errors name what was expected and what came ---
def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {n}")
    return n


def _count_or_all(text: str) -> int | None:
    """A whole number >= 0, or "all" (None: no limit)."""
    if text == "all":
        return None
    try:
        return _count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 or 'all', got {text!r}") from None


def _spot_checks(text: str) -> str | int:
    if text in ("off", "default", "all"):
        return text
    try:
        return _count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected off, default, all or a number of samples per call, "
                                         f"got {text!r}") from None


def _factor(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not x > 1:
        raise argparse.ArgumentTypeError(f"expected a number > 1, got {text!r}")
    return x


class _Failure(Exception):
    """A command cannot go on: its message (one line: the problem and the fix) is printed, the exit status is 2."""


# --- demo ---
def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model runs (default: auto = the first available of "
                        f"{', '.join(_devices.PREFERENCE)}; `shadow doctor` lists them)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's dtype (default: float32)")
    p.add_argument("--steps", type=_positive_int, default=2, help="optimizer steps to shadow (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for weights and data (default: 0)")
    p.add_argument("--top", type=_positive_int, default=None, help="show only the N worst ops in the table")
    p.add_argument("--save", metavar="PATH", default=None, help="also write the report as JSON to PATH")


@command("demo", "shadow a small model's training step (Linear layers, Adam) and print the per-op table and verdict",
         _demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from .modes import ShadowMode

    backends = _devices.discover()
    if args.device == "auto":
        backend = _devices.choose(backends)
    else:
        backend = next(b for b in backends if b.name == args.device)
        if not backend.available:
            available = ", ".join(b.name for b in backends if b.available)
            return _fail(f"demo: --device {args.device} is not available on this machine: {backend.reason}; "
                         f"available: {available} (or --device auto)")
    if args.save and (problem := _unwritable(args.save)):
        return _fail(f"demo: --save {args.save}: {problem}")
    device = backend.torch_device()
    dtype = DTYPES[args.dtype]
    if dtype == torch.float64 and backend.float64 is False:
        return _fail(f"demo: --dtype float64 is not supported on {backend.name} ({backend.device_name or device}); "
                     "use float32, bfloat16 or float16")

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    ).to(device=device, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 64, device=device, dtype=dtype)
    y = torch.randint(0, 10, (128,), device=device)

    losses = []
    with ShadowMode() as sm:
        for _ in range(args.steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss)
    rep = sm.report

    print(f"shadow demo: MLP 64-256-256-10, Adam, {args.steps} step(s) on {device} {args.dtype} "
          f"(torch {torch.__version__}); errors against a float64 replay on the CPU")
    print()
    print(_summary(rep, top=args.top))
    print()
    print("coverage:", rep.coverage)
    for i, loss in enumerate(losses):
        dev, ref = loss.item(), sm.shadow_of(loss).item()
        print(f"loss step {i + 1}: device {dev:.9g}  shadow {ref:.17g}  rel diff {abs(dev - ref) / abs(ref):.3g}")
    params = [(p.detach(), sm.shadow_of(p)) for p in model.parameters()]
    bad = sum(int((~torch.isfinite(p)).sum()) for p, _ in params)
    if bad:
        print(f"parameters after the last step: {bad} non-finite elements on the device")
    else:
        print(f"parameters after the last step: max rel_norm(device - shadow) "
              f"{max(_rel_diff(p, s) for p, s in params):.3g}")
    first = rep.first_nonfinite()
    if first is not None:
        print(f"first op call where device and shadow disagree on NaN/Inf: #{first.index} {first.op} "
              f"{first.module or '-'} ({first.phase})")
    if args.save:
        rep.save(args.save)
        print(f"report saved to {args.save}")
    return 0


# --- run ---
DEFAULT_MAX_RECORDS = 10_000  # per-call records kept by `run` (~1.2 kB each in the file); the tables cover every call


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="the Python script to run, unchanged (shadow's options come before it)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments: its sys.argv[1:]")
    p.add_argument("-o", "--output", metavar="PATH", default="shadow-report.json",
                   help="where to write the report (default: shadow-report.json in the working directory); each rank "
                        "of a distributed run (torchrun -m shadow run) writes its own, PATH with .rankN before .json")
    p.add_argument("--skip-steps", type=_count, default=0, metavar="N",
                   help="start shadowing when optimizer step N returns (default 0: from the start); every "
                        "optimizer.step() call of any optimizer counts")
    p.add_argument("--steps", type=_positive_int, default=None, metavar="M",
                   help="stop shadowing when optimizer step N+M returns (default: at the script's end)")
    p.add_argument("--emulate", choices=sorted(EMULATIONS), default=None,
                   help="compute on the CPU as an emulated device would (shadow.modes.emulate), e.g. tf32")
    p.add_argument("--max-records", type=_count_or_all, default=DEFAULT_MAX_RECORDS, metavar="N|all",
                   help=f"per-call records kept in the report (default {DEFAULT_MAX_RECORDS}: ~13 MB); the tables "
                        "and the verdict cover every call regardless")
    p.add_argument("--spot-checks", type=_spot_checks, default="default", metavar="off|default|all|N",
                   help="mpmath checks of the float64 reference: default (2 elements of each op's first 16 "
                        "calls, then of one call in 16), N (N elements of every call), all, or off")
    p.add_argument("--follow", choices=FOLLOW, default="device",
                   help="discrete results downstream (indices, masks): the device's or the shadow's own")
    p.add_argument("--no-local", dest="local", action="store_false", help="skip each op's own error (faster)")
    p.add_argument("--no-drift", dest="drift", action="store_false", help="skip the accumulated error")
    p.add_argument("--no-budgets", dest="budgets", action="store_false", help="skip the error budgets")
    p.add_argument("--no-callsites", dest="callsites", action="store_false",
                   help="skip recording each call's line in the script (faster)")
    p.add_argument("--compare-cpu", action="store_true",
                   help="also run each op on the CPU in the device's dtype: device error / CPU error")


@command("run", "run a Python script unchanged under ShadowMode (like python -m cProfile) and write its report",
         _run_arguments)
def _run(args: argparse.Namespace) -> int:
    from .modes import ShadowMode
    from .modes.emulate import emulate
    from .progress import Progress
    from .verdict import conclude

    if not os.path.isfile(args.script):
        why = "is a directory" if os.path.isdir(args.script) else "no such file"
        raise _Failure(f"{args.script}: {why}; give the path of a Python script: shadow run [OPTIONS] SCRIPT [ARGS...]")
    if problem := _unwritable(args.output):
        raise _Failure(f"-o {args.output}: {problem}; give a writable path")
    output = os.path.abspath(args.output)  # where the user meant, even if the script changes directory
    sm = ShadowMode(local=args.local, drift=args.drift, follow=args.follow, max_records=args.max_records,
                    spot_checks=args.spot_checks, budgets=args.budgets, compare_cpu=args.compare_cpu,
                    callsites=args.callsites)
    window = _StepWindow(sm, args.skip_steps, args.steps)
    device = emulate(args.emulate) if args.emulate else contextlib.nullcontext()  # outside ShadowMode, as it must be
    with _Stops() as stops:
        with device, window, Progress(sm.report, step=lambda: window.done, shadowing=lambda: window.active):
            status = _exec_script(args.script, args.args, stops)
        rep = sm.report
        rep.meta["run"] = {"argv": [args.script, *args.args], "emulate": args.emulate, "skip_steps": args.skip_steps,
                           "steps": args.steps, "optimizer_steps": window.done, "exit_status": status}
        shown = rank_path(args.output, rep.meta)  # one file per rank of a distributed run
        rep.save(rank_path(output, rep.meta))
    print(f"shadow: report written to {shown}: {rep.coverage.calls} calls shadowed "
          f"({_shadowed(rep.meta['run'])}); read it with: shadow show {shown}", file=sys.stderr)
    if stops.held is not None:  # a signal came while the report was written: stop now, as it asked
        print(f"shadow: stopped by {signal.Signals(stops.held).name}", file=sys.stderr)
        return 128 + stops.held
    if not window.opened:
        if status:
            return status
        raise _Failure(f"the script made {window.done} optimizer steps, so shadowing (from the end of step "
                       f"{args.skip_steps}) never began: nothing was shadowed; give a smaller --skip-steps")
    for line in conclude(rep).lines:
        print(f"shadow: {line}", file=sys.stderr)
    return status


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # what stops `run`: Ctrl-C, a timeout or a scheduler, a lost terminal
_SIGNAL_NUMBERS = {getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)}


class Stopped(BaseException):
    """A signal stopped the script: raised in it as Ctrl-C raises KeyboardInterrupt (SIGTERM and SIGHUP, whose
    default is to end the process at once, report unwritten). A BaseException, as KeyboardInterrupt: the script's
    ``except Exception`` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class _Stops:
    """``run``'s signal handlers, from its start to its report's last byte: while the script runs (``armed``),
    SIGINT raises KeyboardInterrupt in it and SIGTERM and SIGHUP raise ``Stopped``; outside it (ShadowMode entered
    or left, the report written) a signal is held (``held``: the first one), so the report is written whole and
    the command then exits as the signal asked. The handlers found are restored on exit; a script that installs
    its own keeps them while it runs. Signal handlers exist in the main thread only: elsewhere, nothing changes."""

    def __init__(self) -> None:
        self.held: int | None = None
        self._armed = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stops:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                if hasattr(signal, name):  # no SIGHUP on Windows
                    number = getattr(signal, name)
                    self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    @contextlib.contextmanager
    def armed(self) -> Any:
        """While the script runs: a signal stops it (one held before it began stops it at once)."""
        if self.held is not None:
            raise self._stop(self.held)
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self._armed:
            self._armed = False  # one stop: a second signal while the script unwinds is held, not raised in it
            raise self._stop(signum)
        if self.held is None:
            self.held = signum

    @staticmethod
    def _stop(signum: int) -> BaseException:
        return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


class _StepWindow:
    """Shadows optimizer steps ``skip + 1`` to ``skip + steps``: ``mode`` is entered when step ``skip`` returns (at
    the start when ``skip`` is 0) and left when step ``skip + steps`` returns (at the script's end when ``steps`` is
    None). A step's forward and backward run before its ``optimizer.step()``, so the end of step N is where step
    N + 1 begins. Every ``step()`` call of any optimizer counts (two optimizers make two steps an iteration).

    The switch happens when the step's frame returns, not in the post hook that counts the step: entering or
    leaving ShadowMode adds or removes optimizer step hooks of its own, while torch is iterating over that table to
    call the post hooks ("OrderedDict mutated during iteration"; or a hook of ShadowMode's called at the end of a
    step it never saw begin). So the hook marks its caller, the step's frame, to call back when it returns."""

    def __init__(self, mode: Any, skip: int, steps: int | None):
        self.mode, self.skip, self.steps = mode, skip, steps
        self.done = 0  # optimizer steps the script completed
        self.active = False  # the mode is entered
        self.opened = False  # ... was at some point
        self._handle = None

    def __enter__(self) -> _StepWindow:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self._stepped)
        if self.skip == 0:
            self._open()
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        if self.active:
            self._close()

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.done += 1
        if self.done == self.skip and not self.opened:
            _on_return(sys._getframe(1), self._open)
        elif self.active and self.steps is not None and self.done == self.skip + self.steps:
            _on_return(sys._getframe(1), self._close)

    def _open(self) -> None:
        self.mode.__enter__()
        self.active = self.opened = True

    def _close(self) -> None:
        self.active = False
        self.mode.__exit__(None, None, None)


def _on_return(frame: Any, action: Callable[[], None]) -> None:
    """Call ``action()`` when ``frame`` returns, as pdb's "return" command does: a trace function on that frame
    (chained to one it already has), and tracing turned on for this thread only until then (new frames untraced)."""
    previous = sys.gettrace()
    inner = frame.f_trace

    def trace(f: Any, event: str, arg: Any) -> Any:
        nonlocal inner
        if inner is not None:
            inner = inner(f, event, arg)
        if event != "return":
            return trace
        if previous is None:
            sys.settrace(None)
        action()
        return inner

    frame.f_trace = trace
    if previous is None:
        frame.f_trace_lines = False
        sys.settrace(_untraced)


def _untraced(frame: Any, event: str, arg: Any) -> None:
    return None


def _exec_script(path: str, argv: list[str], stops: _Stops) -> int:
    """Run ``path`` as ``python path ARGS...`` would: as ``__main__``, with ``sys.argv`` = [path, ARGS...] and its
    folder first on ``sys.path``. Returns its exit status; an exception is printed as the script's own traceback
    (shadow's and runpy's frames left out) and gives 1, as Python gives; a signal (``stops``) 128 + its number."""
    saved_argv, saved_path = sys.argv, sys.path[:]
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with stops.armed():
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
        return 1
    except (KeyboardInterrupt, Stopped) as exc:
        sys.stderr.write(_script_traceback(exc))
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except BaseException as exc:  # noqa: B036 - the script's error, whatever it is, is reported as Python would
        sys.stderr.write(_script_traceback(exc))
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


_SHADOW = os.path.dirname(os.path.abspath(__file__)) + os.sep
_RUNPY = (runpy.__file__, runpy.run_path.__code__.co_filename)
# torch's wrappers between an op call and a dispatch mode's __torch_dispatch__ (dynamo's disable): shadow's too
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PLUMBING = tuple(_TORCH + p for p in ("_compile.py", "_dynamo" + os.sep, os.path.join("utils", "_python_dispatch.py")))


def _script_traceback(exc: BaseException) -> str:
    """The traceback Python would print for ``exc`` had the script run alone, in the exception and in those it was
    raised from: the frames of this CLI and runpy above the script's left out, and the stack cut where shadow's
    dispatch begins, with torch's wrappers that lead to it (below it, shadow runs the op on the device: what raises
    there is the op's own error). When
    shadow itself raised, its frames stay: that is a bug in shadow, to report with them."""
    shown = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    pending, seen = [shown], set()
    while pending:
        te = pending.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        frames = list(te.stack)
        while frames and (frames[0].filename.startswith(_SHADOW) or frames[0].filename in _RUNPY):
            frames.pop(0)
        if frames and not frames[-1].filename.startswith(_SHADOW):
            cut = next((i for i, f in enumerate(frames) if f.filename.startswith(_SHADOW)), len(frames))
            while cut and frames[cut - 1].filename.startswith(_PLUMBING):
                cut -= 1
            frames = frames[:cut]
        te.stack = traceback.StackSummary.from_list(frames)
        pending += [t for t in (te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())) if t]
    return "".join(shown.format())


def _shadowed(run: dict) -> str:
    """Which optimizer steps a run shadowed, in words."""
    done, skip, steps = run["optimizer_steps"], run["skip_steps"], run["steps"]
    if skip == 0 and steps is None:
        return f"the whole script: {done} optimizer steps"
    if done <= skip:
        return f"nothing: the script made {done} optimizer steps, shadowing was to begin after step {skip}"
    last = done if steps is None else min(skip + steps, done)
    asked = "" if steps is None or skip + steps <= done else \
        f"; steps up to {skip + steps} asked, the script made {done}"
    which = f"step {last}" if last == skip + 1 else f"steps {skip + 1}-{last}"
    return f"optimizer {which} of {done}{asked}"


# --- show ---
def _show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", nargs="+", help="a report file (shadow run's shadow-report.json, or Report.save's); "
                   "several (the ranks of a distributed run) are merged into one (shadow.merge_reports)")
    p.add_argument("--by", choices=VIEWS, default="op", help="group the table by op (default), module, call site "
                   "or phase")
    p.add_argument("--top", type=_count_or_all, default=30, metavar="N|all", help="rows shown (default 30)")
    p.add_argument("--phase", choices=[ph.value for ph in Phase], default=None,
                   help="only the calls of one phase (default: all)")
    p.add_argument("--tree", action="store_true", help="with --by module: every module, its submodules folded in")
    p.add_argument("--plain", action="store_true",
                   help="plain text even on a terminal with rich installed (rich draws the table otherwise)")


@command("show", "print a report's table, the legend of its columns and the verdict", _show_arguments)
def _show(args: argparse.Namespace) -> int:
    if args.tree and args.by != "module":
        raise _Failure("--tree folds modules into their parents: use it with --by module")
    if len(args.report) == 1:
        rep = _load(args.report[0])
        print(_describe(args.report[0], rep))
    else:
        from .distributed import merge_reports

        rep = merge_reports([_load(path) for path in args.report])
        print(f"{len(args.report)} reports merged (ranks {', '.join(map(str, rep.meta['ranks']))}): "
              f"{', '.join(args.report)}")
    print()
    try:
        print(_summary(rep, by=args.by, top=args.top, phase=args.phase, tree=args.tree, plain=args.plain))
    except ValueError as exc:  # a report saved before call sites and phases were aggregated
        raise _Failure(str(exc)) from None
    print()
    print("coverage:", rep.coverage)
    return 0


def _summary(rep: Report, *, plain: bool = False, **view: Any) -> str:
    """``Report.summary`` drawn by rich on a terminal where rich is installed, plain text otherwise (a pipe, a log)."""
    rich = not plain and sys.stdout.isatty() and _has_rich()
    return rep.summary(**view, rich=rich, color=rich, width=shutil.get_terminal_size().columns)


def _has_rich() -> bool:
    import importlib.util

    return importlib.util.find_spec("rich") is not None


def _load(path: str) -> Report:
    from .errors import ReportFormatError
    from .report import load_report

    if not os.path.exists(path):
        raise _Failure(f"{path}: no such file; give a report written by shadow run (-o PATH) or Report.save")
    try:
        return load_report(path)
    except ReportFormatError as exc:
        raise _Failure(f"{exc}; give a report written by shadow run or Report.save") from None
    except OSError as exc:
        raise _Failure(f"{path}: {exc.strerror}") from None


def _describe(path: str, rep: Report) -> str:
    """A report's provenance in one line: the command that wrote it, what it shadowed, the versions."""
    meta = rep.meta
    versions = f"torch {meta.get('torch', '?')}, shadow {meta.get('shadow', '?')}"
    run = meta.get("run")
    if not run:
        return f"{path}: saved from Python ({versions})"
    emulate = f" --emulate {run['emulate']}" if run.get("emulate") else ""
    status = run["exit_status"]
    stopped = f" (stopped by {signal.Signals(status - 128).name})" if status - 128 in _SIGNAL_NUMBERS else ""
    return (f"{path}: shadow run{emulate} {' '.join(run['argv'])}; {_shadowed(run)}; exit status "
            f"{status}{stopped} ({versions})")


# --- compare ---
def _compare_arguments(p: argparse.ArgumentParser) -> None:
    from .compare import FACTOR

    p.add_argument("a", metavar="A", help="the baseline report (e.g. the float32 or CPU run)")
    p.add_argument("b", metavar="B", help="the report judged against it (e.g. the bfloat16 or device run)")
    p.add_argument("--factor", type=_factor, default=FACTOR,
                   help=f"how much a figure must move to count as changed (default {FACTOR:g})")


@command("compare", "compare two reports of the same program: which ops and modules got worse in B, and by how "
         "much (exit status 1 if any)", _compare_arguments)
def _compare(args: argparse.Namespace) -> int:
    from .compare import CompareError, compare

    a, b = _load(args.a), _load(args.b)
    try:
        cmp = compare(a, b, factor=args.factor)
    except CompareError as exc:
        raise _Failure(f"{args.a} and {args.b}: {exc}") from None
    print(f"A = {_describe(args.a, a)}")
    print(f"B = {_describe(args.b, b)}")
    print(cmp.text)
    return 1 if cmp.worse("op") or cmp.worse("module") else 0


# --- doctor ---
def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")


@command("doctor", "list each device backend (cpu, cuda, mps, xpu, directml): available or why not, its name, "
         "float64 support, and which one demo uses", _doctor_arguments)
def _doctor(args: argparse.Namespace) -> int:
    import json
    import platform

    backends = _devices.discover()
    chosen = _devices.choose(backends)
    numerics = _devices.numerics_settings()
    if args.json:
        print(json.dumps({"torch": torch.__version__, "python": platform.python_version(),
                          "backends": [dataclasses.asdict(b) for b in backends], "uses": chosen.name,
                          "numerics": numerics}, indent=2))
        return 0
    print(f"shadow doctor: torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.system()} {platform.machine()}")
    print()
    print(_doctor_table(backends))
    print()
    where = chosen.name if chosen.device == chosen.name else f"{chosen.name}, {chosen.device}"
    print(f"demo will use: {where}" + (f" ({chosen.device_name})" if chosen.device_name else ""))
    print()
    print("numerics settings (recorded with each report):")
    width = max(map(len, numerics), default=0)
    for name, value in numerics.items():
        print(f"  {name:<{width}}  {value}")
    return 0


def _doctor_table(backends: list) -> str:
    """One line per backend, its reason wrapped and indented below it."""
    import textwrap

    rows = [("backend", "available", "device", "float64", "name")]
    for b in backends:
        f64 = "-" if b.float64 is None else ("yes" if b.float64 else "no")
        rows.append((b.name, "yes" if b.available else "no", b.device or "-", f64, b.device_name or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
        if i:
            lines.extend(textwrap.wrap(backends[i - 1].reason, width=100, initial_indent="    ",
                                       subsequent_indent="    ", break_long_words=False, break_on_hyphens=False))
    return "\n".join(lines)


def _rel_diff(p: torch.Tensor, s: torch.Tensor) -> float:
    d = copy(p, torch.float64, "cpu") - s
    return (torch.linalg.vector_norm(d) / torch.linalg.vector_norm(s).clamp_min(torch.finfo(torch.float64).tiny)).item()


def _unwritable(path: str) -> str:
    """Why a report cannot be written to ``path`` ("" if it can): checked before a long run, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    return ""


def _fail(message: str) -> int:
    print(f"shadow: error: {message}", file=sys.stderr)
    return 2


# --- explain (shadow.explanation) ---
@command("explain", "every table's answer for one op: replay rule, budget family and formula, reference, defined "
         "region, op sets, and what each emulated device does to it",
         lambda p: p.add_argument("op", help="an op: aten.mm (every overload), aten.mm.default, mm, aten::mm.out"))
def _explain(args: argparse.Namespace) -> int:
    from .errors import ShadowOptionError
    from .explanation import explain

    try:
        print(explain(args.op).render())
    except ShadowOptionError as exc:
        raise _Failure(str(exc)) from None
    return 0


# --- entry point ---
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shadow",
        description="Replay a PyTorch program op by op in float64 and report each op's error.",
        epilog="run 'shadow COMMAND --help' for a command's options; exit status: 0 success, 1 the script raised "
               "(run) or B is worse (compare), 2 a usage error or unusable input, N the script's own sys.exit(N)",
    )
    parser.add_argument("--version", action="version",
                        version=f"shadow {__version__} (torch {torch.__version__}, Python {platform.python_version()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in _COMMANDS.values():
        cmd.arguments(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a usage error, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a message on bad arguments
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _COMMANDS[args.command].run(args)
    except _Failure as exc:
        return _fail(f"{args.command}: {exc}")
    except BrokenPipeError:  # output piped into `head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail
        return 1


# commands kept in modules of their own register themselves with @command when imported
try:
    from . import html as _html  # noqa: F401  (registers "html")
except ModuleNotFoundError as exc:  # a copy without it; any other import error is a bug to be seen
    if exc.name != f"{__package__}.html":
        raise
