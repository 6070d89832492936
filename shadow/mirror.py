"""Storage mirror: one float64 shadow per device storage; a tensor's shadow is an as_strided view of it.

Mirroring storages rather than tensors makes aliasing, views, in-place and ``out=`` replay exactly: a
write through any view of a storage lands in the one shadow every other view reads.

Entries are keyed by the StorageImpl address and hold a weak reference to it (what ``StorageWeakRef`` holds),
which keeps the address from being reused while the entry lives; ``sweep`` drops the entries of dead
storages. Every method here runs inside ``__torch_dispatch__`` with dispatch disabled.

A nested tensor (``torch.nested``) has one buffer storage, mirrored alike; its shadow is a float64 nested tensor
over the storage's shadow with its nested sizes, strides and offsets (``shadow.nested``).

Where the shadows live (``ShadowMode(shadow_device=...)``) is a ``Placement``: every shadow the mirror and the
engine make goes to ``placement(device tensor's device)``, resolved once per device (docs/architecture.md:
Where shadows live).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import nested
from .errors import ShadowOptionError
from .scratch import copy

_SWEEP_EVERY = 64  # new entries between sweeps: bounds the shadow memory kept for dead storages
_expired = torch.UntypedStorage._expired  # whether a weak reference's storage died (StorageWeakRef.expired's call)


def shadow_dtype_of(dtype: torch.dtype) -> torch.dtype | None:
    """float64 for real floating dtypes, complex128 for complex ones, None for discrete ones."""
    if dtype.is_complex:
        return torch.complex128
    if dtype.is_floating_point:
        return torch.float64
    return None


# shadow_dtype_of of every dtype torch names, read per op call where a Python call would cost more than the answer
SHADOW_DTYPES: dict[torch.dtype, torch.dtype | None] = {
    d: shadow_dtype_of(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


# --- where shadows live: ShadowMode(shadow_device="auto" | "cpu" | a device with float64) ---
AUTO = "auto"
CPU = torch.device("cpu")
# device types that cannot hold shadows: why, in the words of the error message
NO_FLOAT64 = {
    "mps": "MPS has no float64 (Apple GPUs do not compute in double precision)",
    "privateuseone": "DirectML devices mostly have no float64, and asking one for it raises",
    "meta": "meta tensors hold no values",
}
# "auto" keeps a CUDA device's shadows on it when, at the first tensor shadow sees there, at least this share of
# its memory is free: the float64 shadows of a float32 program take twice its bytes (more for 16-bit ones), so
# a program using at most a third of the device leaves room for them. Decided once per device, never moved.
AUTO_FREE_SHARE = 2 / 3


def parse_shadow_device(value: Any) -> str | torch.device:
    """``"auto"``, or the device ``value`` names (a string or a ``torch.device``), checked: a device type torch
    knows, with float64 compute, available on this machine, not a PrivateUse1 backend (DirectML, or one renamed
    such as Ascend's "npu": their shadows stay on the CPU). ``"cuda"`` means the current CUDA device."""
    if isinstance(value, str) and value == AUTO:
        return AUTO
    expected = ("expected 'auto' (shadows on a CUDA device when it has the memory, else on the CPU), 'cpu', "
                "or a device that computes float64 such as 'cuda' or 'cuda:1'")
    if isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError as exc:
            raise ShadowOptionError(f"shadow_device={value!r} is not a device torch knows "
                                    f"({str(exc).splitlines()[0][:120]}): {expected}") from None
    elif isinstance(value, torch.device):
        device = value
    else:
        raise ShadowOptionError(f"shadow_device={value!r}: {expected}")
    if device.type in NO_FLOAT64:
        raise ShadowOptionError(f"shadow_device={value!r}: {NO_FLOAT64[device.type]}, so shadows cannot live "
                                "there; use 'auto' (shadows of such devices' tensors stay on the CPU) or 'cpu'")
    if device.type == torch._C._get_privateuse1_backend_name():  # renamed (Ascend's "npu"): shadows are CPU-side
        raise ShadowOptionError(f"shadow_device={value!r}: the PrivateUse1 backend {device.type!r} (privateuseone "
                                "renamed) is a device whose tensors shadow reads over to the CPU, not one shadows can "
                                "live on; use 'auto' (its tensors' shadows stay on the CPU) or 'cpu'")
    if device.type == "cpu":
        return CPU
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ShadowOptionError(f"shadow_device={value!r}: no {device.type} device is available on this machine "
                                f"(torch.{device.type}.is_available() is not True); use 'auto' or 'cpu'")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    index = device.index if device.index is not None else backend.current_device()
    if index >= count:
        raise ShadowOptionError(f"shadow_device={value!r}: this machine has {count} {device.type} device(s) "
                                f"({device.type}:0 to {device.type}:{count - 1})")
    return torch.device(device.type, index)


def _memory_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device (a function of its own: tests replace it)."""
    return torch.cuda.mem_get_info(device)


def resolve_auto(device: torch.device, min_free: int = 0) -> torch.device:
    """Where "auto" keeps the shadows of ``device``'s tensors: the CUDA device itself when at least
    ``AUTO_FREE_SHARE`` of its memory (and ``min_free`` bytes) is free, else the CPU; every other device type's
    on the CPU (MPS and DirectML have no float64; others are not known to compute it at speed)."""
    if device.type != "cuda":
        return CPU
    try:
        free, total = _memory_info(device)
    except Exception:  # no answer from the driver: the CPU, which always works
        return CPU
    return device if free >= max(AUTO_FREE_SHARE * total, min_free) else CPU


class Placement:
    """The shadow device of each device, resolved once per device (the per-op path reads a dict).

    ``choice``: ``"auto"`` or a device (``parse_shadow_device``'s result); ``min_free``: bytes "auto" wants
    free on a GPU besides its share (``max_shadow_bytes``)."""

    __slots__ = ("choice", "min_free", "fixed", "cpu_home", "_resolved")

    def __init__(self, choice: str | torch.device = CPU, min_free: int = 0):
        self.choice = choice
        self.min_free = min_free
        self.fixed = choice if isinstance(choice, torch.device) else None  # one device for every shadow
        self.cpu_home = self.fixed is None or self.fixed == CPU  # CPU tensors' shadows live on the CPU ("auto" too)
        self._resolved: dict[torch.device, torch.device] = {}

    def __call__(self, device: torch.device) -> torch.device:
        if self.fixed is not None:
            return self.fixed
        d = self._resolved.get(device)
        if d is None:
            d = self._resolved[device] = resolve_auto(device, self.min_free)
        return d

    def on_cpu_unless_chosen(self) -> None:
        """"auto" resolves every device to the CPU from now on, if it resolved none yet (callers whose own
        arithmetic on shadows is CPU-only); an explicit device stays the caller's choice."""
        if self.fixed is None and not self._resolved:
            self.fixed = CPU

    @property
    def resolved(self) -> dict[torch.device, torch.device]:
        """What "auto" decided so far: device -> where its tensors' shadows live."""
        return dict(self._resolved)


class _Entry:
    __slots__ = ("weak", "key", "base", "shadow_storage", "itemsize", "nbytes", "held", "exact", "writes", "nonfinite",
                 "drift", "adopted")

    def __init__(self, storage: torch.UntypedStorage, base: torch.Tensor, itemsize: int, exact: bool, writes: int,
                 nonfinite: bool):
        # a weak reference to the StorageImpl, as StorageWeakRef holds one (without its Python frames): it keeps
        # the address from being reused while the entry lives, and frees with the entry (__del__)
        self.weak = storage._weak_ref()
        self.key = storage._cdata
        self.base = base  # 1-D shadow of the whole storage
        self.shadow_storage = base.untyped_storage()._cdata  # the shadow's own storage, to spot outputs aliasing it
        self.itemsize = itemsize
        self.nbytes = storage.nbytes()
        self.held = base.numel() * base.element_size()  # the shadow's bytes (Mirror.held)
        self.exact = exact  # the shadow equals the device's values exactly
        self.writes = writes  # writes seen through ops that bump the version counter
        self.nonfinite = nonfinite  # the device's values hold a NaN or an infinity (as far as shadow saw)
        self.drift = 0.0  # rel_norm of the drift of the last value written (a partial write: the larger)
        self.adopted = 0  # Mirror.adopted when this storage was first seen holding values no op shadow saw wrote

    # the function is bound here, not looked up at deletion: torch's module may be gone at interpreter exit
    def __del__(self, _free=torch.UntypedStorage._free_weak_ref) -> None:
        _free(self.weak)


def _region(base: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if t.is_nested:
        return nested.view(base, t)
    r = base.as_strided(t.size(), t.stride(), t.storage_offset())
    # conjugate and negative views (x.conj(), x.mH, _neg_view) read their storage through a lazy bit: the
    # shadow view needs the same bit, and a copy_ into it then writes the storage's raw values, as the device
    if t.is_conj():
        r = r.conj()
    if t.is_neg():
        r = torch._neg_view(r)
    return r


def _storage_values(t: torch.Tensor, n: int) -> torch.Tensor:
    """t's whole storage as n raw values (as_strided keeps t's conj/neg bit, which would store conj(x) or -x)."""
    if t.is_nested:  # its buffer
        return t.detach().values()
    flat = t.detach().as_strided((n,), (1,), 0)
    if flat.is_conj():
        flat = flat.conj()
    if flat.is_neg():
        flat = torch._neg_view(flat)
    return flat


def _as_pair(base: torch.Tensor, itemsize: int, t: torch.Tensor) -> torch.Tensor | None:
    """The storage shadow in t's dtype when t reads a complex storage as (re, im) pairs or the reverse
    (view_as_real, view_as_complex): float64 pairs line up with complex128 as float32 ones with complex64,
    so the shadow is a view too. A copy (``upcast``) would be contiguous, and a reduction over it could
    round in another order than the device's (a sum over view_as_real in polar's backward: 1 ulp)."""
    if base.is_complex() and t.is_floating_point() and t.dtype.to_complex().itemsize == itemsize:
        return torch.view_as_real(base).reshape(-1)
    if base.is_floating_point() and t.is_complex() and t.dtype.to_real().itemsize == itemsize \
            and base.numel() % 2 == 0:
        return torch.view_as_complex(base.view(-1, 2))
    return None


def any_nonfinite(values: torch.Tensor) -> bool:
    """Whether ``values`` hold a NaN or an infinity. Their sum is non-finite wherever an element is (and, rarely,
    where finite values overflow it): only then does the exact test run, whose mask is as large as ``values``
    and costs an order of magnitude more than the sum. A nested tensor: its components'."""
    if values.is_nested:
        values = nested.values(values)
    if values.numel() == 0 or (values.dtype in _SUMMED and bool(torch.isfinite(values.sum()))):
        return False
    return not bool(torch.isfinite(values).all())


_SUMMED = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64})


def _still_nonfinite(e: _Entry, t: torch.Tensor, written: bool) -> bool:
    """Whether a storage holds a NaN/Inf after ``t`` (non-finite or not: ``written``) was written into it: a write
    over the whole storage decides; a partial one keeps what the rest held."""
    return written if t.numel() * t.element_size() == e.nbytes else (e.nonfinite or written)


def _drift_after(e: _Entry, t: torch.Tensor, drift: float) -> float:
    """A storage's drift after ``t`` was written with ``drift``: a write over the whole storage decides; a partial
    one keeps the larger."""
    return drift if t.numel() * t.element_size() == e.nbytes else max(e.drift, drift)


def _same_place(shadow: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``shadow`` lies in its storage where ``t`` lies in its own (a view of t's storage shadow is t's)."""
    if t.is_nested or shadow.is_nested:
        return nested.same_layout(shadow, t)
    return shadow.size() == t.size() and shadow.stride() == t.stride() \
        and shadow.storage_offset() == t.storage_offset()


def _write_region(base: torch.Tensor, t: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into ``base`` where ``t`` lies in its storage; self-overlapping layouts (stride 0)
    cannot be ``copy_``-ed into, so they go through flat indices (duplicates hold equal values)."""
    if t.is_nested:
        nested.write(base, t, value)
        return
    if torch._debug_has_internal_overlap(t) == 0:
        _region(base, t).copy_(value)
        return
    idx = torch.arange(base.numel(), device=base.device).as_strided(t.size(), t.stride(), t.storage_offset())
    value = value.conj() if t.is_conj() else value  # the raw values a conj/neg view of them reads as value
    value = -value if t.is_neg() else value
    base.index_put_((idx.reshape(-1),), value.expand(t.shape).reshape(-1).to(base.device, base.dtype))


class Mirror:
    """The float64 shadows of the storages a program touched, and the version counters seen."""

    def __init__(self, follow_reference: bool, placement: Placement | None = None):
        self.place = placement if placement is not None else Placement()  # the shadow device of a device
        # the dtype of a tensor's shadow, by its dtype (None: not mirrored); follow="reference" keeps discrete
        # results in their own dtype. A dict's get: it is asked several times per op call
        self.shadow_dtype: Callable[[torch.dtype], torch.dtype | None] = {
            d: d if to is None and follow_reference else to for d, to in SHADOW_DTYPES.items()}.get
        self._entries: dict[int, _Entry] = {}
        self._empty: dict[int, StorageWeakRef] = {}  # uninitialized storages not read yet (empty's results)
        self._versions: dict[int, tuple[weakref.ref, int, int, int]] = {}  # id(t) -> (ref, key, version, writes)
        self._new = 0
        self.held = 0  # bytes of the shadows of the entries (ShadowMode(max_shadow_bytes=...))
        self.adopted = 0  # storages first seen mid-run, adopted by exact upcast
        self.reinterpreted = 0  # reads through a view of another dtype size, served from the device

    # --- reading ---
    def entry(self, t: torch.Tensor) -> _Entry:
        """The entry of t's storage, adopting the storage from the device when first seen."""
        storage = t.untyped_storage()
        e = self._entries.get(storage._cdata)
        if e is None or e.nbytes != storage.nbytes():
            e = self._adopt(t, storage, e)
        return e

    def view(self, t: torch.Tensor, e: _Entry) -> torch.Tensor:
        """The shadow of tensor t (a view into its storage's shadow when the layouts agree)."""
        if e.itemsize != t.element_size():
            pair = _as_pair(e.base, e.itemsize, t)
            if pair is not None:
                return _region(pair, t)
            self.reinterpreted += 1
            return self.upcast(t)
        return _region(e.base, t)

    def upcast(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t in its shadow dtype on its shadow device: exact for every floating dtype (a nested tensor:
        its storage's, viewed as t: torch copies only contiguous nested tensors)."""
        dtype, device = self.shadow_dtype(t.dtype) or t.dtype, self.place(t.device)
        if t.is_nested:
            storage = _storage_values(t, t.untyped_storage().nbytes() // t.element_size())
            return nested.view(copy(storage, dtype, device), t)
        return copy(t, dtype, device)

    def _adopt(self, t: torch.Tensor, storage: torch.UntypedStorage, old: _Entry | None) -> _Entry:
        itemsize = t.element_size()
        n = storage.nbytes() // itemsize
        base = copy(_storage_values(t, n), self.shadow_dtype(t.dtype), self.place(t.device))
        if old is None:
            self.adopted += 1
            e = _Entry(storage, base, itemsize, exact=True, writes=0, nonfinite=any_nonfinite(base))
            e.adopted = self.adopted
            return self._keep(storage, e)
        if old.itemsize == itemsize and old.nbytes < storage.nbytes():
            # the storage grew in place (resize_, out= resizing): its old contents are kept, so is their shadow
            base[: old.base.numel()] = old.base
            return self._keep(storage, _Entry(storage, base, itemsize, exact=old.exact, writes=old.writes,
                                         nonfinite=old.nonfinite or any_nonfinite(base)))
        return self._keep(storage, _Entry(storage, base, itemsize, exact=True, writes=old.writes,
                                          nonfinite=any_nonfinite(base)))

    def _keep(self, storage: torch.UntypedStorage, e: _Entry) -> _Entry:
        self._put(storage._cdata, e)
        return e

    def known(self, t: torch.Tensor) -> _Entry | None:
        """The entry of t's storage if it has one (no adoption)."""
        return self._entries.get(t.untyped_storage()._cdata)

    def resync(self, t: torch.Tensor) -> None:
        """Re-read t's whole storage from the device (after a write shadow did not see)."""
        storage = t.untyped_storage()
        old = self._entries.get(storage._cdata)
        self._adopt(t, storage, old)

    def _put(self, key: int, e: _Entry) -> None:
        old = self._entries.get(key)
        if old is not None:
            self.held -= old.held
        self.held += e.held
        self._entries[key] = e
        self._new += 1
        if self._new >= _SWEEP_EVERY:
            self.sweep()

    # --- writing ---
    def assign(self, t: torch.Tensor, value: torch.Tensor, exact: bool, fresh: bool, nonfinite: bool = False,
               drift: float = 0.0) -> _Entry:
        """Make ``value`` the shadow of device tensor t (an op's output).

        ``fresh``: value is a new tensor no other shadow aliases, so it can become the storage shadow
        without a copy when t covers its whole storage contiguously. ``nonfinite``: t holds a NaN or an
        infinity; ``drift``: the rel_norm of t against value."""
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        e = self._entries.get(key)
        itemsize = t.element_size()
        if e is not None and e.nbytes == nbytes:
            b = e.base if e.itemsize == itemsize else _as_pair(e.base, e.itemsize, t)
            if b is not None:
                _write_region(b, t, value)
                e.exact = e.exact and exact
                e.nonfinite = _still_nonfinite(e, t, nonfinite)
                e.drift = _drift_after(e, t, drift)
                return e
        n, numel = nbytes // itemsize, t.numel()
        shadow_dtype = self.shadow_dtype(t.dtype)
        if (
            fresh
            and not t.is_nested  # a nested value's buffer may be laid out otherwise: copied below
            and numel == n
            and t.storage_offset() == 0
            and t.is_contiguous()
            and value.is_contiguous()
            and value.dtype == shadow_dtype
            and not (t.is_conj() or t.is_neg() or value.is_conj() or value.is_neg())  # base holds raw values
        ):
            base = value if value.dim() == 1 else value.reshape(-1)
        else:  # the output does not cover its storage: the rest is what the device holds
            base = copy(_storage_values(t, n), shadow_dtype, self.place(t.device))
            if numel != n:  # the device's values, read where they arrived, before t's region takes the shadow's
                nonfinite = nonfinite or any_nonfinite(base)
            _write_region(base, t, value)
        new = _Entry(storage, base, itemsize, exact, e.writes if e is not None else 0, nonfinite)
        new.drift = drift
        self._put(key, new)
        return new

    def commit_write(self, t: torch.Tensor, shadow_view: torch.Tensor, exact: bool, nonfinite: bool = False,
                     drift: float = 0.0) -> None:
        """After an op wrote device tensor t and its replay wrote ``shadow_view``: keep the result.

        Usually the replay wrote into the storage shadow already; when the op moved or resized t's
        storage (``out=`` reallocation, ``resize_``, ``set_``), the value is copied to where t now lies."""
        storage = t.untyped_storage()
        e = self._entries.get(storage._cdata)
        if (
            e is not None
            and e.nbytes == storage.nbytes()
            and e.itemsize == t.element_size()
            and shadow_view.untyped_storage()._cdata == e.base.untyped_storage()._cdata
            and _same_place(shadow_view, t)
        ):
            e.exact = e.exact and exact
            e.nonfinite = _still_nonfinite(e, t, nonfinite)
            e.drift = _drift_after(e, t, drift)
            return
        self.assign(t, shadow_view, exact, fresh=False, nonfinite=nonfinite, drift=drift)

    # --- versions: writes shadow did not see ---
    def note_write(self, e: _Entry) -> None:
        e.writes += 1

    def absorb(self, t: torch.Tensor) -> None:
        """Count the moves of t's version counter since t was last seen as writes shadow saw: a collective's
        backend writes its outputs after the call, outside any op (gloo on torch 2.4), and those writes are the
        call's, judged with it."""
        e = self.known(t)
        rec = self._versions.get(id(t))
        if e is None or rec is None or rec[0]() is not t or rec[1] != e.key:
            return
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter
            return
        e.writes += max(0, (version - rec[2]) - (e.writes - rec[3]))
        self._versions[id(t)] = (rec[0], e.key, version, e.writes)

    def track(self, t: torch.Tensor, e: _Entry) -> None:
        """Start tracking the version counter of t, an op's new output whose storage's entry is ``e``: the record
        ``unobserved_write`` would leave, without its comparison."""
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter
            return
        self._versions[id(t)] = (weakref.ref(t), e.key, version, e.writes)

    def unobserved_write(self, t: torch.Tensor, e: _Entry) -> bool:
        """Whether t's version counter moved more than the writes seen on its storage since t was last
        seen (checked lazily: the counter is bumped after ``__torch_dispatch__`` returns, so a call notes its
        writes after checking its arguments: ``shadow.engine.prepare.InputShadows``)."""
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter
            return False
        rec = self._versions.get(id(t))
        if rec is not None and rec[0]() is t and rec[1] == e.key:
            moved = version - rec[2] > e.writes - rec[3]
            if rec[2] != version or rec[3] != e.writes:
                self._versions[id(t)] = (rec[0], e.key, version, e.writes)
            return moved
        self._versions[id(t)] = (weakref.ref(t), e.key, version, e.writes)
        return False

    # --- lifetime ---
    def sweep(self) -> None:
        """Drop the shadows of storages that died, and the version records of dead tensors."""
        self._new = 0
        dead = [k for k, e in self._entries.items() if _expired(e.weak)]
        for k in dead:
            self.held -= self._entries.pop(k).held
        self._empty = {k: w for k, w in self._empty.items() if not w.expired()}
        if len(self._versions) > 4 * len(self._entries) + 256:
            self._versions = {k: v for k, v in self._versions.items() if v[0]() is not None}

    def seen_empty(self, t: torch.Tensor) -> None:
        """t is uninitialized memory an op returned (empty): adopted at its first read, whatever wrote it."""
        storage = t.untyped_storage()
        self._empty[storage._cdata] = StorageWeakRef(storage)

    def lookup(self, t: torch.Tensor) -> torch.Tensor | None:
        """The current shadow of t, or None if t's storage was never seen."""
        key = t.untyped_storage()._cdata
        empty = self._empty.pop(key, None)
        if key not in self._entries and (empty is None or empty.expired()):
            return None
        return self.view(t, self.entry(t))  # entry() adopts a new storage, follows one resized since last seen

    def shadow_bytes(self) -> int:
        return sum(e.held for e in self._entries.values() if not _expired(e.weak))

    def device_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if not _expired(e.weak))
