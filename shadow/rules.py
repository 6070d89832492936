"""One rule mechanism for every kind of per-op knowledge: replay rules, error budgets, high-precision
references, emulated devices.

A ``RuleTable`` maps ops to rules. Lookup order, as in ``torch/_subclasses/fake_impls.py``: the exact
``OpOverload``, then (tables that allow it) the op's packet (an ``OpOverloadPacket`` registered as a
whole), then predicates on the op's plan (tags, schema) in registration order, then the table's one
explicit default. A rule returns ``NotImplemented`` to fall through to the next candidate. Registering
an op twice is a ``DuplicateRuleError`` naming both rules. A registration may name the op family its rule
belongs to (``shadow.opsets.Family``); ``matches`` tells, per candidate, how it was found and that family
(``shadow.explain``).

>>> table = RuleTable("example", default=lambda x: "default")
>>> @table.register(torch.ops.aten.mm.default)
... def mm_rule(x):
...     return "mm" if x else NotImplemented
>>> table.run(torch.ops.aten.mm.default, True), table.run(torch.ops.aten.mm.default, False)
('mm', 'default')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch

from .errors import DuplicateRuleError
from .plan import OpPlan, plan_of

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
R = TypeVar("R", bound=Callable[..., Any])


def rule_name(rule: Any) -> str:
    """A rule's name for messages: functions by name, partials with their bound arguments."""
    wrapped = getattr(rule, "__wrapped__", None)  # functools.wraps: the rule it wraps
    if wrapped is not None:
        return rule_name(wrapped)
    if isinstance(rule, functools.partial):
        inner = ", ".join([*map(rule_name, rule.args), *(f"{k}={v!r}" for k, v in rule.keywords.items())])
        return f"{rule_name(rule.func)}({inner})"
    name = getattr(rule, "__name__", None)
    if name is None:
        inner = getattr(rule, "fn", None)
        name = rule_name(inner) if inner is not None else repr(rule)
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class Match(Generic[R]):
    """A candidate rule for an op and how the table found it: ``via`` "op" (the exact overload), "packet",
    "predicate" (``predicate``: the one that held) or "default"; ``family``: what the registration named."""

    rule: R
    via: str
    family: Any = None
    predicate: Callable[[OpPlan], bool] | None = None


class RuleTable(Generic[R]):
    """Rules by op: exact overload -> packet (where ``packets`` allows) -> predicates on the op plan ->
    ``default`` (None: no default; ``chain`` may then be empty).

    ``packets``: whether packets may be registered, and which of a packet's overloads a packet's rule
    covers (e.g. the ones that return tensors); None refuses packets."""

    def __init__(self, name: str, *, default: R | None = None,
                 packets: Callable[[OpOverload], bool] | None = None):
        self.name = name
        self.default = default
        self._covers = packets
        self._exact: dict[OpOverload, Match[R]] = {}
        self._packets: dict[OpOverloadPacket, Match[R]] = {}
        self._predicates: list[Match[R]] = []
        self._matches: dict[Any, tuple[Match[R], ...]] = {}  # lookups, cleared by every registration
        self._chains: dict[Any, tuple[R, ...]] = {}
        self._owns: dict[Any, R | None] = {}

    def __repr__(self) -> str:
        return (f"RuleTable({self.name!r}: {len(self._exact)} ops, {len(self._packets)} packets, "
                f"{len(self._predicates)} predicates)")

    # --- registration ---
    def register(self, *ops: OpOverload | OpOverloadPacket, family: Any = None) -> Callable[[R], R]:
        """Register a rule for exact overloads (``aten.mm.default``), or for whole packets (``aten.exp``)
        where the table allows them; ``family``: the op family the rule belongs to."""

        def deco(rule: R) -> R:
            for op in ops:
                if isinstance(op, OpOverload):
                    table: dict = self._exact
                    via = "op"
                elif isinstance(op, OpOverloadPacket) and self._covers is not None:
                    table, via = self._packets, "packet"
                else:
                    wanted = "OpOverloads or packets (aten.mm.default, aten.exp)" if self._covers is not None \
                        else "OpOverloads such as aten.mm.default"
                    raise TypeError(f"{self.name} rules are registered for {wanted}, got {op!r}")
                if op in table:
                    raise DuplicateRuleError(self.name, op, rule_name(table[op].rule), rule_name(rule))
                table[op] = Match(rule, via, family)
            self._forget()
            return rule

        return deco

    def register_predicate(self, pred: Callable[[OpPlan], bool], *, family: Any = None) -> Callable[[R], R]:
        """Register a rule for every op whose plan satisfies ``pred`` (tried after exact ops and packets,
        in registration order); ``family``: the op family the rule belongs to."""

        def deco(rule: R) -> R:
            self._predicates.append(Match(rule, "predicate", family, pred))
            self._forget()
            return rule

        return deco

    # --- lookup ---
    def _forget(self) -> None:
        self._matches.clear()
        self._chains.clear()
        self._owns.clear()

    def _own(self, func: Any) -> Match[R] | None:
        found = self._exact.get(func)
        if found is None and self._covers is not None and isinstance(func, OpOverload):
            found = self._packets.get(func.overloadpacket)
            if found is not None and not self._covers(func):
                found = None
        return found

    def own(self, func: Any) -> R | None:
        """The rule registered for this op itself (exact, else packet), without predicates or default."""
        try:
            return self._owns[func]
        except KeyError:
            pass
        found = self._own(func)
        rule = self._owns[func] = None if found is None else found.rule
        return rule

    def matches(self, func: Any) -> tuple[Match[R], ...]:
        """The candidate rules for ``func`` in lookup order, each with how it was found, ending with the default
        (if any)."""
        found = self._matches.get(func)
        if found is None:
            found = []
            if isinstance(func, OpOverload):
                own = self._own(func)
                if own is not None:
                    found.append(own)
                if self._predicates:
                    plan = plan_of(func)
                    found.extend(m for m in self._predicates if m.predicate(plan))
            if self.default is not None:
                found.append(Match(self.default, "default"))
            found = self._matches[func] = tuple(found)
        return found

    def chain(self, func: Any) -> tuple[R, ...]:
        """The candidate rules for ``func``, in lookup order, ending with the default (if any)."""
        chain = self._chains.get(func)
        if chain is None:
            chain = self._chains[func] = tuple(m.rule for m in self.matches(func))
        return chain

    def run(self, func: Any, *args: Any) -> Any:
        """The first result of ``func``'s chain that is not ``NotImplemented`` (``NotImplemented`` if none)."""
        return run_chain(self.chain(func), *args)

    # --- tests ---
    @contextlib.contextmanager
    def scoped(self) -> Iterator[RuleTable[R]]:
        """Registrations made inside the block are undone at its end (for tests)."""
        saved = dict(self._exact), dict(self._packets), list(self._predicates)
        try:
            yield self
        finally:
            self._exact, self._packets, self._predicates = dict(saved[0]), dict(saved[1]), list(saved[2])
            self._forget()


def run_chain(chain: tuple, *args: Any) -> Any:
    """The first result of the rules in ``chain`` that is not ``NotImplemented``."""
    for rule in chain:
        res = rule(*args)
        if res is not NotImplemented:
            return res
    return NotImplemented
