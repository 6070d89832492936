"""One-pass kernels of the error budgets, beside the comparison's (``shadow._fused``, whose machinery they use):
the largest bound / |r| (the spot check's element), |a| * scale + offset (an elementwise bound), a matrix's
sums of squares along its rows and down its columns (a matmul's bound), and the bounds of a fused Adam(W) step
(``budgets.optimizer``). Each gives torch's values (the same bits, or the same sums to rounding) from one read
where torch's path makes two or three; the Adam(W) step's, from one read of its inputs where the ``Rounded``
chain of ``budgets.optimizer.adam_step`` runs some forty torch operations over each parameter-sized tensor.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from ._fused import CHUNK, SMALL, Passes, pointer, readable

_INF = np.inf


@njit(error_model="numpy")
def _largest_chunk(bound, step, r, start, stop, out):
    """The first position of the largest ``bound[i * step] / |r[i]|`` in [start, stop) and its value into
    ``out`` (NaN never the largest; position -1 where every quotient is NaN)."""
    best, at = -_INF, -1
    for i in range(start, stop):
        q = bound[i * step] / abs(r[i])
        if q > best:
            best, at = q, i
    out[0], out[1] = best, at


@njit
def _largest_of(parts):
    """The chunks' winners in chunk order: the first of equal values, whichever thread found which."""
    best, at = -_INF, -1.0
    for c in range(parts.shape[0]):
        if parts[c, 1] >= 0 and (at < 0 or parts[c, 0] > best):
            best, at = parts[c, 0], parts[c, 1]
    return int(at)


@njit
def _largest_arrays(bound_address, n_bound, r_address, n):
    """The largest quotient's views of the tensors' memory, the bound's step, and the chunks' partials."""
    bound = numba.carray(pointer(bound_address), n_bound, np.float64)
    r = numba.carray(pointer(r_address), n, np.float64)
    return bound, 0 if n_bound == 1 else 1, r, np.empty(((n + CHUNK - 1) // CHUNK, 2))


def _serial_largest(bound_address, n_bound, r_address, n):
    bound, step, r, parts = _largest_arrays(bound_address, n_bound, r_address, n)
    for c in range(parts.shape[0]):
        _largest_chunk(bound, step, r, c * CHUNK, min(n, (c + 1) * CHUNK), parts[c])
    return _largest_of(parts)


def _parallel_largest(bound_address, n_bound, r_address, n):
    bound, step, r, parts = _largest_arrays(bound_address, n_bound, r_address, n)
    for c in prange(parts.shape[0]):
        _largest_chunk(bound, step, r, c * CHUNK, min(n, (c + 1) * CHUNK), parts[c])
    return _largest_of(parts)


@njit
def _magnitude_chunk(a, out, scale, offset, start, stop):
    """Elements [start, stop) of |a| * scale + offset: a loop the compiler vectorizes; every operation rounds
    once as torch's does, none is fused into another."""
    a, out = a[start:stop], out[start:stop]
    for i in range(out.shape[0]):
        out[i] = abs(a[i]) * scale + offset


@njit
def _magnitude_arrays(a_address, out_address, n):
    """The magnitude's views of the tensors' memory."""
    return numba.carray(pointer(a_address), n, np.float64), numba.carray(pointer(out_address), n, np.float64)


def _serial_magnitude(a_address, out_address, n, scale, offset):
    a, out = _magnitude_arrays(a_address, out_address, n)
    for c in range((n + CHUNK - 1) // CHUNK):
        _magnitude_chunk(a, out, scale, offset, c * CHUNK, min(n, (c + 1) * CHUNK))


def _parallel_magnitude(a_address, out_address, n, scale, offset):
    a, out = _magnitude_arrays(a_address, out_address, n)
    for c in prange((n + CHUNK - 1) // CHUNK):
        _magnitude_chunk(a, out, scale, offset, c * CHUNK, min(n, (c + 1) * CHUNK))


ROW_BLOCKS = 16  # row blocks of the sums of squares: fixed, so that their order never depends on the thread count


@njit(error_model="numpy", fastmath={"reassoc"})
def _squares_block(a, rows, part, start, stop):
    """Rows [start, stop) of the matrix ``a``: each row's sum of squares into ``rows``, and the sums of their
    squares down each column into ``part``. One read; the row sums split over the vector lanes."""
    part[:] = 0.0
    for i in range(start, stop):
        s = 0.0
        for k in range(a.shape[1]):
            v = a[i, k] * a[i, k]
            s += v
            part[k] += v
        rows[i] = s


@njit
def _squares_arrays(a_address, m, k, rows_address, cols_address):
    """The sums of squares' views of the tensors' memory, the row block's length, and the blocks' partials."""
    return (numba.carray(pointer(a_address), (m, k), np.float64), numba.carray(pointer(rows_address), m, np.float64),
            numba.carray(pointer(cols_address), k, np.float64), (m + ROW_BLOCKS - 1) // ROW_BLOCKS,
            np.empty((ROW_BLOCKS, k)))


@njit
def _squares_combine(parts, cols):
    """The blocks' column sums in block order: the same sums whichever thread computed which block."""
    cols[:] = parts[0]
    for b in range(1, parts.shape[0]):
        for k in range(cols.shape[0]):
            cols[k] += parts[b, k]


def _serial_squares(a_address, m, k, rows_address, cols_address):
    a, rows, cols, step, parts = _squares_arrays(a_address, m, k, rows_address, cols_address)
    for b in range(ROW_BLOCKS):
        _squares_block(a, rows, parts[b], min(m, b * step), min(m, (b + 1) * step))
    _squares_combine(parts, cols)


def _parallel_squares(a_address, m, k, rows_address, cols_address):
    a, rows, cols, step, parts = _squares_arrays(a_address, m, k, rows_address, cols_address)
    for b in prange(ROW_BLOCKS):
        _squares_block(a, rows, parts[b], min(m, b * step), min(m, (b + 1) * step))
    _squares_combine(parts, cols)


# --- the fused Adam(W) step's bounds: ``budgets.optimizer.adam_step`` on ``budgets.rounded.Rounded`` values, one
# element at a time. A value is a pair (v, e), an exact input (v, 0.0); each operation is Rounded's, its operands
# in the same order, so that every bound is the torch chain's to the bit wherever torch's float64 square root rounds
# correctly (its vectorized CPU kernel is an ulp off on some inputs; this one is not): tests hold the two within
# 2**-50 relative.
@njit(inline="always")
def _new(v, e, ua):
    return v, e + ua * abs(v)


@njit(inline="always")
def _add(a, b, ua):
    return _new(a[0] + b[0], a[1] + b[1], ua)


@njit(inline="always")
def _sub(a, b, ua):
    return _new(a[0] - b[0], a[1] + b[1], ua)


@njit(inline="always")
def _mul(a, b, ua):
    return _new(a[0] * b[0], a[1] * abs(b[0]) + abs(a[0]) * b[1], ua)


@njit(inline="always")
def _div(a, b, ua):
    q = a[0] / b[0]
    return _new(q, (a[1] + abs(q) * b[1]) / abs(b[0]), ua)


@njit(inline="always")
def _sqrt(a, ua):
    r = np.sqrt(a[0])
    return r, np.fmin(a[1] / (2 * r), np.sqrt(a[1])) + ua * r


@njit(inline="always")
def _maximum(a, b):
    """torch.maximum of the values and of the errors: NaN where either is."""
    if a[0] != a[0] or b[0] != b[0]:
        v = np.nan
    else:
        v = max(a[0], b[0])
    if a[1] != a[1] or b[1] != b[1]:
        return v, np.nan
    return v, max(a[1], b[1])


# the constants of a step, each as the kernel holds it (value, error): the rows of ``adam``'s table
ADAM_CONSTANTS = ("decay", "weight_decay", "w", "beta2", "one_minus_beta2", "correction2", "eps", "step", "scale")
(_K_DECAY, _K_WD, _K_W, _K_BETA2, _K_ONE_MINUS_BETA2, _K_CORRECTION2, _K_EPS, _K_STEP, _K_SCALE) = \
    range(len(ADAM_CONSTANTS))
# the step's branches, each passed as True or None: numba compiles the loop once per combination, the branches
# that do not hold pruned (``is None`` of an argument), so that it vectorizes (about 9 ns an element on one
# thread, against 18 with the branches in the loop)
ADAM_FLAGS = ("scaled", "maximize", "decoupled", "coupled", "near", "amsgrad")


@njit(error_model="numpy")
def _adam_chunk(ins, outs, k, scaled, maximize, decoupled, coupled, near, amsgrad, ua, u_store, start, stop):
    """Elements [start, stop) of the step's inputs (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq in ``ins``)
    into the bounds of what it writes (the same places of ``outs``; the grad's where it is unscaled, the max's under
    amsgrad): ``adam_step``'s operations in its order, then ``Rounded.bound``'s last rounding (``u_store``).
    ``decoupled``: AdamW's weight decay; ``coupled``: Adam's; ``near``: the lerp from its nearer end."""
    decay, wd, w = (k[_K_DECAY, 0], k[_K_DECAY, 1]), (k[_K_WD, 0], k[_K_WD, 1]), (k[_K_W, 0], k[_K_W, 1])
    one_minus_w = _sub((1.0, 0.0), w, ua)
    beta2, one_minus_beta2 = (k[_K_BETA2, 0], k[_K_BETA2, 1]), (k[_K_ONE_MINUS_BETA2, 0], k[_K_ONE_MINUS_BETA2, 1])
    correction2, eps = (k[_K_CORRECTION2, 0], k[_K_CORRECTION2, 1]), (k[_K_EPS, 0], k[_K_EPS, 1])
    step, scale = (k[_K_STEP, 0], k[_K_STEP, 1]), (k[_K_SCALE, 0], k[_K_SCALE, 1])
    for i in range(start, stop):
        p, g, m, v = (ins[0][i], 0.0), (ins[1][i], 0.0), (ins[2][i], 0.0), (ins[3][i], 0.0)
        if scaled is not None:
            g = _div(g, scale, ua)
            outs[1][i] = g[1] + u_store * abs(g[0])
        if maximize is not None:
            g = (-g[0], g[1])
        if decoupled is not None:
            p = _mul(p, decay, ua)
        if coupled is not None:
            g = _add(g, _mul(p, wd, ua), ua)
        if near is not None:
            m = _add(m, _mul(w, _sub(g, m, ua), ua), ua)
        else:
            m = _sub(g, _mul(_sub(g, m, ua), one_minus_w, ua), ua)
        v = _add(_mul(v, beta2, ua), _mul(_mul(one_minus_beta2, g, ua), g, ua), ua)
        if amsgrad is not None:
            vmax = _maximum((ins[4][i], 0.0), v)
            outs[4][i] = vmax[1] + u_store * abs(vmax[0])
            r = _sqrt(vmax, ua)
        else:
            r = _sqrt(v, ua)
        denom = _add(_div(r, correction2, ua), eps, ua)
        p = _add(p, _div(_mul(step, m, ua), denom, ua), ua)
        outs[0][i] = p[1] + u_store * abs(p[0])
        outs[2][i] = m[1] + u_store * abs(m[0])
        outs[3][i] = v[1] + u_store * abs(v[0])


@njit
def _row(address, n):
    return numba.carray(pointer(address), n if address else 0, np.float64)


@njit
def _adam_arrays(a, b, n):
    """The step's views of the tensors' memory (an absent one, address 0, as an empty array)."""
    return ((_row(a[0], n), _row(a[1], n), _row(a[2], n), _row(a[3], n), _row(a[4], n)),
            (_row(b[0], n), _row(b[1], n), _row(b[2], n), _row(b[3], n), _row(b[4], n)))


def _serial_adam(in_addresses, out_addresses, n, k, scaled, maximize, decoupled, coupled, near, amsgrad, ua,
                 u_store):
    ins, outs = _adam_arrays(in_addresses, out_addresses, n)
    for c in range((n + CHUNK - 1) // CHUNK):
        _adam_chunk(ins, outs, k, scaled, maximize, decoupled, coupled, near, amsgrad, ua, u_store, c * CHUNK,
                    min(n, (c + 1) * CHUNK))


def _parallel_adam(in_addresses, out_addresses, n, k, scaled, maximize, decoupled, coupled, near, amsgrad, ua,
                   u_store):
    ins, outs = _adam_arrays(in_addresses, out_addresses, n)
    for c in prange((n + CHUNK - 1) // CHUNK):
        _adam_chunk(ins, outs, k, scaled, maximize, decoupled, coupled, near, amsgrad, ua, u_store, c * CHUNK,
                    min(n, (c + 1) * CHUNK))


_LARGEST, _MAGNITUDE, _SQUARES, _ADAM = range(4)  # the passes of _passes
_passes = Passes((_serial_largest, _parallel_largest), (_serial_magnitude, _parallel_magnitude),
                 (_serial_squares, _parallel_squares), (_serial_adam, _parallel_adam))


def largest_ratio(bound: torch.Tensor, r: torch.Tensor) -> int | None:
    """The first flat position of the largest bound / |r| (NaN never the largest; -1 if every quotient is
    NaN): one read of each, where the torch path writes |r|, then the quotient, then reads it for argmax.
    None where the pass cannot read them (``readable``), or ``bound`` has neither r's shape nor one element."""
    if not (readable(r) and readable(bound) and (bound.shape == r.shape or bound.numel() == 1)):
        return None
    return _passes.run(_LARGEST, (bound.data_ptr(), bound.numel(), r.data_ptr(), r.numel()), r.numel())


def magnitude(a: torch.Tensor, out: torch.Tensor, scale: float = 1.0, offset: float = 0.0) -> bool:
    """|a| * scale + offset into ``out`` in one pass, where torch makes three: the same values, bit for bit.
    False, and ``out`` untouched, where the pass cannot read the tensors (``readable``, both of one size) or they
    have at most SMALL elements."""
    n = out.numel()
    if n <= SMALL or not all(readable(t) and t.numel() == n for t in (a, out)):
        return False
    _passes.run(_MAGNITUDE, (a.data_ptr(), out.data_ptr(), n, scale, offset), n)
    return True


def squares(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The squares of the matrix ``t`` summed along its rows and down its columns, as t.square().sum(-1,
    keepdim=True) and t.square().sum(-2, keepdim=True) to rounding: one read, where torch reads t once per sum
    and squares a strided t into a temporary first (a matmul's bound reads each operand both ways). None where
    the pass cannot read t (2-D, ``readable`` as it is or transposed) or t has at most SMALL elements."""
    if t.dim() != 2 or t.numel() <= SMALL:
        return None
    by_rows = readable(t)
    if not by_rows and not readable(t.T):
        return None
    a = t if by_rows else t.T  # a contiguous matrix: its row sums are t's along rows where by_rows, else down
    rows, cols = torch.empty(a.shape[0], dtype=torch.float64), torch.empty(a.shape[1], dtype=torch.float64)
    _passes.run(_SQUARES, (a.data_ptr(), a.shape[0], a.shape[1], rows.data_ptr(), cols.data_ptr()), a.numel())
    along, down = (rows, cols) if by_rows else (cols, rows)
    return along.unsqueeze(1), down.unsqueeze(0)


def adam(ins: list, outs: list, constants: dict, flags: set, ua: float, u_store: float) -> bool:
    """The bounds of a fused Adam(W) step on one parameter into ``outs``, from one read of ``ins`` (param, grad,
    exp_avg, exp_avg_sq, max_exp_avg_sq; outs in the same places: param's, exp_avg's and exp_avg_sq's always, the
    grad's where ``scaled``, the max's where ``amsgrad``; None where absent): ``constants`` by the names of
    ADAM_CONSTANTS as (value, error) pairs, ``flags`` the names of ADAM_FLAGS that hold, ``u_store`` the last
    rounding's unit. The values of ``Rounded``'s chain (to the bit but for torch's square root). False, ``outs``
    untouched, where the pass cannot read every tensor (``readable``, one size) or they have at most SMALL elements.
    """
    n = ins[0].numel()
    present = [t for t in (*ins, *outs) if t is not None]
    if n <= SMALL or not all(readable(t) and t.numel() == n for t in present):
        return False
    table = np.array([constants.get(name, (0.0, 0.0)) for name in ADAM_CONSTANTS], dtype=np.float64)
    on = tuple(True if name in flags else None for name in ADAM_FLAGS)
    addresses = tuple(tuple(0 if t is None else t.data_ptr() for t in ts) for ts in (ins, outs))
    _passes.run(_ADAM, (*addresses, n, table, *on, ua, u_store), n)
    return True
