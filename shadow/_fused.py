"""One fused pass over a device result and its float64 reference: every figure ``shadow.metrics.compare``
needs, from a single read of both (torch's passes, ``compare``'s path for what this one does not read, read each
output nine times); ``pair`` reads a result once for its drift and its local error together.

The figures follow ``shadow.metrics``'s definitions (docs/error-units.md) operation for operation, so that
maxima and counts equal the other paths' to the last bit: |y - r| is one rounding in either, and the ulp is
|y - r| times the inverse of the spacing unit, a power of two, which rounds exactly as the division by the
unit does. Sums are float64 within fixed-size chunks, the chunks' partials added in chunk order: the figures
do not depend on the thread count. A chunk of finite values takes a branch-free loop that the compiler
vectorizes (``_finite_chunk``; its sums are split over the vector lanes, so they agree with the index-order
sums to rounding), the others the full one (``_chunk``). Measured on an Intel Xeon (AVX-512), one thread:
about 0.6 ns per element for the first (1.0 to 1.2 with a bound, 1.9 when it divided at every element)
against 2.7 for the same loop unvectorized, and 2 to 8 for the second. Complex results stay on ``compare``'s
numpy path. A bound of ulps plus an operand term (``budgets.core.UlpsPlus``) is formed in the pass from the
term and r's bits (``_bound_at``), never written out.

The pass reads CPU memory: ``compare`` sends it references on the CPU only. A reference on a GPU
(``ShadowMode(shadow_device=...)``) is compared there with torch ops (``metrics._compare_torch``), and only the
figures come back; a device result beside a CPU reference is copied to the CPU first (``_on_cpu``).
"""

from __future__ import annotations

import functools
import math
import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

CHUNK = 1 << 15  # elements per partial; fixed, so that the sums' order never depends on the thread count
PARALLEL = 2 * CHUNK  # elements: one chunk runs on the calling thread (waking the others costs about a chunk)

# the figures, in their order in the array ``figures`` returns
(MAX_ABS, SUM_D2, SUM_R2, MAX_ULP, MAX_ULP_NONZERO, BUDGET,
 DEVICE, REFERENCE, MISMATCH, AGREED, ZERO) = range(11)
FIGURES = 11
_SUMS = (SUM_D2, SUM_R2, DEVICE, REFERENCE, MISMATCH, AGREED, ZERO)
_MAXES = (MAX_ABS, MAX_ULP, MAX_ULP_NONZERO, BUDGET)

_INF = np.inf


@intrinsic
def pointer(typingctx, address):
    """An address as a pointer, for numba.carray: tensors reach the kernel as data_ptr() rather than as numpy
    arrays (np.from_dlpack costs more than a 1k-element pass)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@intrinsic
def _bits(typingctx, x):
    """A float64's bits as an int64. For x >= 0 (never NaN) the integers order as the floats do: the maxima
    of the finite pass are integer maxima, which vectorize without reordering anything."""
    if not isinstance(x, types.Float) or x.bitwidth != 64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _float(typingctx, i):
    """The float64 whose bits are the int64 ``i``."""
    if not isinstance(i, types.Integer) or i.bitwidth != 64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@njit(inline="always")
def _inverse_unit(bits, emin):
    """1 / the spacing unit of compare at |r|, from r's bits: 2**(1023 - E) for r's exponent field E clamped
    at ``emin`` (the field of the dtype's smallest normal), written directly as the float64's bits, a subnormal
    for E >= 2046. A power of two, so d times it equals d / unit to the last bit, and no division is needed."""
    e = (bits >> 52) & 0x7FF
    e = e if e > emin else emin
    return _float((2046 - e) << 52 if e < 2046 else 1 << (2097 - e))


@njit(inline="always")
def _inverse_unit_finite(bits, emin):
    """``_inverse_unit`` where |r| < 2**1023, without the subnormal branch: what ``_finite_chunk`` computes,
    whose results stand only where every r * r is finite (a larger |r| overflows its sum, and ``_chunk``
    runs), a select and a shift per element fewer."""
    e = (bits >> 52) & 0x7FF
    return _float((2046 - (e if e > emin else emin)) << 52)


# error_model="numpy": x/0 is inf and 0/0 NaN, as in torch (numba's default raises ZeroDivisionError)
# how a bound's operand term is formed from t (and o), by ``budgets.core.UlpsPlus.op``
AS_IS, ABS, SQUARE, SUB, DIV, MUL = range(6)  # t, |t|, t * t, |t - o|, |t / o|, |t| * |o|
TERMS = {"": AS_IS, "abs": ABS, "square": SQUARE, "sub": SUB, "div": DIV, "mul": MUL}  # UlpsPlus.op -> code


@njit(inline="always")
def _bound_at(t, o, bits_i, scale, alpha, op, tiny):
    """Element i's bound from ``t`` = ``bound[i * step]`` (and ``o``, the other operand's element): t itself
    (``scale`` 0), else ``scale`` spacing units at r plus ``alpha`` times the term ``op`` forms (``TERMS``):
    max(2**floor(log2|r|), tiny) * scale + alpha * term, each operation rounded once and none fused into
    another, as ``budgets.core.UlpsPlus.tensor`` computes it with torch's passes."""
    if scale == 0.0:
        return t
    u = _float(bits_i & 0x7FF0000000000000)  # 2**floor(log2|r|); an infinity for a non-finite r
    if op == ABS:
        t = abs(t)
    elif op == SQUARE:
        t = t * t
    elif op == SUB:
        t = abs(t - o)
    elif op == DIV:
        t = abs(t / o)
    elif op == MUL:
        t = abs(t) * abs(o)
    return (u if u > tiny else tiny) * scale + (t if alpha == 1.0 else alpha * t)


@njit(error_model="numpy")
def _chunk(y, table, r, bits, bound, step, emin, scale, alpha, op, other, ostep, start, stop, out):
    """The figures of elements [start, stop) into ``out``. ``table`` decodes 16-bit formats read as their
    bits (None: y is float32/float64); ``bits`` is r read as int64; ``bound[i * step]`` is element i's bound,
    or with a ``scale`` its operand term, with ``other[i * ostep]`` (``_bound_at``) (step 0: one for all; an
    empty ``bound``: none);
    ``emin``: the float64 exponent field of the dtype's smallest normal, where the spacing unit stops
    shrinking."""
    judged = bound.shape[0] > 0
    tiny = _float(np.int64(emin) << 52)
    max_abs = sum_d2 = sum_r2 = max_ulp = max_ulp_nonzero = used = 0.0
    device = reference = mismatch = agreed = zero = 0
    for i in range(start, stop):
        a = np.float64(y[i]) if table is None else table[y[i]]
        b = r[i]
        d = abs(a - b)
        if not d < _INF:  # NaN or Inf in either (counted apart), or a finite difference that overflows (an error)
            fa, fb = abs(a) < _INF, abs(b) < _INF
            if not (fa and fb):
                if fb:
                    device += 1
                elif fa:
                    reference += 1
                elif a == b or (a != a and b != b):
                    agreed += 1
                else:
                    mismatch += 1
                continue
        max_abs = max(max_abs, d)
        sum_d2 += d * d
        sum_r2 += b * b
        ulp = d * _inverse_unit(bits[i], emin)
        max_ulp = max(max_ulp, ulp)
        if b == 0.0 and d != 0.0 and d < _INF:
            zero += 1
        elif d < _INF:
            max_ulp_nonzero = max(max_ulp_nonzero, ulp)
        if judged:
            q = abs(d / _bound_at(bound[i * step], other[i * ostep], bits[i], scale, alpha, op, tiny))  # 0/0: NaN
            if q > used:
                used = q
    out[MAX_ABS], out[SUM_D2], out[SUM_R2], out[MAX_ULP], out[MAX_ULP_NONZERO], out[BUDGET] = \
        max_abs, sum_d2, sum_r2, max_ulp, max_ulp_nonzero, used
    out[DEVICE], out[REFERENCE], out[MISMATCH], out[AGREED], out[ZERO] = device, reference, mismatch, agreed, zero


@njit(inline="always")
def _finite_at(y, table, r, bits, i, emin, sum_d2, sum_r2, max_abs, max_ulp, max_ulp_nonzero, zero):
    """``_finite_chunk``'s figures with element i added: |y - r| at i, and the sums, the maxima (as the bits of
    non-negative floats, which order as integers) and the count."""
    a = np.float64(y[i]) if table is None else table[y[i]]
    b = r[i]
    d = abs(a - b)
    sum_d2 += d * d
    sum_r2 += b * b
    k = _bits(d)
    max_abs = k if k > max_abs else max_abs
    k = _bits(d * _inverse_unit_finite(bits[i], emin))
    max_ulp = k if k > max_ulp else max_ulp
    zero += 1 if b == 0.0 and d != 0.0 else 0
    k = k if b != 0.0 else 0
    max_ulp_nonzero = k if k > max_ulp_nonzero else max_ulp_nonzero
    return d, sum_d2, sum_r2, max_abs, max_ulp, max_ulp_nonzero, zero


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma)."""
    if not all(isinstance(x, types.Float) and x.bitwidth == 64 for x in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float64(types.float64, types.float64, types.float64), codegen


BLOCK = 256  # elements whose budget quotients are tested together against the largest so far


# reassoc: the sums may be split over the vector lanes (in an order fixed by the compiled loop, whatever the
# thread count); nothing else is reordered, and no product is fused into an add
@njit(error_model="numpy", fastmath={"reassoc"})
def _finite_chunk(y, table, r, bits, bound, step, emin, scale, alpha, op, other, ostep, start, stop, out,
                  extra=None, extra_bits=None, extra_out=None):
    """``_chunk``'s figures of elements [start, stop) where every element is finite, in loops without
    branches that the compiler vectorizes: False, and ``out`` untouched, where one is not (a NaN or an
    infinity on either side, or a square that overflows, makes a sum non-finite), and ``_chunk`` must run.
    The same operations: every maximum and count equals ``_chunk``'s, the sums agree to rounding. The
    arrays are sliced to the chunk first: indices from 0 need no negative-index test, which kept the
    compiler from vectorizing the loop; a one-element bound or operand is repeated over a block, for the
    same reason (a stride only known at run time).

    With a bound, the budget use max |d / bound| takes a division per element, which costs more than the
    rest of the loop. The loop divides only in a BLOCK where some element may exceed the largest quotient
    so far, ``used``: fma(used, bound, -d) > 0 rounds a positive exact used * bound - d, so d / bound < used
    and its rounding is at most used; any other sign, NaN included, divides. A d of 0 never does (its
    quotient is 0 or NaN, which the maximum ignores): exact results would divide every block while used is 0.
    The largest quotient is the same float, since rounding is monotonic.

    ``extra`` (None, or a second reference with its bits): its figures without a bound into ``extra_out``, from
    the same read of y (a result's drift beside its local error, ``_serial_pair``); False where either is not
    finite. None compiles the loops without it."""
    judged = bound.shape[0] > 0
    tiny = _float(np.int64(emin) << 52)
    y, r, bits = y[start:stop], r[start:stop], bits[start:stop]
    n = r.shape[0]
    sum_d2 = sum_r2 = 0.0
    max_abs = max_ulp = max_ulp_nonzero = zero = 0
    used = 0.0
    x_d2 = x_r2 = 0.0
    x_abs = x_ulp = x_ulp_nonzero = x_zero = 0
    if extra is not None:
        xs, xbits = extra[start:stop], extra_bits[start:stop]
    if not judged:
        for i in range(n):
            d, sum_d2, sum_r2, max_abs, max_ulp, max_ulp_nonzero, zero = _finite_at(
                y, table, r, bits, i, emin, sum_d2, sum_r2, max_abs, max_ulp, max_ulp_nonzero, zero)
            if extra is not None:
                _, x_d2, x_r2, x_abs, x_ulp, x_ulp_nonzero, x_zero = _finite_at(
                    y, table, xs, xbits, i, emin, x_d2, x_r2, x_abs, x_ulp, x_ulp_nonzero, x_zero)
    else:
        bound = bound[start:stop] if step else np.full(BLOCK, bound[0])
        other = other[start:stop] if ostep else np.full(BLOCK, other[0])
        for s in range(0, n, BLOCK):
            yb, rb, bb = y[s:s + BLOCK], r[s:s + BLOCK], bits[s:s + BLOCK]
            m = rb.shape[0]
            tb = bound[s:s + BLOCK] if step else bound[:m]
            ob = other[s:s + BLOCK] if ostep else other[:m]
            if extra is not None:
                xb, xbb = xs[s:s + BLOCK], xbits[s:s + BLOCK]
            late = 0
            for i in range(m):
                d, sum_d2, sum_r2, max_abs, max_ulp, max_ulp_nonzero, zero = _finite_at(
                    yb, table, rb, bb, i, emin, sum_d2, sum_r2, max_abs, max_ulp, max_ulp_nonzero, zero)
                t = _bound_at(tb[i], ob[i], bb[i], scale, alpha, op, tiny)
                late += 0 if (d == 0.0) | (_fma(used, t, -d) > 0.0) else 1
                if extra is not None:
                    _, x_d2, x_r2, x_abs, x_ulp, x_ulp_nonzero, x_zero = _finite_at(
                        yb, table, xb, xbb, i, emin, x_d2, x_r2, x_abs, x_ulp, x_ulp_nonzero, x_zero)
            if late:
                for i in range(m):
                    a = np.float64(yb[i]) if table is None else table[yb[i]]
                    q = abs(abs(a - rb[i]) / _bound_at(tb[i], ob[i], bb[i], scale, alpha, op, tiny))  # 0/0: NaN
                    used = q if q > used else used
    if not (sum_d2 < _INF and sum_r2 < _INF):
        return False
    if extra is not None:
        if not (x_d2 < _INF and x_r2 < _INF):
            return False
        _finite_figures(extra_out, x_abs, x_d2, x_r2, x_ulp, x_ulp_nonzero, 0.0, x_zero)
    _finite_figures(out, max_abs, sum_d2, sum_r2, max_ulp, max_ulp_nonzero, used, zero)
    return True


@njit(inline="always")
def _finite_figures(out, max_abs, sum_d2, sum_r2, max_ulp, max_ulp_nonzero, used, zero):
    """``_finite_chunk``'s figures into ``out`` (the maxima as their bits)."""
    out[MAX_ABS], out[SUM_D2], out[SUM_R2], out[MAX_ULP], out[MAX_ULP_NONZERO], out[BUDGET] = \
        _float(max_abs), sum_d2, sum_r2, _float(max_ulp), _float(max_ulp_nonzero), used
    out[DEVICE] = out[REFERENCE] = out[MISMATCH] = out[AGREED] = 0
    out[ZERO] = zero


@njit
def _arrays(y_address, y_like, table, r_address, bound_address, n, n_bound, other_address, n_other):
    """The kernel's views of the tensors' memory (which the caller keeps alive), and the steps of the bound and
    of the other operand. The bound is an array even where there is none (then empty), and so is the other
    operand (then the bound again): an optional array inside a parallel loop was sometimes read as None by
    numba's worker threads (a budget use of 0 where the serial pass found 2**25)."""
    y = numba.carray(pointer(y_address), n, y_like.dtype)
    r, bits = _reference(r_address, n)
    bound = numba.carray(pointer(bound_address), n_bound, np.float64)
    other = numba.carray(pointer(other_address), n_other, np.float64)
    return y, r, bits, bound, 0 if n_bound == 1 else 1, other, 0 if n_other == 1 else 1


@njit
def _reference(address, n):
    """A float64 reference's view of its memory, as values and as their bits."""
    return numba.carray(pointer(address), n, np.float64), numba.carray(pointer(address), n, np.int64)


@njit
def _one_chunk(y, table, r, bits, bound, step, emin, scale, alpha, op, other, ostep, start, stop, out):
    """The figures of elements [start, stop): the finite loop, else the full one."""
    if not _finite_chunk(y, table, r, bits, bound, step, emin, scale, alpha, op, other, ostep, start, stop, out):
        _chunk(y, table, r, bits, bound, step, emin, scale, alpha, op, other, ostep, start, stop, out)


@njit
def _pair_chunk(y, table, lo, lbits, bound, step, emin, scale, alpha, op, other, ostep, r, rbits, start, stop, parts):
    """``_one_chunk`` of y against ``lo`` (with the bound) into parts[0] and against ``r`` (without) into parts[1],
    from one read of y where both are finite."""
    if not _finite_chunk(y, table, lo, lbits, bound, step, emin, scale, alpha, op, other, ostep, start, stop,
                         parts[0], r, rbits, parts[1]):
        _chunk(y, table, lo, lbits, bound, step, emin, scale, alpha, op, other, ostep, start, stop, parts[0])
        _chunk(y, table, r, rbits, bound[:0], step, emin, 0.0, 1.0, 0, other, ostep, start, stop, parts[1])


@njit
def _combine(parts):
    """The chunks' partials in chunk order: the same sums whichever thread computed which chunk."""
    total = parts[0].copy()
    for c in range(1, parts.shape[0]):
        for k in _SUMS:
            total[k] += parts[c, k]
        for k in _MAXES:
            total[k] = max(total[k], parts[c, k])
    return total


def joined(parts: list[list[float]]) -> list[float]:
    """FIGURES lists of consecutive parts of one result joined in their order, as ``_combine`` joins chunks."""
    total = list(parts[0])
    for f in parts[1:]:
        for k in _SUMS:
            total[k] += f[k]
        for k in _MAXES:
            total[k] = max(total[k], f[k])
    return total


def _serial_pass(y_address, y_like, table, r_address, bound_address, n, n_bound, emin, scale, alpha, op, other_address,
                 n_other):
    y, r, bits, bound, step, other, ostep = _arrays(y_address, y_like, table, r_address, bound_address, n, n_bound,
                                                    other_address, n_other)
    parts = np.empty(((n + CHUNK - 1) // CHUNK, FIGURES))
    for c in range(parts.shape[0]):
        _one_chunk(y, table, r, bits, bound, step, emin, scale, alpha, op, other, ostep, c * CHUNK,
                   min(n, (c + 1) * CHUNK), parts[c])
    return _combine(parts)


def _parallel_pass(y_address, y_like, table, r_address, bound_address, n, n_bound, emin, scale, alpha, op, other_address,
                   n_other):
    y, r, bits, bound, step, other, ostep = _arrays(y_address, y_like, table, r_address, bound_address, n, n_bound,
                                                    other_address, n_other)
    parts = np.empty(((n + CHUNK - 1) // CHUNK, FIGURES))
    for c in prange(parts.shape[0]):
        _one_chunk(y, table, r, bits, bound, step, emin, scale, alpha, op, other, ostep, c * CHUNK,
                   min(n, (c + 1) * CHUNK), parts[c])
    return _combine(parts)


def _serial_pair(y_address, y_like, table, r_address, lo_address, bound_address, n, n_bound, emin, scale, alpha, op,
                 other_address, n_other):
    """``_serial_pass`` against ``lo`` (with the bound) and against ``r`` (without), from one read of y."""
    y, lo, lbits, bound, step, other, ostep = _arrays(y_address, y_like, table, lo_address, bound_address, n, n_bound,
                                                      other_address, n_other)
    r, rbits = _reference(r_address, n)
    parts = np.empty(((n + CHUNK - 1) // CHUNK, 2, FIGURES))
    for c in range(parts.shape[0]):
        _pair_chunk(y, table, lo, lbits, bound, step, emin, scale, alpha, op, other, ostep, r, rbits, c * CHUNK,
                    min(n, (c + 1) * CHUNK), parts[c])
    return _combine(parts[:, 0]), _combine(parts[:, 1])


def _parallel_pair(y_address, y_like, table, r_address, lo_address, bound_address, n, n_bound, emin, scale, alpha, op,
                   other_address, n_other):
    y, lo, lbits, bound, step, other, ostep = _arrays(y_address, y_like, table, lo_address, bound_address, n, n_bound,
                                                      other_address, n_other)
    r, rbits = _reference(r_address, n)
    parts = np.empty(((n + CHUNK - 1) // CHUNK, 2, FIGURES))
    for c in prange(parts.shape[0]):
        _pair_chunk(y, table, lo, lbits, bound, step, emin, scale, alpha, op, other, ostep, r, rbits, c * CHUNK,
                    min(n, (c + 1) * CHUNK), parts[c])
    return _combine(parts[:, 0]), _combine(parts[:, 1])


@njit
def _spacing_chunk(bits, out, tiny, scale, start, stop):
    """``metrics.spacing`` of elements [start, stop): r's exponent bits (2**floor(log2|r|); an infinity for a
    non-finite r), at least ``tiny``, times ``scale``; the same three operations as its torch path, in one pass."""
    bits, out = bits[start:stop], out[start:stop]
    for i in range(bits.shape[0]):
        v = _float(bits[i] & 0x7FF0000000000000)
        out[i] = (v if v > tiny else tiny) * scale


@njit
def _spacing_arrays(r_address, out_address, n):
    """The spacing's views of the tensors' memory: r's bits, and the result."""
    return numba.carray(pointer(r_address), n, np.int64), numba.carray(pointer(out_address), n, np.float64)


def _serial_spacing(r_address, out_address, n, tiny, scale):
    bits, out = _spacing_arrays(r_address, out_address, n)
    for c in range((n + CHUNK - 1) // CHUNK):
        _spacing_chunk(bits, out, tiny, scale, c * CHUNK, min(n, (c + 1) * CHUNK))


def _parallel_spacing(r_address, out_address, n, tiny, scale):
    bits, out = _spacing_arrays(r_address, out_address, n)
    for c in prange((n + CHUNK - 1) // CHUNK):
        _spacing_chunk(bits, out, tiny, scale, c * CHUNK, min(n, (c + 1) * CHUNK))


class Passes:
    """Kernels as (serial, parallel) pairs of plain functions, compiled at their first call for each input type:
    two functions each, not one jitted twice, since numba's cache tells entries apart by function, not by the
    parallel flag. ``run(i, args, n)`` runs pair ``i``, the parallel one above PARALLEL elements."""

    def __init__(self, *pairs: tuple) -> None:
        self.pairs = pairs
        self.compiled = self._compile(True)

    def _compile(self, cache: bool) -> list[tuple]:
        try:
            return [(njit(cache=cache)(serial), njit(cache=cache, parallel=True)(parallel))
                    for serial, parallel in self.pairs]
        except RuntimeError:  # numba: "no locator available": no writable cache directory; compile each process
            return self._compile(False)

    def run(self, which: int, args: tuple, n: int):
        try:
            return _call(*self.compiled[which], args, n)
        except OSError:  # numba could not write its cache (disk full, directory gone since import): compile without
            self.compiled = self._compile(False)
            return _call(*self.compiled[which], args, n)


_parallel_lock = threading.Lock()  # one parallel pass at a time (numba's workqueue layer is not thread-safe)
_COMPARISON, _SPACING, _PAIR = range(3)  # the passes of _passes
_passes = Passes((_serial_pass, _parallel_pass), (_serial_spacing, _parallel_spacing), (_serial_pair, _parallel_pair))


def _decode_table(dtype: torch.dtype) -> np.ndarray:
    """float64 value of each 16-bit pattern of ``dtype``, by torch's own (exact) conversion."""
    bits = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16))
    return bits.view(dtype).to(torch.float64).numpy()


# how the kernel reads each device dtype: (an empty array of the dtype it reads, the table decoding it)
_READ = {torch.float32: (np.empty(0, np.float32), None), torch.float64: (np.empty(0, np.float64), None),
         torch.bfloat16: (np.empty(0, np.uint16), _decode_table(torch.bfloat16)),
         torch.float16: (np.empty(0, np.uint16), _decode_table(torch.float16))}


@functools.cache
def _exponent_field(tiny: float) -> int:
    """The float64 exponent field of ``tiny`` (a dtype's smallest normal, a power of two): below it compare's
    spacing unit is the subnormal spacing, ``tiny`` itself (``_inverse_unit``)."""
    return math.frexp(tiny)[1] - 1 + 1023


def _on_cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t itself where it is a contiguous CPU tensor of ``dtype``; else a copy that is. (``is_cpu``: ``device``
    builds a torch.device, four times the cost, and this is asked twice per comparison.)"""
    if t.is_cpu and t.dtype == dtype and t.is_contiguous() and not t.is_neg():
        return t
    if not t.is_cpu or t.dtype != dtype:
        t = t.detach().to(device="cpu", dtype=dtype)
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def figures(y: torch.Tensor, r: torch.Tensor, bound: torch.Tensor | None, tiny: float, scale: float = 0.0,
            alpha: float = 1.0, op: str = "", other: torch.Tensor | None = None) -> list[float]:
    """The FIGURES of device result ``y`` against reference ``r`` (same shape, real), in units whose spacing
    floor is ``tiny`` (the dtype's smallest normal); ``bound`` broadcastable to r, or None. With a ``scale``,
    ``bound`` is an operand term t (and ``other`` a second operand o, both broadcastable to r) and the bound
    is max(2**floor(log2|r|), tiny) * scale + alpha * the term ``op`` forms (``TERMS``), formed where r is
    read (``_bound_at``). Python floats, in the order of FIGURES."""
    y, read = _result(y)
    r = _on_cpu(r, torch.float64)
    n = r.numel()
    bound, n_bound, other, n_other = _operands(r, bound, other)
    return _passes.run(_COMPARISON, (y.data_ptr(), read[0], read[1], r.data_ptr(), bound.data_ptr(), n, n_bound,
                                     _exponent_field(tiny), float(scale), float(alpha), TERMS[op], other.data_ptr(),
                                     n_other), n).tolist()


def pair(y: torch.Tensor, r: torch.Tensor, lo: torch.Tensor, bound: torch.Tensor | None, tiny: float,
         scale: float = 0.0, alpha: float = 1.0, op: str = "", other: torch.Tensor | None = None
         ) -> tuple[list[float], list[float]]:
    """(``figures(y, r, None, tiny)``, ``figures(y, lo, bound, tiny, scale, alpha, op, other)``) from one read of
    y: a result's drift and its local error (the sums agree with the two passes' to rounding, the rest exactly)."""
    y, read = _result(y)
    r, lo = _on_cpu(r, torch.float64), _on_cpu(lo, torch.float64)
    n = r.numel()
    bound, n_bound, other, n_other = _operands(lo, bound, other)
    local, drift = _passes.run(_PAIR, (y.data_ptr(), read[0], read[1], r.data_ptr(), lo.data_ptr(), bound.data_ptr(), n,
                             n_bound, _exponent_field(tiny), float(scale), float(alpha), TERMS[op], other.data_ptr(),
                             n_other), n)
    return drift.tolist(), local.tolist()


def _result(y: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """A device result as the passes read it, and how (``_READ``): another floating dtype (float8) as float64."""
    read = _READ.get(y.dtype)
    if read is None:
        y, read = y.to(torch.float64), _READ[torch.float64]
    return _on_cpu(y, y.dtype), read


def _operands(r: torch.Tensor, bound: torch.Tensor | None, other: torch.Tensor | None
              ) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """(bound, its size, other operand, its size) as the passes read them (``_whole``; r itself and a size of 0
    where there is no bound). The caller holds them while the pass reads their memory."""
    if bound is None:
        return r, 0, r, r.numel()
    bound = _whole(bound, r)
    other = bound if other is None else _whole(other, r)
    return bound, bound.numel(), other, other.numel()


def _whole(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A bound or an operand as the pass reads it: one element, or r's shape (broadcast ones made whole: rare),
    contiguous float64 on the CPU."""
    if t.numel() != 1:
        t = torch.broadcast_to(t, r.shape)
    return _on_cpu(t, torch.float64)


SMALL = 64  # elements: up to this many, torch's passes cost less than setting up a kernel call


def readable(t: torch.Tensor) -> bool:
    """Whether the passes can read ``t``'s memory as it is: a contiguous float64 CPU tensor without a pending
    negation (the tensors they take by ``data_ptr()``; ``figures`` copies the others, the rest refuse them)."""
    return t.device.type == "cpu" and t.dtype == torch.float64 and t.is_contiguous() and not t.is_neg()


def spacing(r: torch.Tensor, out: torch.Tensor | None, tiny: float, scale: float) -> torch.Tensor | None:
    """``metrics.spacing`` into ``out`` (r's size; a new tensor where None): max(2**floor(log2|r|), tiny) *
    scale, one read and one write where torch's path makes three passes. None where the pass cannot read r or
    out (``readable``), or r has at most SMALL elements."""
    if r.numel() <= SMALL or not readable(r) or (out is not None and not readable(out)):
        return None
    out = torch.empty_like(r) if out is None else out
    _passes.run(_SPACING, (r.data_ptr(), out.data_ptr(), r.numel(), tiny, scale), r.numel())
    return out


def _call(serial, parallel, args: tuple, n: int):
    if n >= PARALLEL and _parallel_lock.acquire(blocking=False):
        try:
            numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
            return parallel(*args)
        finally:
            _parallel_lock.release()
    return serial(*args)
