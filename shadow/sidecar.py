"""The inputs kept of the calls over budget (``shadow.engine.keep``), and their saved form: one file next to the
report, ``REPORT.inputs.pt`` (torch.save of plain values and CPU tensors, read with ``weights_only=True``), written
whole or not at all as the report is (``shadow.reportformat.write_atomically``). ``shadow repro`` reads it
(docs/repro.md: the sidecar format).

>>> kept = KeptInputs(64 << 20)
>>> kept.summary()["kept"], sidecar_path("run.json")
([], 'run.json.inputs.pt')
"""

from __future__ import annotations

import dataclasses
import io
import os
import secrets
from typing import Any

import torch

from .errors import SidecarError
from .reportformat import write_atomically
from .reproscript import is_plain, load

FORMAT = "shadow-inputs"
VERSION = 1
SUFFIX = ".inputs.pt"
PER_CLASS = 3  # calls kept per op class, the worst first: memory stays bounded over a long run


def sidecar_path(report: str | os.PathLike) -> str:
    """Where the kept inputs of the report saved at ``report`` live."""
    return os.fspath(report) + SUFFIX


@dataclasses.dataclass
class KeptCall:
    """One call's inputs as the device had them before it, and what its record said.

    ``tensors``: per tensor argument (in the op's argument order, lists expanded) its ``values`` (a contiguous CPU
    tensor of its shape, in its own dtype; None for an out= buffer, whose values the op never reads), ``size``,
    ``stride``, ``offset`` (its storage offset), ``dtype`` and schema ``name``; ``args``/``kwargs``: the call's
    arguments, each tensor as {"tensor": i}, a dtype, device, layout or memory format as {"dtype": "float16"}...;
    ``written``: the tensors an op returning nothing writes (its outputs); ``checksums``: the device's outputs'
    (``shadow.reproscript.checksum``) by output slot; ``record``: the call's ``Record.to_dict()``."""

    index: int
    op: str
    device: str
    dtype: str  # the dtype its error is measured in ("float16")
    tensors: list[dict]
    args: list
    kwargs: dict
    written: list[int]
    checksums: dict[int, str]
    record: dict

    @property
    def budget_used(self) -> float:
        return self.record["budget"]["used"]

    @property
    def nbytes(self) -> int:
        return sum(t["values"].numel() * t["values"].element_size() for t in self.tensors if t["values"] is not None)


class KeptInputs:
    """The calls kept during a run within ``cap`` bytes, and what was left out: by op class, how many calls over
    budget and why ("not among the worst 3 of its class", "over the cap of N bytes", ...). ``emulation``: the
    emulated devices and fault modes (shadow.modes) the run's device computed under."""

    def __init__(self, cap: int, token: str | None = None):
        self.cap = cap
        self.token = token or secrets.token_hex(8)  # the report and its sidecar name the same run
        self.calls: dict[int, KeptCall] = {}
        self.left_out: dict[tuple[str, str], int] = {}
        self.emulation: list[dict] = []  # per mode, outermost first: shadow.engine.keep.recorded
        self.torch = str(torch.__version__)
        self.numerics: dict = {}

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.calls.values())

    def leave_out(self, op: str, why: str) -> None:
        self.left_out[op, why] = self.left_out.get((op, why), 0) + 1

    def summary(self) -> dict:
        """What report.meta["repro"] says: the cap, the calls kept, the calls over budget left out and why."""
        return {"token": self.token, "max_bytes": self.cap, "bytes": self.nbytes,
                "kept": [{"call": c.index, "op": c.op, "budget_used": c.budget_used, "bytes": c.nbytes}
                         for c in sorted(self.calls.values(), key=lambda c: -c.budget_used)],
                "left_out": [{"op": op, "why": why, "calls": n} for (op, why), n in sorted(self.left_out.items())]}

    # --- the saved form ---
    def save(self, path: str | os.PathLike) -> None:
        """Write the sidecar at ``path``, whole or not at all."""
        d = {"format": FORMAT, "version": VERSION, "token": self.token, "torch": self.torch, "numerics": self.numerics,
             "emulation": self.emulation, "calls": [dataclasses.asdict(c) for c in self.calls.values()]}
        buffer = io.BytesIO()
        torch.save(d, buffer)
        write_atomically(path, lambda f: f.write(buffer.getvalue()), binary=True)

    @classmethod
    def load(cls, path: str | os.PathLike, token: str | None) -> KeptInputs:
        """The sidecar at ``path`` of the report naming ``token``; a ``SidecarError`` says what is wrong with any
        other file and what to do."""
        fix = "re-run the program to write the report and its inputs again"
        if not os.path.exists(path):
            raise SidecarError(os.fspath(path), "missing: the kept inputs live in one file next to the report "
                               f"(REPORT{SUFFIX}); copy it beside the report, or {fix}")
        try:
            d = load(path)
        except ValueError as exc:
            raise SidecarError(os.fspath(path), f"{exc}; {fix}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise SidecarError(os.fspath(path), f"not a shadow inputs file (format {FORMAT!r}); {fix}")
        if d.get("version") != VERSION:
            raise SidecarError(os.fspath(path), f"version {d.get('version')!r}: this shadow reads version {VERSION}; "
                               "use the shadow that wrote it, or " + fix)
        if token is not None and d.get("token") != token:
            raise SidecarError(os.fspath(path), f"belongs to another run than the report beside it; {fix}")
        emulation = d.get("emulation")
        if not isinstance(emulation, list) or not all(isinstance(e, dict) and isinstance(e.get("repr"), str)
                                                      and is_plain(e) for e in emulation):
            raise SidecarError(os.fspath(path), f"malformed (its emulations are not plain specs); {fix}")
        kept = cls(0, d["token"])
        kept.torch, kept.numerics, kept.emulation = d["torch"], d["numerics"], d["emulation"]
        try:
            kept.calls = {c["index"]: KeptCall(**c) for c in d["calls"]}
        except (TypeError, KeyError) as exc:
            raise SidecarError(os.fspath(path), f"malformed ({exc}); {fix}") from None
        return kept


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """A tensor argument's place among ``KeptCall.tensors`` (what ``encode`` writes as {"tensor": index})."""

    index: int


def encode(value: Any) -> Any:
    """An argument in its kept form (``KeptCall.args``), its tensors already ``TensorSlot``s. Raises TypeError for a
    value that cannot be kept (a generator)."""
    if isinstance(value, TensorSlot):
        return {"tensor": value.index}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for kind in (torch.dtype, torch.layout, torch.memory_format):
        if isinstance(value, kind):
            return {kind.__name__: str(value).removeprefix("torch.")}
    raise TypeError(f"an argument of type {type(value).__name__}")
