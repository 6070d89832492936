"""Device values read where the shadows live elsewhere (DirectML's tensors, or a GPU's with ``shadow_device="cpu"``):
each storage version crosses once, and the tensors one op call needs cross together.

An op's device inputs are read for its local replay and its device outputs for their spot check and comparisons;
the next op reads those outputs again as its inputs, and the trajectory reads the loss and the stepped parameters.
``HostCopies`` keeps the copy of each tensor it brought over, in the device's own dtype, and hands it out again while
nothing wrote the tensor's storage: its version counter has not moved since, and no op shadow saw wrote the storage
(the engine calls ``drop``: writes that bump no counter, such as ``native_batch_norm``'s running statistics,
included). The copies of one call cross in one batch: a CUDA tensor without blocking into pinned memory, then one
synchronization per device; any other device one blocking copy each.

The copies kept are bounded (``limit``: the oldest go first, and those whose storage died) and freed when the
``ShadowMode`` block ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_SWEEP_EVERY = 64  # copies kept between sweeps of those whose storage died


class _Copy:
    __slots__ = ("weak", "version", "host", "nbytes")

    def __init__(self, storage: torch.UntypedStorage, version: int, host: torch.Tensor):
        self.weak = StorageWeakRef(storage)  # keeps the storage's address from naming another while the copy is kept
        self.version = version
        self.host = host
        self.nbytes = host.numel() * host.element_size()


def _key(t: torch.Tensor) -> tuple:
    return t.untyped_storage()._cdata, t.size(), t.stride(), t.storage_offset(), t.dtype


def transfer(tensors: list[torch.Tensor], to: torch.device) -> list[torch.Tensor]:
    """Copies of ``tensors`` on ``to``, each in its dtype and in the layout ``.to`` gives it. CUDA tensors going to
    the CPU are copied without blocking into pinned memory, then each of their devices synchronized once; the others
    are copied one by one."""
    out, waits = [], []
    for t in tensors:
        t = t.detach()
        if t._is_zerotensor():  # no memory to read
            out.append(torch.zeros(t.shape, dtype=t.dtype, device=to))
        elif t.is_cuda and to.type == "cpu":
            host = torch.empty_strided(t.size(), torch.empty_like(t, device="meta").stride(), dtype=t.dtype,
                                       pin_memory=True)
            out.append(host.copy_(t, non_blocking=True))
            if t.device not in waits:
                waits.append(t.device)
        else:
            out.append(t.to(to, copy=True))
    for d in waits:
        torch.cuda.current_stream(d).synchronize()
    return out


class HostCopies:
    """The copies of device tensors read over to where their shadows live, one per tensor geometry, kept while their
    storage is unchanged (module docstring). ``place``: where a device's shadows live (``shadow.mirror.Placement``);
    ``limit``: the bytes of copies to keep, asked at each copy kept. The copies of the last batch are served
    whatever the limit: the call that brought them over reads them.

    ``transfers`` and ``batches`` count the tensors brought over and the batches they came in."""

    def __init__(self, place: Callable[[torch.device], torch.device], limit: Callable[[], float]):
        self.place = place
        self.limit = limit
        self._copies: dict[tuple, _Copy] = {}  # _key -> copy, the oldest first
        self._new = 0  # copies kept since the last sweep
        self._by_storage: dict[int, list[tuple]] = {}  # storage key -> the keys of its copies
        self._last: dict[tuple, _Copy] = {}  # the last batch's copies
        self.held = 0  # bytes of the copies kept
        self.transfers = 0
        self.batches = 0

    def __bool__(self) -> bool:
        """Whether any copy may be handed out (the last batch's too, which ``held`` does not count)."""
        return bool(self._copies) or bool(self._last)

    def crosses(self, t: torch.Tensor) -> bool:
        """Whether t's shadow lives on another device than t."""
        d = t.device
        return self.place(d) != d

    def read(self, t: torch.Tensor, batch: Iterable[torch.Tensor] = (), keep: bool = True) -> torch.Tensor:
        """t's values where its shadow lives (t crosses): the copy kept, or a new one brought over together with the
        tensors of ``batch`` that cross and have none; ``keep``: keep the new copies for the next reads (else each
        read gets a copy of its own, which it may write)."""
        k = _key(t)
        if keep:
            found = self._current(k, t)
            if found is not None:
                return found.host
        todo, keys, current = [t], [k], {}  # current: the batch's tensors that have a copy, which it keeps serving
        for b in batch:
            if b is not t and isinstance(b, torch.Tensor) and b.layout == torch.strided and not b.is_nested \
                    and self.crosses(b):  # the call's other dense tensors (sparse and nested ones are never read)
                kb = _key(b)
                if kb in keys or kb in current:
                    continue
                c = self._current(kb, b)
                if c is None:
                    todo.append(b)
                    keys.append(kb)
                else:
                    current[kb] = c
        hosts = transfer(todo, self.place(t.device))
        self.transfers += len(todo)
        self.batches += 1
        if keep:
            self._last = current
            for x, kx, h in zip(todo, keys, hosts):
                self._keep(kx, x, h)
        return hosts[0]

    def _current(self, k: tuple, t: torch.Tensor) -> _Copy | None:
        """The copy of key ``k`` (tensor t) if one is kept and nothing wrote t since (else it is forgotten)."""
        kept = self._copies.get(k)
        c = kept if kept is not None else self._last.get(k)
        if c is None:
            return None
        if c.weak.expired() or t._version != c.version:
            self._forget(k)
            return None
        return c

    def _keep(self, k: tuple, t: torch.Tensor, host: torch.Tensor) -> None:
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter: nothing would tell a write
            return
        if t._is_zerotensor():
            return
        self._forget(k)
        c = self._last[k] = self._copies[k] = _Copy(t.untyped_storage(), version, host)
        self._by_storage.setdefault(k[0], []).append(k)
        self.held += c.nbytes
        self._new += 1
        if self._new >= _SWEEP_EVERY:
            self._new = 0
            for dead in [kd for kd, cd in self._copies.items() if cd.weak.expired()]:
                self._forget(dead)
        limit = self.limit()
        while self.held > limit and self._copies:  # the oldest first: a result is most often read by the ops after it
            self._forget(next(iter(self._copies)), kept_only=True)

    def _forget(self, k: tuple, kept_only: bool = False) -> None:
        if not kept_only:
            self._last.pop(k, None)
        c = self._copies.pop(k, None)
        if c is None:
            return
        self.held -= c.nbytes
        keys = self._by_storage[k[0]]
        keys.remove(k)
        if not keys:
            del self._by_storage[k[0]]

    def drop(self, tensors: Iterable[tuple[Any, torch.Tensor]]) -> None:
        """Forget the copies of every storage of ``tensors`` ((spec, tensor) pairs, as ``OpPlan.tensors`` gives
        them): an op shadow saw writes them."""
        for _, t in tensors:
            if t.layout == torch.strided and not t.is_nested:  # the others are never read over
                key = t.untyped_storage()._cdata
                for k in [*self._by_storage.get(key, ()), *(k for k in self._last if k[0] == key)]:
                    self._forget(k)

    def clear(self) -> None:
        self._copies.clear()
        self._by_storage.clear()
        self._last = {}
        self.held = 0
