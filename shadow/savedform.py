"""How a saved value is checked and built: the specs the report's format is declared with (``shadow.reportformat``;
each saved type's own declaration sits beside the type: ``RECORD`` in ``shadow.records``, ``ERROR_STATS`` in
``shadow.metrics``, ``SPOT`` in ``shadow.spot``).

Every part of a report is a ``Spec``: ``write`` gives a value's saved form, ``read`` checks a saved value and
builds it back. A value that is not what the format says is refused with a ``ReportFormatError`` that names the
field by its path (``records[3].local.max_ulp``), what was expected and what came. Hostile input is refused
before anything trusts it: nesting deeper than ``MAX_DEPTH``, integers outside int64 (counts) or float64's range
(figures), NaN and infinities spelled otherwise than the ``"nan"``, ``"inf"``, ``"-inf"`` this
format writes (JSON has no literal for them; the ``NaN``, ``Infinity``, ``-Infinity`` of Python's ``json.dump`` are
read as the figures they name), strings longer than ``MAX_TEXT`` or that are not Unicode text.

>>> COUNT.read(3), FIGURE.read("inf")
(3, inf)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
from typing import Any, Callable

from .errors import ReportFormatError

MAX_DEPTH = 32  # JSON nesting: shadow writes 7 levels (per_rank[i].cells[j].aggregate.kinds); meta may add some
MAX_TEXT = 1 << 20  # characters of one string
FLOAT_MAX = sys.float_info.max
INT64 = 2**63 - 1
NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}  # the strings non-finite figures are saved as


def describe(value: Any) -> str:
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
        return Invalid(f"expected {self.expected}, got {describe(value)}")


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
        raise Invalid(f"{describe(value)} is not a valid {self.cls.__name__} (expected {self.expected})")

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


FIGURE, COUNT, TEXT = Number(), Integer(), Text()
COUNTS = MapOf(COUNT)


def saved(x: Any) -> Any:
    """``x`` (a saved form) with its non-finite floats as the strings of ``NONFINITE``: JSON has no literal for them."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(float(x))  # "inf", "-inf", "nan"
    if isinstance(x, dict):
        return {k: saved(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [saved(v) for v in x]
    return x

