"""The saved report's format: what ``Report.save`` writes, ``Report.to_dict`` returns and ``load_report`` /
``Report.from_dict`` read (docs/reports.md: The saved format). The report is declared here part by part
(``REPORT``), from the saved forms of the types it holds, each declared beside its type (``RECORD``,
``AGGREGATE``... in ``shadow.records``, ``ERROR_STATS`` in ``shadow.metrics``, ``SPOT`` in ``shadow.spot``), all
built of ``shadow.savedform``'s specs. The format reads and writes a ``Contents``, the report's parts; ``Report``
builds itself from one and gives its own.

A value that is not what the format says is refused with a ``ReportFormatError`` that names the field by its path
(``records[3].local.max_ulp``), what was expected and what came; hostile input is refused before anything trusts
it (``shadow.savedform``).

>>> contents = read_file(path)                  # doctest: +SKIP
>>> save(write(contents), path)                 # doctest: +SKIP  (a temporary file, then os.replace)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import sys
from typing import IO, Any, Callable

from .errors import ReportFormatError
from .metrics import ERROR_STATS
from .records import (AGGREGATE, BUDGET, COVERAGE, EVENT, RANK_FIELDS, RECORD, STEP, Aggregate, Coverage, Event,
                      Phase, Record, StepDrift)
from .savedform import (COUNT, MAX_DEPTH, TEXT, Choice, Field, Fields, Integer, Json, ListOf, MapOf, Maybe, Spec,
                        describe, saved)
from .spot.verdict import SPOT

__all__ = ["AGGREGATE", "BUDGET", "CELLS", "COVERAGE", "ERROR_STATS", "EVENT", "FORMAT", "META", "READS", "RECORD",
           "REPORT", "SPOT", "STEP", "VERSION", "Contents", "dump_json", "read", "read_file", "read_text", "save",
           "saved", "write", "write_atomically"]

FORMAT = "shadow-report"
VERSION = 8  # 2: spot checks; 3: error budgets; 4: record dtype and shape, budget "family", over_budget_calls;
# 5: call sites, input drift, aggregates by (op, module, call site, phase) ("cells"); 6: the trajectory; 7: a merged
# report's per-rank cells ("per_rank"); 8: the aggregates' calls judged by a guessed budget ("guessed_calls")
READS = (1, 2, 3, 4, 5, 6, 7, 8)  # versions this shadow loads: 1 had no spot checks, 2 no budgets, 3 called the
# budget family "kind" and over_budget_calls "over_budget", 4 had no call sites (its aggregates: by op and module
# only), 5 no trajectory, 6 no per-rank cells, 7 did not count the guessed calls (read as 0)


class Cells(Spec):
    """Aggregates keyed (op, module, call site, phase), saved as a list of objects naming their key."""

    def __init__(self, aggregate: Fields):
        self.list = ListOf(Fields("cell", {"op": Field(TEXT, True), "module": Field(TEXT, True),
                                           "callsite": Field(TEXT, True), "phase": Field(Choice(Phase), True),
                                           "aggregate": Field(aggregate, True)}, dict))
        self.expected = self.list.expected

    def load(self, value: Any) -> dict:
        return {(c["op"], c["module"], c["callsite"], c["phase"]): c["aggregate"] for c in self.list.load(value)}

    def dump(self, value: Any) -> list:
        return self.list.dump([{"op": k[0], "module": k[1], "callsite": k[2], "phase": k[3], "aggregate": a}
                               for k, a in value.items()])



class Ranks(Spec):
    """A merged report's per-rank cells, {rank: cells}, saved as a list; the cells with only the figures a merged
    table compares (``shadow.records.RANK_FIELDS``)."""

    expected = "a list, each an object (rank)"

    def __init__(self) -> None:
        cells = Cells(AGGREGATE.only(RANK_FIELDS))
        self.list = ListOf(Fields("rank", {"rank": Field(RANK, True), "cells": Field(cells, True)}, dict))

    def load(self, value: Any) -> dict:
        return {p["rank"]: p["cells"] for p in self.list.load(value)}

    def dump(self, value: Any) -> list:
        return self.list.dump([{"rank": rank, "cells": cells} for rank, cells in value.items()])


# --- the report: one declaration per part ---
RANK = Maybe(Integer())
RUN = Fields("run", {  # `shadow run`'s
    "argv": Field(ListOf(TEXT), True), "emulate": Maybe(TEXT), "skip_steps": Field(COUNT, True),
    "steps": Field(Maybe(COUNT), True), "optimizer_steps": Field(COUNT, True),
    "exit_status": Field(Integer(None), True)}, dict)
META = Fields("meta", {"shadow": TEXT, "torch": TEXT, "numerics": MapOf(Json()), "options": MapOf(Json()),
                       "run": RUN, "rank": RANK, "world_size": COUNT, "ranks": ListOf(RANK),
                       "record_ranks": ListOf(RANK)}, dict, rest=Json())
CELLS = Cells(AGGREGATE)


@dataclasses.dataclass
class Contents:
    """What a report holds, part by part: what the format writes and reads."""

    version: int  # the format version it is saved as, or was read from
    meta: dict
    max_records: int | None
    dropped_records: int
    records: list[Record]
    cells: dict[tuple[str, str, str, str], Aggregate]  # {} in a report of a version before 5
    per_rank: dict[Any, dict[tuple[str, str, str, str], Aggregate]]  # a merged report's: rank -> its cells
    by_op: dict[str, Aggregate]  # the cells merged, written for readers of the file (before version 5: the
    by_module: dict[str, Aggregate]  # only aggregates)
    coverage: Coverage
    events: list[Event]
    trajectory: list[StepDrift]


@dataclasses.dataclass(frozen=True)
class Part:
    """A top-level field of the report: its spec, and the version that added it."""

    spec: Spec
    since: int = 1


REPORT: dict[str, Part] = {  # in the order they are saved
    "meta": Part(META),
    "max_records": Part(Maybe(COUNT)),
    "dropped_records": Part(COUNT),
    "records": Part(ListOf(RECORD)),
    "cells": Part(CELLS, since=5),
    "per_rank": Part(Ranks(), since=7),
    "by_op": Part(MapOf(AGGREGATE)),
    "by_module": Part(MapOf(AGGREGATE)),
    "coverage": Part(COVERAGE),
    "events": Part(ListOf(EVENT)),
    "trajectory": Part(ListOf(STEP), since=6),
}
EMPTY = {"cells": {}, "per_rank": {}, "trajectory": []}  # the parts a version before theirs reads as


# --- the report as a whole ---
def write(contents: Contents) -> dict:
    """The report's saved form, before JSON encoding (non-finite figures are floats here), as its version holds it."""
    out = {"format": FORMAT, "version": contents.version}
    for name, part in REPORT.items():
        if contents.version >= part.since:
            out[name] = part.spec.write(getattr(contents, name), name)
    return out


def read(d: Any) -> Contents:
    """A report's parts from its saved form, checked against the declaration of the version it names."""
    if type(d) is not dict:
        raise ReportFormatError(f"not a shadow report: expected a JSON object, got {describe(d)}")
    fmt = d.get("format")
    if fmt != FORMAT:
        got = repr(fmt) if isinstance(fmt, str) and len(fmt) <= 60 else describe(fmt)
        raise ReportFormatError(f"not a shadow report: expected format {FORMAT!r}, got {got}")
    version = d.get("version")
    if type(version) is not int or version not in READS:
        newer = type(version) is int and version > VERSION
        raise ReportFormatError(
            f"shadow report version {describe(version)} cannot be read by this shadow (it reads versions "
            f"{READS[0]} to {READS[-1]})" + ("; it was written by a newer shadow: upgrade shadow to read it"
                                             if newer else ""))
    for k in d:
        if k not in REPORT and k not in ("format", "version"):
            raise ReportFormatError(f"the report: unknown field {k!r}")
    parts = {}
    for name, part in REPORT.items():
        if version < part.since:
            parts[name] = EMPTY[name]  # written by later versions: an earlier one's file may carry it, unread
            continue
        if name not in d:
            raise ReportFormatError(f"the report: missing field {name!r}")
        parts[name] = part.spec.read(d[name], name)
    return Contents(version=version, **parts)


def dump_json(d: dict, f: IO[str]) -> None:
    """Write a report's saved form (``write``) as JSON text into ``f``."""
    json.dump(saved(d), f, indent=1, allow_nan=False)


def read_text(data: bytes | str) -> Contents:
    """A report's parts from the text of a saved one."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ReportFormatError(f"not a shadow report: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        d = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ReportFormatError(f"not a shadow report: not JSON ({exc})") from None
    except RecursionError:  # the parser recurses per level, deeper than the interpreter's stack allows
        where = _path_of(data, lambda token, depth: depth > MAX_DEPTH)
        raise ReportFormatError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
        where = _path_of(data, lambda token, depth: token.lstrip("-").isdigit() and len(token.lstrip("-")) > limit)
        raise ReportFormatError(f"{where}: expected a number, got an integer too long to read") from None
    return read(d)


def read_file(path: str | os.PathLike) -> Contents:
    """The parts of the report saved at ``path``; what is wrong with anything else is a ReportFormatError."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return read_text(data)
    except ReportFormatError as exc:
        raise ReportFormatError(f"{os.fspath(path)}: {exc}") from None


def save(d: dict, path: str | os.PathLike) -> None:
    """A report's saved form (``write``) as JSON at ``path``, written whole or not at all (``write_atomically``)."""
    write_atomically(path, lambda f: dump_json(d, f))


def write_atomically(path: str | os.PathLike, write: Callable[[IO[Any]], None], *, binary: bool = False) -> None:
    """Write a text file (``binary``: a binary one) through ``write(f)`` into a temporary file beside ``path``, flushed to disk, then renamed
    over ``path`` (``os.replace``): a reader, or a crash at any point (an exception, a signal, a full disk, power
    lost after the rename), finds either the old file whole or the new one whole. A symbolic link at ``path`` is
    written through; an existing file keeps its permission bits, a new one gets those ``open`` would give."""
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with (open(fd, "wb") if binary else open(fd, "w", encoding="utf-8")) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(target):
            os.chmod(temporary, os.stat(target).st_mode & 0o7777)
        os.replace(temporary, target)
    except BaseException:
        with _quietly():
            os.unlink(temporary)
        raise
    if hasattr(os, "O_DIRECTORY"):  # the rename itself, on disk (POSIX)
        with _quietly():
            dir_fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


class _quietly:
    """Ignore an OSError (cleanup that may find nothing to do)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, OSError)


# --- where in the text: for what the parser refuses without saying where ---
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"\s*:?|[\[\]{},]|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')


def _path_of(text: str, found: Callable[[str, int], bool]) -> str:
    """The path of the first value whose token ``found(token, depth)`` (a bracket opening a container at that
    depth, or a number: its text), by a scan of the JSON tokens."""
    stack: list[list] = []  # per open container: [is a list, index or key]
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token in ("[", "{"):
            stack.append([token == "[", 0 if token == "[" else ""])
            if found(token, len(stack)):
                stack.pop()  # the path is the container's own
                break
        elif token in ("]", "}"):
            if stack:
                stack.pop()
        elif token == ",":
            if stack and stack[-1][0]:
                stack[-1][1] += 1
        elif token[0] == '"':
            if token.endswith(":") and stack and not stack[-1][0]:
                try:
                    stack[-1][1] = json.loads(token[:-1].rstrip())
                except ValueError:
                    stack[-1][1] = token[:-1].rstrip()
        elif found(token, len(stack)):
            break
    path = ""
    for is_list, at in stack:
        path = f"{path}[{at}]" if is_list else f"{path}.{at}" if path else str(at)
    return path or "the report"

