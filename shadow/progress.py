"""A live status line for long runs (``shadow run``): calls shadowed, optimizer steps, the worst op so far.

Drawn on stderr from a background thread, twice a second, only when stderr is a terminal (a log file gets nothing).
The thread only reads: the report's call counter and a copy of its per-cell aggregates (``dict(report._cells)``,
one C-level copy that no other thread can interleave with; ``Report.view`` is not used because it caches its
result, and a view cached from another thread mid-call could outlive the next call).
"""

from __future__ import annotations

import shutil
import sys
import threading
from typing import Callable, TextIO

from .report import Report
from .verdict import op_class, times


def status(report: Report, step: int, shadowing: bool) -> str:
    """The line's text: "shadow: 1234 calls, step 3 (shadowing), worst aten.mm 40x budget"."""
    worst_op, worst = "", 0.0
    for key, agg in dict(report._cells).items():
        if agg.budgeted_calls and agg.max_budget_used > worst:
            worst_op, worst = key[0], agg.max_budget_used
    text = f"shadow: {report.coverage.calls} calls, step {step} ({'shadowing' if shadowing else 'waiting'})"
    if worst_op:
        text += f", worst {op_class(worst_op)} {times(worst)} budget"
    return text


class Progress:
    """``with Progress(report, step=lambda: n, shadowing=lambda: on):`` keeps the line fresh until the block ends,
    then erases it. Does nothing unless ``stream`` is a terminal."""

    def __init__(self, report: Report, step: Callable[[], int], shadowing: Callable[[], bool],
                 stream: TextIO | None = None, interval: float = 0.5):
        self.report, self.step, self.shadowing = report, step, shadowing
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._run, name="shadow-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._write("")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            line = status(self.report, self.step(), self.shadowing())
            self._write(line[:shutil.get_terminal_size().columns - 1])

    def _write(self, line: str) -> None:
        self.stream.write("\r\x1b[K" + line)  # back to the line's start, erase it, draw
        self.stream.flush()
