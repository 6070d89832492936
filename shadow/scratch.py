"""Reused CPU memory for the large float64 temporaries of an op call: the device's inputs upcast for the
local replay, the inputs an in-place op overwrites as they were before it, the temporaries of the bounds.

glibc hands out a fresh CPU tensor above its mmap threshold (32 MB at most) as new pages, which fault in at
the first write: upcasting 38.6M float32 elements (the LM-shaped model's embedding, its gradient, Adam's
states) takes about 130 ms into a fresh tensor and 43 ms into memory written before (2 cores;
benchmarks/RESULTS.md). Every optimizer op on such a parameter upcasts several of them, every step.

``Scratch`` keeps the storages of such temporaries and hands one out again only when nothing refers to it:
the pool holds the storage alone, so its use count is 1 exactly when every tensor made from it is gone. Nothing
is given back by hand, and a temporary kept past its op (a spot check's inputs, a budget's) only keeps its
buffer from being reused. The pool holds at most ``SHARE`` of the bytes the mirror holds (``Mirror.held``: the
shadows of storages dead since its last sweep included), and never more than ``ShadowMode(max_shadow_bytes=...)``
leaves beside them: what it keeps is what the largest op calls allocate anyway, at their peak, without it.
``ShadowMode.memory()`` reports it; the mode's exit lets it go.
"""

from __future__ import annotations

import math

import torch

# glibc serves smaller ones from its heap, in memory already touched (its mmap threshold grows to 32 MB as mapped
# chunks are freed): a fresh 64 MB upcast took 18 ms and one into touched memory 3.2 ms; 16 to 32 MB, alike
MIN_BYTES = 32 << 20
SHARE = 0.25  # the pool's bytes at most, as a share of the shadows' bytes
# a storage's use count (torch 2.4 to 2.13 have it): without it nothing tells a free buffer, and nothing is pooled
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Scratch:
    """A pool of CPU storages for temporaries of at least ``MIN_BYTES``, most recently used last."""

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []
        self.limit = 0.0  # bytes the pool may hold (set_limit)

    @property
    def held(self) -> int:
        """Bytes of the storages kept (read from them: a replay that resizes one of its inputs grows it)."""
        return sum(s.nbytes() for s in self._storages)

    def set_limit(self, limit: float) -> None:
        """Hold at most ``limit`` bytes from now on: free storages beyond it are let go, least recently used
        first (the engine sets it before each op call, from the shadows' bytes)."""
        self.limit = limit
        if self._storages and self.held > limit:  # every op call sets it: an empty pool costs one test
            self._evict(0)

    def clear(self) -> None:
        """Forget every storage (ShadowMode's exit): those still in use live on with their tensors."""
        self._storages.clear()

    def copy(self, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``copy(t, dtype, device)``, in pooled memory when it is a large copy from the CPU to the CPU."""
        if not self._pools(t.numel() * dtype.itemsize) or device.type != "cpu" or t.device.type != "cpu" \
                or t._is_zerotensor():
            return copy(t, dtype, device)
        stride = torch.empty_like(t, dtype=dtype, device="meta").stride()  # preserve_format, as .to does
        return self._tensor(t.shape, stride, dtype).copy_(t.detach())

    def empty_like(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor with t's shape and layout (as ``torch.empty_like``) in ``dtype``, in
        pooled memory when it is large."""
        if not self._pools(t.numel() * dtype.itemsize):
            return torch.empty_like(t, dtype=dtype, device="cpu")
        return self._tensor(t.shape, torch.empty_like(t, dtype=dtype, device="meta").stride(), dtype)

    @staticmethod
    def _pools(nbytes: int) -> bool:
        return nbytes >= MIN_BYTES and _use_count is not None

    def _tensor(self, shape, stride, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        return torch.empty(0, dtype=dtype).set_(self._storage(nbytes), 0, shape, stride)

    def _storage(self, nbytes: int) -> torch.UntypedStorage:
        """A free storage of nbytes to 2 nbytes (the smallest), else a new one, kept while the pool has room."""
        best = None
        for i, s in enumerate(self._storages):
            n = s.nbytes()
            if nbytes <= n <= 2 * nbytes and (best is None or n < self._storages[best].nbytes()) \
                    and _use_count(s._cdata) == 1:
                best = i
        if best is not None:
            s = self._storages.pop(best)
            self._storages.append(s)
            return s
        s = torch.UntypedStorage(nbytes)
        self._evict(nbytes)
        if self.held + nbytes <= self.limit:
            self._storages.append(s)
        return s

    def _evict(self, room: int) -> None:
        """Let free storages go, least recently used first, until ``room`` more bytes fit in the limit."""
        i, held = 0, self.held
        while held + room > self.limit and i < len(self._storages):
            s = self._storages[i]
            if _use_count(s._cdata) == 1:
                held -= s.nbytes()
                del self._storages[i]
            else:
                i += 1


def copy(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An exact copy of ``t`` in ``dtype`` on ``device`` (``.to`` keeps the layout of a dense tensor), never t
    itself; zeros for an ``_efficientzerotensor``, which has no memory to read."""
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=dtype, device=device)
    return t.detach().to(device=device, dtype=dtype, copy=True)
