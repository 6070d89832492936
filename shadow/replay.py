"""Replay rules: how each aten op is recomputed on float64 CPU shadows.

Lookup order (as in ``torch/_subclasses/fake_impls.py``): the exact-op table, then predicates on the
op's plan (tags, schema), then one explicit default. A rule returns ``(Kind, outputs)``, or
``NotImplemented`` to fall through to the next candidate. Rules are pure functions of the replay
arguments (already remapped to float64 CPU shadows) and, for random ops, of the device's outputs.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import torch

from .plan import OpPlan

aten = torch.ops.aten


class Kind(str, enum.Enum):
    """How an op call was handled; every call gets exactly one."""

    REPLAYED = "replayed"  # recomputed in float64 by the op's own CPU kernel
    DECOMPOSED = "decomposed"  # recomputed through its decomposition (no float64 CPU kernel)
    VIEW = "view"  # an alias or metadata change: no value to recompute
    META = "meta"  # computed on meta tensors (shapes only): no values exist
    RANDOM = "random"  # random values adopted from the device, never replayed
    ADOPTED = "adopted"  # uninitialized memory (empty*): the device's bytes adopted
    UNSUPPORTED = "unsupported"  # could not be replayed: device result adopted, reason recorded


class Unsupported(Exception):
    """A rule cannot replay this call; carries the op and the reason for the report."""

    def __init__(self, op: str, reason: str):
        super().__init__(f"{op}: {reason}")
        self.op = op
        self.reason = reason


@dataclasses.dataclass(slots=True)
class Replay:
    """A rule's normalized input."""

    plan: OpPlan
    args: list
    kwargs: dict
    device_out: Any  # the device's outputs, for rules that adopt a random part

    def arg(self, name: str, default: Any = None) -> Any:
        for i, a in enumerate(self.plan.func._schema.arguments):
            if a.name == name:
                if not a.kwarg_only and i < len(self.args):
                    return self.args[i]
                return self.kwargs.get(name, default)
        return default


Rule = Callable[[Replay], Any]

_EXACT: dict[torch._ops.OpOverload, Rule] = {}
_PREDICATES: list[tuple[Callable[[OpPlan], bool], Rule]] = []


def register_rule(*ops: torch._ops.OpOverload) -> Callable[[Rule], Rule]:
    """Register a rule for exact op overloads; registering an op twice is an error."""

    def deco(rule: Rule) -> Rule:
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"register_rule expects OpOverloads such as aten.mm.default, got {op!r}")
            if op in _EXACT:
                raise ValueError(f"a replay rule for {op} is already registered ({_EXACT[op].__name__})")
            _EXACT[op] = rule
        return rule

    return deco


def register_predicate(pred: Callable[[OpPlan], bool]) -> Callable[[Rule], Rule]:
    """Register a rule for every op whose plan satisfies ``pred`` (tried in registration order)."""

    def deco(rule: Rule) -> Rule:
        _PREDICATES.append((pred, rule))
        return rule

    return deco


def rule_chain(plan: OpPlan) -> tuple[Rule, ...]:
    """The candidate rules for an op, in lookup order, ending with the default."""
    chain = []
    if plan.func in _EXACT:
        chain.append(_EXACT[plan.func])
    chain.extend(rule for pred, rule in _PREDICATES if pred(plan))
    chain.append(default_rule)
    return tuple(chain)


def run_chain(chain: tuple[Rule, ...], r: Replay) -> tuple[Kind, Any]:
    for rule in chain:
        res = rule(r)
        if res is not NotImplemented:
            return res
    raise AssertionError("default_rule never falls through")


# --- the default: the op's own CPU kernel, then its decomposition ---
def _decomposition(func: torch._ops.OpOverload) -> Callable | None:
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)


def default_rule(r: Replay) -> tuple[Kind, Any]:
    func = r.plan.func
    try:
        return Kind.REPLAYED, func(*r.args, **r.kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError) as exc:
        first = exc
    decomp = _decomposition(func)
    try:
        if decomp is not None:
            return Kind.DECOMPOSED, decomp(*r.args, **r.kwargs)
        out = func.decompose(*r.args, **r.kwargs)
        if out is not NotImplemented:
            return Kind.DECOMPOSED, out
    except Exception as exc:  # the decomposition failed too: report both reasons
        raise Unsupported(r.plan.name, f"{_short(first)}; decomposition: {_short(exc)}") from exc
    raise Unsupported(r.plan.name, f"{_short(first)}; no decomposition")


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


# --- views and metadata-only ops: nothing to recompute ---
@register_predicate(lambda p: p.is_view or torch.Tag.inplace_view in p.tags)
def view_rule(r: Replay) -> tuple[Kind, Any]:
    return Kind.VIEW, None


# --- uninitialized memory: the device's bytes are the value ---
EMPTY_OPS = frozenset(
    op
    for op in (
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.empty_like.default,
        aten.empty_permuted.default if hasattr(aten, "empty_permuted") else None,
    )
    if op is not None
)
register_rule(*EMPTY_OPS)(lambda r: (Kind.ADOPTED, None))


# --- randomness: never replayed (it would consume the device's generator) ---
# Ops tagged nondeterministic_seeded that draw no random numbers when their dropout probability is 0.
_DROPOUT_ARGS = ("dropout_p", "dropout")


def _draws_random(r: Replay) -> bool:
    names = {a.name for a in r.plan.func._schema.arguments}
    dropout_args = [n for n in _DROPOUT_ARGS if n in names]
    if not dropout_args:
        return True
    if "train" in names and r.arg("train") is False:
        return False
    return any(r.arg(n, 0.0) not in (0, 0.0, None) for n in dropout_args)


@register_predicate(lambda p: torch.Tag.nondeterministic_seeded in p.tags)
def random_rule(r: Replay) -> Any:
    """Adopt the device's random outputs; SDPA and RNNs with dropout 0 fall through to a replay."""
    return (Kind.RANDOM, None) if _draws_random(r) else NotImplemented


@register_rule(aten.native_dropout.default)
def native_dropout_rule(r: Replay) -> tuple[Kind, Any]:
    """Adopt the device's mask; the kept values come from the shadow input, so drift survives."""
    x, p, train = r.args[0], r.args[1], r.arg("train")
    mask = r.device_out[1].to("cpu")
    if train is False:
        return Kind.REPLAYED, (x.clone(), mask)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return Kind.RANDOM, (x * mask * scale, mask)


from . import kernels  # noqa: E402,F401  (fused device kernels register their rules in the same table)
