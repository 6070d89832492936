"""The saved report's format, declared once: what ``Report.save`` writes, ``Report.to_dict`` returns and
``load_report`` / ``Report.from_dict`` read (docs/reports.md: The saved format).

Every part of a report is a ``Spec``: ``write`` gives a value's saved form, ``read`` checks a saved value and
builds it back. A value that is not what the format says is refused with a ``ReportFormatError`` that names the
field by its path (``records[3].local.max_ulp``), what was expected and what came. Hostile input is refused
before anything trusts it: nesting deeper than ``MAX_DEPTH``, integers outside int64 (counts) or float64's range
(figures), NaN and infinities spelled otherwise than the ``"nan"``, ``"inf"``, ``"-inf"`` this
format writes (JSON has no literal for them; the ``NaN``, ``Infinity``, ``-Infinity`` of Python's ``json.dump`` are
read as the figures they name), strings longer than ``MAX_TEXT`` or that are not Unicode text.

>>> rep = load(path)                            # doctest: +SKIP
>>> save(rep, path)                             # doctest: +SKIP  (a temporary file, then os.replace)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import re
import secrets
import sys
from typing import IO, TYPE_CHECKING, Any, Callable

from .errors import ReportFormatError
from .metrics import ErrorStats
from .records import BudgetInfo, Event, Kind, Phase, Record
from .spot import SpotStats
from .trajectory import StepDrift

if TYPE_CHECKING:
    from .report import Report

FORMAT = "shadow-report"
VERSION = 7  # 2: spot checks; 3: error budgets; 4: record dtype and shape, budget "family", over_budget_calls;
# 5: call sites, input drift, aggregates by (op, module, call site, phase) ("cells"); 6: the trajectory; 7: a merged
# report's per-rank cells ("per_rank")
READS = (1, 2, 3, 4, 5, 6, 7)  # versions this shadow loads: 1 had no spot checks, 2 no budgets, 3 called the budget
# family "kind" and over_budget_calls "over_budget", 4 had no call sites (its aggregates: by op and module only),
# 5 no trajectory, 6 no per-rank cells

MAX_DEPTH = 32  # JSON nesting: shadow writes 7 levels (per_rank[i].cells[j].aggregate.kinds); meta may add some
MAX_TEXT = 1 << 20  # characters of one string
FLOAT_MAX = sys.float_info.max
INT64 = 2**63 - 1
NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}  # the strings non-finite figures are saved as


def _describe(value: Any) -> str:
    """What came, in words: a type and a short repr."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return f"the string {value[:60]!r}" + ("..." if len(value) > 60 else "")
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return f"a Python {type(value).__name__}"


def _text_problem(s: str) -> str | None:
    if len(s) > MAX_TEXT:
        return f"a string of {len(s)} characters (at most {MAX_TEXT})"
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return f"a string holding a lone surrogate ({s[:40]!r})"
    return None


class Invalid(Exception):
    """A value is not what its spec says; ``where`` collects its path on the way out (innermost part first)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem
        self.where: list[str] = []

    def error(self, path: str = "") -> ReportFormatError:
        where = path + "".join(reversed(self.where))
        return ReportFormatError(f"{where.lstrip('.') or 'the report'}: {self.problem}")


# --- specs ---
class Spec:
    """One kind of saved value: ``read`` checks a saved value and builds it, ``write`` gives a value's saved form;
    what is wrong is a ReportFormatError naming the path (``path``, then the value's own parts)."""

    expected = "a value"

    def read(self, value: Any, path: str = "") -> Any:
        try:
            return self.load(value)
        except Invalid as exc:
            raise exc.error(path) from None

    def write(self, value: Any, path: str = "") -> Any:
        try:
            return self.dump(value)
        except Invalid as exc:
            raise exc.error(path) from None

    # what subclasses define: raise Invalid, never ReportFormatError
    def load(self, value: Any) -> Any:
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        return self.load(value)  # saved as it is, once checked

    def refuse(self, value: Any) -> Invalid:
        return Invalid(f"expected {self.expected}, got {_describe(value)}")


class Number(Spec):
    """A figure: a JSON number, or one of the strings ``NONFINITE`` (in memory: any float)."""

    expected = 'a number (or "inf", "-inf", "nan")'

    def load(self, value: Any) -> Any:
        if isinstance(value, float) or isinstance(value, int) and type(value) is not bool and \
                -FLOAT_MAX <= value <= FLOAT_MAX:
            return value
        if type(value) is str and value in NONFINITE:
            return NONFINITE[value]
        raise self.refuse(value)

    def dump(self, value: Any) -> Any:
        if isinstance(value, (float, int)) and type(value) is not bool:
            return value
        raise self.refuse(value)


class Integer(Spec):
    """A whole number within int64, at least ``minimum`` (counts, indices, dimensions)."""

    def __init__(self, minimum: int | None = 0):
        self.minimum = -INT64 - 1 if minimum is None else minimum
        self.expected = f"a whole number from {self.minimum} to {INT64}"

    def load(self, value: Any) -> int:
        if isinstance(value, int) and type(value) is not bool and self.minimum <= value <= INT64:
            return value
        raise self.refuse(value)


class Text(Spec):
    expected = "a string"

    def load(self, value: Any) -> str:
        if not isinstance(value, str):
            raise self.refuse(value)
        if len(value) > 64 or not value.isascii():  # short ASCII strings (most) need no look
            problem = _text_problem(value)
            if problem is not None:
                raise Invalid(f"expected a string of at most {MAX_TEXT} characters, got {problem}")
        return value


class Flag(Spec):
    expected = "true or false"

    def load(self, value: Any) -> bool:
        if type(value) is bool:
            return value
        raise self.refuse(value)


class Choice(Spec):
    """One of a str Enum's values, read as its member."""

    def __init__(self, cls: type[enum.Enum]):
        self.cls = cls
        self.expected = "one of " + ", ".join(repr(m.value) for m in cls)

    def load(self, value: Any) -> enum.Enum:
        if isinstance(value, str):
            try:
                return self.cls(value)
            except ValueError:
                pass
        raise Invalid(f"{_describe(value)} is not a valid {self.cls.__name__} (expected {self.expected})")

    def dump(self, value: Any) -> str:
        return self.load(value).value


class Maybe(Spec):
    """``inner``, or null (None)."""

    def __init__(self, inner: Spec):
        self.inner = inner
        self.expected = f"{inner.expected}, or null"

    def load(self, value: Any) -> Any:
        return None if value is None else self.inner.load(value)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)


class ListOf(Spec):
    """A list of ``item``s (``length`` of them, if given), built by ``into`` (list, tuple)."""

    def __init__(self, item: Spec, *, length: int | None = None, into: Callable = list):
        self.item, self.length, self.into = item, length, into
        self.expected = f"a list{f' of {length}' if length is not None else ''}, each {item.expected}"

    def _each(self, value: Any, each: Callable[[Any], Any]) -> list:
        if not isinstance(value, (list, tuple)) or (self.length is not None and len(value) != self.length):
            raise self.refuse(value)
        out, i = [], 0
        try:
            for i, v in enumerate(value):
                out.append(each(v))
        except Invalid as exc:
            exc.where.append(f"[{i}]")
            raise
        return out

    def load(self, value: Any) -> Any:
        return self.into(self._each(value, self.item.load))

    def dump(self, value: Any) -> list:
        return self._each(value, self.item.dump)


def _keys(spec: Spec, value: Any) -> dict:
    """``value`` as a dict of string keys (what ``spec`` refuses otherwise)."""
    if not isinstance(value, dict):
        raise spec.refuse(value)
    for k in value:
        problem = "not a string" if not isinstance(k, str) else _text_problem(k)
        if problem:
            raise Invalid(f"a key that is {problem}")
    return value


class MapOf(Spec):
    """An object of string keys and ``value``s."""

    def __init__(self, value: Spec):
        self.value = value
        self.expected = f"an object, each value {value.expected}"

    def _each(self, value: Any, each: Callable[[Any], Any]) -> dict:
        out, k = {}, ""
        try:
            for k, v in _keys(self, value).items():
                out[str(k)] = each(v)
        except Invalid as exc:
            exc.where.append(f"[{str(k)!r}]")
            raise
        return out

    def load(self, value: Any) -> dict:
        return self._each(value, self.value.load)

    def dump(self, value: Any) -> dict:
        return self._each(value, self.value.dump)


class Json(Spec):
    """Any JSON value (meta the user adds), within ``MAX_DEPTH`` and ``MAX_TEXT``."""

    expected = "a JSON value"

    def load(self, value: Any, depth: int = 0) -> Any:
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, str):
            return TEXT.load(value)
        if depth >= MAX_DEPTH:
            raise Invalid(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, (list, tuple)):
            return ListOf(self)._each(value, lambda v: self.load(v, depth + 1))
        if isinstance(value, dict):
            return MapOf(self)._each(value, lambda v: self.load(v, depth + 1))
        raise self.refuse(value)


@dataclasses.dataclass(frozen=True)
class Field:
    spec: Spec
    required: bool = False  # absent: the type's own default (a Fields' build applies it)
    old: str | None = None  # the name it was saved under by earlier versions


class Fields(Spec):
    """An object of named fields, built by ``build(**fields)``: unknown fields are refused (``rest`` reads them, if
    given), absent ones get the type's default; ``legacy(values)`` fills what earlier versions left out."""

    def __init__(self, name: str, fields: dict[str, Field | Spec], build: Callable[..., Any], *,
                 legacy: Callable[[dict], None] | None = None, rest: Spec | None = None):
        self.name, self.build, self.legacy, self.rest = name, build, legacy, rest
        self.fields = {k: f if isinstance(f, Field) else Field(f) for k, f in fields.items()}
        self.known = frozenset(self.fields) | {f.old for f in self.fields.values() if f.old}
        self.expected = f"an object ({name})"

    def only(self, names: tuple[str, ...]) -> Fields:
        """The same object saved with only ``names`` (the others read back as their defaults)."""
        return Fields(self.name, {k: self.fields[k] for k in names}, self.build, legacy=self.legacy)

    def _check(self, value: Any) -> dict:
        """``value`` as a dict, every key declared (or ``rest`` given, keys checked)."""
        if not isinstance(value, dict):
            raise self.refuse(value)
        if self.rest is not None:
            return _keys(self, value)
        if not self.known.issuperset(value):
            unknown = next(k for k in value if k not in self.known)
            raise Invalid(f"unknown field {unknown!r} in {self.expected}")
        return value

    def load(self, value: Any) -> Any:
        saved = self._check(value)
        values, name = {}, ""
        try:
            for name, f in self.fields.items():
                if name in saved:
                    values[name] = f.spec.load(saved[name])
                elif f.old is not None and f.old in saved:
                    values[name] = f.spec.load(saved[f.old])
                elif f.required:
                    missing, name = name, ""  # the object's path, not the field's
                    raise Invalid(f"missing field {missing!r}")
            if self.rest is not None:
                for name, v in saved.items():
                    if name not in self.known:
                        values[name] = self.rest.load(v)
        except Invalid as exc:
            if name:
                exc.where.append(f".{name}")
            raise
        if self.legacy is not None:
            self.legacy(values)
        return self.build(**values)

    def dump(self, value: Any) -> dict:
        name = ""
        try:
            if not isinstance(value, dict):  # an object: every declared field, in order
                return {name: f.spec.dump(getattr(value, name)) for name, f in self.fields.items()}
            for k, f in self.fields.items():  # a mapping (meta, a cell): the keys it has, declared or ``rest``
                if f.required and k not in value:
                    raise Invalid(f"missing field {k!r}")
            out = {}
            for name, v in self._check(value).items():
                out[name] = (self.fields[name].spec if name in self.fields else self.rest).dump(v)
            return out
        except Invalid as exc:
            if name:
                exc.where.append(f".{name}")
            raise


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
    """A merged report's per-rank cells, {rank: a Report holding that rank's cells}, saved as a list; the cells
    with only the figures a merged table compares (``shadow.report.RANK_FIELDS``)."""

    expected = "a list, each an object (rank)"

    @functools.cached_property
    def list(self) -> ListOf:
        from .report import RANK_FIELDS

        cells = Cells(AGGREGATE.only(RANK_FIELDS))
        return ListOf(Fields("rank", {"rank": Field(RANK, True), "cells": Field(cells, True)}, dict))

    def load(self, value: Any) -> dict:
        from .report import Report

        ranks = {}
        for p in self.list.load(value):
            ranks[p["rank"]] = part = Report()
            part._cells = p["cells"]
        return ranks

    def dump(self, value: Any) -> list:
        return self.list.dump([{"rank": rank, "cells": part._cells} for rank, part in value.items()])


def _aggregate(**values: Any) -> Any:
    from .report import Aggregate

    return Aggregate(**values)


def _coverage(**values: Any) -> Any:
    from .report import Coverage

    return Coverage(**values)


def _aggregate_legacy(values: dict) -> None:
    values.setdefault("max_local_ulp_nonzero", values.get("max_local_ulp", 0.0))  # before version 4
    if "budgeted_calls" not in values and "max_budget_used" in values:  # version 3 did not count them
        values["budgeted_calls"] = values.get("calls", 0)


# --- the format: one declaration per part ---
FIGURE, COUNT, TEXT = Number(), Integer(), Text()
ERROR_STATS = Fields("ErrorStats", {
    "max_abs": FIGURE, "max_ulp": FIGURE, "rel_norm": FIGURE, "n": COUNT, "nonfinite_device": COUNT,
    "nonfinite_reference": COUNT, "nonfinite_mismatch": COUNT, "nonfinite_agreed": COUNT, "norm": FIGURE,
    "budget_used": Maybe(FIGURE), "effective_bits": Maybe(FIGURE), "zero_reference": COUNT,
    "max_ulp_nonzero": Maybe(FIGURE)}, ErrorStats)
SPOT = Fields("SpotStats", {
    "samples": COUNT, "ref_err_ulp": FIGURE, "device_err_ulp": FIGURE, "device_err_abs": FIGURE,
    "max_cancellation": FIGURE, "trusted": Flag(), "reason": TEXT}, SpotStats)
BUDGET = Fields("BudgetInfo", {"family": Field(TEXT, True, old="kind"), "used": Field(FIGURE, True),
                               "is_default": Flag()}, BudgetInfo)


class _Scalar(Spec):
    """.item()'s device and shadow values: a float, an int or a bool."""

    expected = "a number or true/false"

    def load(self, value: Any) -> Any:
        return value if type(value) is bool else FIGURE.load(value)


RECORD = Fields("Record", {
    "index": Field(COUNT, True), "op": Field(TEXT, True), "module": Field(TEXT, True),
    "phase": Field(Choice(Phase), True), "kind": Field(Choice(Kind), True),
    "local": Maybe(ERROR_STATS), "drift": Maybe(ERROR_STATS), "flips": COUNT, "local_flips": COUNT,
    "shape_mismatch": COUNT, "item": Maybe(ListOf(_Scalar(), length=2, into=tuple)), "reason": TEXT,
    "spot": Maybe(SPOT), "budget": Maybe(BUDGET), "cpu_fallback": Flag(), "cpu": Maybe(ERROR_STATS),
    "dtype": TEXT, "shape": ListOf(COUNT, into=tuple), "inputs_nonfinite": Flag(), "skipped": COUNT,
    "callsite": TEXT, "inputs_drift": FIGURE}, Record)
COUNTS = MapOf(COUNT)
AGGREGATE = Fields("Aggregate", {
    "calls": COUNT, "kinds": COUNTS, "max_local_ulp": FIGURE, "max_local_ulp_nonzero": FIGURE,
    "zero_reference_calls": COUNT, "max_local_abs": FIGURE, "max_drift_rel": FIGURE, "max_drift_ulp": FIGURE,
    "flips": COUNT, "nonfinite": COUNT, "first_nonfinite": Maybe(COUNT), "budgeted_calls": COUNT,
    "max_budget_used": FIGURE, "over_budget_calls": Field(COUNT, old="over_budget"), "min_effective_bits": FIGURE,
    "spot_checked": COUNT, "spot_untrusted": COUNT, "dtypes": COUNTS}, _aggregate, legacy=_aggregate_legacy)
COVERAGE = Fields("Coverage", {
    "calls": COUNT, "kinds": COUNTS, "unsupported": MapOf(TEXT), "internal_errors": COUNT, "passthrough": COUNT,
    "tensors_adopted": COUNT, "unobserved_writes": COUNT, "reinterpreted": COUNT, "compiled": COUNTS,
    "compiled_eagerly": Flag(), "out_of_scope": COUNT}, _coverage)
EVENT = Fields("Event", {"index": Field(COUNT, True), "op": Field(TEXT, True), "kind": Field(TEXT, True),
                         "detail": Field(TEXT, True)}, Event)
STEP = Fields("StepDrift", {"step": Field(COUNT, True), "loss": Field(Maybe(FIGURE), True),
                            "loss_drift": Field(Maybe(FIGURE), True), "params": Field(FIGURE, True),
                            "worst": Field(TEXT, True), "worst_drift": Field(FIGURE, True)}, StepDrift)
RANK = Maybe(Integer())
RUN = Fields("run", {  # `shadow run`'s
    "argv": Field(ListOf(TEXT), True), "emulate": Maybe(TEXT), "skip_steps": Field(COUNT, True),
    "steps": Field(Maybe(COUNT), True), "optimizer_steps": Field(COUNT, True),
    "exit_status": Field(Integer(None), True)}, dict)
META = Fields("meta", {"shadow": TEXT, "torch": TEXT, "numerics": MapOf(Json()), "options": MapOf(Json()),
                       "run": RUN, "rank": RANK, "world_size": COUNT, "ranks": ListOf(RANK),
                       "record_ranks": ListOf(RANK)}, dict, rest=Json())
CELLS = Cells(AGGREGATE)


@dataclasses.dataclass(frozen=True)
class Part:
    """A top-level field of the report: its spec, the version that added it, and how a Report gives it."""

    spec: Spec
    get: Callable[[Report], Any]
    since: int = 1


REPORT: dict[str, Part] = {  # in the order they are saved
    "meta": Part(META, lambda r: r.meta),
    "max_records": Part(Maybe(COUNT), lambda r: r.max_records),
    "dropped_records": Part(COUNT, lambda r: r.dropped_records),
    "records": Part(ListOf(RECORD), lambda r: r.records),
    "cells": Part(CELLS, lambda r: r._cells, since=5),
    "per_rank": Part(Ranks(), lambda r: r.per_rank, since=7),
    # by_op and by_module are the cells merged: written for readers of the file, recomputed on load from version 5
    "by_op": Part(MapOf(AGGREGATE), lambda r: r.by_op),
    "by_module": Part(MapOf(AGGREGATE), lambda r: r.by_module),
    "coverage": Part(COVERAGE, lambda r: r.coverage),
    "events": Part(ListOf(EVENT), lambda r: r.events),
    "trajectory": Part(ListOf(STEP), lambda r: r.trajectory, since=6),
}


# --- the report as a whole ---
def to_dict(report: Report) -> dict:
    """The report's saved form, before JSON encoding (non-finite figures are floats here). A report read from a
    version before 5 has aggregates by op and by module only, no cells: it is saved as version 4, which says so
    (saved as 7 its aggregates would be recomputed from no cells on load: lost)."""
    version = VERSION if report._legacy is None else 4
    out = {"format": FORMAT, "version": version}
    for name, part in REPORT.items():
        if version >= part.since:
            out[name] = part.spec.write(part.get(report), name)
    return out


def from_dict(d: Any) -> Report:
    """A report from its saved form, checked against the declaration of the version it names."""
    from .report import Report

    if type(d) is not dict:
        raise ReportFormatError(f"not a shadow report: expected a JSON object, got {_describe(d)}")
    fmt = d.get("format")
    if fmt != FORMAT:
        got = repr(fmt) if isinstance(fmt, str) and len(fmt) <= 60 else _describe(fmt)
        raise ReportFormatError(f"not a shadow report: expected format {FORMAT!r}, got {got}")
    version = d.get("version")
    if type(version) is not int or version not in READS:
        newer = type(version) is int and version > VERSION
        raise ReportFormatError(
            f"shadow report version {_describe(version)} cannot be read by this shadow (it reads versions "
            f"{READS[0]} to {READS[-1]})" + ("; it was written by a newer shadow: upgrade shadow to read it"
                                             if newer else ""))
    for k in d:
        if k not in REPORT and k not in ("format", "version"):
            raise ReportFormatError(f"the report: unknown field {k!r}")
    parts = {}
    for name, part in REPORT.items():
        if version < part.since:
            continue  # written by later versions: an earlier one's file may carry it, unread
        if name not in d:
            raise ReportFormatError(f"the report: missing field {name!r}")
        parts[name] = part.spec.read(d[name], name)
    rep = Report(max_records=parts["max_records"], meta=parts["meta"])
    rep.dropped_records = parts["dropped_records"]
    rep.records = parts["records"]
    if version < 5:
        rep._legacy = {"op": parts["by_op"], "module": parts["by_module"]}
    else:
        rep._cells = parts["cells"]
    rep.per_rank = parts.get("per_rank", {})
    rep.coverage = parts["coverage"]
    rep.events = parts["events"]
    rep.trajectory = parts.get("trajectory", [])
    return rep


def saved(x: Any) -> Any:
    """``x`` (a saved form) with its non-finite floats as the strings of ``NONFINITE``: JSON has no literal for them."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(float(x))  # "inf", "-inf", "nan"
    if isinstance(x, dict):
        return {k: saved(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [saved(v) for v in x]
    return x


def dump_json(report: Report, f: IO[str]) -> None:
    """Write the report's saved form as JSON text into ``f``."""
    json.dump(saved(to_dict(report)), f, indent=1, allow_nan=False)


def loads(data: bytes | str) -> Report:
    """A report from the text of a saved one."""
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
    return from_dict(d)


def load(path: str | os.PathLike) -> Report:
    """``load_report``: the report saved at ``path``; what is wrong with anything else is a ReportFormatError."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return loads(data)
    except ReportFormatError as exc:
        raise ReportFormatError(f"{os.fspath(path)}: {exc}") from None


def save(report: Report, path: str | os.PathLike) -> None:
    """``Report.save``: the report as JSON, written whole or not at all (``write_atomically``)."""
    write_atomically(path, lambda f: dump_json(report, f))


def write_atomically(path: str | os.PathLike, write: Callable[[IO[str]], None]) -> None:
    """Write a text file through ``write(f)`` into a temporary file beside ``path``, flushed to disk, then renamed
    over ``path`` (``os.replace``): a reader, or a crash at any point (an exception, a signal, a full disk, power
    lost after the rename), finds either the old file whole or the new one whole. A symbolic link at ``path`` is
    written through; an existing file keeps its permission bits, a new one gets those ``open`` would give."""
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with open(fd, "w", encoding="utf-8") as f:
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
