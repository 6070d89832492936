"""Spot checks: sampled output elements recomputed at high precision, to validate the float64 reference.

The float64 replay is shadow's reference, and float64 has only ~29 bits of headroom over float32:
under cancellation it can itself be wrong by more than the device. A spot check takes a few output
elements of one op call, recomputes each from the op's inputs with ``shadow.references`` (exact sums
and dot products, mpmath elsewhere), and measures both the float64 reference and the device result
against that value:

>>> x = torch.tensor([[1e16, 1.0, -1e16]], dtype=torch.float64)
>>> policy = SpotPolicy.from_option("default")
>>> dev, ref = torch.zeros(1), torch.zeros(1, dtype=torch.float64)  # both sums lose the 1.0
>>> s = policy.check(aten.sum.dim_IntList, (x, [1]), {}, [dev], [ref], torch.float32)
>>> s.samples, s.trusted, s.device_err_abs        # exact sum: 1.0; the device is off by 1.0, and so is float64
(1, False, 1.0)

Verdict (``SpotStats.trusted``), per sampled element with exact value ``x`` (the high-precision
value), float64 reference ``r`` and device result ``y`` (dtype ``d``)::

    trusted  <=>  |r - x|  <=  0.01 * max(|y - x|, spacing_d(|x|) / 2)

for every sampled element: the reference's own error is at most 1% of the device's error, and an
exactly rounded (or luckier) device is measured against half an ulp of its dtype instead, so a device
result with a tiny or zero error does not make every reference untrusted. ``spacing_d`` is the one of
``shadow.metrics`` (``2**(floor(log2|x|) - p)``, the subnormal spacing below the smallest normal). A
non-finite ``x`` trusts a reference that equals it (the same infinity, or NaN for NaN); a reference
that is non-finite where ``x`` is finite (or the reverse) is untrusted with an infinite error; a
non-finite device result against a finite ``x`` trusts any finite reference (its error is infinite)
and is left out of the device figures, as ``shadow.metrics`` counts such elements apart. For a
float64 device the rule still holds, but float64 has no headroom over itself: a reference passes only
when its error is at most 1% of the device's (0.005 ulp where the device is exact), so with float64
devices expect untrusted verdicts wherever both round; their calls are never escalated.

Sampling (``SpotPolicy``): a few elements per op call (``DEFAULT_SAMPLES``), chosen deterministically
from a seed, the op's name, its call number and the output; the elements the caller ranks most
ill-conditioned (``priority``) go first. Escalation: when a sampled element shows cancellation beyond
what float64's headroom over the device covers (see ``SpotPolicy``), the same call gets up to
``ESCALATED_SAMPLES`` elements and the op's next ``ESCALATE_CALLS`` calls too. Cost stays bounded by
estimates, not clocks (so the samples are reproducible): an element whose estimated cost exceeds
``ELEMENT_CAP_US`` is not checked (the reason says so), a call's default samples stop at
``CALL_CAP_US``, and escalated samples draw on a budget that grows by ``ESCALATION_REFILL_US`` per op
call seen (at most ``ESCALATION_BUDGET_US`` banked).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import mpmath
import torch
from mpmath.libmp import from_float, mpf_abs, mpf_sub, round_nearest, to_float

from .metrics import precision_bits
from .options import ShadowOptionError
from .references import DEFAULT_BITS, Call, Exact, NoReference, Reference, reference_for, to_float64

aten = torch.ops.aten

__all__ = [
    "ALL_MAX_ELEMENTS",
    "DEFAULT_SAMPLES",
    "Sample",
    "SpotPolicy",
    "SpotStats",
    "estimate_cost_us",
    "sample_indices",
    "spot_check",
]

DEFAULT_SAMPLES = 2  # elements per output per op call by default: one by priority (when given), one at random
ESCALATED_SAMPLES = 16  # elements per output of an escalated call
ESCALATE_CALLS = 4  # later calls of an op that stay escalated after a call showed risk
RISK_FACTOR = 2.0**10  # roundings of float64 error (2**-53 * magnitude) that must fit in the trust tolerance
TRUST_RATIO = 0.01  # the reference may err by at most 1% of the device's error
ALL_MAX_ELEMENTS = 4096  # spot_checks="all" checks every element of outputs up to this size
ELEMENT_CAP_US = 50_000.0  # an element estimated dearer than this is not checked
CALL_CAP_US = 20_000.0  # a call's default samples stop at this estimated cost
ESCALATED_CALL_CAP_US = 100_000.0  # ... its escalated samples at this one
ESCALATION_REFILL_US = 200.0  # escalation budget earned per op call seen
ESCALATION_BUDGET_US = 200_000.0  # at most this much banked
# cost model, measured on 2 cores (gmpy2): one reference call 30-400 us (an mm element of 1024 terms ~200 us);
# exact sums ~0.03 us per term (vectorized error-free extraction: a mean of 262144 ~7 ms); mpmath exp/log ~10 us
# per term (a softmax element of 128 ~1.3 ms)
_BASE_US, _EXACT_US_PER_TERM, _MPMATH_US_PER_TERM = 100.0, 0.04, 10.0

_MODES = ("off", "default", "all")
_FORMS = (
    "spot_checks= expects 'off', 'default', 'all' (every element of outputs up to "
    f"{ALL_MAX_ELEMENTS} elements), an int >= 0 (elements per output per op call), or a dict "
    "{op ('aten.mm.default') or family ('aten.mm'), or 'default' for the others: int >= 0 or 'all'}"
)
_mpmath_lock = threading.Lock()  # mpmath's precision is process-wide; backward may run on other threads


# --- records ---
@dataclasses.dataclass(slots=True)
class SpotStats:
    """The spot check of one op call (numbers only). ``samples == 0`` means nothing was checked and
    ``reason`` says why; the figures are then 0 and ``trusted`` True (no evidence against the
    reference), so read ``checked`` before ``trusted``.

    ``ref_err_ulp``: max |float64 reference - exact| in float64 ulps at the exact value;
    ``device_err_ulp`` / ``device_err_abs``: max |device - exact| in ulps of the device dtype / absolute
    (finite device results only); ``max_cancellation``: max ``Exact.cancellation`` (sum |terms| / |value|,
    inf where the value is 0); ``trusted``: the module docstring's rule held on every sample.

    >>> SpotStats(samples=0, reason="no mpmath reference for aten.index_add.default").checked
    False
    """

    samples: int = 0
    ref_err_ulp: float = 0.0
    device_err_ulp: float = 0.0
    device_err_abs: float = 0.0
    max_cancellation: float = 0.0
    trusted: bool = True
    reason: str = ""

    @property
    def checked(self) -> bool:
        return self.samples > 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpotStats:
        """Inverse of ``to_dict``; also reads "inf"/"nan" strings (how saved reports write them)."""
        def num(v: Any) -> float:
            return float(v)  # numbers, and the "inf"/"nan" strings of saved reports

        return cls(
            samples=int(d["samples"]),
            ref_err_ulp=num(d["ref_err_ulp"]),
            device_err_ulp=num(d["device_err_ulp"]),
            device_err_abs=num(d["device_err_abs"]),
            max_cancellation=num(d["max_cancellation"]),
            trusted=bool(d["trusted"]),
            reason=str(d.get("reason", "")),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One checked element: output ``output`` at ``index``, its exact value correctly rounded to
    float64 (``exact``), the float64 reference and the device value, and the errors and verdict."""

    output: int
    index: tuple[int, ...]
    exact: float
    reference: float
    device: float
    ref_err_ulp: float  # float64 ulps at the exact value
    device_err_ulp: float  # device-dtype ulps at the exact value (nan: non-finite, left out)
    device_err_abs: float
    cancellation: float
    trusted: bool
    risky: bool  # cancellation beyond float64's headroom over the device: escalate


# --- units ---
@functools.cache
def _emin(dtype: torch.dtype) -> int:
    return math.frexp(torch.finfo(dtype).tiny)[1] - 1  # smallest normal = 2**emin


_bits = functools.cache(precision_bits)


def _floor_log2(x: mpmath.mpf) -> int | None:
    """floor(log2 |x|) of a finite mpf (None for 0): mpf stores man * 2**exp with man of bc bits."""
    _, man, exp, bc = x._mpf_
    return exp + bc - 1 if man else None


def _spacing(e2: int | None, dtype: torch.dtype) -> float:
    """spacing_d at |x| = 2**(max(floor(log2|x|), emin) - p), as ``shadow.metrics.spacing``."""
    emin = _emin(dtype)
    return math.ldexp(1.0, max(emin if e2 is None else e2, emin) - _bits(dtype))


def _abs_diff(a: float, x: mpmath.mpf) -> float:
    """|a - x| rounded once to float64 (to the nearest: the difference itself is computed exactly)."""
    return to_float(mpf_abs(mpf_sub(from_float(a), x._mpf_, 53, round_nearest)))


def _same_special(a: float, x: float) -> bool:
    return (math.isnan(a) and math.isnan(x)) or a == x


def _judge(e: Exact, r: float, y: float, dtype: torch.dtype, output: int, index: tuple[int, ...]) -> Sample:
    """One element's errors and verdict (the rule of the module docstring)."""
    x = e.value
    xf = to_float64(x)  # beyond float64's range the exact value rounds to an infinity: so must the reference
    c = e.cancellation
    c = 0.0 if math.isnan(c) else c
    if not math.isfinite(xf) or not math.isfinite(r):  # IEEE specials: equal or wrong, nothing between
        ok = _same_special(r, xf)
        return Sample(output, index, xf, r, y, 0.0 if ok else math.inf, math.nan, math.nan, c, ok, not ok)
    e2 = _floor_log2(x)
    ref_abs = _abs_diff(r, x)
    ref_ulp = ref_abs / _spacing(e2, torch.float64)
    if not math.isfinite(y):  # the device's error is infinite: any finite reference is within 1% of it
        return Sample(output, index, xf, r, y, ref_ulp, math.nan, math.nan, c, True, False)
    sd = _spacing(e2, dtype)
    dev_abs = _abs_diff(y, x)
    tol = TRUST_RATIO * max(dev_abs, sd / 2)
    trusted = ref_abs <= tol
    # float64's typical error here is 2**-53 * magnitude; escalate while RISK_FACTOR of them would not fit
    # in the tolerance (a device dtype as precise as float64 has no headroom to escalate over)
    mag = to_float(mpf_abs(e.magnitude._mpf_)) if mpmath.isfinite(e.magnitude) else abs(xf)
    risky = not trusted or (_bits(dtype) < 52 and RISK_FACTOR * math.ldexp(mag, -53) > tol)
    return Sample(output, index, xf, r, y, ref_ulp, dev_abs / sd, dev_abs, c, trusted, risky)


# --- the check of given elements ---
def _gather(t: torch.Tensor, flats: Sequence[int]) -> list[float]:
    """Elements of ``t`` at flat (row-major) positions, as float64 numbers. On the CPU element by
    element (a few us each); elsewhere one gather and one transfer (one synchronization)."""
    t = t.detach()
    if t.dim() == 0:
        return [float(t.item())] * len(flats)
    shape = tuple(t.shape)
    coords = [_coords(f, shape) for f in flats]
    if t.device.type == "cpu":
        return [float(t[c].item()) for c in coords]
    cols = tuple(torch.tensor(col, dtype=torch.int64, device=t.device) for col in zip(*coords))
    return t[cols].to("cpu", torch.float64).tolist()


def _coords(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        flat, i = divmod(flat, s)
        out.append(i)
    return tuple(reversed(out))


def spot_check(
    func: torch._ops.OpOverload,
    args: Sequence,
    kwargs: Mapping[str, Any] | None,
    device_outputs: Sequence[torch.Tensor | None],
    reference_outputs: Sequence[torch.Tensor | None],
    dtype: torch.dtype,
    elements: Sequence[tuple[int, int]],
    *,
    bits: int = DEFAULT_BITS,
) -> tuple[list[Sample], str]:
    """Check the given elements ``(output, flat index)`` of one call: the samples and, for elements
    that could not be checked, the last reason (``""`` if none). Raises ``NoReference`` if the op has
    no rule.

    >>> x = torch.tensor([1e-20], dtype=torch.float64)
    >>> (s,), why = spot_check(aten.log1p.default, (x,), {}, [torch.tensor([1e-20])],
    ...                        [torch.log(1 + x)], torch.float32, [(0, 0)])
    >>> s.exact, s.reference, s.trusted          # log(1 + x) rounds 1 + 1e-20 to 1
    (1e-20, 0.0, False)
    """
    ref = reference_for(func)
    if ref is None:
        raise NoReference(str(func), f"no mpmath reference for {func}")
    by_output: dict[int, list[int]] = {}
    for k, flat in elements:
        by_output.setdefault(k, []).append(flat)
    samples: list[Sample] = []
    why = ""
    with _mpmath_lock:
        for k, flats in by_output.items():
            dev, r = device_outputs[k], reference_outputs[k]
            ys, rs = _gather(dev, flats), _gather(r, flats)
            shape = tuple(r.shape)
            for flat, y, rv in zip(flats, ys, rs):
                index = _coords(flat, shape)
                try:
                    e = ref(args, kwargs, index, output=k, bits=bits)
                except NoReference as exc:
                    why = exc.reason
                    continue
                except Exception as exc:  # noqa: BLE001 -- a rule's failure loses this element, never the op's record
                    why = f"reference rule failed at output {k} index {index}: {type(exc).__name__}: {exc}"
                    continue
                samples.append(_judge(e, rv, y, dtype, k, index))
    return samples, why


# --- sampling ---
def _priority_order(priority: torch.Tensor | None, n: int) -> list[int]:
    """The flat positions of the ``n`` largest priorities (NaN ranks last), largest first."""
    if priority is None or n <= 0 or priority.numel() == 0:
        return []
    p = priority.detach().reshape(-1).to("cpu", torch.float64)
    if n == 1:  # the default: one pass, NaN (which argmax prefers) removed only where one wins
        i = int(p.argmax())
        if not math.isnan(p[i].item()):
            return [i]
    p = torch.nan_to_num(p, nan=-math.inf)
    return torch.topk(p, min(n, p.numel())).indices.tolist()


def sample_indices(
    seed: int, op_name: str, call: int, output: int, numel: int, n: int,
    priority: torch.Tensor | None = None, exclude: Sequence[int] = (),
) -> list[int]:
    """``n`` distinct flat positions in ``[0, numel)``: the top ``ceil(n/2)`` by ``priority`` (when
    given), then positions drawn from a generator seeded by ``(seed, op_name, call, output)`` (the same
    arguments always give the same positions, across processes); ``exclude``: already checked.

    >>> sample_indices(0, "aten.mm.default", 1, 0, 100, 3) == sample_indices(0, "aten.mm.default", 1, 0, 100, 3)
    True
    """
    taken = set(exclude)
    free = numel - len(taken)
    n = min(n, free)
    if n <= 0:
        return []
    out: list[int] = []
    for i in _priority_order(priority, (n + 1) // 2 + len(taken)):
        if len(out) == (n + 1) // 2:
            break
        if i not in taken:
            taken.add(i)
            out.append(i)
    if free <= 4 * n:  # small outputs: a seeded permutation of what is left
        rest = [i for i in range(numel) if i not in taken]
        random.Random(f"{seed}:{op_name}:{call}:{output}").shuffle(rest)
        return out + rest[: n - len(out)]
    rng = random.Random(f"{seed}:{op_name}:{call}:{output}")  # str seeds hash with SHA-512: reproducible
    while len(out) < n:
        i = rng.randrange(numel)
        if i not in taken:
            taken.add(i)
            out.append(i)
    return out


# --- cost estimates (per element, in microseconds) ---
def _tensor_args(call: Call) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in (*call.args, *call.kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


def _inner(name: str, call: Call, out_numel: int) -> int:
    t = call.arg(name)
    return int(t.shape[-1]) if isinstance(t, torch.Tensor) and t.dim() else 1


def _along_dim(call: Call, out_numel: int) -> int:
    x, d = call.arg("self"), call.arg("dim")
    return int(x.shape[d]) if isinstance(x, torch.Tensor) and x.dim() and isinstance(d, int) else 1


def _conv_terms(call: Call, out_numel: int) -> int:
    w = call.arg("weight")
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        return 1
    return w.numel() // max(1, int(w.shape[1 if call.arg("transposed") else 0]))


def _layer_norm_terms(call: Call, out_numel: int) -> int:
    return 2 * math.prod(call.arg("normalized_shape") or [1])  # a sum and a sum of squares per row


def _batch_norm_terms(call: Call, out_numel: int) -> int:
    x = call.arg("input")
    if not call.arg("training", False) or not isinstance(x, torch.Tensor) or x.dim() < 2:
        return 1
    return 2 * x.numel() // max(1, int(x.shape[1]))


def _ratio_terms(call: Call, out_numel: int) -> int:
    """Reductions (and elementwise ops, at 1): the largest input over the output."""
    return max(1, max((t.numel() for t in _tensor_args(call)), default=1) // max(1, out_numel))


_DOT_ARG = {aten.mm: "self", aten.bmm: "self", aten.addmm: "mat1", aten.addmm_: "mat1", aten.baddbmm: "batch1",
            aten.baddbmm_: "batch1", aten.mv: "self", aten.addmv: "mat", aten.addmv_: "mat", aten.dot: "self",
            aten.matmul: "self", aten.linear: "input"}
_TERMS: dict[Any, Callable[[Call, int], int]] = {p: functools.partial(_inner, a) for p, a in _DOT_ARG.items()}
_TERMS.update({p: _along_dim for p in (aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax,
                                       aten.cumsum, aten.cumsum_)})
_TERMS.update({aten.convolution: _conv_terms, aten._convolution: _conv_terms,
               aten.native_layer_norm: _layer_norm_terms, aten.native_batch_norm: _batch_norm_terms,
               aten._native_batch_norm_legit: _batch_norm_terms,
               aten._native_batch_norm_legit_no_training: _batch_norm_terms})
# rules that evaluate a transcendental per term in mpmath; every other rule with terms sums exactly
_MPMATH_PER_TERM = frozenset({aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax, aten.logsumexp})


def estimate_cost_us(func: torch._ops.OpOverload, args: Sequence, kwargs: Mapping[str, Any] | None,
                     out_numel: int) -> tuple[float, int]:
    """(estimated microseconds to check one element, terms it reduces), from shapes only.

    >>> estimate_cost_us(aten.mm.default, (torch.ones(4, 1024), torch.ones(1024, 4)), {}, 16)[1]
    1024
    """
    call = Call(func, tuple(args), dict(kwargs or {}))
    packet = func.overloadpacket
    terms = _TERMS.get(packet, _ratio_terms)(call, out_numel)
    per_term = _MPMATH_US_PER_TERM if packet in _MPMATH_PER_TERM else _EXACT_US_PER_TERM
    if packet in (aten.norm, aten.linalg_vector_norm):  # orders other than 1 and 2 go through mpmath
        p = call.arg("ord" if packet is aten.linalg_vector_norm else "p")
        per_term = _EXACT_US_PER_TERM if p in (None, 1, 2) else _MPMATH_US_PER_TERM
    return _BASE_US + per_term * terms, terms


# --- the policy ---
def _op_name(func: Any) -> str:
    return str(func)


def _priority(priority: Sequence[torch.Tensor | None] | None, k: int, numel: int) -> torch.Tensor | None:
    """Output ``k``'s priorities, when given for every one of its elements."""
    if priority is None or k >= len(priority):
        return None
    p = priority[k]
    return p if isinstance(p, torch.Tensor) and p.numel() == numel else None


def _family(op_name: str) -> str:
    return op_name.rsplit(".", 1)[0] if op_name.count(".") >= 2 else op_name


@functools.cache
def _resolve(name: str) -> Any:
    """The OpOverload or OpOverloadPacket called ``name`` ("aten.mm.default", "aten.mm"), or None."""
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        return None
    try:
        obj = getattr(getattr(torch.ops, parts[0]), parts[1])
        return getattr(obj, parts[2]) if len(parts) == 3 else obj
    except (AttributeError, RuntimeError):
        return None


def _has_reference(op: Any) -> bool:
    if isinstance(op, torch._ops.OpOverload):
        return reference_for(op) is not None
    if isinstance(op, torch._ops.OpOverloadPacket):
        return any(reference_for(getattr(op, o)) is not None for o in op.overloads())
    return False


def _count_value(where: str, v: Any) -> int | str:
    if v == "all" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        return v
    raise ShadowOptionError(f"spot_checks: {where}: {v!r} is not a count. {_FORMS}")


class _OpState:
    __slots__ = ("calls", "escalate_left", "planned")

    def __init__(self) -> None:
        self.calls = 0  # wants() calls: the call number that seeds the samples
        self.planned: int | None = None  # the call number wants() said yes to, until check() uses it
        self.escalate_left = 0  # next calls that get escalated samples


class SpotPolicy:
    """Which elements of which op calls get spot-checked, and the check itself.

    Build it from the ``spot_checks=`` option; ``wants(op_name)`` (cheap, before the op runs) says
    whether this call gets samples, then ``check(...)`` (after the op) returns its ``SpotStats``.

    >>> policy = SpotPolicy.from_option(3)               # three elements per output per call
    >>> policy.wants("aten.exp.default"), policy.wants("aten.index_add.default")
    (True, False)

    Escalation: an element is *risky* when it is untrusted, or when float64's typical error on it
    (2**-53 times the magnitude of the terms it is formed from, i.e. cancellation times its value)
    times ``RISK_FACTOR`` exceeds the trust tolerance. A risky sample makes the rest of the call and
    the op's next ``ESCALATE_CALLS`` calls use ``max(ESCALATED_SAMPLES, 8 * count)`` elements per
    output, paid from the escalation budget (see the module docstring).
    """

    def __init__(self, *, mode: str = "default", count: int = DEFAULT_SAMPLES,
                 per_op: Mapping[str, int | str] | None = None, seed: int = 0, bits: int = DEFAULT_BITS,
                 escalation_budget_us: float = ESCALATION_BUDGET_US, escalation_refill_us: float = ESCALATION_REFILL_US):
        self.mode = mode  # "off" | "default" | "count" | "all" | "per_op"
        self.count = count  # elements per output per call (mode default/count)
        self.per_op = dict(per_op or {})  # op or family name -> count or "all"; "default" -> the others
        self.seed = seed  # with the op name, call number and output, it picks the random samples
        self.bits = bits  # precision of the references
        self.escalation_budget_us = escalation_budget_us  # most estimated cost banked for escalated samples
        self.escalation_refill_us = escalation_refill_us  # ... earned per op call seen
        self.reset()

    def reset(self) -> None:
        """Forget the call counts, escalations and budget (a new run samples as the first did)."""
        self._ops: dict[str, _OpState] = {}
        self._checkable: dict[str, bool] = {}
        self._budget = self.escalation_budget_us
        self.last: list[Sample] = []  # the samples of the last check(), for inspection

    def __repr__(self) -> str:
        what = {"count": self.count, "per_op": self.per_op}.get(self.mode, "")
        return f"SpotPolicy({self.mode}{' ' + repr(what) if what != '' else ''}, seed={self.seed})"

    @classmethod
    def from_option(cls, value: Any) -> SpotPolicy:
        """Validate ``spot_checks=``: "off", "default", "all", an int >= 0 (elements per output per call,
        0 = off), or a dict {op or family name (or its OpOverload): count or "all"}, where the key
        "default" sets the count of unlisted ops (0 otherwise). A SpotPolicy passes through.

        >>> SpotPolicy.from_option({"aten.mm": 8, "default": 1}).per_op
        {'aten.mm': 8, 'default': 1}
        """
        if isinstance(value, SpotPolicy):
            return value
        if isinstance(value, str):
            if value not in _MODES:
                raise ShadowOptionError(f"spot_checks={value!r}: unknown mode. {_FORMS}")
            return cls(mode=value)
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ShadowOptionError(f"spot_checks={value}: a count must be >= 0. {_FORMS}")
            return cls(mode="count", count=value) if value else cls(mode="off")
        if isinstance(value, Mapping):
            per_op: dict[str, int | str] = {}
            for key, v in value.items():
                name = str(key) if isinstance(key, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else key
                if not isinstance(name, str):
                    raise ShadowOptionError(f"spot_checks: key {key!r} is not an op name. {_FORMS}")
                per_op[name] = _count_value(f"{name!r}", v)
                if name == "default":
                    continue
                op = _resolve(name)
                if op is None:
                    raise ShadowOptionError(
                        f"spot_checks: {name!r} names no op (expected 'namespace.op' or 'namespace.op.overload', "
                        f"such as 'aten.mm' or 'aten.mm.default'). {_FORMS}")
                if not _has_reference(op):
                    raise ShadowOptionError(
                        f"spot_checks: {name!r} has no mpmath reference rule, so it cannot be spot-checked "
                        "(shadow.references lists the covered ops)")
            return cls(mode="per_op", per_op=per_op)
        raise ShadowOptionError(f"spot_checks={value!r} ({type(value).__name__}). {_FORMS}")

    # --- decisions ---
    def _count_for(self, op_name: str) -> int | str:
        if self.mode == "off":
            return 0
        if self.mode == "all":
            return "all"
        if self.mode == "per_op":
            p = self.per_op
            return p.get(op_name, p.get(_family(op_name), p.get("default", 0)))
        return self.count

    def _checkable_name(self, op_name: str) -> bool:
        ok = self._checkable.get(op_name)
        if ok is None:
            op = _resolve(op_name)
            ok = self._checkable[op_name] = isinstance(op, torch._ops.OpOverload) and reference_for(op) is not None
        return ok

    def _state(self, op_name: str) -> _OpState:
        st = self._ops.get(op_name)
        if st is None:
            st = self._ops[op_name] = _OpState()
        return st

    def wants(self, op_name: str) -> bool:
        """Whether this call of ``op_name`` gets samples (then snapshot the inputs an in-place op
        overwrites, and call ``check``). Deterministic: the op's call count decides, never a clock.
        Ops without a reference rule are never wanted (``check`` still explains them)."""
        self._budget = min(self.escalation_budget_us, self._budget + self.escalation_refill_us)
        st = self._state(op_name)
        st.calls += 1
        n = self._count_for(op_name)
        if n == 0 or not self._checkable_name(op_name):
            st.planned = None
            return False
        st.planned = st.calls
        return True

    # --- the check ---
    def check(
        self,
        func: torch._ops.OpOverload,
        args: Sequence,
        kwargs: Mapping[str, Any] | None,
        device_outputs: Sequence[torch.Tensor | None],
        reference_outputs: Sequence[torch.Tensor | None],
        dtype: torch.dtype,
        priority: Sequence[torch.Tensor | None] | None = None,
    ) -> SpotStats | None:
        """Spot-check one call: ``args``/``kwargs`` as the float64 reference read them (for in-place and
        ``out=`` ops, as they were before the call); ``device_outputs`` and ``reference_outputs`` aligned
        with the op's tensor outputs (None where absent); ``dtype`` the device dtype; ``priority``
        optional per-element condition estimates (same shapes; larger = checked first).

        Returns None when the policy does not sample this op (off, or a count of 0 for it); otherwise
        ``SpotStats`` (``samples == 0`` with a reason when nothing could be checked).
        """
        self.last = []
        name = _op_name(func)
        st = self._state(name)
        call_no = st.planned if st.planned is not None else st.calls
        st.planned = None
        n = self._count_for(name)
        if n == 0:
            return None
        ref = reference_for(func)
        if ref is None:
            return SpotStats(reason=f"no mpmath reference for {name}")
        if not (dtype.is_floating_point or dtype.is_complex):
            return SpotStats(reason=f"{dtype} result: discrete results are compared exactly, not spot-checked")
        outs, why = self._eligible(ref, device_outputs, reference_outputs)
        if not outs:
            return SpotStats(reason=why)
        cost, terms = estimate_cost_us(func, args, kwargs, max(reference_outputs[k].numel() for k in outs))
        if cost > ELEMENT_CAP_US:
            return SpotStats(reason=f"one element of {name} reduces {terms} terms (~{cost / 1e3:.0f} ms estimated "
                                    f"at high precision): above the {ELEMENT_CAP_US / 1e3:.0f} ms per-element cap")
        if n == "all":
            total = sum(reference_outputs[k].numel() for k in outs)
            if total > ALL_MAX_ELEMENTS:
                return SpotStats(reason=f"spot_checks='all' checks outputs of at most {ALL_MAX_ELEMENTS} elements; "
                                        f"this call's have {total}: give {name} a count instead")
            elements = [(k, i) for k in outs for i in range(reference_outputs[k].numel())]
            return self._run(func, args, kwargs, device_outputs, reference_outputs, dtype, elements, why)
        escalated = st.escalate_left > 0 and _bits(dtype) < 52
        if escalated:
            st.escalate_left -= 1
        # default samples, within the per-call cap
        per_out = max(1, min(n, int(CALL_CAP_US // (cost * len(outs)))))
        chosen: dict[int, list[int]] = {}
        for k in outs:
            numel = reference_outputs[k].numel()
            chosen[k] = sample_indices(self.seed, name, call_no, k, numel, per_out, _priority(priority, k, numel))
        elements = [(k, i) for k in outs for i in chosen[k]]
        samples, why2 = self._check(func, args, kwargs, device_outputs, reference_outputs, dtype, elements)
        why = why2 or why
        if any(s.risky for s in samples):
            st.escalate_left = ESCALATE_CALLS
            escalated = _bits(dtype) < 52
        if escalated:  # more elements of this call, paid from the escalation budget
            want = max(ESCALATED_SAMPLES, 8 * n) - per_out
            afford = int(min(self._budget, ESCALATED_CALL_CAP_US) // (cost * len(outs)))
            extra_n = max(0, min(want, afford))
            if extra_n:
                extra = []
                for k in outs:
                    numel = reference_outputs[k].numel()
                    more = sample_indices(self.seed, name, call_no, k, numel, extra_n, _priority(priority, k, numel),
                                          exclude=chosen[k])
                    extra += [(k, i) for i in more]
                self._budget -= cost * len(extra)
                s2, why3 = self._check(func, args, kwargs, device_outputs, reference_outputs, dtype, extra)
                samples += s2
                why = why3 or why
        return self._summarize(samples, why)

    def _eligible(self, ref: Reference, device_outputs, reference_outputs) -> tuple[list[int], str]:
        """Outputs the rule computes that both sides have, as floating tensors of one shape."""
        outs, why = [], ""
        for k in range(min(ref.outputs, len(device_outputs), len(reference_outputs))):
            d, r = device_outputs[k], reference_outputs[k]
            if not isinstance(d, torch.Tensor) or not isinstance(r, torch.Tensor):
                continue
            if not (d.is_floating_point() and r.is_floating_point()):
                why = why or f"output {k} is {d.dtype}: not a real floating result"
                continue
            if d.shape != r.shape:
                why = why or f"output {k}: device shape {tuple(d.shape)} != reference shape {tuple(r.shape)}"
                continue
            if r.numel():
                outs.append(k)
        if not outs and not why:
            why = f"no output of {ref.func} the reference rule computes (it covers outputs 0..{ref.outputs - 1})"
        return outs, why

    def _check(self, func, args, kwargs, device_outputs, reference_outputs, dtype, elements):
        samples, why = spot_check(func, args, kwargs, device_outputs, reference_outputs, dtype, elements,
                                  bits=self.bits)
        self.last += samples
        return samples, why

    def _run(self, func, args, kwargs, device_outputs, reference_outputs, dtype, elements, why) -> SpotStats:
        samples, why2 = self._check(func, args, kwargs, device_outputs, reference_outputs, dtype, elements)
        return self._summarize(samples, why2 or why)

    @staticmethod
    def _summarize(samples: list[Sample], why: str) -> SpotStats:
        if not samples:
            return SpotStats(reason=why or "no element could be checked")
        finite_dev = [s for s in samples if not math.isnan(s.device_err_ulp)]
        return SpotStats(
            samples=len(samples),
            ref_err_ulp=max(s.ref_err_ulp for s in samples),
            device_err_ulp=max((s.device_err_ulp for s in finite_dev), default=0.0),
            device_err_abs=max((s.device_err_abs for s in finite_dev), default=0.0),
            max_cancellation=max(s.cancellation for s in samples),
            trusted=all(s.trusted for s in samples),
        )
