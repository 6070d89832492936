"""High-precision references: one output element of an aten op, recomputed exactly or with mpmath.

Spot checks validate the float64 reference itself: float64 has only ~29 bits of headroom over
float32, and under cancellation (a sum whose terms cancel, a variance with a large mean, ``gelu``
far in its negative tail) the float64 replay can be wrong by more than the device. A *reference
rule* computes ONE output element from the op's inputs, far more accurately than float64:

>>> x = torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64)
>>> float(reference(aten.sum.default, (x,), {}, ()).value)      # float64's own sum gives 0.0
1.0

Rules live in a table filled by ``@register_reference(*ops)``; ``reference_for(func)`` looks up the
exact ``OpOverload``, then its family (an ``OpOverloadPacket`` registered as a whole, for overloads
that return tensors), then gives ``None``: an op without a rule is not spot-checkable, never guessed.
A rule that meets arguments it does not cover (complex dtypes, named dims, non-finite inputs, an
output it cannot compute) raises ``NoReference``.

Accuracy. Sums and dot products are *exact* (an exact binary number, no rounding at all): the
products of two float32-valued numbers are exact in float64 (24 + 24 = 48 <= 53 significand bits),
those of two float64 numbers split exactly into two float64 numbers (Dekker's two-product), and
repeated ``math.fsum`` (exactly rounded) peels the exact sum off as a few non-overlapping float64
parts; mpmath's exact integer arithmetic covers the exponent ranges where that could over- or
underflow. Everything else (transcendentals, division, square roots) runs in mpmath at
``bits + GUARD_BITS`` of working precision (``working_precision``), restored in ``finally``.

Inputs are read as they are: exact binary numbers of any float dtype (Python scalars at their
float64 value). For in-place and ``out=`` overloads, pass the inputs as they were before the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fractions
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Protocol, Union

import mpmath
import numpy as np
import torch
from mpmath.libmp import from_float, mpf_mul, mpf_pos, mpf_shift, mpf_sum, round_nearest, to_float, to_int

aten = torch.ops.aten
mpf = mpmath.mpf

DEFAULT_BITS = 128  # the precision promised for a result: 75 bits more than float64
GUARD_BITS = 32  # extra working bits so that a few roundings inside a formula stay below DEFAULT_BITS

__all__ = [
    "DEFAULT_BITS",
    "Exact",
    "NoReference",
    "Reference",
    "exact_dot",
    "exact_sum",
    "reference",
    "reference_for",
    "register_reference",
    "to_float64",
    "working_precision",
]


# --- precision and results ---
@contextlib.contextmanager
def working_precision(bits: int = DEFAULT_BITS) -> Iterator[int]:
    """Run mpmath at ``bits + GUARD_BITS`` bits; the previous precision comes back even on error.

    mpmath's precision is process-wide: references are computed from one thread at a time.

    >>> with working_precision(128) as prec:
    ...     mpmath.mp.prec == prec == 160
    True
    """
    if bits < 64:
        raise ValueError(f"working_precision needs at least 64 bits to beat float64, got {bits}")
    old = mpmath.mp.prec
    mpmath.mp.prec = bits + GUARD_BITS
    try:
        yield mpmath.mp.prec
    finally:
        mpmath.mp.prec = old


def to_float64(x: mpmath.mpf) -> float:
    """``x`` correctly rounded to float64 (nearest, ties to even), subnormals and overflow included.

    mpmath's own ``float()`` rounds twice below the normal range and truncates under its default
    rounding mode, hence this.

    >>> to_float64(mpmath.fadd(1, mpmath.ldexp(1, -53), exact=True))  # a tie: to even
    1.0
    """
    raw = x._mpf_
    sign, man, exp, bc = raw
    if not man:  # zero, inf, nan
        return to_float(raw)
    if exp + bc <= -1022:  # |x| < 2**-1022: round on the subnormal grid of 2**-1074
        return math.ldexp(to_int(mpf_shift(raw, 1074), round_nearest), -1074)
    try:
        return to_float(mpf_pos(raw, 53, round_nearest), strict=True)
    except OverflowError:
        return -math.inf if sign else math.inf


@dataclasses.dataclass(frozen=True, slots=True)
class Exact:
    """One output element at high precision.

    ``value`` is exact or accurate to the working precision; ``magnitude`` is the scale of the terms
    the op's formula forms it from (sum of |terms| for a sum or dot product, ``|x| + |mean|`` in a
    normalization, ``|value|`` where the formula cannot cancel). A float64 evaluation errs by about
    ``n * 2**-53 * magnitude``, so ``cancellation = magnitude / |value|`` far above 1 flags elements
    where float64 itself can be wrong.

    >>> e = exact_sum(torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64))
    >>> float(e), e.cancellation
    (1.0, 2e+16)
    """

    value: mpmath.mpf
    magnitude: mpmath.mpf

    def __float__(self) -> float:
        return to_float64(self.value)

    @property
    def cancellation(self) -> float:
        v = abs(self.value)
        if v == 0:
            return math.inf if self.magnitude > 0 else 1.0
        return float(self.magnitude / v)


def _plain(v: mpmath.mpf) -> Exact:
    """An element whose formula cannot cancel: its magnitude is itself."""
    return Exact(v, abs(v))


class NoReference(Exception):
    """This call cannot be spot-checked; carries the op and the reason (never a guessed value)."""

    def __init__(self, op: str, reason: str):
        super().__init__(f"{op}: {reason}")
        self.op = op
        self.reason = reason


class _Uncovered(ValueError):
    """Input values an exact path does not take: non-finite (an IEEE special result, compared apart
    by the metrics) or integers beyond 2**53."""


# --- exact sums and dot products ---
# Products of two values that fit float32 (24-bit significands, exponents in [-149, 127]) have at
# most 48 significant bits and exponents in [-298, 255]: exact, normal float64 numbers.
_NARROW_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_EXACT_INT_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32})
_SPLIT = 134217729.0  # 2**27 + 1: Veltkamp's splitter for 53-bit significands
# Dekker's two-product is exact when nothing over- or underflows: with every nonzero |x| in
# [2**-400, 2**400], partial products stay in [2**-906, 2**801], far from both ends of float64.
_DEKKER_LO, _DEKKER_HI = 2.0**-400, 2.0**400
_FLOAT32_MAX = torch.finfo(torch.float32).max
_MAX_PARTS = 64  # an exact float64 sum spans < 2200 bits: < 42 parts of 53 bits; more is a bug


def _float64_array(t: torch.Tensor | Sequence[float]) -> tuple[np.ndarray, bool]:
    """Values as a flat float64 array (an exact conversion) and whether they all fit float32."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t, dtype=torch.float64)
    if t.is_complex():
        raise _Uncovered(f"exact sums take real tensors, got {t.dtype}")
    if not (t.is_floating_point() or t.dtype in _EXACT_INT_DTYPES) and t.numel() and t.abs().max().item() > 2**53:
        raise _Uncovered(f"{t.dtype} values above 2**53 are not exact in float64")
    t = (t.detach() if t.requires_grad else t).cpu().reshape(-1)
    # numpy converts float32 exactly and faster than a torch op; bfloat16/float16/ints go through torch
    a = t.numpy().astype(np.float64) if t.dtype in (torch.float32, torch.float64) else t.to(torch.float64).numpy()
    if not np.isfinite(a).all():
        raise _Uncovered("non-finite input: IEEE special values are compared apart")
    if t.dtype in _NARROW_DTYPES or t.dtype in _EXACT_INT_DTYPES:
        return a, True
    if a.size and np.abs(a).max() > _FLOAT32_MAX:  # (checked first: the cast would overflow)
        return a, False
    return a, bool((a.astype(np.float32).astype(np.float64) == a).all())


def _granularity(terms: np.ndarray) -> float:
    """The largest power of two g that divides every term (so the exact sum is a multiple of g)."""
    m, e = np.frexp(terms[terms != 0])  # term = m * 2**e, 0.5 <= |m| < 1: m * 2**53 is an integer
    if m.size == 0:
        return math.inf
    sig = np.abs(np.ldexp(m, 53)).astype(np.int64)
    return float(np.ldexp((sig & -sig).astype(np.float64), e - 53).min())


def _fsum_parts(terms: np.ndarray) -> list[float]:
    """The exact sum of ``terms`` as non-overlapping float64 parts, largest first.

    ``fsum`` rounds the exact sum correctly; appending the negated part and summing again gives the
    correctly rounded remainder, 53 bits further down. The exact sum T is a multiple of the terms'
    granularity g, and so is each remainder R: once a part s = round(R) has |s| < 2**52 g, R (a
    multiple of g below 2**53 g) is a float64 number, s = R and the next remainder is zero. That
    usually ends it after one or two ``fsum`` passes; in the worst case (terms spanning the whole
    float64 range) after ~42 parts of 53 bits.
    """
    stop = 2.0**52 * _granularity(terms)
    work = terms.tolist()
    parts: list[float] = []
    s = math.fsum(work)
    while s != 0.0:
        parts.append(s)
        if abs(s) < stop:
            break
        if len(parts) == _MAX_PARTS:
            raise AssertionError("fsum expansion did not terminate")
        work.append(-s)
        s = math.fsum(work)
    return parts


def _exact_from_parts(parts: Sequence[float], magnitude: float) -> Exact:
    return Exact(mpmath.mp.make_mpf(mpf_sum([from_float(p) for p in parts])), mpf(magnitude))


def _extract_parts(terms: np.ndarray) -> list[float]:
    """The exact sum of finite float64 ``terms`` as float64 parts, in a few vectorized passes.

    Rump, Ogita and Oishi's ExtractVector (Accurate floating-point summation I, SISC 2008, Lemma
    3.3): with n + 2 <= 2**M and sigma = 2**j >= 2**M * max|p|, q = (sigma + p) - sigma keeps each
    term's bits above eps * sigma (Sterbenz: the subtraction is exact), p - q is the rounding error
    of sigma + p (exact), and sum(q) is computed without rounding in any order: every partial sum is
    a multiple of eps * sigma below sigma. Each pass peels ~53 - M bits off; where sigma would reach
    subnormal territory (outside the lemma) the remaining terms go to fsum.
    """
    p = terms
    M = max(1, math.ceil(math.log2(p.size + 2)))  # 2**M >= n + 2
    if M > 26:  # the partial sums of q stay below sigma only while n * eps < 2**(1 - M)
        return _fsum_parts(p)
    parts: list[float] = []
    while True:
        mu = float(np.abs(p).max()) if p.size else 0.0
        if mu == 0.0:
            return parts
        sigma = math.ldexp(1.0, M + math.frexp(mu)[1])  # 2**M * 2**ceil(log2 mu) >= 2**M * mu
        if sigma > 2.0**1020:  # sigma + p could overflow
            raise OverflowError("terms too large for the extraction")
        if sigma < 2.0**-1000 or len(parts) == _MAX_PARTS:
            return parts + _fsum_parts(p)
        q = (sigma + p) - sigma
        p = p - q
        tau = float(q.sum())
        if tau != 0.0:
            parts.append(tau)
        p = p[p != 0]


def _sum_terms(terms: np.ndarray, method: str) -> Exact | None:
    """Exact sum of finite float64 terms by the float paths, or None where only mpmath can do it."""
    a = np.abs(terms)
    top = float(a.max()) if a.size else 0.0
    mag = top * float((a / top).sum()) if top else 0.0  # scaled: no overflow warning from numpy
    try:
        parts = _extract_parts(terms) if method == "auto" else _fsum_parts(terms)
    except OverflowError:  # sigma or a partial sum beyond float64's range
        if method == "fsum":
            raise
        return None
    return _exact_from_parts(parts, mag)


def _mp_sum(raw: list) -> Exact:
    """Exact sum of raw mpf terms (``mpf_sum`` with precision 0 drops and rounds nothing)."""
    value = mpf_sum(raw)
    mag = mpf_sum(raw, 64, round_nearest, absolute=True)
    return Exact(mpmath.mp.make_mpf(value), mpmath.mp.make_mpf(mag))


_METHODS = ("auto", "fsum", "mpmath")


def exact_sum(x: torch.Tensor | Sequence[float], *, method: str = "auto") -> Exact:
    """The exact sum of ``x`` (any real dtype, any shape); ``magnitude`` is sum |x| (in float64).

    ``method``: "auto" (vectorized error-free extraction, ``_extract_parts``; mpmath where partial
    sums leave float64's range), "fsum" (repeated ``math.fsum``) or "mpmath" to force one path.

    >>> float(exact_sum(torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64)))
    1.0
    """
    _check_method(method)
    a, _ = _float64_array(x)
    if method != "mpmath":
        r = _sum_terms(a, method)
        if r is not None:
            return r
    return _mp_sum([from_float(v) for v in a.tolist()])


def exact_dot(a: torch.Tensor | Sequence[float], b: torch.Tensor | Sequence[float], *, method: str = "auto") -> Exact:
    """The exact dot product of two vectors (flattened); ``magnitude`` is sum |a_i b_i| (in float64).

    The products become float64 terms whose exact sum is the dot product (values that fit float32:
    the products themselves; otherwise Dekker's two-product inside a safe exponent range), then are
    summed as in ``exact_sum``; mpmath's exact integer arithmetic takes the remaining cases.
    ``method`` as in ``exact_sum``; a forced float path raises ``ValueError`` where it cannot vouch.

    >>> float(exact_dot([1e6, 1e-6, -1e6], [1.0, 1.0, 1.0])) == 1e-6   # float64: 1.00000761449337e-06
    True
    """
    _check_method(method)
    x, x_narrow = _float64_array(a)
    y, y_narrow = _float64_array(b)
    if x.shape != y.shape:
        raise ValueError(f"exact_dot needs vectors of one length, got {x.size} and {y.size}")
    if method != "mpmath":
        terms = _exact_products(x, y, x_narrow and y_narrow)
        r = None if terms is None else _sum_terms(terms, method)
        if r is not None:
            return r
        if method != "auto":
            raise ValueError("the float paths are not provably exact for these values (exponent range)")
    return _mp_sum([mpf_mul(from_float(p), from_float(q)) for p, q in zip(x.tolist(), y.tolist())])


def _exact_products(x: np.ndarray, y: np.ndarray, narrow: bool) -> np.ndarray | None:
    """Float64 terms whose exact sum is sum(x * y), or None where that cannot be guaranteed."""
    if narrow:
        return x * y
    for v in (x, y):
        m = np.abs(v)
        nz = m[m != 0]
        if nz.size and (nz.max() >= _DEKKER_HI or nz.min() <= _DEKKER_LO):
            return None
    # Veltkamp split and Dekker's two-product, each numpy op rounding once (no FMA contraction)
    p = x * y
    t = _SPLIT * x
    xh = t - (t - x)
    xl = x - xh
    t = _SPLIT * y
    yh = t - (t - y)
    yl = y - yh
    e = ((xh * yh - p) + xh * yl + xl * yh) + xl * yl
    return np.concatenate([p, e])


def _check_method(method: str) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, _METHODS))}, got {method!r}")


def _exact_add(*terms: mpmath.mpf) -> mpmath.mpf:
    return mpmath.mp.make_mpf(mpf_sum([t._mpf_ for t in terms]))


def _exact_mul(a: mpmath.mpf, b: mpmath.mpf) -> mpmath.mpf:
    return mpmath.mp.make_mpf(mpf_mul(a._mpf_, b._mpf_))


# --- the normalized input and the table ---
@functools.cache
def _schema_args(func: torch._ops.OpOverload) -> dict[str, tuple[int, Any]]:
    return {a.name: (i, a) for i, a in enumerate(func._schema.arguments)}


@dataclasses.dataclass(slots=True)
class Call:
    """A rule's normalized input: the op, its arguments as given, and which output is asked for."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: Mapping[str, Any]
    output: int = 0

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument ``name`` as passed, else its schema default, else ``default``."""
        pos, a = _schema_args(self.func).get(name, (None, None))
        if a is None:
            return default
        if not a.kwarg_only and pos < len(self.args):
            return self.args[pos]
        if name in self.kwargs:
            return self.kwargs[name]
        return a.default_value if a.has_default_value() else default

    def has(self, name: str) -> bool:
        return name in _schema_args(self.func)

    def tensor(self, name: str) -> torch.Tensor:
        t = self.arg(name)
        if not isinstance(t, torch.Tensor):
            raise self.fail(f"argument {name!r} is {type(t).__name__}, expected a tensor")
        if t.is_complex():
            raise self.fail(f"argument {name!r} is {t.dtype}: complex ops have no reference")
        return t

    def fail(self, reason: str) -> NoReference:
        return NoReference(str(self.func), reason)


class Rule(Protocol):
    """Computes one element of output ``call.output`` at ``index``, at mpmath's current precision."""

    def __call__(self, call: Call, index: tuple[int, ...]) -> Exact: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    """The reference of one op; calling it normalizes the arguments and sets the precision.

    >>> ref = reference_for(aten.exp.default)
    >>> float(ref((torch.tensor([1.0]),), {}, (0,)).value)
    2.718281828459045
    """

    func: torch._ops.OpOverload
    rule: Rule
    outputs: int  # how many of the op's outputs the rule can compute (0..outputs-1)

    def __call__(
        self,
        args: Sequence,
        kwargs: Mapping[str, Any] | None,
        index: Sequence[int],
        *,
        output: int = 0,
        bits: int = DEFAULT_BITS,
    ) -> Exact:
        call = Call(self.func, tuple(args), dict(kwargs or {}), output)
        if not 0 <= output < self.outputs:
            raise call.fail(f"output {output}: the reference computes outputs 0..{self.outputs - 1}")
        with working_precision(bits):
            try:
                return self.rule(call, tuple(int(i) for i in index))
            except _Uncovered as exc:
                raise call.fail(str(exc)) from exc


_Key = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]
_EXACT: dict[torch._ops.OpOverload, tuple[Rule, int]] = {}
_FAMILY: dict[torch._ops.OpOverloadPacket, tuple[Rule, int]] = {}


def _rule_name(rule: Callable) -> str:
    if isinstance(rule, functools.partial):
        return f"{_rule_name(rule.func)}({', '.join(map(_rule_name, rule.args))})"
    return getattr(rule, "__name__", repr(rule))


def register_reference(*ops: _Key, outputs: int = 1) -> Callable[[Rule], Rule]:
    """Register a rule for exact overloads (``aten.mm.default``) or whole families (``aten.exp``).

    A family covers every overload of the packet that returns tensors and has no exact rule; rules
    read arguments by schema name, so one rule serves ``exp.default``, ``exp.out`` alike. Registering
    an op twice is an error.
    """

    def deco(rule: Rule) -> Rule:
        for op in ops:
            if isinstance(op, torch._ops.OpOverload):
                table: dict = _EXACT
            elif isinstance(op, torch._ops.OpOverloadPacket):
                table = _FAMILY
            else:
                raise TypeError(
                    f"register_reference expects aten OpOverloads or packets (aten.mm.default, aten.exp), got {op!r}"
                )
            if op in table:
                raise ValueError(f"a reference for {op} is already registered ({_rule_name(table[op][0])})")
            table[op] = (rule, outputs)
        return rule

    return deco


def _returns_tensors(func: torch._ops.OpOverload) -> bool:
    return any(isinstance(r.type, torch.TensorType) for r in func._schema.returns)


def reference_for(func: Any) -> Reference | None:
    """The op's reference: exact overload, then family, then None (not spot-checkable).

    >>> reference_for(aten.mm.default) is not None, reference_for(aten.index_add.default)
    (True, None)
    """
    if not isinstance(func, torch._ops.OpOverload):
        return None
    entry = _EXACT.get(func)
    if entry is None and _returns_tensors(func):
        entry = _FAMILY.get(func.overloadpacket)
    return None if entry is None else Reference(func, *entry)


def reference(
    func: torch._ops.OpOverload,
    args: Sequence,
    kwargs: Mapping[str, Any] | None,
    index: Sequence[int],
    *,
    output: int = 0,
    bits: int = DEFAULT_BITS,
) -> Exact:
    """One output element of ``func(*args, **kwargs)`` at high precision; ``NoReference`` if none.

    >>> float(reference(aten.log1p.default, (torch.tensor(1e-20, dtype=torch.float64),), {}, ()).value)
    1e-20
    """
    ref = reference_for(func)
    if ref is None:
        raise NoReference(str(func), "no reference rule for this op")
    return ref(args, kwargs, index, output=output, bits=bits)


# --- reading inputs ---
def _finite(x: float) -> float | int:
    if isinstance(x, float) and not math.isfinite(x):
        raise _Uncovered("non-finite input: IEEE special values are compared apart")
    return x


def _bcast(t: torch.Tensor, index: tuple[int, ...]) -> tuple[int, ...]:
    """The element of ``t`` that broadcasting sends to output ``index``."""
    k = t.dim()
    if len(index) < k:
        raise IndexError(f"output index {index} has fewer dims than an input of shape {tuple(t.shape)}")
    tail = index[len(index) - k :] if k else ()
    return tuple(0 if s == 1 else i for s, i in zip(t.shape, tail))


def _scalar(call: Call, name: str, index: tuple[int, ...] = ()) -> float | int:
    """Argument ``name`` at (broadcast) output ``index``, as an exact Python number."""
    v = call.arg(name)
    if isinstance(v, torch.Tensor):
        if v.is_complex():
            raise call.fail(f"argument {name!r} is {v.dtype}: complex ops have no reference")
        v = v[_bcast(v, index)].item()
    if isinstance(v, bool):
        return int(v)
    if not isinstance(v, (int, float)):
        raise call.fail(f"argument {name!r} is {type(v).__name__}, expected a real number or tensor")
    return _finite(v)


def _dims(call: Call, nd: int, dims: Any) -> set[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(nd))
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) for d in dims):
        raise call.fail(f"dims {dims!r}: only integer dims are supported")
    return {d % max(nd, 1) for d in dims} if nd else set()


def _reduced(call: Call, x: torch.Tensor, dims: Any, keepdim: bool, index: tuple[int, ...]) -> torch.Tensor:
    """The elements of ``x`` that a reduction over ``dims`` sends to output ``index`` (flat)."""
    nd = x.dim()
    red = _dims(call, nd, dims)
    expected = nd if keepdim else nd - len(red)
    if len(index) != expected:
        raise IndexError(f"output index {index} has {len(index)} dims, expected {expected}")
    it = iter(index)
    sel: list = []
    for d in range(nd):
        if d in red:
            if keepdim and next(it) != 0:
                raise IndexError(f"output index {index}: reduced dim {d} is kept with size 1")
            sel.append(slice(None))
        else:
            sel.append(next(it))
    return x[tuple(sel)].reshape(-1)


def _along(
    call: Call, x: torch.Tensor, dim: int, index: tuple[int, ...], stop: bool = False
) -> tuple[torch.Tensor, int]:
    """The line of ``x`` through ``index`` along ``dim`` (up to ``index[dim]`` when ``stop``), and the position on it."""
    if len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    if x.dim() == 0:
        return x.reshape(1), 0
    if not isinstance(dim, int):
        raise call.fail(f"dim {dim!r}: only integer dims are supported")
    d = dim % x.dim()
    k = index[d]
    sel = list(index)
    sel[d] = slice(0, k + 1) if stop else slice(None)
    return x[tuple(sel)].reshape(-1), k


def _values(x: torch.Tensor) -> list[float]:
    vals = x.detach().to("cpu", torch.float64).reshape(-1).tolist()
    for v in vals:
        _finite(v)
    return vals


_NAN = mpf("nan")
_INF = mpf("inf")


# --- elementwise rules ---
def _unary(fn: Callable[[mpmath.mpf, float | int], mpmath.mpf], call: Call, index: tuple[int, ...]) -> Exact:
    """An elementwise op of ``self``; ``fn`` gets the value as mpf and as the float it came from
    (for the sign of zero, which mpf drops)."""
    x = _scalar(call, "self", index)
    return _plain(fn(mpf(x), x))


def _log_domain(fn: Callable, x: mpmath.mpf, xf: float, pole: float = 0.0) -> mpmath.mpf:
    if x == pole:
        return -_INF
    return _NAN if x < pole else fn(x)


def _recip(x: mpmath.mpf, xf: float) -> mpmath.mpf:
    return mpf(math.copysign(math.inf, xf)) if x == 0 else 1 / x


def _rsqrt(x: mpmath.mpf, xf: float) -> mpmath.mpf:
    if x == 0:
        return mpf(math.copysign(math.inf, xf))  # rsqrt(-0.0) = 1 / -0.0 = -inf
    return _NAN if x < 0 else 1 / mpmath.sqrt(x)


def _sigmoid(x: mpmath.mpf) -> mpmath.mpf:
    return 1 / (1 + mpmath.exp(-x))


_UNARY: dict[tuple[torch._ops.OpOverloadPacket, ...], Callable[[mpmath.mpf, float], mpmath.mpf]] = {
    (aten.abs, aten.abs_): lambda x, xf: abs(x),
    (aten.neg, aten.neg_): lambda x, xf: -x,
    (aten.relu, aten.relu_): lambda x, xf: max(x, mpf(0)),
    (aten.reciprocal, aten.reciprocal_): _recip,
    (aten.sqrt, aten.sqrt_): lambda x, xf: _NAN if x < 0 else mpmath.sqrt(x),
    (aten.rsqrt, aten.rsqrt_): _rsqrt,
    (aten.exp, aten.exp_): lambda x, xf: mpmath.exp(x),
    (aten.expm1, aten.expm1_): lambda x, xf: mpmath.expm1(x),
    (aten.log, aten.log_): functools.partial(_log_domain, mpmath.log),
    (aten.log2, aten.log2_): functools.partial(_log_domain, lambda x: mpmath.log(x, 2)),
    (aten.log1p, aten.log1p_): lambda x, xf: _log_domain(mpmath.log1p, x, xf, pole=-1.0),
    (aten.sin, aten.sin_): lambda x, xf: mpmath.sin(x),
    (aten.cos, aten.cos_): lambda x, xf: mpmath.cos(x),
    (aten.tanh, aten.tanh_): lambda x, xf: mpmath.tanh(x),
    (aten.sigmoid, aten.sigmoid_): lambda x, xf: _sigmoid(x),
    (aten.erf, aten.erf_): lambda x, xf: mpmath.erf(x),
    (aten.silu, aten.silu_): lambda x, xf: x * _sigmoid(x),
}
for _ops, _fn in _UNARY.items():
    register_reference(*_ops)(functools.partial(_unary, _fn))


@register_reference(aten.gelu, aten.gelu_)
def gelu_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """x/2 (1 + erf(x/sqrt 2)), or with approximate='tanh' x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = mpf(_scalar(call, "self", index))
    approximate = call.arg("approximate", "none")
    if approximate == "none":
        # erfc form: 1 + erf(z) cancels for z << 0, where float64 kernels lose every digit
        value = x / 2 * mpmath.erfc(-x / mpmath.sqrt(2))
        return Exact(value, abs(x) / 2 * (1 + abs(mpmath.erf(x / mpmath.sqrt(2)))))
    if approximate == "tanh":
        # the op's definition uses the decimal constant 0.044715; 1 + tanh(y) = 2 / (1 + exp(-2y))
        y = mpmath.sqrt(2 / mpmath.pi) * (x + mpf("0.044715") * x**3)
        return Exact(x / (1 + mpmath.exp(-2 * y)), abs(x) / 2 * (1 + abs(mpmath.tanh(y))))
    raise call.fail(f"approximate={approximate!r}: expected 'none' or 'tanh'")


@register_reference(aten.softplus)
def softplus_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (part of the op's definition)."""
    xf = _scalar(call, "self", index)
    beta, threshold = mpf(_scalar(call, "beta")), mpf(_scalar(call, "threshold"))
    if beta == 0:
        raise call.fail("beta == 0")
    x = mpf(xf)
    # the branch is taken on the exact product: a float kernel rounding beta*x across the threshold
    # differs by about log1p(exp(-threshold)), a documented property of the op, not an error here
    if x * beta > threshold:
        return _plain(x)
    return _plain(mpmath.log1p(mpmath.exp(beta * x)) / beta)


def _add_rule(sign: int, reverse: bool, call: Call, index: tuple[int, ...]) -> Exact:
    """self + sign * alpha * other (reverse: other - alpha * self, as aten.rsub)."""
    a, b = mpf(_scalar(call, "self", index)), mpf(_scalar(call, "other", index))
    alpha = mpf(_scalar(call, "alpha")) if call.has("alpha") else mpf(1)
    if reverse:
        a, b = b, a
    t = sign * alpha * b
    return Exact(a + t, abs(a) + abs(t))


register_reference(aten.add, aten.add_)(functools.partial(_add_rule, 1, False))
register_reference(aten.sub, aten.sub_)(functools.partial(_add_rule, -1, False))
register_reference(aten.rsub)(functools.partial(_add_rule, -1, True))


@register_reference(aten.mul, aten.mul_)
def mul_rule(call: Call, index: tuple[int, ...]) -> Exact:
    return _plain(mpf(_scalar(call, "self", index)) * mpf(_scalar(call, "other", index)))


@register_reference(aten.div, aten.div_)
def div_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """self / other, rounded toward zero or down with rounding_mode='trunc' / 'floor' (exactly)."""
    af, bf = _scalar(call, "self", index), _scalar(call, "other", index)
    mode = call.arg("rounding_mode")
    if mode not in (None, "trunc", "floor"):
        raise call.fail(f"rounding_mode={mode!r}: expected None, 'trunc' or 'floor'")
    if bf == 0:
        if af == 0:
            return _plain(_NAN)
        return _plain(mpf(math.copysign(math.inf, af) * math.copysign(1.0, bf)))
    if mode is None:
        return _plain(mpf(af) / mpf(bf))
    q = fractions.Fraction(af) / fractions.Fraction(bf)  # exact: a floor must not see a rounded quotient
    return _plain(mpf(math.trunc(q) if mode == "trunc" else math.floor(q)))


@register_reference(aten.pow, aten.pow_)
def pow_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """self ** exponent with IEEE pow's real-valued special cases (0 ** -y = inf, (-x) ** 0.5 = nan)."""
    xf, yf = _scalar(call, "self", index), _scalar(call, "exponent", index)
    x, y = mpf(xf), mpf(yf)
    if y == 0:
        return _plain(mpf(1))
    if x == 0:
        if y > 0:
            return _plain(mpf(0))
        odd = float(yf).is_integer() and int(yf) % 2 == 1
        return _plain(mpf(math.copysign(math.inf, xf) if odd else math.inf))
    if x < 0 and not float(yf).is_integer():
        return _plain(_NAN)
    return _plain(mpmath.power(x, int(yf) if float(yf).is_integer() else y))


# --- dot products: mm, bmm, addmm, matmul, linear, convolution ---
def _combine(call: Call, dot: Exact, index: tuple[int, ...], bias: str | None) -> Exact:
    """beta * bias + alpha * dot; the bias is not read when beta == 0 (NaN there is ignored too)."""
    alpha = mpf(_scalar(call, "alpha")) if call.has("alpha") else mpf(1)
    beta = mpf(_scalar(call, "beta")) if call.has("beta") else mpf(1)
    value, mag = alpha * dot.value, abs(alpha) * dot.magnitude
    if bias is not None and beta != 0 and call.arg(bias) is not None:
        c = beta * mpf(_scalar(call, bias, index))
        value, mag = value + c, mag + abs(c)
    return Exact(value, mag)


def _mm_rule(a_name: str, b_name: str, bias: str | None, call: Call, index: tuple[int, ...]) -> Exact:
    """One element of a (batched) matrix product: ``a[..., i, :] . b[..., :, j]`` (+ beta * bias)."""
    a, b = call.tensor(a_name), call.tensor(b_name)
    expected = a.dim() - (b.dim() == 1)
    if len(index) != expected:
        raise IndexError(f"output index {index} has {len(index)} dims, expected {expected}")
    if b.dim() == 1:  # mv, addmv: out[..., i] = a[..., i, :] . b
        return _combine(call, exact_dot(a[index], b), index, bias)
    *batch, i, j = index
    return _combine(call, exact_dot(a[(*batch, i)], b[(*batch, slice(None), j)]), index, bias)


register_reference(aten.mm, aten.bmm)(functools.partial(_mm_rule, "self", "mat2", None))
register_reference(aten.addmm, aten.addmm_)(functools.partial(_mm_rule, "mat1", "mat2", "self"))
register_reference(aten.baddbmm, aten.baddbmm_)(functools.partial(_mm_rule, "batch1", "batch2", "self"))
register_reference(aten.mv)(functools.partial(_mm_rule, "self", "vec", None))
register_reference(aten.addmv, aten.addmv_)(functools.partial(_mm_rule, "mat", "vec", "self"))


@register_reference(aten.dot)
def dot_rule(call: Call, index: tuple[int, ...]) -> Exact:
    if index:
        raise IndexError(f"dot has a 0-d output, got index {index}")
    return exact_dot(call.tensor("self"), call.tensor("tensor"))


@register_reference(aten.matmul)
def matmul_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """torch.matmul's cases: dot, matrix-vector, vector-matrix, broadcast batched matrix products."""
    a, b = call.tensor("self"), call.tensor("other")
    if a.dim() == 0 or b.dim() == 0:
        raise call.fail("matmul needs tensors of at least one dimension")
    if a.dim() == 1 and b.dim() == 1:
        return exact_dot(a, b)
    if b.dim() == 1:
        return exact_dot(a[tuple(index)], b)
    if a.dim() == 1:
        *batch, j = index
        return exact_dot(a, b[(*batch, slice(None), j)])
    *batch, i, j = index
    return exact_dot(
        a[(*_bcast(a[..., 0, 0], tuple(batch)), i)], b[(*_bcast(b[..., 0, 0], tuple(batch)), slice(None), j)]
    )


@register_reference(aten.linear)
def linear_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """input[..., :] . weight[j, :] + bias[j]."""
    x, w = call.tensor("input"), call.tensor("weight")
    if w.dim() != 2:
        raise call.fail(f"weight of shape {tuple(w.shape)}: only 2-d weights are covered")
    *lead, j = index
    return _combine(call, exact_dot(x[tuple(lead)], w[j]), (j,), "bias")


def _conv_window(
    call: Call, x: torch.Tensor, w: torch.Tensor, out_pos: Sequence[int], transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and weight values (flat, paired) that meet at output position ``out_pos``.

    ``x``: one sample's input channels of the group, ``(Cg, *L)``; ``w``: the matching weights,
    ``(Cg, *K)``. Out-of-range positions are zero padding: their terms are left out.
    """
    nsp = x.dim() - 1
    stride, padding, dilation = (_per_dim(call, n, nsp) for n in ("stride", "padding", "dilation"))
    out_pad = _per_dim(call, "output_padding", nsp) if transposed else [0] * nsp
    idx, valid = [], []
    for o, s, p, d, op, L, K in zip(out_pos, stride, padding, dilation, out_pad, x.shape[1:], w.shape[1:]):
        size = (L - 1) * s - 2 * p + d * (K - 1) + op + 1 if transposed else (L + 2 * p - d * (K - 1) - 1) // s + 1
        if not 0 <= o < size:
            raise IndexError(f"output position {tuple(out_pos)} is outside the output ({size} along a spatial dim)")
        k = torch.arange(K)
        if transposed:  # o = i * s - p + k * d: the inputs i that land on o
            num = o + p - k * d
            ok = (num >= 0) & (num % s == 0) & (num // s < L)
            pos = num // s
        else:
            pos = o * s - p + k * d
            ok = (pos >= 0) & (pos < L)
        idx.append(pos.clamp(0, L - 1))
        valid.append(ok)
    grids = torch.meshgrid(*idx, indexing="ij")
    mask = functools.reduce(torch.logical_and, torch.meshgrid(*valid, indexing="ij"))
    window = x[(slice(None), *grids)]
    return window[:, mask].reshape(-1), w[:, mask].reshape(-1)


def _per_dim(call: Call, name: str, n: int) -> list[int]:
    v = list(call.arg(name))
    if len(v) == 1:
        v = v * n
    if len(v) != n:
        raise call.fail(f"{name}={v}: expected {n} values")
    return v


@register_reference(aten.convolution, aten._convolution)
def convolution_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """out[n, co, *o] = bias[co] + sum over the group's input channels and kernel taps of x * w."""
    x, w = call.tensor("input"), call.tensor("weight")
    transposed, groups = bool(call.arg("transposed")), int(call.arg("groups"))
    if x.dim() != w.dim() or x.dim() < 3:
        raise call.fail(f"input {tuple(x.shape)} and weight {tuple(w.shape)}: expected batched N-d convolution")
    if len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    n, co, *o = index
    if transposed:  # weight (C_in, C_out / groups, *K)
        cin_g, cout_g = x.shape[1] // groups, w.shape[1]
        g = co // cout_g
        xs, ws = x[n, g * cin_g : (g + 1) * cin_g], w[g * cin_g : (g + 1) * cin_g, co % cout_g]
    else:  # weight (C_out, C_in / groups, *K)
        cin_g, cout_g = w.shape[1], w.shape[0] // groups
        g = co // cout_g
        xs, ws = x[n, g * cin_g : (g + 1) * cin_g], w[co]
    if not 0 <= co < cout_g * groups:
        raise IndexError(f"output channel {co} out of range")
    a, b = _conv_window(call, xs, ws, o, transposed)
    return _combine(call, exact_dot(a, b), (co,), "bias")


# --- reductions ---
def _reduction_input(call: Call, index: tuple[int, ...], dim_name: str = "dim") -> torch.Tensor:
    return _reduced(call, call.tensor("self"), call.arg(dim_name), bool(call.arg("keepdim", False)), index)


@register_reference(aten.sum)
def sum_rule(call: Call, index: tuple[int, ...]) -> Exact:
    return exact_sum(_reduction_input(call, index))


@register_reference(aten.mean)
def mean_rule(call: Call, index: tuple[int, ...]) -> Exact:
    x = _reduction_input(call, index)
    if x.numel() == 0:
        return _plain(_NAN)
    s = exact_sum(x)
    return Exact(s.value / x.numel(), s.magnitude / x.numel())


def _correction(call: Call) -> mpmath.mpf:
    if call.has("correction"):
        c = call.arg("correction")
        return mpf(1 if c is None else c)
    return mpf(1 if call.arg("unbiased", True) else 0)


def _variance(x: torch.Tensor, correction: mpmath.mpf) -> tuple[Exact, Exact]:
    """(variance, mean) of the values of ``x``: the numerator N*sum(x^2) - sum(x)^2 is exact, so the
    only roundings are the final division; magnitude sum(x^2)/(N - c) is the scale that the one-pass
    formula E[x^2] - E[x]^2 cancels from."""
    n = x.numel()
    if n == 0:
        return _plain(_NAN), _plain(_NAN)
    s, s2 = exact_sum(x), exact_dot(x, x)
    num = _exact_add(_exact_mul(mpf(n), s2.value), -_exact_mul(s.value, s.value))
    dof = max(mpf(n) - correction, mpf(0))
    mean = Exact(s.value / n, s.magnitude / n)
    if dof == 0:  # IEEE: 0/0 and x/0
        return (_plain(_NAN) if num == 0 else Exact(_INF, _INF)), mean
    return Exact(num / (n * dof), s2.value / dof), mean


def _var_rule(root: bool, call: Call, index: tuple[int, ...]) -> Exact:
    var, mean = _variance(_reduction_input(call, index), _correction(call))
    if call.output == 1:
        return mean
    return Exact(mpmath.sqrt(var.value), mpmath.sqrt(var.magnitude)) if root else var


register_reference(aten.var)(functools.partial(_var_rule, False))
register_reference(aten.std)(functools.partial(_var_rule, True))
register_reference(aten.var_mean, outputs=2)(functools.partial(_var_rule, False))
register_reference(aten.std_mean, outputs=2)(functools.partial(_var_rule, True))


def _norm_rule(ord_name: str, call: Call, index: tuple[int, ...]) -> Exact:
    """The vector norm (sum |x|^p)^(1/p), with p = 2, 1, inf, -inf, 0 (count) or any other real."""
    x = _reduction_input(call, index)
    p = call.arg(ord_name)
    p = 2 if p is None else p
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise call.fail(f"{ord_name}={p!r}: only real orders are covered")
    if p == 2:
        return _plain(mpmath.sqrt(exact_dot(x, x).value))
    if p == 1:
        return _plain(exact_sum(x.abs()).value)
    vals = [abs(mpf(v)) for v in _values(x)]
    if p in (math.inf, -math.inf):
        if not vals:
            raise call.fail("the inf-norm of an empty tensor is an error in torch")
        return _plain(max(vals) if p > 0 else min(vals))
    if p == 0:
        return _plain(mpf(sum(1 for v in vals if v != 0)))
    if p < 0 and any(v == 0 for v in vals):
        return _plain(mpf(0))  # a zero term makes sum |x|^p infinite, its (1/p)-th power zero
    return _plain(mpmath.fsum(v**p for v in vals) ** (1 / mpf(p)))


register_reference(aten.linalg_vector_norm)(functools.partial(_norm_rule, "ord"))
register_reference(aten.norm)(functools.partial(_norm_rule, "p"))


@register_reference(aten.cumsum, aten.cumsum_)
def cumsum_rule(call: Call, index: tuple[int, ...]) -> Exact:
    line, _ = _along(call, call.tensor("self"), call.arg("dim"), index, stop=True)
    return exact_sum(line)


# --- softmax family: exp is inexact, so these run in mpmath (about 10 us per term) ---
def _lse_parts(call: Call, line: torch.Tensor) -> tuple[mpmath.mpf, mpmath.mpf] | None:
    """(m, log sum exp(x - m)) with m the largest value; -inf terms contribute exp(-inf) = 0.
    None when every term is -inf."""
    vals = line.detach().to(torch.float64).tolist()
    finite = [v for v in vals if v != -math.inf]
    for v in finite:
        _finite(v)
    if not finite:
        return None
    m = mpf(max(finite))
    return m, mpmath.log(mpmath.fsum(mpmath.exp(mpf(v) - m) for v in finite))


def _softmax_rule(log: bool, call: Call, index: tuple[int, ...]) -> Exact:
    line, k = _along(call, call.tensor("self"), call.arg("dim"), index)
    parts = _lse_parts(call, line)
    if parts is None:  # every logit -inf: 0/0
        return _plain(_NAN)
    xk = line[k].item()
    if xk == -math.inf:
        return _plain(-_INF if log else mpf(0))
    m, lse = parts
    d = mpf(xk) - m
    if log:  # the kernel's x - m - lse cancels when x_k dominates: magnitude |x - m| + |lse|
        return Exact(d - lse, abs(d) + abs(lse))
    return _plain(mpmath.exp(d - lse))


register_reference(aten._softmax, aten.softmax)(functools.partial(_softmax_rule, False))
register_reference(aten._log_softmax, aten.log_softmax)(functools.partial(_softmax_rule, True))


@register_reference(aten.logsumexp)
def logsumexp_rule(call: Call, index: tuple[int, ...]) -> Exact:
    parts = _lse_parts(call, _reduction_input(call, index))
    if parts is None:
        return _plain(-_INF)
    m, lse = parts
    return Exact(m + lse, abs(m) + abs(lse))


# --- normalizations ---
def _normalized(
    x: mpmath.mpf, s: Exact, n: int, var: mpmath.mpf, eps: mpmath.mpf
) -> tuple[mpmath.mpf, mpmath.mpf, mpmath.mpf]:
    """((x - mean) * rstd, rstd, magnitude of the former) with mean = s / n, x - mean exact in its numerator."""
    rstd = 1 / mpmath.sqrt(var + eps)
    centered = _exact_add(_exact_mul(x, mpf(n)), -s.value) / n
    return centered * rstd, rstd, (abs(x) + abs(s.value) / n) * rstd


def _affine(call: Call, y: mpmath.mpf, mag: mpmath.mpf, at: tuple[int, ...]) -> Exact:
    """y * weight + bias at ``at`` (either may be None)."""
    w, b = call.arg("weight"), call.arg("bias")
    if w is not None:
        wv = mpf(_scalar(call, "weight", at))
        y, mag = y * wv, mag * abs(wv)
    if b is not None:
        bv = mpf(_scalar(call, "bias", at))
        y, mag = y + bv, mag + abs(bv)
    return Exact(y, mag)


def _stats_exact(x: torch.Tensor) -> tuple[int, Exact, mpmath.mpf, mpmath.mpf]:
    """(n, sum, biased variance, its magnitude sum(x^2)/n) with an exact numerator."""
    n = x.numel()
    s, s2 = exact_sum(x), exact_dot(x, x)
    num = _exact_add(_exact_mul(mpf(n), s2.value), -_exact_mul(s.value, s.value))
    return n, s, num / (mpf(n) * n), s2.value / n


@register_reference(aten.native_layer_norm, outputs=3)
def layer_norm_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """Outputs: (x - mean) * rstd * weight + bias, mean, rstd = 1/sqrt(var + eps) over the normalized dims."""
    x = call.tensor("input")
    k = len(call.arg("normalized_shape"))
    axis = x.dim() - k
    if len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    lead, inner = index[:axis], index[axis:]
    n, s, var, var_mag = _stats_exact(x[lead].reshape(-1))
    if n == 0:
        raise call.fail("empty normalized shape")
    eps = mpf(_scalar(call, "eps"))
    if call.output == 1:
        _check_ones(inner)
        return Exact(s.value / n, s.magnitude / n)
    rstd = 1 / mpmath.sqrt(var + eps)
    if call.output == 2:
        _check_ones(inner)
        return Exact(rstd, rstd * (var_mag + eps) / (var + eps))
    y, _, mag = _normalized(mpf(_finite(x[index].item())), s, n, var, eps)
    return _affine(call, y, mag, inner)


def _check_ones(inner: tuple[int, ...]) -> None:
    if any(inner):
        raise IndexError(f"mean/rstd have size 1 along the normalized dims, got index {inner}")


@register_reference(
    aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training, outputs=3
)
def batch_norm_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """Outputs: (x - mean[c]) * invstd[c] * weight[c] + bias[c], save_mean[c], save_invstd[c].

    Training: biased statistics of channel c (dim 1) over every other dim; inference: the running
    statistics. (The running-stat updates are writes to inputs, not outputs: not covered here.)
    """
    x = call.tensor("input")
    eps = mpf(_scalar(call, "eps"))
    training = bool(call.arg("training", False))
    c = index[1] if call.output == 0 else index[0]
    if call.output == 0 and len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    if call.output != 0 and len(index) != 1:
        raise IndexError(f"save_mean/save_invstd are 1-d (channels), got index {index}")
    if training:
        n, s, var, var_mag = _stats_exact(x.transpose(0, 1)[c].reshape(-1))
        mean, invstd = s.value / n, 1 / mpmath.sqrt(var + eps)
        if call.output == 1:
            return Exact(mean, s.magnitude / n)
        if call.output == 2:
            return Exact(invstd, invstd * (var_mag + eps) / (var + eps))
        y, _, mag = _normalized(mpf(_finite(x[index].item())), s, n, var, eps)
        return _affine(call, y, mag, (c,))
    if call.output != 0:
        raise call.fail("inference batch norm returns empty save_mean/save_invstd")
    if call.arg("running_mean") is None or call.arg("running_var") is None:
        raise call.fail("inference without running statistics")
    rm, rv = mpf(_scalar(call, "running_mean", (c,))), mpf(_scalar(call, "running_var", (c,)))
    xv = mpf(_finite(x[index].item()))
    invstd = 1 / mpmath.sqrt(rv + eps)
    return _affine(call, (xv - rm) * invstd, (abs(xv) + abs(rm)) * invstd, (c,))


# --- losses ---
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # at::Reduction


def _reduction(call: Call) -> str:
    r = call.arg("reduction")
    if r not in _REDUCTIONS:
        raise call.fail(f"reduction={r!r}: expected 0 (none), 1 (mean) or 2 (sum)")
    return _REDUCTIONS[r]


@register_reference(aten.mse_loss)
def mse_loss_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """(x - y)^2 per element, or its sum / mean: sum x^2 - 2 sum xy + sum y^2, each exact."""
    x, y = call.tensor("self"), call.tensor("target")
    mode = _reduction(call)
    if mode == "none":
        a, b = mpf(_scalar(call, "self", index)), mpf(_scalar(call, "target", index))
        d = a - b
        return Exact(d * d, abs(d) * (abs(a) + abs(b)))  # x - y cancels when x ~ y
    if index:
        raise IndexError(f"a reduced loss is 0-d, got index {index}")
    x, y = torch.broadcast_tensors(x, y)
    total = _exact_add(exact_dot(x, x).value, _exact_mul(mpf(-2), exact_dot(x, y).value), exact_dot(y, y).value)
    xd, yd = x.detach().double(), y.detach().double()
    mag = mpf(math.fsum(((xd - yd).abs() * (xd.abs() + yd.abs())).reshape(-1).tolist()))
    n = x.numel()
    if mode == "sum":
        return Exact(total, mag)
    return Exact(total / n, mag / n) if n else _plain(_NAN)


@register_reference(aten.nll_loss_forward, aten.nll_loss2d_forward, outputs=2)
def nll_loss_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """Outputs: -weight[t] * x[.., t, ..] per sample (or their sum, or their weighted mean), total_weight.

    The class dim is 1 (0 for a 1-d input); samples whose target is ignore_index weigh 0.
    """
    x, target = call.tensor("self"), call.arg("target")
    weight, ignore = call.arg("weight"), int(call.arg("ignore_index"))
    mode = _reduction(call)
    cdim = 1 if x.dim() >= 2 else 0
    n_classes = x.shape[cdim]
    if mode == "none":
        if call.output == 1:
            raise call.fail("reduction='none' leaves total_weight unspecified")
        t = int(target[index].item())
        if t == ignore:
            return _plain(mpf(0))
        if not 0 <= t < n_classes:
            raise call.fail(f"target {t} outside [0, {n_classes})")
        picked = mpf(_finite(x[(*index[:cdim], t, *index[cdim:])].item()))
        w = mpf(_scalar(call, "weight", (t,))) if weight is not None else mpf(1)
        return _plain(-w * picked)
    if index:
        raise IndexError(f"a reduced loss is 0-d, got index {index}")
    rows = x.movedim(cdim, -1).reshape(-1, n_classes)
    t = target.reshape(-1)
    keep = t != ignore
    t, rows = t[keep], rows[keep]
    if t.numel() and not (0 <= int(t.min()) and int(t.max()) < n_classes):
        raise call.fail(f"targets outside [0, {n_classes})")
    picked = rows[torch.arange(t.numel()), t]
    w = weight.detach()[t] if weight is not None else torch.ones(t.numel(), dtype=torch.float64)
    total_weight = exact_sum(w)
    if call.output == 1:
        return total_weight
    num = exact_dot(w, picked)
    if mode == "sum":
        return Exact(-num.value, num.magnitude)
    if total_weight.value == 0:
        return _plain(_NAN)  # 0/0, as torch
    return Exact(-num.value / total_weight.value, num.magnitude / abs(total_weight.value))
