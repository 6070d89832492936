"""Error budgets: an a-priori bound on the local error a *correct* implementation of an op may make.

A budget answers "is this kernel broken, or is this normal rounding?". For one op call it is a bound
per output element, a pure function of the op's inputs (the device's own inputs upcast exactly to
float64), its float64 reference outputs, its shapes and the unit roundoff of the device dtype::

    u(float32) = 2**-24   u(bfloat16) = 2**-8   u(float16) = 2**-11   u(float64) = 2**-53

Families (kind) and what "correct" means for each:

- ``elementwise``/``movement``: a few ulps of the result (``ULPS``: movement 1, arithmetic 2,
  transcendental 4, special functions 64, other pointwise-tagged ops 4), plus, for formulas PyTorch's
  kernels evaluate with cancellation (gelu for x << 0, logit near 1/2, add with alpha, floor division near
  integers...), a term relative to the operands (``OPERAND_TERMS``). Calibrated on OpInfo in float32,
  bfloat16 and float16 (tests/test_budgets.py).
- ``reduction``, ``matmul``, ``conv``, ``norm``, ``attention``: Higham's worst case for any summation
  order, gamma_n(ua) * sum|terms|, with ``ua`` the accumulation precision torch uses for the dtype (its
  opmath type: float32 for bfloat16 and float16), plus one rounding of the result at ``u``. A kernel
  that accumulates long sums in float16 is therefore over the float16 budget: that is what the budget is
  for. Short sums (pooling, interpolation, scatter) are bounded at ``u``: CPU kernels round them in the
  device dtype.
- ``loss``: per-element terms at ``u``, then the reduction at ``ua``.
- ``unbounded``: linear algebra whose error depends on the inputs' conditioning (bound = inf).
- ``default``: an op no rule knows: ``DEFAULT_ULPS`` ulps of the result, ``is_default=True``.

Lookup order (as in ``torch/_subclasses/fake_impls.py``): the exact-op table, then predicates (tags,
op-name families), then one explicit default. A rule returns a :class:`Budget`, or ``NotImplemented`` to
fall through. ``dtype`` is the dtype the error is measured in: the output's (for a cast, the target).

>>> import torch
>>> aten = torch.ops.aten
>>> a = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]], dtype=torch.float64)
>>> b = budget_for(aten.mm.default, (a, a.T), {}, [a @ a.T], torch.float32)
>>> b.kind, b.is_default
('matmul', False)
>>> budget_used(torch.zeros(2, 2, dtype=torch.float64), b.bound[0])
0.0

Error units (DESIGN.md): ``budget_used = max(abs / bound)``; ``effective_bits`` is defined in
:func:`effective_bits`. Cost: for matmul, convolution and attention the bound avoids a second product
(Cauchy-Schwarz norms: ~10-30% of the float64 replay for large operands); memory-bound ops (sums,
norms, softmax) need a few passes over their data, more than their one-pass fused replay; ulps budgets
cost nothing when the caller already has max_ulp (``budget_used = max_ulp / ulps``); the optimizer's
ops (add with alpha, addcmul, addcdiv, lerp) add their operand term into the ulps tensor in one fused
in-place op. Benchmarked (benchmarks/RESULTS.md): 12-23 % of the replay work on a training step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch

from ..metrics import precision_bits, spacing

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload

__all__ = [
    "Budget",
    "BudgetCall",
    "DuplicateBudgetError",
    "budget_for",
    "budget_used",
    "effective_bits",
    "gamma",
    "register_budget",
    "register_budget_predicate",
    "unit_roundoff",
]


# --- units ---
def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2**-(p+1) for a dtype with p stored mantissa bits (the real part's, for complex dtypes).

    >>> unit_roundoff(torch.float32) == 2.0**-24, unit_roundoff(torch.bfloat16) == 2.0**-8
    (True, True)
    """
    if dtype.is_complex:
        dtype = dtype.to_real()
    return 2.0 ** -(precision_bits(dtype) + 1)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision PyTorch kernels accumulate in for ``dtype`` (at::opmath_type): float32 for the halves."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def gamma(n: float, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the worst-case relative error of n chained roundings
    (any summation order; inf once n u >= 1, where the worst case says nothing).

    >>> gamma(3, 2.0**-24) == 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    True
    """
    nu = n * u
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


def _subnormal_min(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype.to_real() if dtype.is_complex else dtype)
    return fi.tiny * fi.eps


# mean of delta**2 / u**2 for a round-to-nearest relative error delta when mantissas are log-uniformly
# distributed (Benford): the absolute error is uniform in +-ulp/2, so E[delta**2] = u**2/3 * E[1/m**2] with
# m in [1, 2) of density 1/(m ln 2), E[1/m**2] = 3/(8 ln 2).
KAPPA = 1.0 / (8.0 * math.log(2.0))


# rule families whose bound is gamma_n times a sum of magnitudes (the rest round once per element)
SUM_KINDS = frozenset({"reduction", "matmul", "conv", "norm", "loss", "attention", "fft"})


# --- the record a rule returns ---
class Budget:
    """The error budget of one op call: a bound per output element and how it was derived.

    ``kind``: the rule family ("elementwise", "movement", "reduction", "matmul", "conv", "norm", "loss",
    "attention", "unbounded", "default"...); ``bound``: one float64 tensor per output (broadcastable to it;
    ``None`` for discrete outputs), computed on first access; ``is_default``: no rule knows this op and the
    bound is a guess of a few ulps; ``ulps``: set when the bound is exactly ``ulps`` units in the last
    place of the output (``ulps * spacing(|r|)``), so ``budget_used = max_ulp / ulps`` needs no tensor.

    >>> r = torch.tensor([1.0, 3.0], dtype=torch.float64)
    >>> b = Budget.in_ulps("elementwise", 2.0, [r], torch.float32)
    >>> b.bound[0].tolist() == [2 * 2.0**-23, 2 * 2.0**-22]   # spacing of float32 at 1 and at 3
    True
    """

    __slots__ = ("_bound", "_dtype", "_make", "_outputs", "_scale_sq", "is_default", "kind", "ulps")

    def __init__(self, kind: str, bound: Sequence[torch.Tensor | None] | Callable[[], Sequence] | None, *,
                 outputs: Sequence[Any], dtype: torch.dtype, is_default: bool = False,
                 ulps: float | None = None, scale_sq: Any = None):  # float, (scale, acc), or a callable of either
        self.kind = kind
        self.is_default = is_default
        self.ulps = ulps
        self._outputs = list(outputs)
        self._dtype = dtype
        self._make = bound if callable(bound) else None
        self._bound = None if callable(bound) else (tuple(bound) if bound is not None else None)
        self._scale_sq = scale_sq

    @classmethod
    def in_ulps(cls, kind: str, ulps: float, outputs: Sequence[Any], dtype: torch.dtype, *,
                is_default: bool = False) -> Budget:
        """A bound of ``ulps`` units in the last place of ``dtype`` at each reference value."""
        return cls(kind, None, outputs=outputs, dtype=dtype, is_default=is_default, ulps=ulps)

    @property
    def bound(self) -> tuple[torch.Tensor | None, ...]:
        if self._bound is None:
            if self._make is not None:
                self._bound = tuple(self._make())
            else:  # ulps of the result
                rd = self._dtype.to_real() if self._dtype.is_complex else self._dtype
                self._bound = tuple(spacing(r, rd, self.ulps) if _is_float(r) else None
                                    for r in self._outputs)
        return self._bound

    @property
    def of_sum(self) -> bool:
        """The bound is one of a sum's (``SUM_KINDS``): bound / |result| then estimates how much the result
        cancels (sum|x| / |sum x|, ||a_i|| ||b_j|| / |c_ij|); spot checks look there first."""
        return self.kind in SUM_KINDS and self.ulps is None

    def scale_sq(self) -> float:
        """Sum over output elements of T**2, T the one-rounding error scale of :func:`effective_bits`
        (the result itself unless the rule says otherwise)."""
        return self._scales()[0]

    def _scales(self) -> tuple[float, float]:
        """(scale_sq, acc_sq): a rule's ``scale_sq`` returns the first or both (see :func:`effective_bits`)."""
        s = self._scale_sq
        if s is None:
            s = sum(_sumsq(r) for r in self._outputs if _is_float(r))
        elif callable(s):
            s = s()
        if not isinstance(s, tuple):
            s = (float(s), 0.0)
        self._scale_sq = s
        return s

    def used(self, abs_errs: Sequence[torch.Tensor | None]) -> float:
        """max(abs error / bound) over every output (see :func:`budget_used`)."""
        m = 0.0
        for e, b in zip(abs_errs, self.bound):
            if e is not None and b is not None:
                m = max(m, budget_used(e, b))
        return m

    def bits(self, err_sq_sum: float) -> float:
        """:func:`effective_bits` of an observed sum of squared errors under this op's scales."""
        s, acc = self._scales()
        n = sum(r.numel() for r in self._outputs if _is_float(r))
        return effective_bits(err_sq_sum, s, acc, self._dtype, n)

    def effective_bits(self, abs_errs: Sequence[torch.Tensor | None]) -> float:
        """:func:`effective_bits` of the observed errors of every output under this op's scales."""
        return self.bits(sum(_sumsq_finite(e) for e in abs_errs if e is not None))

    def __repr__(self) -> str:
        extra = f", ulps={self.ulps}" if self.ulps is not None else ""
        return f"Budget(kind={self.kind!r}, is_default={self.is_default}{extra})"


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _sumsq(t: torch.Tensor) -> float:
    """sum |t|**2 over the finite elements: one pass (vector_norm), the masked sum only when non-finite."""
    if t.numel() == 0:
        return 0.0
    s = float(torch.linalg.vector_norm(t)) ** 2
    if math.isfinite(s):
        return s
    a = t.abs()
    a = a[torch.isfinite(a)]
    return float(a.square().sum())


def _sumsq_finite(e: torch.Tensor) -> float:
    if e.numel() == 0:
        return 0.0
    s = float(e.square().sum())
    if math.isfinite(s):
        return s
    e = e[torch.isfinite(e)]
    return float(e.square().sum())


def budget_used(abs_err: torch.Tensor, bound: torch.Tensor) -> float:
    """max(abs_err / bound) over the elements where the error is finite (non-finite results are
    counted apart, DESIGN.md); 0/0 counts 0, x/0 counts inf. > 1 means over budget.

    >>> budget_used(torch.tensor([1e-7, 0.0]), torch.tensor([2e-7, 0.0]))
    0.5
    """
    if abs_err.numel() == 0:
        return 0.0
    q = abs_err / bound
    m = float(q.max())
    if math.isfinite(m):
        return max(m, 0.0)
    # slow path: 0/0 (exact where the bound is 0) or non-finite errors
    fin = torch.isfinite(abs_err) & (abs_err != 0)
    if not bool(fin.any()):
        return 0.0
    b = torch.broadcast_to(bound, abs_err.shape)
    return float((abs_err[fin] / b[fin]).max())


def effective_bits(err_sq_sum: float, scale_sq_sum: float, acc_sq_sum: float = 0.0,
                   dtype: torch.dtype | None = None, n_out: int = 1) -> float:
    """The stored mantissa bits p that explain an observed error, under the model "every quantity the op
    is sensitive to is rounded once to p bits, independently, and the op's long sums accumulate as a
    correct kernel in ``dtype`` would": p = -log2(u_eff) - 1 with

        u_eff**2 = ( sum(err**2) / KAPPA  -  ua**2 * ACC ) / sum(T**2),   KAPPA = 1 / (8 ln 2) ~ 0.180

    where T runs over those quantities (the rule's scale: the result for elementwise ops, softmax and
    norms; each product a_ik*b_kj twice, once per rounded operand, for matmul and convolution; each
    summand for sums), KAPPA*u**2 is the mean squared relative error of rounding to nearest at unit
    roundoff u, ACC (``acc_sq_sum``) the sum of the squared partial sums a sequential accumulation rounds
    (matmul and convolution estimate it, see ``_accumulation_sq``; 0 elsewhere) and ua the unit roundoff
    of ``dtype``'s accumulation type. Rounding everything at u = 2**-(p+1) gives p back on average: a
    correctly rounded float32 op reads ~23, a matmul on inputs rounded to TF32's 10 mantissa bits ~10.
    Where the accumulation alone explains the whole error (a correct kernel's), the figure is the
    dtype's own p (23 for float32): no input seems to have carried fewer bits than the dtype stores.
    With a ``dtype`` the figure never exceeds that p (a lucky result carries no more bits than are stored).
    ``ua**2 * ACC`` is the accumulation's *expected* contribution; over ``n_out`` outputs its realized value
    scatters by ~sqrt(2 / n_out) of it (a chi-square), so what is subtracted is that expectation plus three
    such deviations: one unlucky output of a correct sum (a full reduction) is not read as lost bits.

    Why not solve the worst-case bound for u (gamma_K(u) * |A||B| = error)? Random rounding errors
    cancel, so the worst case overstates typical errors by ~K**1.5 for a matmul and the solved p would
    grow with K (17 bits at K=64, 26 at K=4096 for TF32 inputs); the rms model above does not.

    Returns inf for an exact result, -inf for an error where the scale is 0, nan where the scale is not
    finite (non-finite inputs).

    >>> round(effective_bits(KAPPA * 2.0**-22, 1.0), 6)   # errors of u = 2**-11 in rms: 10 bits
    10.0
    """
    if not math.isfinite(scale_sq_sum) or not math.isfinite(acc_sq_sum) or math.isnan(err_sq_sum):
        return math.nan
    if err_sq_sum <= 0.0:
        return math.inf
    excess = err_sq_sum / KAPPA
    p_max = math.inf if dtype is None else float(precision_bits(dtype.to_real() if dtype.is_complex else dtype))
    if acc_sq_sum > 0.0 and dtype is not None:
        excess -= unit_roundoff(accumulation_dtype(dtype)) ** 2 * acc_sq_sum * (1 + 3 * math.sqrt(2 / max(n_out, 1)))
        if excess <= 0.0:
            return p_max
    if scale_sq_sum <= 0.0 or math.isinf(err_sq_sum):
        return -math.inf
    return min(-0.5 * math.log2(excess / scale_sq_sum) - 1.0, p_max)


# --- the normalized input every rule gets ---
@dataclasses.dataclass(slots=True)
class BudgetCall:
    """A rule's input: the op, its arguments by schema name (defaults filled in; tensors are the device's
    inputs upcast to float64), the float64 reference outputs (flattened returns; for ops that return
    nothing, the written arguments), the device dtype, ``u`` (its unit roundoff) and ``ua`` (the unit
    roundoff of the accumulation dtype)."""

    func: OpOverload
    a: dict[str, Any]
    outputs: list[Any]
    dtype: torch.dtype
    u: float
    ua: float

    def out(self, i: int = 0) -> torch.Tensor:
        return self.outputs[i]

    def ulps(self, kind: str, n: float) -> Budget:
        return Budget.in_ulps(kind, n, self.outputs, self.dtype)

    def budget(self, kind: str, make: Callable[[], Sequence], scale_sq: Any = None) -> Budget:
        return Budget(kind, make, outputs=self.outputs, dtype=self.dtype, scale_sq=scale_sq)

    def floor(self, c: float = 1.0) -> float:
        """c subnormal spacings of the device dtype: the rounding of results below its smallest normal."""
        return c * _subnormal_min(self.dtype)

    def final(self, r: torch.Tensor, c: float = 1.0) -> torch.Tensor:
        """c roundings of the result to the device dtype: c*u*|r| + c subnormal spacings."""
        return torch.add(torch.full((), self.floor(c), dtype=torch.float64), r.abs(), alpha=c * self.u)


Rule = Callable[[BudgetCall], Any]


class DuplicateBudgetError(ValueError):
    """A budget rule for this op is already registered."""

    def __init__(self, op: OpOverload, existing: Rule):
        super().__init__(f"a budget rule for {op} is already registered "
                         f"({getattr(existing, '__name__', existing)}); each op has one rule")
        self.op = op


_EXACT: dict[OpOverload, Rule] = {}
_PREDICATES: list[tuple[Callable[[OpOverload], bool], Rule]] = []


def register_budget(*ops: OpOverload) -> Callable[[Rule], Rule]:
    """Register a budget rule for exact op overloads; registering an op twice is an error."""

    def deco(rule: Rule) -> Rule:
        for op in ops:
            if not isinstance(op, OpOverload):
                raise TypeError(f"register_budget expects OpOverloads such as aten.mm.default, got {op!r}")
            if op in _EXACT:
                raise DuplicateBudgetError(op, _EXACT[op])
            _EXACT[op] = rule
        _rule_chain.cache_clear()
        reads_overwritten.cache_clear()
        return rule

    return deco


def register_budget_predicate(pred: Callable[[OpOverload], bool]) -> Callable[[Rule], Rule]:
    """Register a rule for every op satisfying ``pred`` (tried in registration order, after exact ops)."""

    def deco(rule: Rule) -> Rule:
        _PREDICATES.append((pred, rule))
        _rule_chain.cache_clear()
        reads_overwritten.cache_clear()
        return rule

    return deco


def overloads(*names: str, inplace: bool = True) -> list[OpOverload]:
    """Every overload of the named aten packets (and of their in-place ``name_`` twins), out= ones included."""
    ops = []
    for name in names:
        for n in (name, name + "_") if inplace else (name,):
            packet = getattr(aten, n, None)
            if isinstance(packet, torch._ops.OpOverloadPacket):
                ops.extend(getattr(packet, o) for o in packet.overloads())
    return ops


def _bind(func: OpOverload, args: Sequence, kwargs: dict) -> dict[str, Any]:
    named = {}
    for i, arg in enumerate(func._schema.arguments):
        if not arg.kwarg_only and i < len(args):
            named[arg.name] = args[i]
        elif arg.name in kwargs:
            named[arg.name] = kwargs[arg.name]
        else:
            named[arg.name] = arg.default_value if arg.has_default_value() else None
    return named


def budget_for(func: OpOverload, args: Sequence, kwargs: dict, outputs: Sequence[Any] | Any,
               dtype: torch.dtype) -> Budget:
    """The budget of one call of ``func``.

    ``args``/``kwargs``: the op's device inputs upcast exactly to float64 on the CPU, as *before* the op
    ran (in-place ops overwrite them); ``outputs``: the float64 reference results, flattened (a single
    tensor is accepted); ``dtype``: the device dtype the error is measured in (the output's).

    >>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    >>> budget_for(aten.exp.default, (x,), {}, [x.exp()], torch.bfloat16).kind
    'elementwise'
    """
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    if all(not _is_float(r) or r.numel() == 0 for r in outputs):  # nothing to bound
        return Budget.in_ulps("empty", 0.0, outputs, dtype)
    call = BudgetCall(func, _bind(func, args, kwargs), list(outputs), dtype, unit_roundoff(dtype),
                      unit_roundoff(accumulation_dtype(dtype)))
    for rule in _rule_chain(func):
        res = rule(call)
        if res is not NotImplemented:
            return res
    raise AssertionError("default_budget never falls through")


def _reads_no_overwritten(rule: Rule) -> Rule:
    """Mark a rule that never reads the arguments an in-place op overwrites (its ``self``): the engine then
    need not copy them before the op for the budget's sake (see :func:`reads_overwritten`)."""
    rule.reads_overwritten = False
    return rule


@functools.cache
def reads_overwritten(func: OpOverload) -> bool:
    """Whether a budget rule of ``func`` may read, as they were before the op, the arguments it overwrites
    (unmarked rules may: only a rule marked by ``_reads_no_overwritten`` promises not to). ``_foreach_X``
    ops answer as X."""
    base = _foreach_base(func)
    if base is not None:
        return reads_overwritten(base)
    return any(getattr(getattr(rule, "func", rule), "reads_overwritten", True) for rule in _rule_chain(func))


@functools.cache
def _rule_chain(func: OpOverload) -> tuple[Rule, ...]:
    chain = [_EXACT[func]] if func in _EXACT else []
    chain.extend(rule for pred, rule in _PREDICATES if pred(func))
    chain.append(default_budget)
    return tuple(chain)


# The default: an op no rule knows. A few ulps of the result, flagged so reports can tell the guess apart.
DEFAULT_ULPS = 4.0


@_reads_no_overwritten
def default_budget(c: BudgetCall) -> Budget:
    return Budget.in_ulps("default", DEFAULT_ULPS, c.outputs, c.dtype, is_default=True)


# --- shared helpers (pure functions of float64 tensors) ---
def _abs(t: Any) -> Any:
    return t.abs() if isinstance(t, torch.Tensor) else abs(t)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float64, torch.complex128) else t.to(torch.float64)


def _dims(x: torch.Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return [d % max(x.dim(), 1) for d in dim]


def _count(x: torch.Tensor, dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d] if x.dim() else 1
    return n


def _at_least_1d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1) if x.dim() == 0 else x


# --- op sets treated alike (built by name; overloads() expands packets and their in-place twins) ---
# Data movement and selection: a correct kernel returns its inputs' values exactly; the one rounding it may
# do is of a Python scalar argument (fill value, clamp bound) or of a cast to the output dtype: 1 ulp.
MOVEMENT = frozenset(overloads(
    "clone", "copy", "_to_copy", "cat", "stack", "index", "index_select", "gather", "masked_fill",
    "masked_scatter", "where", "relu", "threshold", "threshold_backward", "hardtanh", "hardtanh_backward",
    "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmax", "fmin", "max", "min", "amax",
    "amin", "aminmax", "sort", "topk", "kthvalue", "median", "nanmedian", "mode", "cummax", "cummin", "flip",
    "roll", "rot90", "repeat", "repeat_interleave", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
    "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d", "zeros", "ones", "full",
    "zeros_like", "ones_like", "full_like", "fill", "scalar_tensor", "new_zeros", "new_ones", "new_full",
    "embedding", "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "fractional_max_pool2d", "fractional_max_pool3d", "max_unpool2d", "max_unpool3d",
    "abs", "neg", "sign", "floor", "ceil", "trunc", "frac", "positive", "conj_physical", "copysign",
    "heaviside", "nan_to_num", "select_backward", "slice_backward", "diagonal_backward",
    "as_strided_scatter", "select_scatter", "slice_scatter", "diagonal_scatter", "tril", "triu",
    "masked_select", "take", "take_along_dim", "_unsafe_index", "index_copy", "index_fill", "narrow_copy",
    "lift_fresh_copy", "detach_copy", "alias_copy", "expand_copy", "permute_copy", "view_copy", "unfold_copy",
    "t_copy", "transpose_copy", "squeeze_copy", "unsqueeze_copy", "diagonal_copy", "select_copy", "slice_copy",
    "split_copy", "split_with_sizes_copy", "unbind_copy", "as_strided_copy", "_reshape_copy", "complex",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_local_scalar_dense", "diag_embed", "diag",
    "im2col", "channel_shuffle", "pixel_shuffle", "pixel_unshuffle", "native_channel_shuffle",
    "hardshrink", "_unsafe_masked_index", "_unsafe_view", "zero", "_reshape_alias", "_to_dense", "to_dense",
    "_to_copy", "lift_fresh",
))

# Unit-of-ulps constants per elementwise family (calibrated: see tests/test_budgets.py).
ARITH = ("mul", "true_divide", "reciprocal", "sqrt", "rsqrt", "square", "deg2rad", "rad2deg", "ldexp",
         "leaky_relu", "leaky_relu_backward", "relu6", "hardswish", "hardsigmoid", "hardswish_backward",
         "hardsigmoid_backward", "kron", "float_power", "softshrink", "round", "sgn",
         "nextafter")  # nextafter: the float64 replay steps by a float64 ulp, the device by its own
TRANSCENDENTAL = (
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin", "acos", "atan",
    "atan2", "arctan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "gelu",
    "silu", "mish", "softplus", "elu", "selu", "celu", "log_sigmoid_forward", "logaddexp", "logaddexp2",
    "xlogy", "special_xlog1py", "sinc", "pow", "hypot", "logit", "gelu_backward", "silu_backward",
    "sigmoid_backward", "tanh_backward", "elu_backward", "softplus_backward", "mish_backward",
    "log_sigmoid_backward", "logit_backward", "special_entr", "angle", "rrelu_with_noise", "prelu",
    "_prelu_kernel", "_prelu_kernel_backward", "glu", "polar",
)
SPECIAL = (
    "lgamma", "digamma", "polygamma", "mvlgamma", "erfinv", "igamma", "igammac", "special_zeta",
    "special_ndtri", "special_airy_ai", "special_bessel_j0", "special_bessel_j1", "special_bessel_y0",
    "special_bessel_y1", "special_modified_bessel_i0", "special_modified_bessel_i1", "special_modified_bessel_k0",
    "special_modified_bessel_k1", "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1",
    "special_spherical_bessel_j0", "special_i0e", "special_i1e", "i0", "special_i0", "special_i1", "special_ndtr",
    "special_log_ndtr", "special_erfcx",
)
POLYNOMIALS = (
    "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u",
    "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_w", "special_hermite_polynomial_h",
    "special_hermite_polynomial_he", "special_laguerre_polynomial_l", "special_legendre_polynomial_p",
    "special_shifted_chebyshev_polynomial_t", "special_shifted_chebyshev_polynomial_u",
    "special_shifted_chebyshev_polynomial_v", "special_shifted_chebyshev_polynomial_w",
)
ULPS = {"movement": 1.0, "arith": 2.0, "transcendental": 4.0, "special": 64.0, "pointwise": 4.0}


@_reads_no_overwritten
def ulps_rule(c: BudgetCall, *, kind: str, ulps: float) -> Budget:
    """``ulps`` units in the last place of the result: an elementwise kernel given exact inputs."""
    return c.ulps(kind, ulps)


def _arg0(c: BudgetCall) -> Any:
    return c.a.get("self", c.a.get("input"))


# PyTorch's kernels for these evaluate a formula that cancels where the result is small, so their error
# is not a few ulps of the result there; the extra term (in u of the device dtype, which reduced-precision
# kernels may round intermediates to) says what it is relative to.
OPERAND_TERMS: dict[str, Callable[[BudgetCall], Any]] = {
    # x * (1 + erf(x / sqrt 2)) / 2 (or the tanh form): 1 + erf cancels for x << 0
    "gelu": lambda c: 4 * c.u * _arg0(c).abs(),
    "gelu_backward": lambda c: 4 * c.u * c.a["grad_output"].abs() * (1 + c.a["self"].abs()),
    "sinc": lambda c: 2 * c.u,  # sin(pi x) / (pi x): pi x is rounded, moving sin by u absolute
    "logit": lambda c: 4 * c.u,  # log(x / (1 - x)) near x = 1/2: the quotient's rounding, absolute
    "logit_backward": lambda c: 4 * c.u * c.out().abs(),
    "softplus": lambda c: 2 * c.u / abs(float(c.a.get("beta", 1) or 1)),  # log(1 + exp(b x)): 1 + tiny rounded
    "logaddexp": lambda c: 2 * c.u * (_abs(c.a["self"]) + _abs(c.a["other"])),  # x - y rounded
    "logaddexp2": lambda c: 2 * c.u * (_abs(c.a["self"]) + _abs(c.a["other"])),
    # g * (x / 3 + 1/2) on (-3, 3): cancels at x = -3/2
    "hardswish_backward": lambda c: 2 * c.u * c.a["grad_output"].abs() * (c.a["self"].abs() / 3 + 0.5),
    "softplus_backward": lambda c: 2 * c.u * c.a["grad_output"].abs(),
    # g s (1 + x (1 - s)), s = sigmoid(x): cancels near x = -1.28
    "silu_backward": lambda c: 4 * c.u * c.a["grad_output"].abs() * (1 + c.a["self"].abs()) * torch.sigmoid(c.a["self"]),
    "mish_backward": lambda c: 4 * c.u * c.a["grad_output"].abs() * (1 + c.a["self"].abs()),
}
_SPECIAL_ABS = 16.0  # special functions near their zeros: an absolute floor of this many u


def operand_term_rule(c: BudgetCall, *, family: str, term: Callable[[BudgetCall], Any]) -> Budget:
    return _with_operand_term(c, family, lambda b: _iadd(b, term(c)))


for _names, _family in ((ARITH, "arith"), (TRANSCENDENTAL, "transcendental")):
    for _name in _names:
        if _name in OPERAND_TERMS:
            _rule = functools.partial(operand_term_rule, family=_family, term=OPERAND_TERMS[_name])
        else:
            _rule = functools.partial(ulps_rule, kind="elementwise", ulps=ULPS[_family])
        register_budget(*overloads(_name))(_rule)
def _reflection_term(c: BudgetCall) -> Any:
    """lgamma, digamma, polygamma for x < 0 use the reflection formula, whose sin(pi x) has pi x rounded:
    relative error ~ (n+1) pi u |x| / dist(x, poles) of the result (absolute for lgamma)."""
    x = c.a["self"]
    if not isinstance(x, torch.Tensor):
        return _SPECIAL_ABS * c.u
    name = c.func._schema.name.split("::")[-1].rstrip("_")
    n = c.a.get("n", 0) if name == "polygamma" else 0
    dist = (x - x.round()).abs().clamp_min(c.u)
    k = 4 * (n + 1) * c.u * x.abs() / dist * (x < 0)
    scale = 1.0 if name == "lgamma" else c.out().abs()
    return _SPECIAL_ABS * c.u + k * scale


register_budget(*overloads(*(n for n in SPECIAL if n not in ("lgamma", "digamma", "polygamma"))))(
    functools.partial(operand_term_rule, family="special", term=lambda c: _SPECIAL_ABS * c.u))
register_budget(*overloads("lgamma", "digamma", "polygamma"))(
    functools.partial(operand_term_rule, family="special", term=_reflection_term))
# recurrences for degree-n polynomials lose ~n^2 u relative to max(1, |P_n|) near their roots
register_budget(*overloads(*POLYNOMIALS))(functools.partial(
    operand_term_rule, family="special", term=lambda c: 4 * c.u * _abs(c.a["n"]) ** 2 * (1 + c.out().abs())))
register_budget(*sorted(MOVEMENT, key=str))(functools.partial(ulps_rule, kind="movement", ulps=ULPS["movement"]))


def _near_integer(q: torch.Tensor, u: float) -> torch.Tensor:
    """Where a quotient rounded at u may land on the other side of an integer (floor/trunc flips)."""
    return (q - q.round()).abs() <= 4 * u * q.abs() + 4 * u


@register_budget(*overloads("div", "floor_divide", "remainder", "fmod"))
def quotient_budget(c: BudgetCall) -> Budget:
    """Plain division: ulps. floor/trunc division, remainder, fmod: PyTorch rounds a/b before flooring, so
    where a/b is within u of an integer the result may be off by one step (1 for the quotient, |b| for the
    remainder); a correct kernel given exact inputs would not, but the budget holds PyTorch's own kernels."""
    name = c.func._schema.name.split("::")[-1].rstrip("_")
    mode = c.a.get("rounding_mode")
    if name == "div" and mode is None:
        return c.ulps("elementwise", ULPS["arith"])
    a, b = c.a["self"], c.a["other"]
    r = c.out()

    def make():
        q = torch.as_tensor(a, dtype=torch.float64) / torch.as_tensor(b, dtype=torch.float64)
        near = _near_integer(q, c.u).to(torch.float64)
        step = near if name in ("div", "floor_divide") else near * _abs(torch.as_tensor(b, dtype=torch.float64))
        return [_ulp_bound(c, r, ULPS["arith"]) + step]

    return c.budget("elementwise", make)


@register_budget(*overloads("linspace", "arange", "_histogramdd_bin_edges", "range"))
def linspace_budget(c: BudgetCall) -> Budget:
    """start + i * step: the roundings are relative to the largest value, not to each (a value near 0 in
    the middle of the range keeps an error of ~u * max|r|)."""
    outs = c.outputs
    return c.budget("elementwise", lambda: [
        None if not _is_float(r) else _ulp_bound(c, r, 2.0) + 4 * c.u * (r.abs().max() if r.numel() else 0.0)
        for r in outs])


@register_budget_predicate(lambda f: torch.Tag.pointwise in f.tags)
@_reads_no_overwritten
def pointwise_budget(c: BudgetCall) -> Budget:
    """Pointwise ops no family names (tagged ``torch.Tag.pointwise``)."""
    return c.ulps("elementwise", ULPS["pointwise"])


def _ulp_bound(c: BudgetCall, r: torch.Tensor, n: float) -> torch.Tensor:
    rd = c.dtype.to_real() if c.dtype.is_complex else c.dtype
    return spacing(r, rd, n)


def _with_operand_term(c: BudgetCall, family: str, add_term: Callable[[torch.Tensor], torch.Tensor]) -> Budget:
    """ulps of the result plus a term relative to an operand: what a rounding *before* a cancelling
    add costs (a scaled operand, a Python scalar rounded to the compute type). Reduced-precision kernels
    may round that intermediate in the device dtype (bf16 add with alpha does), so the term is in u.
    ``add_term(b)`` adds the term into b, the fresh ulps tensor, and returns the bound: in place by one fused
    op where it can (the optimizer's add/addcmul/addcdiv/lerp: every parameter, every step), else ``_iadd``."""
    r = c.out()
    return c.budget("elementwise", lambda: [add_term(_ulp_bound(c, r, ULPS[family]))])


def _iadd(b: torch.Tensor, t: Any) -> torch.Tensor:
    """b + t, in place in the fresh tensor b where the shapes allow (bounds are large: no third tensor)."""
    if isinstance(t, torch.Tensor) and torch.broadcast_shapes(b.shape, t.shape) != b.shape:
        return b + t
    return b.add_(t)


def _scale(v: Any) -> Any:
    return 1.0 if v is None else v


def _same(a: Any, b: Any) -> bool:
    """a and b are the same values: one tensor, or two views of the same memory with one layout."""
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                      and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


def _abs_fresh(t: torch.Tensor) -> torch.Tensor:
    """|t| of a temporary computed for the bound: in place where it stays real."""
    return t.abs() if t.is_complex() else t.abs_()


@register_budget(*overloads("add", "sub"))
@_reads_no_overwritten
def add_budget(c: BudgetCall) -> Budget:
    """a + alpha*b: ulps of the result, plus the rounding of alpha*b (or of a Python scalar b) before the add."""
    other, alpha = c.a.get("other"), _scale(c.a.get("alpha"))
    if isinstance(other, torch.Tensor) and alpha == 1:
        return c.ulps("elementwise", ULPS["arith"])
    k = 2 * c.u * abs(alpha)
    return _with_operand_term(c, "arith", lambda b: b.add_(_abs(other), alpha=k))


@register_budget(*overloads("rsub"))
def rsub_budget(c: BudgetCall) -> Budget:
    """other - alpha*self: as add, with the roles of the operands swapped."""
    self_, other, alpha = c.a["self"], c.a.get("other"), _scale(c.a.get("alpha"))
    return _with_operand_term(c, "arith", lambda b: _iadd(b, 2 * c.u * (_abs(alpha) * _abs(self_) + _abs(other))))


@register_budget(*overloads("addcmul"))
@_reads_no_overwritten
def addcmul_budget(c: BudgetCall) -> Budget:
    """self + value*t1*t2: the product is rounded (twice, value included) before the add."""
    t1, t2 = c.a["tensor1"], c.a["tensor2"]
    k = 3 * c.u * abs(_scale(c.a["value"]))
    if _same(t1, t2) and not t1.is_complex():  # Adam's g * g: non-negative, no |.| temporaries
        return _with_operand_term(c, "arith", lambda b: b.addcmul_(t1, t1, value=k))
    return _with_operand_term(c, "arith", lambda b: b.addcmul_(_abs(t1), _abs(t2), value=k))


@register_budget(*overloads("addcdiv"))
@_reads_no_overwritten
def addcdiv_budget(c: BudgetCall) -> Budget:
    """self + value*t1/t2: the quotient is rounded (twice, value included) before the add."""
    a = c.a
    k = 3 * c.u * abs(_scale(a["value"]))
    return _with_operand_term(c, "arith", lambda b: b.add_(_abs_fresh(a["tensor1"] / a["tensor2"]), alpha=k))


@register_budget(*overloads("lerp"))
def lerp_budget(c: BudgetCall) -> Budget:
    """start + w*(end - start) (or end - (1-w)*(end - start)): the difference and its product are rounded."""
    a = c.a
    w = a["weight"]
    if isinstance(w, torch.Tensor):
        return _with_operand_term(
            c, "arith", lambda b: _iadd(b, 3 * c.u * (w.abs() + (1 - w).abs()) * (a["end"] - a["self"]).abs()))
    k = 3 * c.u * (abs(w) + abs(1 - w))
    return _with_operand_term(c, "arith", lambda b: b.add_(_abs_fresh(a["end"] - a["self"]), alpha=k))


# --- foreach ops: each list element under the rule of the op the name says ---
_FOREACH_BASE = {
    "add": aten.add.Tensor, "sub": aten.sub.Tensor, "mul": aten.mul.Tensor, "div": aten.div.Tensor,
    "addcmul": aten.addcmul.default, "addcdiv": aten.addcdiv.default, "lerp": aten.lerp.Tensor,
    "norm": aten.linalg_vector_norm.default, "copy": aten.copy.default, "clamp_min": aten.clamp_min.Tensor,
    "clamp_max": aten.clamp_max.Tensor, "maximum": aten.maximum.default, "minimum": aten.minimum.default,
    "pow": aten.pow.Tensor_Tensor, "zero": aten.zeros_like.default,
}


def _foreach_base(f: OpOverload) -> OpOverload | None:
    name = f._schema.name.split("::")[-1]
    if not name.startswith("_foreach_"):
        return None
    base = name[len("_foreach_"):].rstrip("_")
    if base in _FOREACH_BASE:
        return _FOREACH_BASE[base]
    packet = getattr(aten, base, None)
    if isinstance(packet, torch._ops.OpOverloadPacket) and packet.overloads():
        return getattr(packet, packet.overloads()[0])
    return None


@register_budget_predicate(lambda f: _foreach_base(f) is not None)
def foreach_budget(c: BudgetCall) -> Budget:
    """``_foreach_X``: element i of every list argument (tensor or scalar list) goes to X's rule."""
    base = _foreach_base(c.func)
    schema = c.func._schema.arguments
    args = [c.a[arg.name] for arg in schema if not arg.kwarg_only]
    # keyword-only arguments (alpha of _foreach_add_.List) go by name: positions would drop them
    base_kw = {a.name for a in base._schema.arguments if a.kwarg_only}
    kwargs = {arg.name: c.a[arg.name] for arg in schema if arg.kwarg_only and arg.name in base_kw}
    n = len(c.outputs)
    subs = []
    for i in range(n):
        elems = [v[i] if isinstance(v, (list, tuple)) and len(v) == n else v for v in args]
        if c.func._schema.name.endswith("_norm"):  # (self[], ord, dtype) -> linalg_vector_norm(self, ord)
            elems = elems[:2]
        kw = {k: (v[i] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in kwargs.items()}
        subs.append(budget_for(base, elems[: len(base._schema.arguments)], kw, [c.outputs[i]], c.dtype))
    kinds = {b.kind for b in subs}
    ulps = {b.ulps for b in subs}
    return Budget(kinds.pop() if len(kinds) == 1 else "foreach", lambda: [b.bound[0] for b in subs],
                  outputs=c.outputs, dtype=c.dtype, is_default=any(b.is_default for b in subs),
                  ulps=ulps.pop() if len(ulps) == 1 else None,
                  scale_sq=lambda: tuple(map(sum, zip(*(b._scales() for b in subs)))))


# --- reductions: Higham's worst case for any summation order (recursive, pairwise, blocked, with or
# without FMA): |fl(sum x) - sum x| <= gamma_n(ua) * sum|x|, then one rounding of the result at u ---
def _reduced(x: torch.Tensor, dim: Any, keepdim: bool, fn: Callable) -> tuple[torch.Tensor, int]:
    dims = _dims(x, dim)
    n = _count(x, dims)
    if x.dim() == 0:
        return fn(x), 1
    return fn(x, dims, keepdim), n


def _sum_abs(x, dims=None, keepdim=False):
    # one pass, no |x| temporary: as cheap as the replayed sum itself
    return x.abs() if dims is None else torch.linalg.vector_norm(x, 1, dims, keepdim=keepdim)


def _nansum_abs(x, dims=None, keepdim=False):
    a = x.abs()
    return a if dims is None else a.nansum(dims, keepdim=keepdim)


def _sumsq_reduce(x, dims=None, keepdim=False):
    a = x.abs().square()
    return a if dims is None else a.sum(dims, keepdim=keepdim)


def sum_budget(c: BudgetCall, *, mean: bool = False, nan: bool = False) -> Budget:
    """sum/mean/nansum: gamma_n(ua) * sum|x| (/n for the mean) + one rounding of the result."""
    x = c.a["self"]
    r = c.out()

    def make():
        s, n = _reduced(x, c.a.get("dim"), bool(c.a.get("keepdim")), _nansum_abs if nan else _sum_abs)
        g = gamma(n + (1 if mean else 0), c.ua)
        return [torch.add(c.final(r), s, alpha=g / n if mean else g)]

    def scale_sq():
        n = _count(x, _dims(x, c.a.get("dim")))
        s, r_sq = _sumsq(x) / (n * n if mean else 1), _sumsq(r)  # the terms t = x (x / n for the mean)
        return s + _out_rounding_sq(c, r_sq), _accumulation_sq(n, s, r_sq)

    return c.budget("reduction", make, scale_sq)


register_budget(*overloads("sum"))(sum_budget)
register_budget(*overloads("mean"))(functools.partial(sum_budget, mean=True))
register_budget(*overloads("nansum"))(functools.partial(sum_budget, nan=True))
register_budget(*overloads("nanmean"))(functools.partial(sum_budget, mean=True, nan=True))


@register_budget(*overloads("prod"))
def prod_budget(c: BudgetCall) -> Budget:
    """n - 1 products, each relative: gamma_n * |r| + one rounding. Reduced-precision CPU kernels multiply in
    the device dtype, so gamma_n(u): a product has no cancellation for a wider accumulator to save."""
    x, r = c.a["self"], c.out()
    n = _count(x, _dims(x, c.a.get("dim")))
    return c.budget("reduction", lambda: [torch.add(c.final(r), r.abs(), alpha=gamma(n, c.u))])


@register_budget(*overloads("cumsum"))
def cumsum_budget(c: BudgetCall) -> Budget:
    """prefix k: gamma_k(ua) * sum_{j<=k} |x_j| <= gamma_n(ua) * cumsum(|x|)."""
    x, r = c.a["self"], c.out()
    dim = c.a["dim"]
    n = x.shape[dim] if x.dim() else 1
    def scale_sq():
        # output k of a row carries the roundings of the partial sums r_1..r_k (sequential by definition):
        # summed over outputs, sum_j (n - j + 1) r_j**2
        rr = _at_least_1d(r)
        d = dim % rr.dim()
        w = torch.arange(n, 0, -1, dtype=torch.float64).reshape([n if i == d else 1 for i in range(rr.dim())])
        return _sumsq(x) + _out_rounding_sq(c, _sumsq(r)), float(torch.nansum(rr.square() * w))

    return c.budget("reduction", lambda: [torch.add(c.final(r), _at_least_1d(x).abs().cumsum(dim).reshape(x.shape),
                                                    alpha=gamma(n, c.ua))], scale_sq)


@register_budget(*overloads("cumprod"))
def cumprod_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    n = x.shape[c.a["dim"]] if x.dim() else 1
    return c.budget("reduction", lambda: [torch.add(c.final(r), r.abs(), alpha=gamma(n, c.ua))])


# exp and log kernels: a few ulps of the compute type each (vectorized SLEEF u10 and glibc are <= 1-2 ulps)
_EXP_ULPS = 4.0


def _lse_abs_bound(c: BudgetCall, n: int, r: torch.Tensor) -> torch.Tensor:
    """Absolute error of m + log(sum exp(x - m)): each x_j - m is rounded (relative ua), so exp(x_j - m) is
    off by ua*|x_j - m| relative; weighted by p_j = exp(x_j - lse) that is ua * sum p_j (m - x_j) <= ua * H(p)
    <= ua * log(n) (H the entropy); the sum adds gamma_n(ua), exp/log _EXP_ULPS*ua each, the final add ua*|r|."""
    const = c.ua * (math.log(max(n, 1)) + 2 * _EXP_ULPS) + gamma(n, c.ua)
    return torch.add(c.final(r, 2.0) + const, r.abs(), alpha=c.ua)


@register_budget(*overloads("logsumexp"))
def logsumexp_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    n = _count(x, _dims(x, c.a.get("dim")))
    return c.budget("reduction", lambda: [_lse_abs_bound(c, n, r)])


@register_budget(*overloads("logcumsumexp"))
def logcumsumexp_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    n = x.shape[c.a["dim"]] if x.dim() else 1
    # each step is a logaddexp: the worst case grows with the prefix like a sum
    return c.budget("reduction", lambda: [_lse_abs_bound(c, n, r) + gamma(n, c.ua) * r.abs()])


def _var_parts(c: BudgetCall, x: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """sum(x**2) over the reduced dims (keepdim as the op), n and the divisor n - correction."""
    dims = _dims(x, c.a.get("dim"))
    n = _count(x, dims)
    corr = c.a.get("correction")
    if corr is None:
        corr = 1 if c.a.get("unbiased", True) is not False else 0
    s2 = x.abs().square().sum(dims, keepdim=bool(c.a.get("keepdim"))) if x.dim() else x.abs().square()
    return s2, n, max(n - float(corr), 0.0)


def var_budget(c: BudgetCall, *, std: bool, with_mean: bool) -> Budget:
    """var = sum (x - mean)**2 / (n - correction). Bounded by gamma_{2n+4}(ua) * sum x**2 / (n - c): that
    covers two-pass, Welford and the one-pass sum(x**2) - n*mean**2 form (whose error is relative to
    sum x**2, not to the centered sum). std = sqrt(var): |d sqrt| <= min(sqrt(dv), dv / (2 sqrt v))."""
    x = c.a["self"]

    def make():
        s2, n, d = _var_parts(c, x)
        dv = gamma(2 * n + 4, c.ua) * s2 / d if d > 0 else torch.full_like(s2, math.inf)
        r = c.out(0)
        if std:
            main = torch.minimum(dv.sqrt(), dv / (2 * r.abs())) + 2 * c.ua * r.abs()
        else:
            main = dv + c.ua * r.abs()
        bounds = [main + c.final(r)]
        if with_mean:
            m = c.out(1)
            bounds.append(torch.add(c.final(m), s2.sqrt(), alpha=gamma(n + 1, c.ua) / math.sqrt(max(n, 1))))
        return bounds

    return c.budget("reduction", make)


register_budget(*overloads("var"))(functools.partial(var_budget, std=False, with_mean=False))
register_budget(*overloads("std"))(functools.partial(var_budget, std=True, with_mean=False))
register_budget(*overloads("var_mean"))(functools.partial(var_budget, std=False, with_mean=True))
register_budget(*overloads("std_mean"))(functools.partial(var_budget, std=True, with_mean=True))


def norm_budget(c: BudgetCall) -> Budget:
    """(sum |x|**p)**(1/p): each |x|**p is relative (a pow kernel), the sum of positive terms gamma_n(ua),
    the root divides the relative error by |p| and adds its own: relative to the result throughout.
    p = +-inf and 0 are exact selections / counts."""
    x, r = c.a["self"], c.out()
    p = c.a.get("ord", c.a.get("p"))
    p = 2.0 if p is None else float(p)
    if math.isinf(p) or p == 0:
        return c.ulps("movement", ULPS["movement"])
    n = _count(x, _dims(x, c.a.get("dim")))
    rel = (gamma(n, c.ua) + _EXP_ULPS * c.ua) / abs(p) + _EXP_ULPS * c.ua
    # the sum S of positive terms |x|**p accumulates as _accumulation_sq (its term K/3 S**2 dominates), and
    # r = S**(1/p) carries 1/p of S's relative error: sum over outputs of K/3 (r/p)**2
    return c.budget("reduction", lambda: [torch.add(c.final(r), r.abs(), alpha=rel)],
                    lambda: (_sumsq(r), n / (3.0 * p * p) * _sumsq(r)))


register_budget(*overloads("linalg_vector_norm", "norm"))(norm_budget)


@register_budget(*overloads("dist"))
def dist_budget(c: BudgetCall) -> Budget:
    """norm(x - y, p): the difference is relative to each term, so the norm bound holds with one more ua."""
    x = c.a["self"]
    y = c.a["other"]
    b = norm_budget(dataclasses.replace(c, a={"self": torch.broadcast_tensors(x, y)[0], "p": c.a.get("p")}))
    r = c.out()
    return c.budget("reduction", lambda: [b.bound[0] + c.ua * r.abs()] if b.bound[0] is not None else [None])


# --- softmax family: bounds from the reference output alone (cheap) ---
def _softmax_n(c: BudgetCall) -> int:
    x = c.a.get("self", c.a.get("grad_output"))
    return x.shape[c.a["dim"]] if x.dim() else 1


@register_budget(*overloads("_softmax", "softmax", "special_softmax", "_safe_softmax"))
def softmax_budget(c: BudgetCall) -> Budget:
    """y_i = exp(x_i - m) / S. Relative error of y_i: ua*(m - x_i) (rounding of x_i - m, then exp) + the
    same averaged by y over the row (<= ua log n, the entropy bound) + gamma_n(ua) (the sum) + exp and
    division roundings. m - x_i <= -log y_i, so the first term is ua * y_i * (-log y_i): no pass over x."""
    y = c.out()
    n = _softmax_n(c)
    rel = c.ua * (math.log(max(n, 1)) + _EXP_ULPS + 2) + gamma(n, c.ua)
    # final(y, 2): the CPU kernels store exp(x - m) in the output dtype, then divide in place: two roundings
    def make():  # y >= 0: three passes over y
        b = torch.add(torch.full((), 2 * c.floor(), dtype=torch.float64), y, alpha=rel + 2 * c.u)
        return [b.add_(torch.special.entr(y), alpha=c.ua)]

    # the row sum S of positive terms accumulates as _accumulation_sq (K/3 S**2), and every y_i carries
    # S's relative error: sum over outputs of n/3 y**2
    return c.budget("reduction", make, lambda: (_sumsq(y), n / 3.0 * _sumsq(y)))


@register_budget(*overloads("_log_softmax", "log_softmax", "special_log_softmax"))
def log_softmax_budget(c: BudgetCall) -> Budget:
    """z_i = (x_i - m) - log S: ua*|x_i - m| <= ua*|z_i|, log S off by ua*(log n + c) + gamma_n(ua).
    Reduced-precision kernels round m + log S to the device dtype before subtracting it: u * |x_i - z_i|."""
    # fp16 log_softmax: observed error ~u absolute where |z| << 1 (S rounded to fp16 before the log)
    z, x = c.out(), c.a["self"]
    n = _softmax_n(c)
    const = c.ua * (math.log(max(n, 1)) + 2 * _EXP_ULPS) + gamma(n, c.ua)
    # ... and may round S itself (>= 1, so log S moves by u): u * (|x_i - z_i| + 2)
    lse_term = (lambda: c.u * ((x - z).abs() + 2)) if c.u != c.ua else (lambda: 0.0)
    return c.budget("reduction", lambda: [
        torch.add(torch.full((), 2 * c.floor() + const, dtype=torch.float64), z.abs(), alpha=2 * c.u + 2 * c.ua) +
        lse_term()])


@register_budget(*overloads("_softmax_backward_data"))
def softmax_backward_budget(c: BudgetCall) -> Budget:
    """gx = y * (g - sum_j g_j y_j): the dot is off by gamma_n(ua) sum|g y|, the difference and the product
    by ua each."""
    g, y, gx = c.a["grad_output"], c.a["output"], c.out()
    n = _softmax_n(c)
    return c.budget("reduction", lambda: [
        c.final(gx) + 2 * c.ua * gx.abs() + gamma(n, c.ua) * y.abs() * (g * y).abs().sum(c.a["dim"], keepdim=True)])


@register_budget(*overloads("_log_softmax_backward_data"))
def log_softmax_backward_budget(c: BudgetCall) -> Budget:
    """gx = g - exp(z) * sum g: the sum is off by gamma_n(ua) sum|g|, exp by a few ulps, then two roundings."""
    g, z, gx = c.a["grad_output"], c.a["output"], c.out()
    n = _softmax_n(c)

    def make():
        e = z.exp()
        s = g.sum(c.a["dim"], keepdim=True)
        sa = g.abs().sum(c.a["dim"], keepdim=True)
        return [c.final(gx) + c.ua * gx.abs() + e * (gamma(n, c.ua) * sa + (_EXP_ULPS + 2) * c.ua * s.abs())]

    return c.budget("reduction", make)


# --- matmul family: gamma_K(ua) * (|A| @ |B|) (Higham Thm 3.5, any order, FMA or not) ---
# |A| @ |B| costs another matmul, as much as the float64 replay. Above this many multiply-adds the bound
# uses Cauchy-Schwarz instead: (|A||B|)_ij <= ||a_i||_2 ||b_j||_2, O(MK + KN + MN) work, looser by ~pi/2 on
# random data (sum|a||b| ~ (2/pi) K vs ||a|| ||b|| ~ K for Gaussian entries), more when the mass of a_i
# and b_j sits on different k (sparse or one-hot rows).
EXACT_MAGNITUDE_MACS = 1 << 16


def _sq_sum(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """sum of |t|**2 along dim, by the faster way for t's layout: vector_norm reduces a unit-stride dim
    several times faster than square + sum, and a strided one several times slower (weights seen
    transposed, W.T, are the rule in backward)."""
    if t.dim() and t.stride(dim) == 1 and not t.is_complex():
        return torch.linalg.vector_norm(t, dim=dim, keepdim=keepdim).square_()
    return t.abs().square_().sum(dim, keepdim=keepdim) if t.is_complex() else t.square().sum(dim, keepdim=keepdim)


def _mm_magnitude(A: torch.Tensor, B: torch.Tensor, scale: float = 1.0, base: Any = 0.0) -> torch.Tensor:
    """base + scale * (an upper bound of |A| @ |B|), batched on leading dims: exact when small,
    Cauchy-Schwarz else (one fused pass over the M x N result)."""
    if A.numel() and B.numel() and A.numel() * B.shape[-1] <= EXACT_MAGNITUDE_MACS:
        return torch.add(base, A.abs() @ B.abs(), alpha=scale)
    na = _sq_sum(A, -1, keepdim=True).sqrt_().mul_(scale)
    nb = _sq_sum(B, -2, keepdim=True).sqrt_()
    return torch.addcmul(torch.as_tensor(base, dtype=torch.float64), na, nb)


def _mm_scale_sq(A: torch.Tensor, B: torch.Tensor) -> float:
    """Two roundings (one per operand) of every product a_ik b_kj: 2 sum_k (sum_i a_ik^2)(sum_j b_kj^2)."""
    ca = _sq_sum(A, -2)  # [..., K]
    rb = _sq_sum(B, -1)  # [..., K]
    return 2.0 * float(torch.linalg.vecdot(ca, rb).sum())


def _accumulation_sq(K: int, terms_sq: float, result_sq: float) -> float:
    """Estimated sum of the squared partial sums s_1..s_K of K-term inner products accumulated in
    sequence (BLAS and oneDNN kernels run K in order per output, one rounding per step with FMA), over
    all outputs, given sum t**2 over every term t and sum c**2 over every result c. With the terms in
    random order the partial sums form a Brownian bridge from 0 to c: E[s_j**2] = (j/K)**2 c**2 +
    (j/K)(1 - j/K) V, V = sum t**2 - c**2 / K; summed over j: K/3 c**2 + K/6 V."""
    if K <= 0:  # empty inner products: no accumulation
        return 0.0
    return K / 3.0 * result_sq + K / 6.0 * max(terms_sq - result_sq / K, 0.0)


def _out_rounding(c: BudgetCall, r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """m plus the final rounding to the device dtype when the accumulation is wider (bf16/fp16 results):
    u * |r|, not u * m. On random data |r| ~ sqrt(K) while m ~ K, and u * m would be as large as the error of
    accumulating in the device dtype itself, which the budget must catch."""
    if c.u == c.ua:
        return m
    return torch.add(m, r.abs(), alpha=c.u)


def _out_rounding_sq(c: BudgetCall, r_sq: float) -> float:
    """The scale of the result's own rounding where it is apart from the accumulation (bf16/fp16 results
    of a float32 accumulation): sum r**2; 0 where the last accumulation step is that rounding."""
    return 0.0 if c.u == c.ua else r_sq


def _addmm_like(c: BudgetCall, A: torch.Tensor, B: torch.Tensor, K: int, bias: Any, beta: Any, alpha: Any,
                kind: str = "matmul") -> Budget:
    r = c.out()
    beta, alpha = _scale(beta), _scale(alpha)
    use_bias = isinstance(bias, torch.Tensor) and beta != 0

    def make():
        g = gamma(K + (2 if use_bias or alpha != 1 else 0), c.ua)
        base = torch.full((), c.floor(), dtype=torch.float64)
        # beta and alpha may be rounded to the device dtype (bf16 addmm does): one u each where they scale
        if use_bias:
            base = base + ((g + (2 * c.u if beta != 1 else 0)) * abs(beta)) * bias.abs()
        out = _mm_magnitude(A, B, (g + (2 * c.u if alpha != 1 else 0)) * abs(alpha), base)
        out = out.reshape(r.shape) if out.numel() == r.numel() else out.expand(r.shape)
        return [_out_rounding(c, r, out)]

    def scale_sq():
        s, r_sq = _mm_scale_sq(A, B) * abs(alpha) ** 2, _sumsq(r)
        acc = _accumulation_sq(K, s / 2, r_sq)
        if use_bias:
            # a broadcast repeats every element of bias equally often
            s += _sumsq(bias) * (r.numel() / max(bias.numel(), 1)) * abs(beta) ** 2
        return s + _out_rounding_sq(c, r_sq), acc

    return c.budget(kind, make, scale_sq)


@register_budget(*overloads("mm", "bmm", "matmul"))
def mm_budget(c: BudgetCall) -> Budget:
    A, B = c.a["self"], c.a.get("mat2", c.a.get("other"))
    if A.dim() < 2 or B.dim() < 2:
        return NotImplemented
    return _addmm_like(c, A, B, A.shape[-1], None, 0, 1)


@register_budget(*overloads("addmm", "baddbmm"))
def addmm_budget(c: BudgetCall) -> Budget:
    A = c.a.get("mat1", c.a.get("batch1"))
    B = c.a.get("mat2", c.a.get("batch2"))
    return _addmm_like(c, A, B, A.shape[-1], c.a["self"], c.a.get("beta"), c.a.get("alpha"))


@register_budget(*overloads("_addmm_activation"))
def addmm_activation_budget(c: BudgetCall) -> Budget:
    """relu (1-Lipschitz) or gelu (Lipschitz 1.13) after addmm, plus the activation's own ulps."""
    A, B = c.a["mat1"], c.a["mat2"]
    b = _addmm_like(c, A, B, A.shape[-1], c.a["self"], c.a.get("beta"), c.a.get("alpha"))
    r = c.out()
    return c.budget("matmul", lambda: [1.13 * b.bound[0] + _ulp_bound(c, r, ULPS["transcendental"])],
                    b._scales)


@register_budget(*overloads("addbmm"))
def addbmm_budget(c: BudgetCall) -> Budget:
    """beta*C + alpha*sum_b A_b @ B_b: one inner product of length batch*K."""
    A, B = c.a["batch1"], c.a["batch2"]
    Af = A.permute(1, 0, 2).reshape(A.shape[1], -1)  # [M, batch*K]
    Bf = B.reshape(-1, B.shape[-1])  # [batch*K, N]
    return _addmm_like(c, Af, Bf, Af.shape[-1], c.a["self"], c.a.get("beta"), c.a.get("alpha"))


@register_budget(*overloads("mv", "addmv"))
def mv_budget(c: BudgetCall) -> Budget:
    has_bias = "mat" in c.a
    A, v = (c.a["mat"] if has_bias else c.a["self"]), c.a["vec"].unsqueeze(-1)
    bias = c.a["self"].reshape(-1, 1) if has_bias else None
    return _addmm_like(c, A, v, A.shape[-1], bias, c.a.get("beta"), c.a.get("alpha"))


@register_budget(*overloads("dot", "vdot", "inner"))
def dot_budget(c: BudgetCall) -> Budget:
    a, b = c.a["self"], c.a.get("tensor", c.a.get("other"))
    if a.dim() != 1:
        return NotImplemented
    r = c.out()
    n = a.shape[0]
    def scale_sq():
        terms, r_sq = float((a.abs() * b.abs()).square().sum()), _sumsq(r)
        return 2.0 * terms + _out_rounding_sq(c, r_sq), _accumulation_sq(n, terms, r_sq)

    return c.budget("matmul", lambda: [torch.add(c.final(r), (a.abs() * b.abs()).sum(), alpha=gamma(n, c.ua))],
                    scale_sq)


@register_budget(*overloads("addr", "outer", "ger"))
def addr_budget(c: BudgetCall) -> Budget:
    """beta*C + alpha*v1 v2^T: products and one add per element, intermediates possibly in the device dtype."""
    v1, v2 = c.a.get("vec1", c.a.get("self")), c.a.get("vec2")
    r = c.out()
    bias = c.a["self"] if "vec1" in c.a else None
    beta, alpha = _scale(c.a.get("beta")), _scale(c.a.get("alpha"))

    def make():
        t = abs(alpha) * torch.outer(v1.abs(), v2.abs())
        if bias is not None and beta != 0:
            t = t + abs(beta) * bias.abs()
        return [c.final(r, 2.0) + 3 * c.u * t]

    return c.budget("matmul", make)


# --- convolution: gamma_K(ua) * (|x| conv |w|), K = C_in/groups * prod(kernel) ---
def _conv_args(a: dict) -> tuple:
    return a["stride"], a["padding"], a["dilation"], a["transposed"], a["output_padding"], a["groups"]


def _conv_K(w: torch.Tensor, transposed: bool, groups: int) -> int:
    k = math.prod(w.shape[2:])
    return (w.shape[0] // groups if transposed else w.shape[1]) * k


def _conv_magnitude(x: torch.Tensor, w: torch.Tensor, a: dict, scale: float = 1.0) -> torch.Tensor:
    """scale * an upper bound of |x| conv |w|: exact when small; else Cauchy-Schwarz per output: the norm
    of the input window times the norm of the output channel's filter. Window norms: x**2 summed over each
    group's channels, then a ones kernel (one channel in, one out, per group): ~1/(C_in C_out) of the op's
    work; the result is one fused pass over the output."""
    stride, padding, dilation, transposed, output_padding, groups = _conv_args(a)
    macs = x.shape[0] * _conv_K(w, transposed, groups) * (w.shape[1] * groups if transposed else w.shape[0])
    conv = functools.partial(aten.convolution.default, stride=stride, padding=padding, dilation=dilation,
                             transposed=transposed, output_padding=output_padding, groups=groups)
    if macs * 64 <= EXACT_MAGNITUDE_MACS:  # tiny: the exact magnitude costs less than the bookkeeping
        return conv(x.abs(), w.abs(), None) * scale
    ks = w.shape[2:]
    if transposed:
        c_out = w.shape[1] * groups
        wn = w.abs().square().reshape(groups, w.shape[0] // groups, w.shape[1], -1).sum((1, 3))  # [g, C_out/g]
    else:
        c_out = w.shape[0]
        wn = w.abs().square().reshape(groups, c_out // groups, -1).sum(-1)  # [g, C_out/g]
    N, c_in = x.shape[0], x.shape[1]
    xs = x.abs().square().reshape(N, groups, c_in // groups, *x.shape[2:]).sum(2)  # [N, g, *in]
    xn = conv(xs, torch.ones((groups, 1, *ks), dtype=torch.float64), None).sqrt_()  # [N, g, *out]
    spatial = xn.shape[2:]
    xn = xn.reshape(N, groups, 1, *spatial)
    wn = (wn.sqrt() * scale).reshape(1, groups, c_out // groups, *([1] * len(spatial)))
    return (xn * wn).reshape(N, c_out, *spatial)


@register_budget(*overloads("convolution", "_convolution"))
def conv_budget(c: BudgetCall) -> Budget:
    x, w, bias = c.a["input"], c.a["weight"], c.a.get("bias")
    if not isinstance(w, torch.Tensor) or w.dim() < 3:
        return NotImplemented
    transposed, groups = c.a["transposed"], c.a["groups"]
    K = _conv_K(w, transposed, groups)
    r = c.out()

    def make():
        g = gamma(K + (1 if bias is not None else 0), c.ua)
        b = _conv_magnitude(x, w, c.a, g)
        extra = c.floor() + (g * bias.abs().reshape(1, -1, *([1] * (b.dim() - 2))) if bias is not None else 0.0)
        return [_out_rounding(c, r, b.add_(extra))]

    def scale_sq():
        # sum over outputs of sum over terms of x^2 w^2, by linearity: conv(sum_n x^2, sum_co w^2)
        a = c.a
        x2 = x.abs().square().sum(0, keepdim=True)
        if transposed:
            w2 = w.abs().square().sum(1, keepdim=True)  # [C_in, 1, *k]
        else:
            w2 = w.abs().square().reshape(groups, w.shape[0] // groups, *w.shape[1:]).sum(1)  # [g, C_in/g, *k]
        s = aten.convolution.default(x2, w2, None, a["stride"], a["padding"], a["dilation"], transposed,
                                     a["output_padding"], groups)
        terms, r_sq = float(s.sum()), _sumsq(r)
        return 2.0 * terms + _out_rounding_sq(c, r_sq) + (
            _sumsq(torch.broadcast_to(bias.reshape(1, -1, *([1] * (r.dim() - 2))), r.shape)) if bias is not None
            else 0.0), _accumulation_sq(K, terms, r_sq)

    return c.budget("conv", make, scale_sq)


@register_budget(*overloads("convolution_backward"))
def conv_backward_budget(c: BudgetCall) -> Budget:
    """(grad_input, grad_weight, grad_bias), each an inner product bounded as the forward:
    grad_input: K = C_out/groups * prod(kernel) terms, magnitude <= ||grad_output window|| * ||w[:, ci]||
    (window norms by the op itself on grad_output**2 with a ones kernel, one channel per group);
    grad_weight: N * (spatial size) terms, magnitude <= ||grad_output[:, co]|| * ||input[:, ci]|| (whole
    channels: looser than the windows, O(N C HW) work); grad_bias: a sum, gamma_n * sum|grad_output|.
    Exact magnitudes (the op on |arguments|, as much work as the replay) when tiny."""
    a = c.a
    gy, x, w = a["grad_output"], a["input"], a["weight"]
    if w.dim() < 3:
        return NotImplemented
    transposed, groups = a["transposed"], a["groups"]
    ks = w.shape[2:]
    c_out = w.shape[1] * groups if transposed else w.shape[0]
    c_in = x.shape[1]
    K_in = (c_out // groups) * math.prod(ks)
    N = x.shape[0]
    K_w = N * max(math.prod(x.shape[2:]), math.prod(gy.shape[2:]))
    K_b = N * math.prod(gy.shape[2:])
    outs = c.outputs
    args = (a["bias_sizes"], a["stride"], a["padding"], a["dilation"], transposed, a["output_padding"], groups)

    def exact():
        mi, mw, mb = aten.convolution_backward.default(gy.abs(), x.abs(), w.abs(), *args, [True, True, True])
        return mi, mw, mb

    def make():
        small = N * c_out * math.prod(gy.shape[2:]) * K_in * 64 <= EXACT_MAGNITUDE_MACS
        if small:
            mi, mw, mb = exact()
        else:
            mi = mw = mb = None
            if _is_float(outs[0]):
                ones = torch.ones((groups, c_out // groups, *ks) if transposed else (c_out, 1, *ks), dtype=torch.float64)
                dummy = torch.zeros((N, groups, *x.shape[2:]), dtype=torch.float64)
                win = aten.convolution_backward.default(gy.abs().square(), dummy, ones, None, *args[1:],
                                                        [True, False, False])[0].sqrt()  # [N, g, *in]
                if transposed:
                    wn = w.abs().square().sum(tuple(range(1, w.dim())))  # [C_in]
                else:
                    wn = w.abs().square().reshape(groups, c_out // groups, c_in // groups, -1).sum((1, 3)).reshape(-1)
                sp = x.shape[2:]
                mi = (win.reshape(N, groups, 1, *sp) *
                      wn.sqrt().reshape(1, groups, c_in // groups, *([1] * len(sp)))).reshape(x.shape)
            if _is_float(outs[1]):
                gn = torch.linalg.vector_norm(gy.transpose(0, 1).reshape(c_out, -1), dim=1)  # [C_out]
                xn = torch.linalg.vector_norm(x.transpose(0, 1).reshape(c_in, -1), dim=1)  # [C_in]
                if transposed:  # w [C_in, C_out/g, *k]
                    mw = xn.reshape(groups, c_in // groups, 1) * gn.reshape(groups, 1, c_out // groups)
                    mw = mw.reshape(c_in, c_out // groups)
                else:  # w [C_out, C_in/g, *k]
                    mw = gn.reshape(groups, c_out // groups, 1) * xn.reshape(groups, 1, c_in // groups)
                    mw = mw.reshape(c_out, c_in // groups)
                mw = mw.reshape(*mw.shape, *([1] * len(ks))).expand(w.shape)
            if _is_float(outs[2]):
                mb = gy.abs().sum([d for d in range(gy.dim()) if d != 1])
        bounds = []
        for m, K, r in ((mi, K_in, outs[0]), (mw, K_w, outs[1]), (mb, K_b, outs[2])):
            if not _is_float(r) or m is None:
                bounds.append(None)
                continue
            g = gamma(K, c.ua)
            bounds.append(_out_rounding(c, r, torch.add(torch.full((), c.floor(), dtype=torch.float64),
                                                         m.reshape(r.shape), alpha=g)))
        return bounds

    return c.budget("conv", make, lambda: _results_accumulated(c, (K_in, K_w, K_b)))


def _results_accumulated(c: BudgetCall, Ks: Sequence[int]) -> tuple[float, float]:
    """(scale, accumulation) for outputs that are each a K-term sum, without the terms at hand: the results'
    own rounding, and _accumulation_sq's drift part K/3 r**2 (its random-walk part needs the terms: left
    out, so the estimate is low and the bits read conservatively)."""
    scale = acc = 0.0
    for r, K in zip(c.outputs, Ks):
        if _is_float(r):
            r_sq = _sumsq(r)
            scale += r_sq
            acc += _accumulation_sq(K, 0.0, r_sq)
    return scale, acc


@register_budget(*overloads("upsample_linear1d_backward", "upsample_bilinear2d_backward",
                            "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward",
                            "upsample_bicubic2d_backward", "_upsample_bicubic2d_aa_backward"))
def upsample_backward_budget(c: BudgetCall) -> Budget:
    """Each input gathers at most ``count`` weighted output gradients (count per dim: outputs per input,
    times taps for the antialiased filters); weights <= 1 (cubic: |w| sums to <= 1.5 per dim), each off by
    8 u * in_size from its rounded coordinate: (gamma(u) * cw + 8 u cw sum(in sizes)) * count * max|g|."""
    g, r = c.a["grad_output"], c.out()
    name = c.func._schema.name.split("::")[-1]
    d = g.dim() - 2
    ins, outs_ = list(c.a["input_size"])[2:], list(g.shape[2:])
    aa = "_aa" in name
    count = math.prod((-(-o // max(i, 1)) + 2) * ((2 * -(-i // max(o, 1)) + 2) if aa else 1)
                      for i, o in zip(ins, outs_))
    cw = 1.5 ** d if "bicubic" in name else 1.0

    def make():
        gmax = g.abs().amax(tuple(range(2, g.dim())), keepdim=True) if g.dim() > 2 else g.abs()
        k = (gamma(count * 2 ** d + 2, c.u) + 8 * c.u * sum(ins)) * cw * count
        return [torch.add(c.final(r), gmax.expand(r.shape[:2] + (1,) * d), alpha=k).expand(r.shape)]

    return c.budget("elementwise", make)


@register_budget(*overloads("_embedding_bag_per_sample_weights_backward"))
def embedding_bag_psw_backward_budget(c: BudgetCall) -> Budget:
    """One dot product of length D per index: gamma_D(ua) * (the op on magnitudes)."""
    a, r = c.a, c.out()
    D = a["weight"].shape[-1]
    return c.budget("reduction", lambda: [torch.add(c.final(r), _call_with(c, grad=a["grad"].abs(),
                                                                            weight=a["weight"].abs()),
                                                    alpha=gamma(D + 2, c.ua) + 2 * c.u)])


@register_budget(*overloads("_embedding_bag_backward", "_embedding_bag_dense_backward"))
def embedding_bag_backward_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["grad", "per_sample_weights"], c.a["indices"].numel() + 2)


# --- normalization: composed first-order bounds, written once over a "statistics view" ---
# The bounds are per statistics group (a row for layer norm, a channel for batch norm) times |weight|, from
# a few read-only reductions (extremes and norms of x and of the gradient), so their cost stays near the
# fused kernels' own; per element they are looser where |xhat| is below its group's largest.
@dataclasses.dataclass(slots=True)
class _NormView:
    """x as [..] with the statistics (mean, rstd) and the affine parameters broadcastable to it:
    layer norm [R, n] / [R, 1] / [1, n]; batch norm [N, C, L] / [1, C, 1] / [1, C, 1];
    group norm [N, G, C/G, L] / [N, G, 1, 1] / [1, G, C/G, 1]."""

    kind: str  # "ln", "bn", "gn"
    x: torch.Tensor
    stat_shape: tuple
    param_shape: tuple
    stat_dims: tuple  # reduced for the statistics (n elements)
    param_dims: tuple  # reduced for weight/bias gradients (R elements)
    k: int = 0  # layer norm: number of normalized dims

    @property
    def n(self) -> int:
        return _count(self.x, self.stat_dims)

    @property
    def R(self) -> int:
        return _count(self.x, self.param_dims)

    def stat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.stat_shape)

    def param(self, t: Any) -> Any:
        return None if t is None else t.reshape(self.param_shape)

    def to_output(self, t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """A bound computed in this view, reshaped to broadcast against an output of ``shape``."""
        if t.numel() == math.prod(shape):
            return t.reshape(shape)
        if self.kind == "ln":
            return t.reshape(*shape[: len(shape) - self.k], *([1] * self.k))
        if self.kind == "bn":
            return t.reshape(1, shape[1], *([1] * (len(shape) - 2)))
        full = t.expand(self.x.shape[0], self.x.shape[1], self.x.shape[2], 1)  # gn: per (n, channel)
        return full.reshape(shape[0], shape[1], *([1] * (len(shape) - 2)))

    def xhat_max(self, mu: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        """max |x - mean| * rstd per group, from the group's extremes (read-only passes)."""
        return _absmax(self.x, self.stat_dims, mu) * rstd


def _absmax(t: torch.Tensor, dims: Sequence[int], center: Any = 0.0) -> torch.Tensor:
    """max |t - center| over dims (keepdim), from two read-only reductions; 0 for empty groups."""
    if t.numel() == 0:
        return torch.zeros([1 if i in dims else s for i, s in enumerate(t.shape)], dtype=torch.float64)
    return torch.maximum(t.amax(dims, keepdim=True) - center, center - t.amin(dims, keepdim=True))


def _ln_view(x: torch.Tensor, normalized_shape: Sequence[int]) -> _NormView:
    n = math.prod(normalized_shape)
    R = x.numel() // max(n, 1)
    return _NormView("ln", x.reshape(R, n), (R, 1), (1, n), (1,), (0,), len(normalized_shape))


def _bn_view(x: torch.Tensor) -> _NormView:
    N, C = x.shape[0], x.shape[1]
    return _NormView("bn", x.reshape(N, C, math.prod(x.shape[2:])), (1, C, 1), (1, C, 1), (0, 2), (0, 2))


def _gn_view(x: torch.Tensor, N: int, C: int, G: int) -> _NormView:
    L = x.numel() // max(N * C, 1)
    return _NormView("gn", x.reshape(N, G, C // G, L), (N, G, 1, 1), (1, G, C // G, 1), (2, 3), (0, 3))


def _norm_forward(c: BudgetCall, v: _NormView, y: torch.Tensor, mu: torch.Tensor, rstd: torch.Tensor,
                  w: Any, b: Any, eps: float, stats_computed: bool) -> tuple[torch.Tensor, Any, Any]:
    """y = (x - mean) * rstd * w + b, bounds for (y, mean, rstd) with the exact statistics known.

    mean: gamma_n(ua) * mean|x| <= gamma_n(ua) * sqrt(mean^2 + var). rstd: relative 0.5 * the variance's,
    which is gamma_{2n+4}(ua) * (mean^2 + var) / (var + eps) (as for ``var``: covers one-pass forms), plus
    the rsqrt. y: the kernels compute x * (rstd w) + (b - mean rstd w), so the roundings are relative to
    |x| rstd |w| <= (|xhat| + 2|mean| rstd) |w|, and reduced-precision kernels normalize with the mean and
    rstd they return, rounded to the device dtype (bf16 batch norm does): one more u on each. With X the
    group's largest |xhat| (|y - b| <= X |w|):
        |dy| <= |w| (dmu rstd + (3 ua + u) |mean| rstd + (rho + 2 u + 6 ua) X) + (4 ua + u) |b|."""
    mu, rstd = v.stat(mu), v.stat(rstd)
    X = v.xhat_max(mu, rstd)
    if stats_computed:
        n = v.n
        var = (rstd.pow(-2) - eps).clamp_min(0.0)
        ms = mu.square() + var
        dmu = gamma(n, c.ua) * ms.sqrt()
        rho = 0.5 * gamma(2 * n + 4, c.ua) * ms / (var + eps) + 3 * c.ua
    else:  # statistics given (eval batch norm): only the rsqrt of var + eps
        dmu = torch.zeros_like(mu)
        rho = torch.full_like(rstd, 3 * c.ua)
    group = (dmu + (3 * c.ua + c.u) * mu.abs()) * rstd + (rho + 2 * c.u + 6 * c.ua) * X
    base = torch.full((), c.floor(), dtype=torch.float64)
    if b is not None:
        base = base + (4 * c.ua + c.u) * v.param(b).abs()
    by = torch.addcmul(base, v.param(w).abs(), group) if w is not None else group + base
    return v.to_output(by, y.shape), dmu, rho * rstd


def _stat_bounds(c: BudgetCall, v: _NormView, mu: torch.Tensor, rstd: torch.Tensor, dmu: Any, drstd: Any) -> list:
    return [(dmu + c.final(v.stat(mu))).reshape(mu.shape), (drstd + c.final(v.stat(rstd))).reshape(rstd.shape)]


@register_budget(*overloads("native_layer_norm"))
def layer_norm_budget(c: BudgetCall) -> Budget:
    x, y, mu, rstd = c.a["input"], c.out(0), c.out(1), c.out(2)
    v = _ln_view(x, c.a["normalized_shape"])

    def make():
        by, dmu, drstd = _norm_forward(c, v, y, mu, rstd, c.a.get("weight"), c.a.get("bias"), c.a["eps"], True)
        return [by, *_stat_bounds(c, v, mu, rstd, dmu, drstd)]

    return c.budget("norm", make)


@register_budget(*overloads("native_group_norm"))
def group_norm_budget(c: BudgetCall) -> Budget:
    x, y, mu, rstd = c.a["input"], c.out(0), c.out(1), c.out(2)
    v = _gn_view(x, c.a["N"], c.a["C"], c.a["group"])

    def make():
        by, dmu, drstd = _norm_forward(c, v, y, mu, rstd, c.a.get("weight"), c.a.get("bias"), c.a["eps"], True)
        return [by, *_stat_bounds(c, v, mu, rstd, dmu, drstd)]

    return c.budget("norm", make)


def batch_norm_budget(c: BudgetCall, *, training: bool | None = None) -> Budget:
    """native_batch_norm and the _native_batch_norm_legit / _batch_norm_with_update family. The running
    statistics it updates in place are not outputs: no bound for them here."""
    a = c.a
    x, y = a["input"], c.out(0)
    train = a.get("training", training) if training is None else training
    v = _bn_view(x)
    eps = a["eps"]

    def make():
        if train:
            mu, rstd = c.out(1), c.out(2)
        else:
            mu, rstd = a["running_mean"], (a["running_var"] + eps).rsqrt()
        by, dmu, drstd = _norm_forward(c, v, y, mu, rstd, a.get("weight"), a.get("bias"), eps, bool(train))
        out = [by]
        for t, d in ((c.out(1), dmu), (c.out(2), drstd)):
            out.append((d + c.final(v.stat(t))).reshape(t.shape) if train and t.numel() == mu.numel() else
                       (torch.zeros_like(t) if isinstance(t, torch.Tensor) else None))
        out.extend(torch.zeros_like(t) if isinstance(t, torch.Tensor) else None for t in c.outputs[3:])
        return out

    return c.budget("norm", make)


register_budget(*overloads("native_batch_norm", "_native_batch_norm_legit"))(batch_norm_budget)
register_budget(*overloads("_native_batch_norm_legit_no_training", "_batch_norm_no_update"))(
    functools.partial(batch_norm_budget, training=False))
register_budget(*overloads("_batch_norm_with_update"))(functools.partial(batch_norm_budget, training=True))


@register_budget(*overloads("_fused_rms_norm"))
def rms_norm_budget(c: BudgetCall) -> Budget:
    """y = x * rstd * w, rstd = (mean(x^2) + eps)^-1/2: relative 0.5 gamma_{n+1}(ua) + rsqrt, then 2 products."""
    v = _ln_view(c.a["input"], c.a["normalized_shape"])
    rel = 0.5 * gamma(v.n + 1, c.ua) + 3 * c.ua
    y, rstd = c.out(0), c.out(1)
    return c.budget("norm", lambda: [torch.add(c.final(y), y.abs(), alpha=rel + 3 * c.ua),
                                     torch.add(c.final(rstd), rstd.abs(), alpha=rel)])


def _bcast_sum(t: torch.Tensor, shape: Sequence[int], dims: Sequence[int]) -> torch.Tensor:
    """sum over ``dims`` of t broadcast to ``shape``, without materializing the broadcast."""
    own = [d for d in dims if t.shape[d] != 1]
    mult = math.prod(shape[d] for d in dims if t.shape[d] == 1)
    return (t.sum(own, keepdim=True) if own else t) * mult


def _norm_backward(c: BudgetCall, v: _NormView, dy: torch.Tensor, mu: torch.Tensor, rstd: torch.Tensor, w: Any,
                   outs: Sequence[Any], train: bool = True) -> list:
    """Bounds for (dx, dw, db) of y = xhat * w + b, xhat = (x - mean) * rstd, statistics given.

    dx = rstd * (g - mean(g) - xhat * mean(g xhat)), g = dy * w. Kernels compute it in the uncentered form
    rstd*g + c2*x + c3 (c2 from sum(g x) - mean * sum(g)), whose roundings are relative to |x| and |mean|.
    With K = rstd * rms(x) = sqrt(mean(xhat^2) + (mean rstd)^2) (about 1 for centered data, more with an
    offset mean or a negative eps), mean|g| <= rms(g) and mean|g x| <= rms(g) rms(x) (Cauchy-Schwarz), X and
    G the group's largest |xhat| and |g| (so |dx| <= rstd (G + rms(g) (1 + X K))):
        |d dx| <= rstd * [4 (gamma_{n+3}(ua) + 4 ua) rms(g) (1 + K (X + K)) + 3 u G + 3 u (G + rms(g) (1 + X K))].
    dw = sum dy * xhat, xhat computed as x rstd - mean rstd: (gamma_R(ua) + 2 ua) * sum |dy| (X + 2 |mean| rstd),
    by Cauchy-Schwarz over the summed dims; db = sum dy: gamma_R(ua) * sum|dy|. Read-only reductions only."""
    dyv = dy.reshape(v.x.shape)
    mu, rstd = v.stat(mu), v.stat(rstd)
    d = v.stat_dims
    n = max(v.n, 1)
    mr = (mu * rstd).abs()
    X = v.xhat_max(mu, rstd)
    K = (torch.linalg.vector_norm(v.x, 2, d, keepdim=True) / math.sqrt(n)) * rstd
    wm = _absmax(v.param(w), d) if w is not None else 1.0  # the largest |w| a group meets
    bounds = []
    dx, dw, db = (list(outs) + [None, None, None])[:3]
    if _is_float(dx):
        G = _absmax(dyv, d) * wm
        if train:
            rms_g = torch.linalg.vector_norm(dyv, 2, d, keepdim=True) / math.sqrt(n) * wm
            t = 4 * (gamma(v.n + 3, c.ua) + 4 * c.ua) * rms_g * (1 + K * (X + K)) + 3 * c.u * G
            bdx = rstd * (t + 3 * c.u * (G + rms_g * (1 + X * K)))
        else:  # eval: dx = dy * w * rstd, elementwise
            bdx = 6 * c.u * rstd * G
        bounds.append(v.to_output(bdx + c.floor(), dx.shape))
    else:
        bounds.append(None)
    R = v.R
    if _is_float(dw):
        cw = (X + 2 * mr).square()
        # (squares summed: torch's norm kernels are slow over leading dims)
        s = dyv.square().sum(v.param_dims).sqrt() * _bcast_sum(cw, v.x.shape, v.param_dims).reshape(
            [s for i, s in enumerate(cw.shape) if i not in v.param_dims] or [1]).sqrt()
        bounds.append(torch.add(c.final(dw), s.reshape(dw.shape), alpha=gamma(R, c.ua) + 2 * c.ua))
    else:
        bounds.append(None)
    if _is_float(db):
        s1 = dyv.abs().sum(v.param_dims)
        bounds.append(torch.add(c.final(db), s1.reshape(db.shape), alpha=gamma(R, c.ua)))
    else:
        bounds.append(None)
    return bounds


@register_budget(*overloads("native_layer_norm_backward"))
def layer_norm_backward_budget(c: BudgetCall) -> Budget:
    a = c.a
    v = _ln_view(a["input"], a["normalized_shape"])
    w = a.get("weight")
    return c.budget("norm", lambda: _norm_backward(
        c, v, a["grad_out"], a["mean"], a["rstd"], None if w is None else w.reshape(-1), c.outputs))


@register_budget(*overloads("native_group_norm_backward"))
def group_norm_backward_budget(c: BudgetCall) -> Budget:
    a = c.a
    v = _gn_view(a["input"], a["N"], a["C"], a["group"])
    return c.budget("norm", lambda: _norm_backward(c, v, a["grad_out"], a["mean"], a["rstd"], a.get("weight"),
                                                   c.outputs))


def _bn_backward(c: BudgetCall, train: bool, saved_rstd: str) -> Budget:
    """Batch norm's backward from the saved statistics (training) or the running ones (inference)."""
    a = c.a
    v = _bn_view(a["input"])

    def make():
        if train:
            mu, rstd = a["save_mean"], a[saved_rstd]
        else:
            mu, rstd = a["running_mean"], (a["running_var"] + a["eps"]).rsqrt()
        return _norm_backward(c, v, a["grad_out"], mu, rstd, a.get("weight"), c.outputs, train)

    return c.budget("norm", make)


@register_budget(*overloads("native_batch_norm_backward"))
def batch_norm_backward_budget(c: BudgetCall) -> Budget:
    return _bn_backward(c, bool(c.a["train"]), "save_invstd")


@register_budget(*overloads("batch_norm_backward"))
def batch_norm_backward2_budget(c: BudgetCall) -> Budget:
    """The backward of _batch_norm_with_update / _batch_norm_no_update: ``save_var`` holds the saved
    inverse standard deviation (what the forward returned), empty when the running statistics were used."""
    a = c.a
    return _bn_backward(c, bool(a["update"]) and a["save_mean"] is not None and a["save_mean"].numel() > 0,
                        "save_var")


@register_budget(*overloads("_fused_rms_norm_backward"))
def rms_norm_backward_budget(c: BudgetCall) -> Budget:
    """As layer norm's backward with mean 0."""
    a = c.a
    v = _ln_view(a["input"], a["normalized_shape"])
    rstd = a["rstd"]
    w = a.get("weight")
    outs = [c.outputs[0], c.outputs[1] if len(c.outputs) > 1 else None, None]
    return c.budget("norm", lambda: _norm_backward(c, v, a["grad_out"], torch.zeros_like(rstd), rstd,
                                                   None if w is None else w.reshape(-1), outs)[:len(c.outputs)])


# --- losses: per-element terms (relative c_el * ua, plus an absolute a_el), then the reduction ---
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def _call_with(c: BudgetCall, **changes: Any) -> Any:
    """The op itself on changed arguments (|x| for a magnitude); out= variants write fresh buffers, never
    the caller's (those are the shadow's own outputs)."""
    a = dict(c.a, **changes)
    for arg in c.func._schema.arguments:
        if arg.is_out and isinstance(a.get(arg.name), torch.Tensor):
            a[arg.name] = torch.empty(0, dtype=a[arg.name].dtype)
    args = [a[arg.name] for arg in c.func._schema.arguments if not arg.kwarg_only]
    kw = {arg.name: a[arg.name] for arg in c.func._schema.arguments if arg.kwarg_only and arg.name in a}
    return c.func(*args, **kw)


def _loss(c: BudgetCall, rel: float, absolute: Callable[[], Any] | None = None, divisor: Any = None) -> Budget:
    """l = reduce(l_i): |d l_i| <= rel * u * |l_i| + abs_i (the elementwise terms may be rounded to the device
    dtype before the reduction: reduced-precision kernels do); the sum adds gamma_n(ua) sum|l_i|; the mean
    divides by n (or by ``divisor``: nll's total weight, itself a sum of positive terms, gamma_n relative)."""
    red = _REDUCTION.get(c.a.get("reduction", 1), "mean")
    r = c.out()

    def make():
        li = _call_with(c, reduction=0)
        li = li[0] if isinstance(li, tuple) else li
        la = li.abs()
        e = rel * c.u * la
        if absolute is not None:
            e = e + absolute()
        if red == "none":
            return [e + c.final(r)]
        n = max(li.numel(), 1)
        s = e.sum() + gamma(n, c.ua) * la.sum()
        if red == "mean":
            d = float(n) if divisor is None else divisor()
            s = s / d + (gamma(n, c.ua) if divisor is not None else c.ua) * la.sum() / d
        return [c.final(r, 2.0) + s + c.ua * r.abs()]

    return c.budget("loss", make)


def _tensor_loss(c: BudgetCall, *, rel: float) -> Budget:
    return _loss(c, rel)


register_budget(*overloads("mse_loss"))(functools.partial(_tensor_loss, rel=4.0))
register_budget(*overloads("l1_loss"))(functools.partial(_tensor_loss, rel=2.0))
register_budget(*overloads("smooth_l1_loss", "huber_loss"))(functools.partial(_tensor_loss, rel=6.0))
@register_budget(*overloads("soft_margin_loss"))
def soft_margin_budget(c: BudgetCall) -> Budget:
    """log(1 + exp(-y x)): 1 + exp(-y x) is rounded (log then moves by u absolute), -y x too (relative)."""
    x, y = c.a["self"], c.a["target"]
    return _loss(c, 2 * _EXP_ULPS + 4, lambda: 2 * c.u * (1 + (x * y).abs()))


@register_budget(*overloads("binary_cross_entropy"))
def bce_budget(c: BudgetCall) -> Budget:
    """-w (t log x + (1-t) log(1-x)): both terms have one sign (no cancellation); 1 - x is rounded (ua,
    relative), which moves log(1-x) by ua absolute."""
    a = c.a
    w = a.get("weight")

    def absolute():
        t = (2 * c.u) * (a["target"].abs() + (1 - a["target"]).abs())
        return t * w.abs() if w is not None else t

    return _loss(c, _EXP_ULPS + 4, absolute)


@register_budget(*overloads("binary_cross_entropy_with_logits"))
def bce_logits_budget(c: BudgetCall) -> Budget:
    """(1-t) x + lw (log1p(exp(-|x|)) + max(-x, 0)), lw = 1 + (pw - 1) t: the terms cancel (to |t x| for
    x < 0), so the roundings are relative to |x| (|1 - t| + |lw|) + |lw|."""
    a = c.a
    x, t, w, pw = a["self"], a["target"], a.get("weight"), a.get("pos_weight")

    def absolute():
        lw = 1 + (pw - 1) * t if pw is not None else torch.ones_like(t)
        e = (2 * _EXP_ULPS * c.u) * (x.abs() * ((1 - t).abs() + lw.abs()) + lw.abs())
        return e * w.abs() if w is not None else e

    return _loss(c, _EXP_ULPS + 4, absolute)


def nll_budget(c: BudgetCall) -> Budget:
    """-w_t x[i, t_i] summed, divided by the total weight (mean). total_weight: gamma_n(ua) * itself."""
    r, tw = c.out(0), c.out(1)
    main = _loss(c, 2.0, divisor=lambda: float(tw))
    return c.budget("loss", lambda: [main.bound[0],
                                     torch.add(c.final(tw), tw.abs(), alpha=gamma(max(r.numel(), c.a["self"].shape[0]
                                                                               if c.a["self"].dim() else 1), c.ua))])


register_budget(*overloads("nll_loss_forward", "nll_loss2d_forward"))(nll_budget)


# Loss and activation backward ops are elementwise given their inputs: a handful of roundings of the result.
LOSS_BACKWARD = ("mse_loss_backward", "nll_loss_backward", "nll_loss2d_backward", "binary_cross_entropy_backward",
                 "smooth_l1_loss_backward", "huber_loss_backward", "l1_loss_backward")
register_budget(*overloads(*LOSS_BACKWARD))(functools.partial(ulps_rule, kind="loss", ulps=8.0))
# -y g sigmoid(-y x) / n through exp(-y x) / (1 + exp(-y x)): more roundings (observed up to 24 ulps)
register_budget(*overloads("soft_margin_loss_backward"))(functools.partial(ulps_rule, kind="loss", ulps=32.0))


# --- sums of inputs with nonnegative weights (pooling, scatter-add, embedding backward): the op itself
# applied to |inputs| is the exact magnitude: gamma_n * op(|x|), n the most terms one output gets. These
# short sums are bounded at the device's u: CPU kernels for them accumulate in the device dtype (bf16
# adaptive_avg_pool3d, index_reduce, upsampling do), unlike the long sums of the families above ---
def _linear_sum(c: BudgetCall, names: Sequence[str], n: int, kind: str = "reduction") -> Budget:
    r = c.out()

    def make():
        mag = _call_with(c, **{k: _abs(c.a[k]) for k in names if isinstance(c.a.get(k), torch.Tensor)})
        return [torch.add(c.final(r), mag, alpha=gamma(n + 1, c.u))]

    return c.budget(kind, make)


@register_budget(*overloads("avg_pool1d", "avg_pool2d", "avg_pool3d"))
def avg_pool_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["self"], math.prod(c.a["kernel_size"]) + 1)


@register_budget(*overloads("avg_pool2d_backward", "avg_pool3d_backward"))
def avg_pool_backward_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["grad_output"], math.prod(c.a["kernel_size"]) + 1)


@register_budget(*overloads("max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward"))
def max_pool_backward_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["grad_output"], math.prod(c.a["kernel_size"]))


@register_budget(*overloads("_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool1d",
                            "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward"))
def adaptive_avg_pool_budget(c: BudgetCall) -> Budget:
    x = c.a.get("self")
    g = c.a.get("grad_output")
    # a window holds at most ceil(in/out) + 1 elements per dim; the backward sums at most as many windows
    src, dst = (x, c.out()) if g is None else (x, g)
    d = max(src.dim() - 2, 1)
    n = math.prod(-(-i // max(o, 1)) + 1 for i, o in zip(src.shape[-d:], dst.shape[-d:]))
    return _linear_sum(c, ["self", "grad_output"] if g is None else ["grad_output"], n + 1)


@register_budget(*overloads("embedding_dense_backward"))
def embedding_backward_budget(c: BudgetCall) -> Budget:
    idx = c.a["indices"]
    n = idx.numel()
    if c.a.get("scale_grad_by_freq"):
        n += 2  # the 1/count scaling
    return _linear_sum(c, ["grad_output"], n)


@register_budget(*overloads("index_add", "scatter_add", "index_put", "_index_put_impl", "put", "col2im",
                            "unfold_backward", "trace", "_unsafe_masked_index_put_accumulate",
                            "_unsafe_index_put"))
def scatter_add_budget(c: BudgetCall) -> Budget:
    """Sums into places: the op on magnitudes. index_put/put without accumulate are copies."""
    if c.a.get("accumulate") is False:
        return c.ulps("movement", ULPS["movement"])
    src = next((c.a[k] for k in ("source", "src", "values", "self") if isinstance(c.a.get(k), torch.Tensor)), None)
    n = src.numel() if src is not None else 1
    alpha = _scale(c.a.get("alpha"))
    b = _linear_sum(c, ["self", "source", "src", "values", "grad_in", "grad"], n + 2)
    return b if alpha == 1 or alpha is None else c.budget(
        "reduction", lambda: [b.bound[0] * max(1.0, abs(alpha)) + 2 * c.ua * abs(alpha) * c.out().abs()])


@register_budget(*overloads("scatter_reduce", "index_reduce"))
def scatter_reduce_budget(c: BudgetCall) -> Budget:
    red = c.a["reduce"]
    if red in ("amax", "amin"):
        return c.ulps("movement", ULPS["movement"])
    src = c.a.get("src", c.a.get("source"))
    n = src.numel() + 1
    if red in ("sum", "mean"):
        return _linear_sum(c, ["self", "src", "source"], n + 1)
    r = c.out()  # prod: relative, multiplied in the device dtype
    return c.budget("reduction", lambda: [torch.add(c.final(r), r.abs(), alpha=gamma(n, c.u))])


@register_budget(*overloads("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
                            "_upsample_bilinear2d_aa"))
def upsample_linear_budget(c: BudgetCall) -> Budget:
    """Interpolation weights are >= 0 and sum to 1, but each is computed from a source coordinate rounded
    relative to its size (u * in_size absolute): gamma(2^d + 2) * op(|x|) + 4 u * sum(in sizes) * max|x|."""
    x, r = c.a["input"] if "input" in c.a else c.a["self"], c.out()
    d = x.dim() - 2
    key = "input" if "input" in c.a else "self"

    def make():
        mag = _call_with(c, **{key: x.abs()})
        coord = 4 * c.u * sum(x.shape[2:]) * x.abs().amax(tuple(range(2, x.dim())), keepdim=True)
        return [torch.add(c.final(r) + coord, mag, alpha=gamma(2 ** d + 2, c.u))]

    return c.budget("elementwise", make)


# --- attention (CPU flash kernel; the math path dispatches matmuls and softmax, bounded above) ---
def _attention_parts(c: BudgetCall):
    q, k, v = c.a["query"], c.a["key"], c.a["value"]
    E, S = q.shape[-1], k.shape[-2]
    s = c.a.get("scale")
    s = 1.0 / math.sqrt(E) if s is None else float(s)
    qn = torch.linalg.vector_norm(q, dim=-1)  # [..., L]
    kmax = torch.linalg.vector_norm(k, dim=-1).amax(-1, keepdim=True)  # [..., 1]
    return q, k, v, E, S, s, qn, kmax


@register_budget(*overloads("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"))
def attention_budget(c: BudgetCall) -> Budget:
    """out_i = sum_j P_ij v_j, P = softmax(s q k^T + mask). Logit i,j is off by eps_i = gamma_{E+2}(ua) s
    ||q_i|| max_j ||k_j|| (Cauchy-Schwarz) + ua |m_i| (rounding at the row max m_i, |m_i| <= |lse_i| + log S);
    P_ij by P_ij (2 eps_i + ua (lse_i - x_ij) + c ua + gamma_S(ua)) (online-softmax rescalings included);
    with sum_j P_ij (lse_i - x_ij) <= log S (entropy) and sum_j P_ij |v_jd| <= max_j |v_jd|:
        |d out_id| <= max_j |v_jd| * (2 eps_i + 2 ua log S + c ua + 2 gamma_S(ua)) + rounding of out;
        |d lse_i|  <= eps_i + ua (log S + c) + gamma_S(ua) + ua |lse_i|.
    O(L E + S E) work: norms and maxima, no L x S matrix. Outside the gamma terms (accumulations, at ua)
    the roundings are at the device's u: the bf16 CPU kernel rounds the logits and P to bf16 for its GEMMs."""
    if c.a.get("dropout_p", 0.0) not in (0, 0.0, None):
        return NotImplemented  # random: not replayed, nothing to bound
    _, _, v, E, S, s, qn, kmax = _attention_parts(c)
    out = c.out(0)
    lse = c.outputs[1] if len(c.outputs) > 1 and _is_float(c.outputs[1]) and c.outputs[1].numel() else None

    def make():
        m_abs = (lse.abs() + math.log(max(S, 1))) if lse is not None else None
        eps = gamma(E + 2, c.ua) * s * qn * kmax  # [..., L]
        if m_abs is not None:
            eps = eps + c.u * m_abs.reshape(eps.shape)
        const = 2 * c.u * math.log(max(S, 1)) + (2 * _EXP_ULPS + 4) * c.u + 2 * gamma(S, c.ua)
        vmax = v.abs().amax(-2, keepdim=True)  # [..., 1, Ev]
        b_out = vmax * (2 * eps + const).unsqueeze(-1) + c.u * out.abs() + c.final(out)
        bounds = [b_out]
        if lse is not None:
            b_lse = (eps + c.u * (math.log(max(S, 1)) + 2 * _EXP_ULPS) + gamma(S, c.ua)).reshape(lse.shape)
            bounds.append(b_lse + 2 * c.u * lse.abs() + c.final(lse))
        bounds.extend(None for _ in c.outputs[len(bounds):])
        return bounds

    return c.budget("attention", make)


@register_budget(*overloads("_scaled_dot_product_flash_attention_for_cpu_backward"))
def attention_backward_budget(c: BudgetCall) -> Budget:
    """dV = P^T dO, dS = P o (dO V^T - D), D_i = dO_i . O_i, dQ = s dS K, dK = s dS^T Q, P recomputed from
    the given lse with relative error eta_ij <= eps_i + ua (lse_i - x_ij) + c ua. With R_i = ||dO_i|| max_j
    ||v_j|| + sum_d |dO_id O_id| (>= |dP_ij| + |D_i|), |dS_ij| <= P_ij R_i and
        |d dQ_id| <= s R_i max_j |k_jd| (eps_i + ua (log S + c) + 2 gamma_Ev(ua) + gamma_S(ua) + ua)
    (rows of P sum to 1, entropy bound as in the forward). dK and dV sum over queries, where P has no
    normalization: there P_ij <= 1 and P_ij (lse_i - x_ij) <= 1/e, so their bounds are looser by up to ~S."""
    a = c.a
    if a.get("dropout_p", 0.0) not in (0, 0.0, None):
        return NotImplemented
    q, k, v, E, S, s, qn, kmax = _attention_parts(c)
    dO, O, lse = a["grad_out"], a["out"], a["logsumexp"]
    L, Ev = q.shape[-2], v.shape[-1]

    def make():
        eps = gamma(E + 2, c.ua) * s * qn * kmax + 2 * c.u * (lse.abs().reshape(qn.shape) + math.log(max(S, 1)))
        R = torch.linalg.vector_norm(dO, dim=-1) * torch.linalg.vector_norm(v, dim=-1).amax(-1, keepdim=True) + \
            (dO * O).abs().sum(-1)  # [..., L]
        base = (2 * _EXP_ULPS + 4) * c.u + 2 * gamma(Ev, c.ua) + c.u
        dq_rel = eps + c.u * math.log(max(S, 1)) + base + gamma(S, c.ua)
        dq = s * (R * dq_rel).unsqueeze(-1) * k.abs().amax(-2, keepdim=True)
        per_i = (eps + base + gamma(L, c.ua) + c.u / math.e)  # [..., L]
        dk = s * ((per_i * R).unsqueeze(-1) * q.abs()).sum(-2, keepdim=True)  # [..., 1, E]
        dv = ((per_i.unsqueeze(-1)) * dO.abs()).sum(-2, keepdim=True)  # [..., 1, Ev]
        outs = []
        for b, r in zip((dq, dk, dv), c.outputs):
            outs.append(None if not _is_float(r) else (b + 2 * c.u * r.abs() + c.final(r)).expand(r.shape))
        return outs

    return c.budget("attention", make)


# --- FFT: normwise bound (Higham, Thm 24.2): ||dy||_2 <= c log2(n) ua ||y||_2, and each |dy_k| <= ||dy||_2 ---
_FFT_C = 8.0


@register_budget(*overloads("_fft_r2c", "_fft_c2r", "_fft_c2c"))
def fft_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    dims = _dims(x, c.a["dim"])
    if c.func._schema.name.endswith("_c2r"):
        n = math.prod(x.shape[d] for d in dims[:-1]) * c.a["last_dim_size"]
        herm = math.sqrt(2.0)  # the half spectrum stands for the full one: ||X_full|| <= sqrt(2) ||X_half||
    else:
        n = math.prod(x.shape[d] for d in dims)
        herm = 1.0
    norm = {0: 1.0, 1: 1.0 / math.sqrt(max(n, 1)), 2: 1.0 / max(n, 1)}[c.a["normalization"]]
    rel = _FFT_C * (math.log2(max(n, 2)) + 1) * c.ua

    def make():
        xn = torch.linalg.vector_norm(x, dim=dims, keepdim=True)
        return [torch.add(c.final(r, 2.0), xn, alpha=rel * math.sqrt(n) * herm * norm).expand(r.shape)]

    return c.budget("fft", make)


# --- pairwise distances: p = 2 goes through a matmul (|x|^2 + |y|^2 - 2 x.y) and cancels ---
@register_budget(*overloads("_cdist_forward"))
def cdist_budget(c: BudgetCall) -> Budget:
    x1, x2, r = c.a["x1"], c.a["x2"], c.out()
    p = float(c.a["p"])
    K = x1.shape[-1]
    if p == 2.0:
        def make():
            n1 = x1.abs().square().sum(-1, keepdim=True)
            n2 = x2.abs().square().sum(-1).unsqueeze(-2)
            dd = 2 * gamma(K + 3, c.ua) * (n1 + n2)  # error of the squared distance
            return [torch.minimum(dd.sqrt(), dd / (2 * r.abs())) + c.final(r, 4.0)]

        return c.budget("reduction", make)
    if math.isinf(p) or p == 0:
        return c.budget("reduction", lambda: [c.final(r, 2.0) + c.ua * r.abs()])
    rel = (gamma(K, c.ua) + (_EXP_ULPS + 1) * c.ua) / abs(p) + _EXP_ULPS * c.ua
    return c.budget("reduction", lambda: [torch.add(c.final(r), r.abs(), alpha=rel)])


@register_budget(*overloads("linalg_cross", "cross"))
def cross_budget(c: BudgetCall) -> Budget:
    """a_i b_j - a_j b_i: two products, one cancelling difference: 3 u (|a_i b_j| + |a_j b_i|)."""
    a_, b_, r = c.a["self"], c.a["other"], c.out()
    dim = c.a.get("dim")
    dim = -1 if dim is None else dim

    def make():
        aa, bb = torch.broadcast_tensors(a_.abs(), b_.abs())
        return [c.final(r) + 3 * c.u * (aa.roll(1, dim) * bb.roll(-1, dim) + aa.roll(-1, dim) * bb.roll(1, dim))]

    return c.budget("elementwise", make)


# --- no a-priori bound: errors set by the inputs' conditioning, not by shapes ---
UNBOUNDED_NAMES = frozenset((
    "cholesky", "cholesky_solve", "_cholesky_solve_helper", "cholesky_inverse", "lu_solve", "lu_unpack",
    "triangular_solve", "_lu_with_info", "geqrf", "orgqr", "ormqr", "inverse", "det", "logdet", "slogdet",
    "svd", "_svd_helper", "pinverse", "matrix_exp", "matrix_power", "qr", "symeig", "eig", "lstsq",
    "linalg_householder_product", "_linalg_check_errors",
))


def _unbounded(f: OpOverload) -> bool:
    name = f._schema.name.split("::")[-1].rstrip("_")
    return name.startswith(("linalg_", "_linalg_")) or name in UNBOUNDED_NAMES


@register_budget_predicate(_unbounded)
def unbounded_budget(c: BudgetCall) -> Budget:
    """Linear algebra (solves, factorizations, eigen/singular values, inverses): the error of a correct
    implementation scales with the condition number, which the shapes do not give: bound = inf."""
    return c.budget("unbounded", lambda: [torch.full_like(r, math.inf, dtype=torch.float64) if _is_float(r) and not
                                          r.is_complex() else (torch.full(r.shape, math.inf, dtype=torch.float64)
                                                               if _is_float(r) else None) for r in c.outputs])


@register_budget(*overloads("_trilinear"))
def trilinear_budget(c: BudgetCall) -> Budget:
    """sum over sumdim of i1 * i2 * i3 (nn.Bilinear): the op on magnitudes; intermediates (the kernel forms
    i1 x i2 first) may be rounded to the device dtype."""
    a, r = c.a, c.out()
    n = max(a["i1"].numel(), a["i2"].numel(), a["i3"].numel())

    def make():
        mag = _call_with(c, i1=a["i1"].abs(), i2=a["i2"].abs(), i3=a["i3"].abs())
        return [torch.add(c.final(r), mag, alpha=gamma(n + 2, c.ua) + 4 * c.u)]

    return c.budget("matmul", make)


@register_budget(*overloads("_embedding_bag", "_embedding_bag_forward_only"))
def embedding_bag_budget(c: BudgetCall) -> Budget:
    """mode sum/mean: a sum per bag, bounded on magnitudes; mode max: a selection. Other outputs are indices."""
    a, r = c.a, c.out()
    if a.get("mode", 0) == 2:
        return c.budget("movement", lambda: [_ulp_bound(c, r, 1.0)] + [None] * (len(c.outputs) - 1))
    n = a["indices"].numel() + 2

    def make():
        psw = a.get("per_sample_weights")
        mag = _call_with(c, weight=a["weight"].abs(), per_sample_weights=None if psw is None else psw.abs())[0]
        return [torch.add(c.final(r), mag, alpha=gamma(n, c.u))] + [None] * (len(c.outputs) - 1)

    return c.budget("reduction", make)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(-1) if x.dim() else x.abs()


@register_budget(*overloads("multi_margin_loss"))
def multi_margin_budget(c: BudgetCall) -> Budget:
    """sum_j max(0, margin - x_y + x_j)^p w_y / C: each term off by (2p + 2) u relative to
    (|margin| + 2 max|x|)^p, the sum by gamma_C(ua)."""
    a = c.a
    x, p, w = a["self"], float(a.get("p", 1)), a.get("weight")
    C = x.shape[-1] if x.dim() else 1
    wmax = float(w.abs().max()) if isinstance(w, torch.Tensor) and w.numel() else 1.0
    return _loss(c, 0.0, lambda: (gamma(C + 2, c.ua) + (2 * p + 2) * c.u) * wmax *
                 (abs(float(a.get("margin", 1))) + 2 * _row_max(x)) ** p)


@register_budget(*overloads("multilabel_margin_loss_forward"))
def multilabel_margin_budget(c: BudgetCall) -> Budget:
    """sum over target/non-target pairs of max(0, 1 - (x_j - x_k)) / C: at most C^2 terms of size
    <= 1 + 2 max|x|, each off by 2 u. Output 1 (is_target) is a 0/1 mask."""
    x = c.a["self"]
    C = x.shape[-1] if x.dim() else 1
    main = _loss(c, 0.0, lambda: (gamma(C * C + 2, c.ua) + 4 * c.u) * C * (1 + 2 * _row_max(x)))
    return c.budget("loss", lambda: [main.bound[0], _ulp_bound(c, c.out(1), 1.0)])


@register_budget(*overloads("upsample_bicubic2d", "_upsample_bicubic2d_aa"))
def upsample_bicubic_budget(c: BudgetCall) -> Budget:
    """16 taps whose cubic weights (some negative, sum of |w| <= 1.5 per dim) come from source coordinates
    rounded relative to the input size: (gamma_20(u) * 2.25 + 16 u * sum(in sizes)) * max|x| per plane."""
    x = c.a.get("self", c.a.get("input"))
    r = c.out()

    def make():
        amax = x.abs().amax((-2, -1), keepdim=True) if x.dim() >= 2 else x.abs()
        return [_ulp_bound(c, r, 2.0) + (2.25 * gamma(20, c.u) + 16 * c.u * sum(x.shape[-2:])) * amax]

    return c.budget("elementwise", make)
