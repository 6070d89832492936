"""Which elements of an output get checked: the most ill-conditioned first, then seeded random ones."""

from __future__ import annotations

import math
import random
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
        random.Random(f"{seed}:{op_name}:{call}:{output}").shuffle(rest)
        return out + rest[: n - len(out)]
    rng = random.Random(f"{seed}:{op_name}:{call}:{output}")  # str seeds hash with SHA-512: reproducible
    while len(out) < n:
        i = rng.randrange(numel)
        if i not in taken:
            taken.add(i)
            out.append(i)
    return out
