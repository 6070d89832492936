"""Reused CPU memory for an op call's large float64 tensors: the device's inputs upcast for the local replay,
the inputs an in-place op overwrites as they were before it, the temporaries of the bounds, and the replays'
results and those of the bounds that run the op on magnitudes (``shadow.replay.table.pooled_call``), the drift
replay's kept as shadows.

glibc hands out a fresh CPU tensor above its mmap threshold (32 MB at most) as new pages, which fault in at
the first write: upcasting 38.6M float32 elements (the LM-shaped model's embedding, its gradient, Adam's
states) takes about 130 ms into a fresh tensor and 43 ms into memory written before (2 cores;
benchmarks/RESULTS.md). Every optimizer op on such a parameter upcasts several of them, every step.

``Scratch`` keeps the storages it hands out and hands one out again only when nothing refers to it: the pool
holds the storage alone, so its use count is 1 exactly when every tensor made from it is gone. Nothing is given
back by hand: a temporary kept past its op (a spot check's inputs, a budget's) or a shadow the mirror keeps only
keeps its buffer from being reused. Storages are counted by size class (a power of two: a request takes an
idle storage of 1 to 2 times its bytes), and idle ones are let go, least recently used first, while their
class's storages, in use and idle, total more than the most that class has had in use at once: the pool never
holds more of a size than its own busiest moment for that size needed (``peak`` sums those), so it moves the
process's peak memory little (benchmarks/RESULTS.md), and never holds more idle bytes than
``ShadowMode(max_shadow_bytes=...)`` leaves beside the shadows. One budget for all sizes would churn: a step
whose logits need 49 MB buffers while the optimizer's 294 MB ones sit idle let those go to make room, and
page-faulted fresh ones in at the optimizer, every step (the LM-shaped benchmark).
``ShadowMode.memory()`` reports the idle bytes; the mode's exit lets the pool go.
"""

from __future__ import annotations

import math

import torch

# glibc serves smaller ones from its heap, in memory already touched (its mmap threshold grows to 32 MB as mapped
# chunks are freed); a fresh mapping above it pays a page fault per page (benchmarks/page_faults.py)
MIN_BYTES = 32 << 20
# a storage's use count (torch 2.4 to 2.13 have it): without it nothing tells a free buffer, and nothing is pooled
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Scratch:
    """A pool of CPU storages for tensors of at least ``MIN_BYTES``, most recently used last."""

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []
        self.limit = math.inf  # idle bytes the pool may hold (set_limit)
        # CPU tensors of at least this many bytes are pooled (none without use counts)
        self.smallest = MIN_BYTES if _use_count is not None else math.inf
        self._peaks: dict[int, int] = {}  # size class -> the most bytes its storages have had in use at once

    @property
    def peak(self) -> int:
        """The most bytes the pool may hold: each size class's most in use at once, summed."""
        return sum(self._peaks.values())

    @property
    def held(self) -> int:
        """Bytes of the storages kept, in use or idle (read from them: a replay that resizes one of its inputs
        grows it)."""
        return sum(s.nbytes() for s in self._storages)

    @property
    def idle(self) -> int:
        """Bytes of the storages kept that nothing else refers to: the memory the pool itself costs."""
        return sum(s.nbytes() for s in self._storages if _use_count(s._cdata) == 1)

    def set_limit(self, limit: float) -> None:
        """Keep at most ``limit`` idle bytes from now on (under ``max_shadow_bytes``, the engine sets it before
        each op call from the cap and the shadows' bytes; without a cap it stays infinite). The storages outgrow
        their class's peak only as one is handed out or a replay resizes one; the next hand-out trims them."""
        self.limit = limit
        if limit < math.inf and self._storages:
            self._evict()

    def clear(self) -> None:
        """Forget every storage (ShadowMode's exit): those still in use live on with their tensors."""
        self._storages.clear()
        self._peaks.clear()

    def copy(self, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``copy(t, dtype, device)``, in pooled memory when it is a large copy from the CPU to the CPU."""
        if t.numel() * dtype.itemsize < self.smallest or device.type != "cpu" or t.device.type != "cpu" \
                or t._is_zerotensor():
            return copy(t, dtype, device)
        stride = torch.empty_like(t, dtype=dtype, device="meta").stride()  # preserve_format, as .to does
        return self._tensor(t.shape, stride, dtype).copy_(t.detach())

    def empty_like(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``torch.empty_like(t, dtype=dtype)``: in pooled memory when it is large and on the CPU."""
        if t.numel() * dtype.itemsize < self.smallest or t.device.type != "cpu":
            return torch.empty_like(t, dtype=dtype)
        return self._tensor(t.shape, torch.empty_like(t, dtype=dtype, device="meta").stride(), dtype)

    def empty_strided(self, shape, stride, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor of this shape, strides and dtype, in pooled memory when it is large."""
        if math.prod(shape) * dtype.itemsize < self.smallest:
            return torch.empty_strided(shape, stride, dtype=dtype)
        return self._tensor(shape, stride, dtype)

    def _tensor(self, shape, stride, dtype: torch.dtype) -> torch.Tensor:
        # the storage spans the elements the strides reach (a dense layout: all of them)
        nbytes = (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * dtype.itemsize if math.prod(shape) else 0
        return torch.empty(0, dtype=dtype).set_(self._storage(nbytes), 0, shape, stride)

    def _storage(self, nbytes: int) -> torch.UntypedStorage:
        """An idle storage of nbytes to 2 nbytes (the smallest), else a new one; either is kept, most recently
        used last."""
        best = None
        for i, s in enumerate(self._storages):
            n = s.nbytes()
            if nbytes <= n <= 2 * nbytes and (best is None or n < self._storages[best].nbytes()) \
                    and _use_count(s._cdata) == 1:
                best = i
        s = torch.UntypedStorage(nbytes) if best is None else self._storages.pop(best)
        self._evict(s)
        self._storages.append(s)
        return s

    def _evict(self, new: torch.UntypedStorage | None = None) -> None:
        """Let idle storages go, least recently used first, while the idle bytes are above the limit or their size
        class holds more than its peak. ``new``, about to be handed out, counts as in use, and its class's peak
        grows to what the class has in use with it."""
        held: dict[int, int] = {}
        in_use: dict[int, int] = {}
        idle = 0
        for s in self._storages + ([] if new is None else [new]):
            n, c = s.nbytes(), _size_class(s.nbytes())
            held[c] = held.get(c, 0) + n
            if s is new or _use_count(s._cdata) != 1:
                in_use[c] = in_use.get(c, 0) + n
            else:
                idle += n
        if new is not None:
            c = _size_class(new.nbytes())
            self._peaks[c] = max(self._peaks.get(c, 0), in_use[c])
        i = 0
        while i < len(self._storages):
            s = self._storages[i]
            n, c = s.nbytes(), _size_class(s.nbytes())
            if _use_count(s._cdata) == 1 and (idle > self.limit or held[c] > self._peaks.get(c, 0)):
                idle -= n
                held[c] -= n
                del self._storages[i]
            else:
                i += 1


def _size_class(nbytes: int) -> int:
    """floor(log2(nbytes)): storages of one class are within 2x of each other."""
    return nbytes.bit_length() - 1


def copy(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An exact copy of ``t`` in ``dtype`` on ``device`` (``.to`` keeps the layout of a dense tensor), never t
    itself; zeros for an ``_efficientzerotensor``, which has no memory to read. Across devices the values cross in
    their own dtype and are converted where they arrive: a device without float64 (DirectML) refuses a copy that
    converts to float64 on its side."""
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=dtype, device=device)
    t = t.detach()
    if t.dtype != dtype and t.device != torch.device(device):
        return t.to(device=device, copy=True).to(dtype)
    return t.to(device=device, dtype=dtype, copy=True)
