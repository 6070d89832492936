"""``shadow run``: a script run unchanged under ShadowMode (like ``python -m cProfile``), its report written whole
even when a signal stops it (``Stops``), optimizer steps chosen by ``StepWindow``."""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import signal
import sys
import threading
import traceback
from typing import Any, Callable

import torch

from ..distributed import rank_path
from ..modes.emulate import EMULATIONS
from ..options import FOLLOW, MAX_REPRO_BYTES
from .common import (STOP_SIGNALS, count, count_or_all, envelope, envelope_argument, positive_int, shadowed, spot_checks,
                     unwritable)
from .registry import Failure, command

DEFAULT_MAX_RECORDS = 10_000  # per-call records kept by `run` (~1.2 kB each in the file); the tables cover every call


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="the Python script to run, unchanged (shadow's options come before it)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments: its sys.argv[1:]")
    p.add_argument("-o", "--output", metavar="PATH", default="shadow-report.json",
                   help="where to write the report (default: shadow-report.json in the working directory); each rank "
                        "of a distributed run (torchrun -m shadow run) writes its own, PATH with .rankN before .json")
    p.add_argument("--skip-steps", type=count, default=0, metavar="N",
                   help="start shadowing when optimizer step N returns (default 0: from the start); every "
                        "optimizer.step() call of any optimizer counts")
    p.add_argument("--steps", type=positive_int, default=None, metavar="M",
                   help="stop shadowing when optimizer step N+M returns (default: at the script's end)")
    p.add_argument("--emulate", choices=sorted(EMULATIONS), default=None,
                   help="compute on the CPU as an emulated device would (shadow.modes.emulate), e.g. tf32")
    p.add_argument("--max-records", type=count_or_all, default=DEFAULT_MAX_RECORDS, metavar="N|all",
                   help=f"per-call records kept in the report (default {DEFAULT_MAX_RECORDS}: ~13 MB); the tables "
                        "and the verdict cover every call regardless")
    p.add_argument("--spot-checks", type=spot_checks, default="default", metavar="off|default|all|N",
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
    p.add_argument("--max-repro-bytes", type=count, default=MAX_REPRO_BYTES, metavar="N",
                   help=f"bytes of inputs kept of the worst calls over budget, for shadow repro (default "
                        f"{MAX_REPRO_BYTES >> 20} MiB; 0 keeps none), in REPORT.inputs.pt beside the report")
    envelope_argument(p)


@command("run", "run a Python script unchanged under ShadowMode (like python -m cProfile) and write its report",
         arguments)
def execute(args: argparse.Namespace) -> int:
    from ..modes import ShadowMode
    from ..modes.emulate import emulate
    from ..progress import Progress
    from ..verdict import conclude

    if not os.path.isfile(args.script):
        why = "is a directory" if os.path.isdir(args.script) else "no such file"
        raise Failure(f"{args.script}: {why}; give the path of a Python script: shadow run [OPTIONS] SCRIPT [ARGS...]")
    if problem := unwritable(args.output):
        raise Failure(f"-o {args.output}: {problem}; give a writable path")
    output = os.path.abspath(args.output)  # where the user meant, even if the script changes directory
    env = envelope(args.envelope)  # read before the script runs: a wrong path fails at once
    sm = ShadowMode(local=args.local, drift=args.drift, follow=args.follow, max_records=args.max_records,
                    spot_checks=args.spot_checks, budgets=args.budgets, compare_cpu=args.compare_cpu,
                    callsites=args.callsites, max_repro_bytes=args.max_repro_bytes)
    window = StepWindow(sm, args.skip_steps, args.steps)
    device = emulate(args.emulate) if args.emulate else contextlib.nullcontext()  # outside ShadowMode, as it must be
    with Stops() as stops:
        with device, window, Progress(sm.report, step=lambda: window.done, shadowing=lambda: window.active):
            status = exec_script(args.script, args.args, stops)
        rep = sm.report
        rep.meta["run"] = {"argv": [args.script, *args.args], "emulate": args.emulate, "skip_steps": args.skip_steps,
                           "steps": args.steps, "optimizer_steps": window.done, "exit_status": status}
        shown = rank_path(args.output, rep.meta)  # one file per rank of a distributed run
        rep.save(rank_path(output, rep.meta))
    print(f"shadow: report written to {shown}: {rep.coverage.calls} calls shadowed "
          f"({shadowed(rep.meta['run'])}); read it with: shadow show {shown}", file=sys.stderr)
    if stops.held is not None:  # a signal came while the report was written: stop now, as it asked
        print(f"shadow: stopped by {signal.Signals(stops.held).name}", file=sys.stderr)
        return 128 + stops.held
    hint = misplaced(args.script, args.args) if status else None  # the script failed: perhaps on shadow's option
    if not window.opened:
        if status:
            _note(hint)
            return status
        raise Failure(f"the script made {window.done} optimizer steps, so shadowing (from the end of step "
                       f"{args.skip_steps}) never began: nothing was shadowed; give a smaller --skip-steps")
    for line in conclude(rep, env).lines:
        print(f"shadow: {line}", file=sys.stderr)
    _note(hint)
    return status


def _note(hint: str | None) -> None:
    if hint is not None:
        print(f"shadow: note: {hint}", file=sys.stderr)


class _Options(argparse.ArgumentParser):
    """A parser given ``run``'s arguments only to collect its options: each option string -> the option's action."""

    def __init__(self) -> None:
        super().__init__(add_help=False)
        self.options: dict[str, argparse.Action] = {}

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*names, **kwargs)
        self.options.update(dict.fromkeys(action.option_strings, action))
        return action


def misplaced(script: str, argv: list[str]) -> str | None:
    """What to say when a script that failed was given options of ``run``'s own: everything after SCRIPT is the
    script's (it got them unchanged), so ``shadow run train.py --emulate bf16`` gave ``--emulate`` to the script.
    The hint names them and the command with them before the script; None when there are none."""
    probe = _Options()
    arguments(probe)
    names, moved, rest, i = [], [], [], 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0] if token.startswith("--") else token[:2]  # --output=r.json, -or.json
        action = probe.options.get(name) if token.startswith("-") else None
        if action is None:
            rest.append(token)
            i += 1
            continue
        takes = 0 if action.nargs == 0 or len(name) < len(token) else 1  # run's options take at most one value
        names.append(f"`{name}`")
        moved += argv[i:i + 1 + takes]
        i += 1 + takes
    if not names:
        return None
    which = f"{names[0]} is an option" if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]} are options"
    command = " ".join(["shadow run", *moved, script, *rest])
    return (f"{which} of shadow run, given after the script: the script got {'it' if len(names) == 1 else 'them'} "
            f"(everything after the script is its own). shadow's options go before the script: {command}")


class Stopped(BaseException):
    """A signal stopped the script: raised in it as Ctrl-C raises KeyboardInterrupt (SIGTERM and SIGHUP, whose
    default is to end the process at once, report unwritten). A BaseException, as KeyboardInterrupt: the script's
    ``except Exception`` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Stops:
    """``run``'s signal handlers, from its start to its report's last byte: while the script runs (``armed``),
    SIGINT raises KeyboardInterrupt in it and SIGTERM and SIGHUP raise ``Stopped``; outside it (ShadowMode entered
    or left, the report written) a signal is held (``held``: the first one), so the report is written whole and
    the command then exits as the signal asked. The handlers found are restored on exit; a script that installs
    its own keeps them while it runs. Signal handlers exist in the main thread only: elsewhere, nothing changes."""

    def __init__(self) -> None:
        self.held: int | None = None
        self._armed = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Stops:
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


class StepWindow:
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

    def __enter__(self) -> StepWindow:
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


def exec_script(path: str, argv: list[str], stops: Stops, *, ends: tuple[type[BaseException], ...] = ()) -> int:
    """Run ``path`` as ``python path ARGS...`` would: as ``__main__``, with ``sys.argv`` = [path, ARGS...] and its
    folder first on ``sys.path``. Returns its exit status; an exception is printed as the script's own traceback
    (shadow's and runpy's frames left out) and gives 1, as Python gives; a signal (``stops``) 128 + its number; an
    exception of ``ends`` (shadow stopping the script, ``shadow envelope``) gives 0."""
    saved_argv, saved_path = sys.argv, sys.path[:]
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with stops.armed():
            runpy.run_path(path, run_name="__main__")
    except ends:
        return 0
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


_SHADOW = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # shadow/, this package's parent
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
