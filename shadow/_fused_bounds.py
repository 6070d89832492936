"""One-pass kernels of the error budgets, beside the comparison's (``shadow._fused``, whose machinery they use):
the largest bound / |r| (the spot check's element), |a| * scale + offset (an elementwise bound), and a matrix's
sums of squares along its rows and down its columns (a matmul's bound). Each gives torch's values (the same bits,
or the same sums to rounding) from one read where torch's path makes two or three.
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


_LARGEST, _MAGNITUDE, _SQUARES = range(3)  # the passes of _passes
_passes = Passes((_serial_largest, _parallel_largest), (_serial_magnitude, _parallel_magnitude),
                 (_serial_squares, _parallel_squares))


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
