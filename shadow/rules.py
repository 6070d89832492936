"""One rule mechanism for every kind of per-op knowledge: replay rules, error budgets, high-precision
references, emulated devices.

A ``RuleTable`` maps ops to rules. Lookup order, as in ``torch/_subclasses/fake_impls.py``: the exact
``OpOverload``, then (tables that allow it) the op's family (an ``OpOverloadPacket`` registered as a
whole), then predicates on the op's plan (tags, schema) in registration order, then the table's one
explicit default. A rule returns ``NotImplemented`` to fall through to the next candidate. Registering
an op twice is a ``DuplicateRuleError`` naming both rules.

>>> table = RuleTable("example", default=lambda x: "default")
>>> @table.register(torch.ops.aten.mm.default)
... def mm_rule(x):
...     return "mm" if x else NotImplemented
>>> table.run(torch.ops.aten.mm.default, True), table.run(torch.ops.aten.mm.default, False)
('mm', 'default')
"""

from __future__ import annotations

import contextlib
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
    if isinstance(rule, functools.partial):
        inner = ", ".join([*map(rule_name, rule.args), *(f"{k}={v!r}" for k, v in rule.keywords.items())])
        return f"{rule_name(rule.func)}({inner})"
    name = getattr(rule, "__name__", None)
    if name is None:
        inner = getattr(rule, "fn", None)
        name = rule_name(inner) if inner is not None else repr(rule)
    return name


class RuleTable(Generic[R]):
    """Rules by op: exact overload -> family (packet, where ``families`` allows) -> predicates on the op
    plan -> ``default`` (None: no default; ``chain`` may then be empty).

    ``families``: whether packets may be registered, and which of a packet's overloads a family rule
    covers (e.g. the ones that return tensors); None refuses packets."""

    def __init__(self, name: str, *, default: R | None = None,
                 families: Callable[[OpOverload], bool] | None = None):
        self.name = name
        self.default = default
        self._covers = families
        self._exact: dict[OpOverload, R] = {}
        self._families: dict[OpOverloadPacket, R] = {}
        self._predicates: list[tuple[Callable[[OpPlan], bool], R]] = []
        self._chains: dict[Any, tuple[R, ...]] = {}  # lookups, cleared by every registration
        self._owns: dict[Any, R | None] = {}

    def __repr__(self) -> str:
        return (f"RuleTable({self.name!r}: {len(self._exact)} ops, {len(self._families)} families, "
                f"{len(self._predicates)} predicates)")

    # --- registration ---
    def register(self, *ops: OpOverload | OpOverloadPacket) -> Callable[[R], R]:
        """Register a rule for exact overloads (``aten.mm.default``), or for whole families (``aten.exp``)
        where the table allows them."""

        def deco(rule: R) -> R:
            for op in ops:
                if isinstance(op, OpOverload):
                    table: dict = self._exact
                elif isinstance(op, OpOverloadPacket) and self._covers is not None:
                    table = self._families
                else:
                    wanted = "OpOverloads or packets (aten.mm.default, aten.exp)" if self._covers is not None \
                        else "OpOverloads such as aten.mm.default"
                    raise TypeError(f"{self.name} rules are registered for {wanted}, got {op!r}")
                if op in table:
                    raise DuplicateRuleError(self.name, op, rule_name(table[op]), rule_name(rule))
                table[op] = rule
            self._forget()
            return rule

        return deco

    def register_predicate(self, pred: Callable[[OpPlan], bool]) -> Callable[[R], R]:
        """Register a rule for every op whose plan satisfies ``pred`` (tried after exact ops and families,
        in registration order)."""

        def deco(rule: R) -> R:
            self._predicates.append((pred, rule))
            self._forget()
            return rule

        return deco

    # --- lookup ---
    def _forget(self) -> None:
        self._chains.clear()
        self._owns.clear()

    def own(self, func: Any) -> R | None:
        """The rule registered for this op itself (exact, else family), without predicates or default."""
        try:
            return self._owns[func]
        except KeyError:
            pass
        rule = self._exact.get(func)
        if rule is None and self._covers is not None and isinstance(func, OpOverload):
            rule = self._families.get(func.overloadpacket)
            if rule is not None and not self._covers(func):
                rule = None
        self._owns[func] = rule
        return rule

    def chain(self, func: Any) -> tuple[R, ...]:
        """The candidate rules for ``func``, in lookup order, ending with the default (if any)."""
        chain = self._chains.get(func)
        if chain is None:
            rules = []
            if isinstance(func, OpOverload):
                own = self.own(func)
                if own is not None:
                    rules.append(own)
                if self._predicates:
                    plan = plan_of(func)
                    rules.extend(rule for pred, rule in self._predicates if pred(plan))
            if self.default is not None:
                rules.append(self.default)
            chain = self._chains[func] = tuple(rules)
        return chain

    def run(self, func: Any, *args: Any) -> Any:
        """The first result of ``func``'s chain that is not ``NotImplemented`` (``NotImplemented`` if none)."""
        return run_chain(self.chain(func), *args)

    # --- tests ---
    @contextlib.contextmanager
    def scoped(self) -> Iterator[RuleTable[R]]:
        """Registrations made inside the block are undone at its end (for tests)."""
        saved = dict(self._exact), dict(self._families), list(self._predicates)
        try:
            yield self
        finally:
            self._exact, self._families, self._predicates = dict(saved[0]), dict(saved[1]), list(saved[2])
            self._forget()


def run_chain(chain: tuple, *args: Any) -> Any:
    """The first result of the rules in ``chain`` that is not ``NotImplemented``."""
    for rule in chain:
        res = rule(*args)
        if res is not NotImplemented:
            return res
    return NotImplemented
