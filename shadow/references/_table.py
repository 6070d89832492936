"""The reference table: one ``RuleTable`` of reference rules, each registered with the cost of checking
one element, and the normalized input (``Call``) every rule reads.

A rule computes ONE element of one output of an op at mpmath's current precision; ``Reference`` sets
that precision and turns inputs a rule does not cover into ``NoReference``. ``estimate_cost_us`` reads
the cost registered beside the rule, so adding a reference is one ``@register_reference``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Protocol

import mpmath
import torch

from ..errors import NoReference
from ..plan import OpPlan, plan_of
from ..rules import RuleTable
from .exact import DEFAULT_BITS, Exact, Uncovered, working_precision

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
NAN = mpmath.mpf("nan")
INF = mpmath.mpf("inf")


READ_WHOLE = 64  # a tensor of at most this many elements is read whole: one tolist costs less than two items


# --- the rule input ---
@dataclasses.dataclass(slots=True)
class Call:
    """A rule's normalized input: the op, its arguments as given, and which output is asked for."""

    func: OpOverload
    args: tuple
    kwargs: Mapping[str, Any]
    output: int = 0
    plan: OpPlan = dataclasses.field(init=False, repr=False)  # the op's, looked up once: rules read many arguments
    # small tensor arguments' values by name, read whole at their first element asked: a check reads several
    _values: dict[str, list] = dataclasses.field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.plan = plan_of(self.func)

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument ``name`` as passed, else its schema default, else ``default``."""
        return self.plan.arg(self.args, self.kwargs, name, default)

    def has(self, name: str) -> bool:
        return self.plan.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        """Argument ``name``, which must be a real tensor."""
        t = self.arg(name)
        if not isinstance(t, torch.Tensor):
            raise self.fail(f"argument {name!r} is {type(t).__name__}, expected a tensor")
        if t.is_complex():
            raise self.fail(f"argument {name!r} is {t.dtype}: complex ops have no reference")
        return t

    def scalar(self, name: str, index: tuple[int, ...] = ()) -> float | int:
        """Argument ``name`` at (broadcast) output ``index``, as an exact Python number."""
        v = self.arg(name)
        if isinstance(v, torch.Tensor):
            if v.is_complex():
                raise self.fail(f"argument {name!r} is {v.dtype}: complex ops have no reference")
            v = self._element(name, v, bcast(v, index))
        if isinstance(v, bool):
            return int(v)
        if not isinstance(v, (int, float)):
            raise self.fail(f"argument {name!r} is {type(v).__name__}, expected a real number or tensor")
        return finite(v)

    def fail(self, reason: str) -> NoReference:
        return NoReference(str(self.func), reason)

    def _element(self, name: str, t: torch.Tensor, at: tuple[int, ...]) -> float | int | bool:
        """Tensor argument ``name`` (``t``) at ``at``, as a Python number."""
        if t.numel() > READ_WHOLE:
            return t[at].item()
        values = self._values.get(name)
        if values is None:
            values = self._values[name] = t.reshape(-1).tolist()
        flat = 0
        for size, i in zip(t.shape, at):  # row-major, as reshape(-1) reads it
            flat = flat * size + i
        return values[flat]


def finite(x: float) -> float | int:
    """``x`` itself; ``Uncovered`` for IEEE special values (the metrics compare those apart)."""
    if isinstance(x, float) and not math.isfinite(x):
        raise Uncovered("non-finite input: IEEE special values are compared apart")
    return x


def bcast(t: torch.Tensor, index: tuple[int, ...]) -> tuple[int, ...]:
    """The element of ``t`` that broadcasting sends to output ``index``."""
    k = t.dim()
    if len(index) < k:
        raise IndexError(f"output index {index} has fewer dims than an input of shape {tuple(t.shape)}")
    tail = index[len(index) - k :] if k else ()
    return tuple(0 if s == 1 else i for s, i in zip(t.shape, tail))


class Rule(Protocol):
    """Computes one element of output ``call.output`` at ``index``, at mpmath's current precision."""

    def __call__(self, call: Call, index: tuple[int, ...]) -> Exact: ...


# --- cost: what checking one element takes, from shapes only ---
Terms = Callable[[Call, int], int]  # (call, elements of the output) -> terms one element reduces
# measured on 2 cores with gmpy2 (docs/references.md, "Cost"): a call's fixed part, then per term
BASE_US = 100.0
US_PER_TERM = {"exact": 0.04, "mpmath": 10.0}  # a term summed exactly; a transcendental per term in mpmath


def ratio_terms(call: Call, out_numel: int) -> int:
    """Reductions (and elementwise ops, at 1): the largest input over the output."""
    largest = max((t.numel() for _, t in call.plan.tensors(call.args, call.kwargs)), default=1)
    return max(1, largest // max(1, out_numel))


@dataclasses.dataclass(frozen=True, slots=True)
class Cost:
    """The cost of one element: ``terms(call, out_numel)`` terms at ``US_PER_TERM[per_term]`` each, plus
    ``BASE_US``; ``per_term`` is "exact", "mpmath", or a function of the call that names one."""

    terms: Terms = ratio_terms
    per_term: str | Callable[[Call], str] = "exact"

    def __post_init__(self) -> None:
        if isinstance(self.per_term, str) and self.per_term not in US_PER_TERM:
            raise ValueError(f"per_term must be one of {', '.join(map(repr, US_PER_TERM))} or a function of the "
                             f"call, got {self.per_term!r}")

    def estimate_us(self, call: Call, out_numel: int) -> tuple[float, int]:
        """(microseconds to check one element, terms it reduces)."""
        terms = self.terms(call, out_numel)
        kind = self.per_term if isinstance(self.per_term, str) else self.per_term(call)
        return BASE_US + US_PER_TERM[kind] * terms, terms


# --- the table ---
@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    fn: Rule  # named fn: shadow.rules.rule_name reads it to name the entry in duplicate errors
    outputs: int
    cost: Cost
    rounds_once: bool


def _returns_tensors(func: OpOverload) -> bool:
    """Which overloads a packet's rule covers: those that return tensors (``aten.add.t`` adds lists)."""
    return any(isinstance(r.type, torch.TensorType) for r in func._schema.returns)


REFERENCES: RuleTable[Any] = RuleTable("reference", packets=_returns_tensors)


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    """The reference of one op; calling it normalizes the arguments and sets the precision.

    >>> ref = reference_for(torch.ops.aten.exp.default)
    >>> float(ref((torch.tensor([1.0]),), {}, (0,)).value)
    2.718281828459045
    """

    func: OpOverload
    rule: Rule
    outputs: int  # how many of the op's outputs the rule can compute (0..outputs-1)
    cost: Cost
    # every overload's float64 kernel rounds each element once from its inputs (IEEE 754: *, /, sqrt) or not at
    # all (neg, abs): its reference is the exact value correctly rounded to float64 (docs/spot-checks.md)
    rounds_once: bool = False

    def __call__(
        self,
        args: Sequence,
        kwargs: Mapping[str, Any] | None,
        index: Sequence[int],
        *,
        output: int = 0,
        bits: int = DEFAULT_BITS,
    ) -> Exact:
        call = self.call(args, kwargs, output)
        with working_precision(bits):
            return self.element(call, tuple(map(int, index)))

    def call(self, args: Sequence, kwargs: Mapping[str, Any] | None, output: int = 0) -> Call:
        """The rule's input for elements of output ``output`` (``NoReference`` for an output it does not compute)."""
        call = Call(self.func, tuple(args), dict(kwargs or {}), output)
        if not 0 <= output < self.outputs:
            raise call.fail(f"output {output}: the reference computes outputs 0..{self.outputs - 1}")
        return call

    def element(self, call: Call, index: tuple[int, ...]) -> Exact:
        """The element at ``index`` (Python ints) at mpmath's current precision: a check of many elements builds
        their ``call`` and sets the precision once."""
        try:
            return self.rule(call, index)
        except Uncovered as exc:
            raise call.fail(str(exc)) from exc


def register_reference(
    *ops: OpOverload | OpOverloadPacket,
    family: str | None = None,
    outputs: int = 1,
    terms: Terms = ratio_terms,
    per_term: str | Callable[[Call], str] = "exact",
    rounds_once: bool = False,
) -> Callable[[Rule], Rule]:
    """Register a rule for exact overloads (``aten.mm.default``) or whole packets (``aten.exp``), with
    its family (``shadow.opsets.Family``) and the cost of one element (``Cost(terms, per_term)``).
    ``rounds_once``: every overload covered rounds each element of its float64 result once from its inputs,
    whatever their values (``Reference.rounds_once``).

    A packet's rule covers every overload of the packet that returns tensors and has no exact rule; rules
    read arguments by schema name, so one rule serves ``exp.default``, ``exp.out`` alike. Registering
    an op twice is a ``DuplicateRuleError`` (a ``ValueError``).
    """
    cost = Cost(terms, per_term)

    def deco(rule: Rule) -> Rule:
        REFERENCES.register(*ops, family=family)(_Entry(rule, outputs, cost, rounds_once))
        return rule

    return deco


def reference_for(func: Any) -> Reference | None:
    """The op's reference: exact overload, then packet, then None (not spot-checkable).

    >>> aten = torch.ops.aten
    >>> reference_for(aten.mm.default) is not None, reference_for(aten.index_add.default)
    (True, None)
    """
    entry = REFERENCES.own(func)
    if entry is None:
        return None
    made = _MADE.get(func)
    if made is None or made[0] is not entry:  # first asked, or registered anew (RuleTable.scoped in tests)
        made = _MADE[func] = (entry, Reference(func, entry.fn, entry.outputs, entry.cost, entry.rounds_once))
    return made[1]


_MADE: dict[OpOverload, tuple[_Entry, Reference]] = {}  # reference_for's answers: a spot check asks three times


def reference(func: OpOverload, *args: Any, **options: Any) -> Exact:
    """One output element of ``func`` at high precision: ``reference_for(func)(args, kwargs, index, *, output=0,
    bits=DEFAULT_BITS)`` (``Reference.__call__``); ``NoReference`` if the op has no rule.

    >>> float(reference(torch.ops.aten.log1p.default, (torch.tensor(1e-20, dtype=torch.float64),), {}, ()).value)
    1e-20
    """
    ref = reference_for(func)
    if ref is None:
        raise NoReference(str(func), "no reference rule for this op")
    return ref(*args, **options)


_UNREGISTERED = Cost()  # an op without a reference: priced as a reduction of its largest input


def estimate_cost_us(func: OpOverload, args: Sequence, kwargs: Mapping[str, Any] | None,
                     out_numel: int) -> tuple[float, int]:
    """(estimated microseconds to check one element, terms it reduces), from shapes only: the cost
    registered with the op's reference.

    >>> estimate_cost_us(torch.ops.aten.mm.default, (torch.ones(4, 1024), torch.ones(1024, 4)), {}, 16)[1]
    1024
    """
    ref = reference_for(func)
    cost = _UNREGISTERED if ref is None else ref.cost
    return cost.estimate_us(Call(func, tuple(args), dict(kwargs or {})), out_numel)
