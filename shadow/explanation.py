"""What shadow knows about one aten op: every per-op table's answer, in one typed value (``explain``).

An op's facts live in several tables (``shadow.rules.RuleTable``), each filled where its family's rules are
written: how it is replayed in float64 (``shadow.replay``), its error budget (``shadow.budgets``), its
high-precision reference (``shadow.references``), which output elements it defines (``shadow.replay.defined``),
the op sets it belongs to (``shadow.opsets.OPSETS``) and what each emulated device does to it
(``shadow.modes.emulate.EMULATIONS``, with the audit's precision where the device is one). ``explain`` asks them
all; the CLI prints the answer (``shadow explain aten.mm``).

>>> e = explain(torch.ops.aten.mm.default)
>>> e.budget[0].name, e.budget[0].family, e.reference.family, e.replay[0].name
('mm_budget', 'matmul', 'matmul', 'default_rule')
>>> [d.name for d in e.devices if d.claims]
['bf16', 'fp16', 'fp16_accum', 'fp8', 'ftz', 'tf32']
>>> explain("aten.mm")["out"].op   # a packet: one explanation per overload
'aten.mm.out'
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from typing import Any, Iterator

import torch

from .budgets import BUDGETS
from .budgets.core import InUlps, foreach_base
from .errors import ShadowOptionError
from .modes.emulate import EMULATIONS
from .opsets import OPSETS, Matmul
from .plan import plan_of
from .references import REFERENCES
from .replay import REPLAY
from .replay.defined import DEFINED
from .rules import Match, RuleTable, rule_name

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


@dataclasses.dataclass(frozen=True)
class Answer:
    """One candidate rule of one table for the op, in lookup order: its ``name``, how the table found it
    (``via``: "op", "packet", "predicate NAME", "default"), the ``family`` its registration named
    (``shadow.opsets.Family`` values; None where it named none), the ``module`` that defines it, and what it
    does (``doc``: its docstring's first paragraph, or what the rule says of itself)."""

    name: str
    via: str
    family: str | None
    module: str
    doc: str

    def line(self) -> str:
        family = f"{self.family}: " if self.family else ""
        where = f", {self.module}" if self.module else ""
        return f"{family}{self.name} ({self.via}{where})" + (f": {self.doc}" if self.doc else "")


@dataclasses.dataclass(frozen=True)
class Device:
    """What one emulated device does to the op: the rules of its table that claim it (none: the op passes
    through untouched), what the device is, and its format where ``shadow.audit`` offers it as a precision."""

    name: str
    claims: tuple[Answer, ...]
    summary: str
    audit: str | None

    def line(self) -> str:
        audit = f" [audit precision: {self.audit}]" if self.audit else ""
        if not self.claims:
            return f"{self.name}: passes it through{audit}"
        rules = "; then ".join(f"{c.name} ({c.via}, {c.module})" for c in self.claims)
        return f"{self.name}: {rules}{audit}" + (f": {self.summary}" if self.summary else "")


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Every table's answer for one op overload (``explain``). ``replay``, ``budget``, ``defined``: the candidate
    rules in lookup order (a rule may return NotImplemented for a call, and the next answers); ``reference``: the
    spot checks' rule, or None (the op is not spot-checked); ``opsets``: the ``shadow.opsets`` sets it belongs to;
    ``devices``: every emulated device, by name."""

    op: str  # "aten.mm.default"
    schema: str
    tags: tuple[str, ...]
    replay: tuple[Answer, ...]
    budget: tuple[Answer, ...]
    reference: Answer | None
    defined: tuple[Answer, ...]
    opsets: tuple[str, ...]
    devices: tuple[Device, ...]

    def render(self) -> str:
        def rows(title: str, answers: tuple[Answer, ...], none: str) -> list[str]:
            if not answers:
                return [f"  {title:<10} {none}"]
            return [f"  {title if i == 0 else '':<10} {'then ' if i else ''}{a.line()}" for i, a in enumerate(answers)]

        lines = [f"{self.op}: {self.schema}" + (f"  [{', '.join(self.tags)}]" if self.tags else "")]
        lines += rows("replay", self.replay, "none")
        lines += rows("budget", self.budget, "none")
        lines += rows("reference", (self.reference,) if self.reference else (), "none: not spot-checked")
        lines += rows("defined", self.defined, "every element of every output")
        lines.append(f"  {'op sets':<10} {', '.join(self.opsets) or 'none'}")
        lines += [f"  {'devices' if i == 0 else '':<10} {d.line()}" for i, d in enumerate(self.devices)]
        return "\n".join(lines)

    __str__ = render


@dataclasses.dataclass(frozen=True)
class Explanations:
    """The explanations of every overload of a packet (``explain(torch.ops.aten.mm)``, ``explain("aten.mm")``),
    in the packet's order; index by position or overload name."""

    op: str  # "aten.mm"
    overloads: tuple[Explanation, ...]

    def __iter__(self) -> Iterator[Explanation]:
        return iter(self.overloads)

    def __len__(self) -> int:
        return len(self.overloads)

    def __getitem__(self, key: int | str) -> Explanation:
        if isinstance(key, str):
            for e in self.overloads:
                if e.op.rsplit(".", 1)[-1] == key:
                    return e
            raise KeyError(f"{self.op} has no overload {key!r}: it has "
                           f"{', '.join(e.op.rsplit('.', 1)[-1] for e in self.overloads)}")
        return self.overloads[key]

    def render(self) -> str:
        return "\n\n".join(e.render() for e in self.overloads)

    __str__ = render


def explain(op: Any) -> Explanation | Explanations:
    """Every table's answer for ``op``: an ``OpOverload`` (``torch.ops.aten.mm.default``) or its name
    ("aten.mm.default", "mm.default", "aten::mm.out") gives an ``Explanation``; a packet (``torch.ops.aten.mm``)
    or its name ("aten.mm", "mm") gives ``Explanations``, one per overload. An unknown name is a
    ``ShadowOptionError`` listing the closest ones.

    >>> print(explain("aten.exp.default").budget[0].line())
    elementwise: InUlps (op): 4 ulps of the result (reads no argument)
    """
    found = resolve(op)
    if isinstance(found, OpOverload):
        return _explain(found)
    name = f"{found._qualified_op_name.replace('::', '.')}"
    return Explanations(name, tuple(_explain(getattr(found, o)) for o in found.overloads()))


def resolve(op: Any) -> OpOverload | OpOverloadPacket:
    """``op`` as an OpOverload or OpOverloadPacket (see ``explain`` for the names it takes)."""
    if isinstance(op, (OpOverload, OpOverloadPacket)):
        return op
    if not isinstance(op, str):
        raise ShadowOptionError(f"explain({op!r}): expected an aten op (torch.ops.aten.mm.default, "
                                "torch.ops.aten.mm) or its name ('aten.mm.default', 'aten.mm', 'mm')")
    text = op.strip().removeprefix("torch.ops.").replace("::", ".")
    parts = text.split(".")
    candidates = []
    if len(parts) >= 2:
        candidates.append((parts[0], parts[1], parts[2:]))  # namespace.name[.overload]
    candidates.append(("aten", parts[0], parts[1:]))  # name[.overload] in aten
    for namespace, name, rest in candidates:
        if len(rest) > 1 or not name:
            continue
        packet = _packet(namespace, name)
        if packet is None:
            continue
        if not rest:
            return packet
        if rest[0] in packet.overloads():
            return getattr(packet, rest[0])
        raise ShadowOptionError(f"explain({op!r}): {namespace}.{name} has no overload {rest[0]!r}; its overloads: "
                                f"{', '.join(packet.overloads())}")
    close = difflib.get_close_matches(text if "." in text else f"aten.{text}", _op_names(), n=5, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ShadowOptionError(f"explain({op!r}): no such op (expected 'aten.NAME[.OVERLOAD]' or 'NAME', as "
                            f"torch.ops.aten names it){hint}")


def _packet(namespace: str, name: str) -> OpOverloadPacket | None:
    if not namespace.isidentifier() or not name.isidentifier():
        return None
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, OpOverloadPacket) else None


@functools.cache
def _op_names() -> tuple[str, ...]:
    """Every registered op's name as torch.ops spells it ("aten.mm", "aten.add.Tensor")."""
    return tuple(sorted(n.replace("::", ".") for n in torch._C._dispatch_get_all_op_names()))


# --- one overload ---
def _explain(func: OpOverload) -> Explanation:
    plan = plan_of(func)
    return Explanation(
        op=plan.name,
        schema=str(func._schema),
        tags=tuple(sorted(t.name for t in func.tags)),
        replay=_answers(REPLAY, func),
        budget=_answers(BUDGETS, func, _budget_doc),
        reference=next(iter(_answers(REFERENCES, func, _reference_doc)), None),
        defined=_answers(DEFINED, func),
        opsets=tuple(_opset(name, members, plan.base) for name, members in OPSETS.items() if plan.base in members),
        devices=tuple(_device(name, mode, func) for name, mode in sorted(EMULATIONS.items())),
    )


def _answers(table: RuleTable, func: OpOverload, doc: Any = None) -> tuple[Answer, ...]:
    return tuple(_answer(m, func, doc) for m in table.matches(func))


def _answer(match: Match, func: OpOverload, doc: Any = None) -> Answer:
    rule = match.rule
    inner = _inner(rule)
    via = match.via
    if match.predicate is not None:
        via = f"predicate {rule_name(match.predicate)}"
    family = match.family if match.family is not None else getattr(rule, "family", None)
    said = doc(rule, func) if doc is not None else None
    if isinstance(inner, InUlps):  # an instance: named by its class, defined where it was registered
        return Answer("InUlps", via, str(family), "", said)
    return Answer(rule_name(rule), via, None if family is None else str(family),
                  getattr(inner, "__module__", None) or "", said if said is not None else _first_paragraph(inner))


def _inner(rule: Any) -> Any:
    """The function a table's entry runs: a budget's or reference's ``fn``, a partial's or a wrapper's own."""
    while True:
        if isinstance(rule, functools.partial):
            rule = rule.func
        elif getattr(rule, "__wrapped__", None) is not None:
            rule = rule.__wrapped__
        elif hasattr(rule, "fn") and callable(rule.fn):
            rule = rule.fn
        else:
            return rule


def _first_paragraph(fn: Any) -> str:
    doc = inspect.getdoc(fn) if callable(fn) and getattr(fn, "__doc__", None) else None
    if not doc or isinstance(fn, type) and fn.__doc__ == type(fn).__doc__:
        return ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _budget_doc(rule: Any, func: OpOverload) -> str | None:
    fn = rule.fn
    if isinstance(fn, InUlps):
        guess = ", a guess: no rule knows this op" if fn.is_default else ""
        return f"{fn.ulps:g} ulps of the result (reads no argument){guess}"
    base = foreach_base(func)
    if base is not None:
        return f"each list element as {plan_of(base).name}'s budget"
    return None


def _reference_doc(entry: Any, func: OpOverload) -> str:
    cost = entry.cost
    per = cost.per_term if isinstance(cost.per_term, str) else f"{rule_name(cost.per_term)} per call"
    parts = [_first_paragraph(_inner(entry.fn)).rstrip("."),
             f"outputs 0..{entry.outputs - 1}" if entry.outputs > 1 else "",
             f"cost per element: {rule_name(cost.terms)} terms, {per}", "rounds once" if entry.rounds_once else ""]
    return "; ".join(p for p in parts if p)


def _opset(name: str, members: Any, base: str) -> str:
    roles = members.get(base) if isinstance(members, dict) else None
    if isinstance(roles, Matmul):
        fields = ", ".join(f"{f.name}={getattr(roles, f.name)}" for f in dataclasses.fields(roles)
                           if getattr(roles, f.name) is not None)
        return f"{name} ({fields})"
    return name


def _device(name: str, mode: Any, func: OpOverload) -> Device:
    a = mode.audit
    audit = None if a is None else (f"{a.format.name}, {a.bits} bits" + (", scaled per tensor" if a.scaled else "")
                                    + (", held on the device's kernels" if a.held else ""))
    return Device(name, _answers(mode.table, func), _first_paragraph(mode), audit)


__all__ = ["Answer", "Device", "Explanation", "Explanations", "explain", "resolve"]
