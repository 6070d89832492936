"""Which elements of an output get checked: the most ill-conditioned first, then seeded random ones."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Protocol

import torch


class Ranked(Protocol):
    """A priority computed when asked (``shadow.engine``'s condition estimates): its size, and the flat
    positions of its ``n`` largest values, largest first, as ``top_positions`` of it would give them."""

    def numel(self) -> int: ...

    def top(self, n: int) -> list[int]: ...


def _priority_order(priority: torch.Tensor | Ranked | None, n: int) -> list[int]:
    """The flat positions of the ``n`` largest priorities, largest first (none without a priority)."""
    if priority is None or n <= 0 or priority.numel() == 0:
        return []
    return top_positions(priority, n) if isinstance(priority, torch.Tensor) else priority.top(n)


def top_positions(priority: torch.Tensor, n: int) -> list[int]:
    """The flat positions of the ``n`` largest priorities (NaN ranks last), largest first."""
    p = priority.detach().reshape(-1).to(torch.float64)  # ranked where it lives: only positions come back
    if n == 1:  # the default: one pass, NaN (which argmax prefers) removed only where one wins
        i = p.argmax()
        i, top = torch.stack([i.to(torch.float64), p[i]]).tolist()
        if not math.isnan(top):
            return [int(i)]
    p = torch.nan_to_num(p, nan=-math.inf)
    return torch.topk(p, min(n, p.numel())).indices.tolist()


_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """SplitMix64's output function."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _key(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class _Stream:
    """Seeded 64-bit draws: SplitMix64 (Steele, Lea and Flood 2014) from a BLAKE2b hash of ``key``, the
    same in every process and on every platform, and ~10x cheaper to seed than ``random.Random(str)``
    (SHA-512 and a Mersenne Twister state of 624 words) for the two draws a default call makes."""

    __slots__ = ("_x",)

    def __init__(self, key: str):
        self._x = _key(key)

    def below(self, n: int) -> int:
        """A position in ``[0, n)``: the next draw modulo n (a bias below n / 2**64: none that matters)."""
        self._x = x = (self._x + _GAMMA) & _MASK
        return _mix(x) % n

    def shuffle(self, items: list) -> None:
        """Fisher-Yates, in place."""
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]


@functools.cache
def _op_key(seed: int, op_name: str) -> int:
    return _key(f"{seed}:{op_name}")


def _drawn(key: int, call: int, one_in: int) -> bool:
    return _mix((key + call * _GAMMA) & _MASK) % one_in == 0


def drawn(seed: int, op_name: str, call: int, one_in: int) -> bool:
    """Whether call ``call`` of ``op_name`` is one of the calls drawn with probability ``1 / one_in``
    (SplitMix64's ``call``-th draw from the op's seeded state): the same answer for the same arguments,
    across processes."""
    return _drawn(_op_key(seed, op_name), call, one_in)


def next_drawn(seed: int, op_name: str, after: int, one_in: int) -> int:
    """The first call after ``after`` that ``drawn`` draws.

    >>> n = next_drawn(0, "aten.mm.default", 16, 16)
    >>> drawn(0, "aten.mm.default", n, 16), [m for m in range(17, n) if drawn(0, "aten.mm.default", m, 16)]
    (True, [])
    """
    key, n = _op_key(seed, op_name), after + 1
    while not _drawn(key, n, one_in):
        n += 1
    return n


def sample_indices(
    seed: int, op_name: str, call: int, output: int, numel: int, n: int,
    priority: torch.Tensor | Ranked | None = None, exclude: Sequence[int] = (),
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
        _Stream(f"{seed}:{op_name}:{call}:{output}").shuffle(rest)
        return out + rest[: n - len(out)]
    rng = _Stream(f"{seed}:{op_name}:{call}:{output}")
    while len(out) < n:
        i = rng.below(numel)
        if i not in taken:
            taken.add(i)
            out.append(i)
    return out
