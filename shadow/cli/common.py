"""What several commands share: argument types whose errors name what was expected and what came, the checks and
words about report files (``load``, ``describe``, ``unwritable``), and how a report's summary is drawn."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from typing import Any, Callable

from ..band import Envelope, load_envelope
from ..errors import ReportFormatError
from ..report import Report, load_report
from .registry import Failure

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # what stops `run`: Ctrl-C, a timeout or a scheduler, a lost terminal
SIGNAL_NUMBERS = {getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)}


def _whole_number(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {n}")
        return n

    return parse


positive_int = _whole_number(1)
count = _whole_number(0)


def count_or_all(text: str) -> int | None:
    """A whole number >= 0, or "all" (None: no limit)."""
    if text == "all":
        return None
    try:
        return count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 or 'all', got {text!r}") from None


def spot_checks(text: str) -> str | int:
    if text in ("off", "default", "all"):
        return text
    try:
        return count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected off, default, all or a number of samples per call, "
                                         f"got {text!r}") from None


def factor(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not x > 1:
        raise argparse.ArgumentTypeError(f"expected a number > 1, got {text!r}")
    return x


def unwritable(path: str) -> str:
    """Why a report cannot be written to ``path`` ("" if it can): checked before a long run, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    return ""


def summary(rep: Report, *, plain: bool = False, **view: Any) -> str:
    """``Report.summary`` drawn by rich on a terminal where rich is installed, plain text otherwise (a pipe, a log)."""
    rich = not plain and sys.stdout.isatty() and _has_rich()
    return rep.summary(**view, rich=rich, color=rich, width=shutil.get_terminal_size().columns)


def _has_rich() -> bool:
    import importlib.util

    return importlib.util.find_spec("rich") is not None


def load(path: str) -> Report:
    """The report saved at ``path``, or a ``Failure`` saying what is wrong and what to give instead."""
    if not os.path.exists(path):
        raise Failure(f"{path}: no such file; give a report written by shadow run (-o PATH) or Report.save")
    try:
        return load_report(path)
    except ReportFormatError as exc:
        raise Failure(f"{exc}; give a report written by shadow run or Report.save") from None
    except OSError as exc:
        raise Failure(f"{path}: {exc.strerror}") from None


def envelope_argument(p: argparse.ArgumentParser) -> None:
    """``--envelope PATH``: a saved envelope (``shadow envelope -o``) the verdict holds the run's loss to."""
    p.add_argument("--envelope", metavar="PATH", default=None, help="an envelope written by shadow envelope (-o "
                   "PATH): the verdict says whether the run's loss stays in its band of correct implementations")


def envelope(path: str | None) -> Envelope | None:
    """The envelope saved at ``path`` (None: none given), or a ``Failure`` saying what is wrong and what to give."""
    if path is None:
        return None
    if not os.path.exists(path):
        raise Failure(f"--envelope {path}: no such file; make one with shadow envelope SCRIPT -o {path}")
    try:
        return load_envelope(path)
    except ReportFormatError as exc:
        raise Failure(f"--envelope {exc}; give a file written by shadow envelope SCRIPT -o PATH") from None
    except (OSError, ValueError) as exc:  # unreadable, or not JSON
        raise Failure(f"--envelope {path}: cannot be read ({exc}); give a file written by shadow envelope -o") \
            from None


def describe(path: str, rep: Report) -> str:
    """A report's provenance in one line: the command that wrote it, what it shadowed, the versions."""
    meta = rep.meta
    versions = f"torch {meta.get('torch', '?')}, shadow {meta.get('shadow', '?')}"
    run = meta.get("run")
    if not run:
        return f"{path}: saved from Python ({versions})"
    emulate = f" --emulate {run['emulate']}" if run.get("emulate") else ""
    status = run["exit_status"]
    stopped = f" (stopped by {signal.Signals(status - 128).name})" if status - 128 in SIGNAL_NUMBERS else ""
    return (f"{path}: shadow run{emulate} {' '.join(run['argv'])}; {shadowed(run)}; exit status "
            f"{status}{stopped} ({versions})")


def shadowed(run: dict) -> str:
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

