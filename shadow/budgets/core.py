"""The budgets' core: the :class:`Budget` a rule returns, the :class:`BudgetCall` it is given, and the one rule
table ``BUDGETS`` that the family modules fill (the units they count in: ``shadow.budgets.units``).

A rule is a pure function of a :class:`BudgetCall` (the op's arguments by schema name, the device's
inputs upcast exactly to float64, the float64 reference outputs, the device dtype and its unit
roundoffs) that returns a :class:`Budget`, or ``NotImplemented`` to fall through. Lookup order
(``shadow.rules.RuleTable``): the exact op, then predicates on the op's plan in registration order, then
the default (``DEFAULT_ULPS`` ulps, an :class:`InUlps`). The derivations and the error model behind
:func:`effective_bits`: docs/budgets.md.

>>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
>>> budget_for(aten.exp.default, (x,), {}, [x.exp()], torch.bfloat16).family
'elementwise'
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch

from ..metrics import ErrorStats, fused_bounds, precision_bits, spacing
from ..opsets import Family
from ..plan import OpPlan, plan_of
from ..replay.table import pooled_call
from ..rules import RuleTable, rule_name
from .units import SUM_FAMILIES, accumulation_dtype, effective_bits, effective_bits_rel, subnormal_min, unit_roundoff

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload


# --- the record a rule returns ---
_TERMS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {  # UlpsPlus.op -> its term by torch's passes
    "": lambda t, o: t, "abs": lambda t, o: t.abs(), "square": lambda t, o: t * t,
    "sub": lambda t, o: (t - o).abs(), "div": lambda t, o: (t / o).abs(), "mul": lambda t, o: t.abs() * o.abs()}


@dataclasses.dataclass(frozen=True, slots=True)
class UlpsPlus:
    """A bound of ``ulps`` units in the last place of ``dtype`` at each reference value r plus ``alpha`` times
    an operand term: spacing(r) * ulps + alpha * term, each operation rounded once, none fused into another.
    The term is ``term`` itself, or what ``op`` forms from it and ``other``: "abs" |term|, "square" term * term,
    "sub" |term - other|, "div" |term / other|, "mul" |term| * |other|. ``shadow.metrics.compare`` forms the
    bound element by element where it reads r (``shadow._fused``), so the bounds of the optimizer's updates
    (every parameter, every step) are never written out; ``tensor`` computes the same bits with torch's
    passes for every other reader.

    >>> r = torch.tensor([1.0, 3.0], dtype=torch.float64)
    >>> b = UlpsPlus(2.0, torch.tensor([0.5, 0.5], dtype=torch.float64), 2.0**-20, torch.float32).tensor(r)
    >>> b.tolist() == [2 * 2.0**-23 + 2.0**-21, 2 * 2.0**-22 + 2.0**-21]   # 2 ulps at 1 and at 3, plus 2**-21
    True
    """

    ulps: float
    term: torch.Tensor  # float64 (complex where an op's |.| makes it real), broadcastable to r
    alpha: float
    dtype: torch.dtype  # real
    op: str = ""
    other: torch.Tensor | None = None  # the second operand of "sub", "div" and "mul"

    @property
    def scale(self) -> float:
        """The spacing unit's factor: ulps * 2**-p, as ``metrics.spacing`` forms it."""
        return self.ulps * 2.0 ** -precision_bits(self.dtype)

    def term_tensor(self) -> torch.Tensor:
        """The term, by torch's passes."""
        return _TERMS[self.op](self.term, self.other)

    def tensor(self, r: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bound as a tensor of r's shape (into ``out`` where given)."""
        t = self.term_tensor()
        return add_into(spacing(r, self.dtype, self.ulps, out=out), t if self.alpha == 1.0 else t * self.alpha)


class Budget:
    """The error budget of one op call: a bound per output element and how it was derived.

    ``family``: the rule's family (a ``shadow.opsets.Family`` value: "elementwise", "movement", "reduction",
    "matmul", "conv", "norm", "loss", "attention", "composed", "unbounded", "default"...); ``bound``: one float64
    tensor per output (broadcastable to it; ``None`` for discrete outputs), computed on first access;
    ``is_default``: no rule knows this op and the bound is a guess of a few ulps; ``ulps``: set when the bound is
    exactly ``ulps`` units in the last place of the output (``ulps * spacing(|r|)``), so ``budget_used = max_ulp /
    ulps`` needs no tensor. A rule may give formulas instead (``of_formulas``, ``UlpsPlus``): ``divisors`` hands
    them to the comparison, which forms the bound where it reads the result, and ``bound`` computes their tensors
    for every other reader.

    >>> r = torch.tensor([1.0, 3.0], dtype=torch.float64)
    >>> b = Budget.in_ulps("elementwise", 2.0, [r], torch.float32)
    >>> b.bound[0].tolist() == [2 * 2.0**-23, 2 * 2.0**-22]   # spacing of float32 at 1 and at 3
    True
    """

    __slots__ = ("_bound", "_built", "_dtype", "_elements", "_formulas", "_make", "_outputs", "_scale_sq", "family",
                 "is_default", "ulps")

    def __init__(self, family: str, bound: Sequence[torch.Tensor | None] | Callable[[], Sequence] | None, *,
                 outputs: Sequence[Any], dtype: torch.dtype, is_default: bool = False,
                 ulps: float | None = None, scale_sq: Any = None,  # float, (scale, acc), or a callable of either
                 formulas: Callable[[], Sequence[UlpsPlus | torch.Tensor | None]] | None = None):
        self.family = str(family)  # a Family's value: what reports save
        self.is_default = is_default
        self.ulps = ulps
        self._outputs = list(outputs)
        self._dtype = dtype
        if bound is None:
            self._make = self._bound = None
        elif callable(bound):
            self._make, self._bound = bound, None
        else:
            self._make, self._bound = None, tuple(bound)
        self._scale_sq = scale_sq
        self._formulas = formulas
        self._built = None
        self._elements: int | None = None  # the outputs' elements where they are not held (``of_pieces``)

    @classmethod
    def of_formulas(cls, family: str, formulas: Callable[[], Sequence[UlpsPlus | torch.Tensor | None]], *,
                    outputs: Sequence[Any], dtype: torch.dtype, scratch: Any = None) -> Budget:
        """A bound given per output as an ``UlpsPlus`` (or a tensor, or None), built on first use: the
        comparison reads the formulas (``divisors``), ``bound`` computes their tensors."""
        def make() -> list:
            return [f.tensor(r, out=_empty(scratch, r)) if isinstance(f, UlpsPlus) else f
                    for f, r in zip(budget.formulas(), outputs)]
        budget = cls(family, make, outputs=outputs, dtype=dtype, formulas=formulas)
        return budget

    @classmethod
    def of_pieces(cls, like: Budget, scales: tuple[float, float], elements: int) -> Budget:
        """The budget of a call judged in pieces (``shadow.engine.pieces``): the family, default flag and ulps of
        ``like`` (a piece's), the pieces' ``scales()`` summed and their outputs' elements, for ``bits`` over every
        element; no bounds and no tensors held (each piece compared its own part)."""
        budget = cls(like.family, None, outputs=(), dtype=like._dtype, is_default=like.is_default, ulps=like.ulps,
                     scale_sq=scales)
        budget._elements = elements
        return budget

    @property
    def divisors(self) -> tuple[UlpsPlus | torch.Tensor | None, ...]:
        """Per output what the comparison divides the error by: ``bound``'s tensors, or for a rule that gives
        formulas, its ``UlpsPlus`` (formed element by element where the comparison reads the reference)."""
        if self._formulas is None or self._bound is not None:
            return self.bound
        return self.formulas()

    def formulas(self) -> tuple[UlpsPlus | torch.Tensor | None, ...]:
        """The rule's formulas, built once (a rule without formulas must not be asked)."""
        if self._built is None:
            self._built = tuple(self._formulas())
        return self._built

    @classmethod
    def in_ulps(cls, family: str, ulps: float, outputs: Sequence[Any], dtype: torch.dtype, *,
                is_default: bool = False) -> Budget:
        """A bound of ``ulps`` units in the last place of ``dtype`` at each reference value."""
        return cls(family, None, outputs=outputs, dtype=dtype, is_default=is_default, ulps=ulps)

    @property
    def bound(self) -> tuple[torch.Tensor | None, ...]:
        if self._bound is None:
            if self._make is not None:
                self._bound = tuple(self._make())
            else:  # ulps of the result
                rd = self._dtype.to_real() if self._dtype.is_complex else self._dtype
                self._bound = tuple(spacing(r, rd, self.ulps) if is_float(r) else None
                                    for r in self._outputs)
        return self._bound

    @property
    def of_sum(self) -> bool:
        """The bound is one of a sum's (``SUM_FAMILIES``): bound / |result| then estimates how much the
        result cancels (sum|x| / |sum x|, ||a_i|| ||b_j|| / |c_ij|); spot checks look there first."""
        return self.family in SUM_FAMILIES and self.ulps is None

    def scale_sq(self) -> float:
        """Sum over output elements of T**2, T the one-rounding error scale of :func:`effective_bits`
        (the result itself unless the rule says otherwise)."""
        return self.scales()[0]

    def scales(self) -> tuple[float, float]:
        """(scale_sq, acc_sq): a rule's ``scale_sq`` returns the first or both (see :func:`effective_bits`)."""
        s = self._scale_sq
        if s is None:
            s = sum(sumsq(r) for r in self._outputs if is_float(r))
        elif callable(s):
            s = s()
        if not isinstance(s, tuple):
            s = (float(s), 0.0)
        self._scale_sq = s
        return s

    def bits(self, stats: ErrorStats, whole: bool = False) -> float:
        """:func:`effective_bits` of a call's local error ``stats`` (its ``norm`` > 0) under this op's scales.
        ``whole``: ``stats`` are the one output's, over every element, all finite: where the scale is that
        output's own (the default), it is ||r|| = norm / rel_norm, not read again (a pass over the output)."""
        outs = self._outputs
        if whole and self._scale_sq is None and len(outs) == 1:  # the one output is the one compared
            return effective_bits_rel(stats.rel_norm, self._dtype)
        s, acc = self.scales()
        n = self._elements if self._elements is not None else sum(r.numel() for r in outs if is_float(r))
        return effective_bits(stats.norm ** 2, s, acc, self._dtype, n)

    def __repr__(self) -> str:
        extra = f", ulps={self.ulps}" if self.ulps is not None else ""
        return f"Budget(family={self.family!r}, is_default={self.is_default}{extra})"


def _empty(scratch: Any, r: torch.Tensor) -> torch.Tensor:
    """A real tensor with r's shape and layout from ``scratch`` (a ``shadow.scratch.Scratch``; None: fresh)."""
    dtype = r.dtype.to_real() if r.is_complex() else r.dtype
    return torch.empty_like(r, dtype=dtype) if scratch is None else scratch.empty_like(r, dtype)


# --- shared helpers (pure functions of float64 tensors) ---
def is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def sumsq(t: torch.Tensor) -> float:
    """sum |t|**2 over the finite elements: one pass (vector_norm), the masked sum only when non-finite."""
    if t.numel() == 0:
        return 0.0
    s = float(torch.linalg.vector_norm(t)) ** 2
    if math.isfinite(s):
        return s
    a = t.abs()
    a = a[torch.isfinite(a)]
    return float(a.square().sum())


def add_into(b: torch.Tensor, t: Any, alpha: float = 1.0) -> torch.Tensor:
    """b + alpha * t, in place in b (a fresh tensor of the rule's own) where the shapes allow: bounds are as large
    as the outputs, and a fresh tensor that size costs more in page faults than the add (3x the add inside a
    training step of the LM-shaped benchmark)."""
    # torch.broadcast_shapes costs more than the rest of the rule: asked only where the shapes differ
    if isinstance(t, torch.Tensor) and t.dim() and t.shape != b.shape \
            and torch.broadcast_shapes(b.shape, t.shape) != b.shape:
        return torch.add(b, t, alpha=alpha)
    return b.add_(t, alpha=alpha)


def magnitude_of(a: torch.Tensor, out: torch.Tensor, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    """``out`` (a real temporary of the bound, a's shape) set to |a| * scale + offset: in one numba pass where
    it reads the tensors (``shadow._fused_bounds.magnitude``, the same values bit for bit), else torch's three."""
    if fused_bounds is None or not fused_bounds.magnitude(a, out, scale, offset):
        torch.abs(a, out=out).mul_(scale).add_(offset)
    return out


def magnitude(t: Any) -> Any:
    """|t| of a tensor or a Python number."""
    return t.abs() if isinstance(t, torch.Tensor) else abs(t)


def coefficient(v: Any) -> Any:
    """An alpha or beta argument: None means 1."""
    return 1.0 if v is None else v


def reduced_dims(x: torch.Tensor, dim: Any) -> list[int]:
    """The dims a reduction's ``dim`` argument names (None or []: all), made non-negative."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return [d % max(x.dim(), 1) for d in dim]


def numel_over(x: torch.Tensor, dims: Iterable[int]) -> int:
    """How many elements of x each output of a reduction over ``dims`` sums."""
    n = 1
    for d in dims:
        n *= x.shape[d] if x.dim() else 1
    return n


# --- the normalized input every rule gets ---
@dataclasses.dataclass(slots=True)
class BudgetCall:
    """A rule's input: the op's plan, its arguments as passed (``args``, ``kwargs``; tensors are the device's
    inputs upcast to float64) and by schema name (``a``), the float64 reference outputs (flattened returns; for
    ops that return nothing, the written arguments), the device dtype, ``u`` (its unit roundoff) and ``ua`` (the
    unit roundoff of the accumulation dtype). The budgets it builds are of ``family``, the one the running rule
    was registered with, unless a rule names another."""

    plan: OpPlan
    args: Sequence[Any]
    kwargs: dict[str, Any]
    outputs: list[Any]
    dtype: torch.dtype
    u: float
    ua: float
    scratch: Any = None  # shadow.scratch.Scratch: reused memory for the bounds' large temporaries (None: fresh)
    named: dict[str, Any] | None = None  # ``a`` once bound (a rule may pass its own)
    # the unit roundoff of the device inputs' dtype where it is not the result's (oneDNN's bfloat16 LSTM backward
    # returns float32 gradients of values it keeps in bfloat16); None: ``u``
    u_inputs: float | None = None
    family: str | None = None  # the running rule's (set by ``BudgetRule``)

    @property
    def a(self) -> dict[str, Any]:
        """Every argument by schema name (defaults filled in), bound at the first read: most rules read none."""
        if self.named is None:
            self.named = self.plan.bind(self.args, self.kwargs)
        return self.named

    @property
    def func(self) -> OpOverload:
        return self.plan.func

    def empty(self, r: torch.Tensor) -> torch.Tensor:
        """A real tensor with r's shape and layout, for a temporary of the bound (reused memory when large)."""
        return _empty(self.scratch, r)

    def out(self, i: int = 0) -> torch.Tensor:
        return self.outputs[i]

    def ulps(self, n: float, *, family: str | None = None) -> Budget:
        """``n`` units in the last place of the result."""
        return Budget.in_ulps(self._family(family), n, self.outputs, self.dtype)

    def budget(self, make: Callable[[], Sequence], scale_sq: Any = None, *, family: str | None = None) -> Budget:
        """The bound ``make()`` gives per output, built on first use; ``scale_sq`` as :func:`effective_bits` reads
        it (``Budget.scales``)."""
        return Budget(self._family(family), make, outputs=self.outputs, dtype=self.dtype, scale_sq=scale_sq)

    def ulps_plus(self, ulps: float, term: Callable[[], Any], alpha: float = 1.0, op: str = "", other: Any = None,
                  *, family: str | None = None) -> Budget:
        """``ulps`` of the result plus ``alpha`` times a term, as an ``UlpsPlus``: ``term()`` (a tensor
        broadcastable to the result, or a number), computed on first use, or what ``op`` forms from it and
        ``other``."""
        dtype = self.dtype.to_real() if self.dtype.is_complex else self.dtype

        def tensor(v: Any) -> torch.Tensor | None:
            if v is None or isinstance(v, torch.Tensor):
                return v
            return torch.tensor(v, dtype=torch.complex128 if isinstance(v, complex) else torch.float64)

        def formulas() -> list[UlpsPlus]:
            return [UlpsPlus(ulps, tensor(term()), float(alpha), dtype, op, tensor(other))]

        return Budget.of_formulas(self._family(family), formulas, outputs=self.outputs, dtype=self.dtype,
                                  scratch=self.scratch)

    def _family(self, family: str | None) -> str:
        family = family or self.family
        if family is None:
            raise TypeError(f"a budget of {self.plan.name} built outside a registered rule: name its family "
                            "(family=Family.X)")
        return family

    def floor(self, c: float = 1.0) -> float:
        """c subnormal spacings of the device dtype: the rounding of results below its smallest normal."""
        return c * subnormal_min(self.dtype)

    def final(self, r: torch.Tensor, c: float = 1.0) -> torch.Tensor:
        """c roundings of the result to the device dtype: c*u*|r| + c subnormal spacings."""
        # in one temporary: a fresh large tensor costs more in page faults than the arithmetic
        return magnitude_of(r, self.empty(r), c * self.u, self.floor(c))

    def ulp_bound(self, r: torch.Tensor, n: float) -> torch.Tensor:
        """n units in the last place of the device dtype at each value of r."""
        return spacing(r, self.dtype.to_real() if self.dtype.is_complex else self.dtype, n, out=self.empty(r))

    def out_rounding(self, r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """m plus the final rounding to the device dtype when the accumulation is wider (bf16/fp16 results):
        u * |r|, not u * m. On random data |r| ~ sqrt(K) while m ~ K, and u * m would be as large as the
        error of accumulating in the device dtype itself, which the budget must catch."""
        if self.u == self.ua:
            return m
        return torch.add(m, r.abs(), alpha=self.u)

    def out_rounding_sq(self, r_sq: float) -> float:
        """The scale of the result's own rounding where it is apart from the accumulation (bf16/fp16
        results of a float32 accumulation): sum r**2; 0 where the last accumulation step is that rounding."""
        return 0.0 if self.u == self.ua else r_sq

    def call_with(self, /, **changes: Any) -> Any:
        """The op itself on changed arguments (|x| for a magnitude); out= variants write fresh buffers,
        never the caller's (those are the shadow's own outputs); a large result in reused memory, as a
        replay's (``shadow.replay.table.pooled_call``)."""
        a = dict(self.a, **changes)
        schema = self.func._schema.arguments
        for i in self.plan.out_args:
            t = a[schema[i].name]
            if isinstance(t, torch.Tensor):
                a[schema[i].name] = torch.empty(0, dtype=t.dtype)
        r = self.outputs[0] if self.outputs else None
        return pooled_call(self.plan, [a[arg.name] for arg in schema if not arg.kwarg_only],
                           {arg.name: a[arg.name] for arg in schema if arg.kwarg_only}, self.scratch,
                           r.numel() * 8 if isinstance(r, torch.Tensor) else 0)


Rule = Callable[[BudgetCall], Any]  # returns a Budget, or NotImplemented to fall through


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetRule:
    """A rule as the table holds it, with its family (the budgets it builds are of it unless it names another)
    and the fact the engine's copy policy needs: whether it may read the arguments an in-place op overwrites,
    as they were before the op (see :func:`reads_overwritten`)."""

    fn: Rule
    family: str
    reads_overwritten: bool = True
    early: bool = False

    def __call__(self, c: BudgetCall) -> Any:
        c.family = self.family
        return self.fn(c)


@dataclasses.dataclass(frozen=True, slots=True)
class InUlps:
    """The rule "``ulps`` units in the last place of every result, whatever the arguments": it reads none, so its
    budget is built from the outputs alone (``budget``), without a ``BudgetCall``, and the engine keeps no inputs
    for it (:func:`fixed_budget`). Most elementwise ops' rule, and the default."""

    family: str
    ulps: float
    is_default: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", str(self.family))  # a Family's value, as Budget.family holds it

    def __call__(self, c: BudgetCall) -> Budget:
        return self.budget(c.outputs, c.dtype)

    def budget(self, outputs: Sequence[Any], dtype: torch.dtype) -> Budget:
        """The budget of a call with these float64 reference outputs in the device ``dtype``: ``budget_for``'s."""
        if _nothing_to_bound(outputs):
            return Budget.in_ulps(Family.EMPTY, 0.0, outputs, dtype)
        return Budget.in_ulps(self.family, self.ulps, outputs, dtype, is_default=self.is_default)


def _nothing_to_bound(outputs: Sequence[Any]) -> bool:
    """No output is a floating tensor with elements."""
    for r in outputs:  # is_float inlined: most calls ask, once each
        if isinstance(r, torch.Tensor) and r.numel() and (r.is_floating_point() or r.is_complex()):
            return False
    return True


# The default: an op no rule knows. A few ulps of the result, flagged so reports can tell the guess apart.
DEFAULT_ULPS = 4.0

BUDGETS: RuleTable[BudgetRule] = RuleTable(
    "budget", default=BudgetRule(InUlps(Family.DEFAULT, DEFAULT_ULPS, is_default=True), str(Family.DEFAULT),
                                 reads_overwritten=False, early=True))


def _held(rule: Rule, family: str | None, reads: bool, ops: tuple = (), early: bool = False) -> BudgetRule:
    """``rule`` as the table holds it: an ``InUlps`` is of its own family, any other rule of the one named."""
    if isinstance(rule, InUlps):
        if family is not None and str(family) != rule.family:
            raise ValueError(f"a budget rule for {', '.join(map(str, ops)) or 'a predicate'} registered with "
                             f"family={str(family)!r} is {rule}: leave family out, or name the same")
        family = rule.family
    if family is None:
        raise TypeError(f"a budget rule for {', '.join(map(str, ops)) or 'a predicate'} ({rule_name(rule)}): name "
                        "its family (family=Family.X, shadow.opsets.Family): the budgets it builds are of it")
    return BudgetRule(rule, str(family), reads, early or isinstance(rule, InUlps))  # an InUlps reads nothing


def register_budget(*ops: OpOverload, family: str | None = None, reads_overwritten: bool = True,
                    early: bool = False) -> Callable[[Rule], Rule]:
    """Register a budget rule for exact op overloads; registering an op twice is a ``DuplicateRuleError``.
    ``family`` (a ``shadow.opsets.Family``; an ``InUlps`` rule has its own): the family of the budgets the rule
    builds, unless it names another. ``reads_overwritten=False`` promises that the rule never reads what an
    in-place op overwrites (its ``self``), so the engine need not copy it before the op. ``early=True`` promises
    that the rule's bounds read the op's inputs only, never the values of its references (which it may hold, to
    read after the replay: ``scale_sq``'s sums), so that the engine may build them before the replays overwrite
    the inputs instead of copying the inputs first (:func:`builds_early`).

    >>> with BUDGETS.scoped():
    ...     _ = register_budget(aten.fix.default, family=Family.ELEMENTWISE, reads_overwritten=False)(
    ...         lambda c: c.ulps(2.0))
    ...     reads_overwritten(aten.fix.default)
    False
    """

    def deco(rule: Rule) -> Rule:
        held = _held(rule, family, reads_overwritten, ops, early)
        BUDGETS.register(*ops, family=held.family)(held)
        return rule

    return deco


def register_budget_predicate(pred: Callable[[OpPlan], bool], *, family: str | None = None,
                              reads_overwritten: bool = True) -> Callable[[Rule], Rule]:
    """Register a rule for every op whose plan satisfies ``pred`` (tried in registration order, after
    exact ops); ``family`` and ``reads_overwritten`` as for :func:`register_budget`."""

    def deco(rule: Rule) -> Rule:
        held = _held(rule, family, reads_overwritten)
        BUDGETS.register_predicate(pred, family=held.family)(held)
        return rule

    return deco


def overloads(*names: str) -> list[OpOverload]:
    """Every overload of the named aten packets (and of their in-place ``name_`` twins), out= ones included."""
    ops = []
    for name in names:
        for n in (name, name + "_"):
            packet = getattr(aten, n, None)
            if isinstance(packet, torch._ops.OpOverloadPacket):
                ops.extend(getattr(packet, o) for o in packet.overloads())
    return ops


def budget_for(func: OpOverload, args: Sequence | None, kwargs: dict | None, outputs: Sequence[Any] | Any,
               dtype: torch.dtype, *, scratch: Any = None, inputs_dtype: torch.dtype | None = None) -> Budget:
    """The budget of one call of ``func``.

    ``args``/``kwargs``: the op's device inputs upcast exactly to float64 on the CPU, as *before* the op
    ran (in-place ops overwrite them; None where :func:`fixed_budget` gives a rule); ``outputs``: the float64
    reference results, flattened (a single tensor is accepted); ``dtype``: the device dtype the error is
    measured in (the output's); ``scratch``: a ``shadow.scratch.Scratch`` the bounds' large temporaries may use
    (the engine's); ``inputs_dtype``: the device inputs' dtype, where a rule reads it (None: ``dtype``).

    >>> a = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]], dtype=torch.float64)
    >>> b = budget_for(aten.mm.default, (a, a.T), {}, [a @ a.T], torch.float32)
    >>> b.family, b.is_default
    ('matmul', False)
    """
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    rule = fixed_budget(func)
    if rule is not None:  # it answers every call, reading no argument
        return rule.budget(outputs, dtype)
    if _nothing_to_bound(outputs):
        return Budget.in_ulps(Family.EMPTY, 0.0, outputs, dtype)
    if args is None:
        raise TypeError(f"budget_for({func}): its budget rule reads the op's arguments (fixed_budget is None): "
                        "pass them")
    call = BudgetCall(plan_of(func), args, kwargs, list(outputs), dtype, unit_roundoff(dtype),
                      unit_roundoff(accumulation_dtype(dtype)), scratch,
                      u_inputs=None if inputs_dtype in (None, dtype) else unit_roundoff(inputs_dtype))
    return BUDGETS.run(func, call)


def fixed_budget(func: OpOverload) -> InUlps | None:
    """The :class:`InUlps` rule that answers every call of ``func`` (its budget reads no argument: ``budget_for``
    takes ``args=None``, and ``InUlps.budget`` gives the same from the outputs alone); None where the op's budget
    is a function of its arguments.

    >>> fixed_budget(aten.mul.Tensor), fixed_budget(aten.mm.default)
    (InUlps(family='elementwise', ulps=2.0, is_default=False), None)
    """
    rule = BUDGETS.chain(func)[0].fn
    return rule if isinstance(rule, InUlps) else None


def reads_overwritten(func: OpOverload) -> bool:
    """Whether a budget rule of ``func`` may read, as they were before the op, the arguments it overwrites
    (the engine copies them before an in-place op only then): true unless every rule that may answer was
    registered with ``reads_overwritten=False``. ``_foreach_X`` ops answer as X.

    >>> reads_overwritten(aten.exp_.default), reads_overwritten(aten._foreach_mul_.Scalar)
    (False, False)
    >>> reads_overwritten(aten.lerp_.Scalar)   # its bound reads self
    True
    """
    base = foreach_base(func)
    if base is not None:
        return reads_overwritten(base)
    return any(rule.reads_overwritten for rule in BUDGETS.chain(func))


def builds_early(func: OpOverload) -> bool:
    """Whether the budget of a call of ``func`` may be built from its inputs before the replays overwrite them
    (every rule that may answer was registered with ``early=True``): an in-place op's inputs then need no copy.

    >>> builds_early(aten._fused_adamw_.default), builds_early(aten.lerp_.Scalar)
    (True, False)
    """
    return all(rule.early for rule in BUDGETS.chain(func))


# --- foreach ops: each list element answers as the op the name says ---
_FOREACH_BASE = {
    "add": aten.add.Tensor, "sub": aten.sub.Tensor, "mul": aten.mul.Tensor, "div": aten.div.Tensor,
    "addcmul": aten.addcmul.default, "addcdiv": aten.addcdiv.default, "lerp": aten.lerp.Tensor,
    "norm": aten.linalg_vector_norm.default, "copy": aten.copy.default, "clamp_min": aten.clamp_min.Tensor,
    "clamp_max": aten.clamp_max.Tensor, "maximum": aten.maximum.default, "minimum": aten.minimum.default,
    "pow": aten.pow.Tensor_Tensor, "zero": aten.zeros_like.default,
}


@functools.cache
def foreach_base(func: OpOverload) -> OpOverload | None:
    """The op whose rule each element of ``_foreach_X`` goes to (None for other ops)."""
    name = plan_of(func).base
    if not name.startswith("_foreach_"):
        return None
    base = name[len("_foreach_"):]
    if base in _FOREACH_BASE:
        return _FOREACH_BASE[base]
    packet = getattr(aten, base, None)
    if isinstance(packet, torch._ops.OpOverloadPacket) and packet.overloads():
        return getattr(packet, packet.overloads()[0])
    return None
