"""A live status line for long runs (``shadow run``): calls shadowed, optimizer steps, the worst op so far.

Drawn on stderr from a background thread, twice a second, only when stderr is a terminal (a log file gets nothing).
The script's own output must not land on the line: while it is drawn, ``sys.stdout`` and ``sys.stderr`` are
wrapped so that a write first erases it, and it is drawn again only once the script's output ends a line.

The thread only reads: the report's call counter and a copy of its per-cell aggregates (``dict(report.cells)``,
one C-level copy that no other thread can interleave with; ``ReportData.view`` is not used because it caches its
result, and a view cached from another thread mid-call could outlive the next call).
"""

from __future__ import annotations

import shutil
import sys
import threading
from typing import Any, Callable, TextIO

from .reportdata import ReportData
from .verdict import op_class, times


def status(report: ReportData, step: int, shadowing: bool) -> str:
    """The line's text: "shadow: 1234 calls, step 3 (shadowing), worst aten.mm 40x budget"."""
    worst_op, worst = "", 0.0
    for key, agg in dict(report.cells).items():
        if agg.budgeted_calls and agg.max_budget_used > worst:
            worst_op, worst = key[0], agg.max_budget_used
    text = f"shadow: {report.coverage.calls} calls, step {step} ({'shadowing' if shadowing else 'waiting'})"
    if worst_op:
        text += f", worst {op_class(worst_op)} {times(worst)} budget"
    return text


class Progress:
    """``with Progress(report, step=lambda: n, shadowing=lambda: on):`` keeps the line fresh until the block ends,
    then erases it. Does nothing unless ``stream`` is a terminal."""

    def __init__(self, report: ReportData, step: Callable[[], int], shadowing: Callable[[], bool],
                 stream: TextIO | None = None, interval: float = 0.5):
        self.report, self.step, self.shadowing = report, step, shadowing
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one writer at a time: the thread drawing, or the script writing
        self._drawn = False  # the line is on the screen
        self._line_start = True  # the script's last output ended its line: the line may be drawn
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> Progress:
        if self.stream.isatty():
            self._saved = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = _Erasing(sys.stdout, self), _Erasing(sys.stderr, self)
            self._thread = threading.Thread(target=self._run, name="shadow-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            sys.stdout, sys.stderr = self._saved
            self.erase()

    def erase(self) -> None:
        with self._lock:
            self._erase()

    def _erase(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")  # back to the line's start, erase it
            self.stream.flush()
            self._drawn = False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            line = status(self.report, self.step(), self.shadowing())[:shutil.get_terminal_size().columns - 1]
            with self._lock:
                if self._line_start:
                    self._erase()
                    self.stream.write(line)
                    self.stream.flush()
                    self._drawn = True

    def _wrote(self, stream: TextIO, text: str) -> None:
        """The script writes ``text`` to ``stream``: erase the line first, and note whether a line was ended."""
        with self._lock:
            self._erase()
            stream.write(text)
            stream.flush()  # before the line can be drawn again (a terminal's stdout is line-buffered)
            if text:
                self._line_start = text.endswith("\n")


class _Erasing:
    """A text stream that erases the status line before anything is written through it."""

    def __init__(self, stream: TextIO, progress: Progress):
        self._stream, self._progress = stream, progress

    def write(self, text: str) -> int:
        self._progress._wrote(self._stream, text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        self.write("".join(lines))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
