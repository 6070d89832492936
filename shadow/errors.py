"""shadow's exception types, in one leaf module (it imports nothing of shadow's): each carries what it is
about (the op, the option, the registrant) and its message says what was expected and the fix."""

from __future__ import annotations

from typing import Any


class ShadowWarning(UserWarning):
    """Something shadow cannot see as the program would run without it (a compiled module runs eagerly):
    the numbers are still honest, about what ran. Filter it with ``warnings.filterwarnings``."""


class ShadowOptionError(ValueError):
    """An option has a value shadow cannot use; the message names the valid values."""


class ReportFormatError(ValueError):
    """A file is not a shadow report this version can read."""


class DuplicateRuleError(ValueError):
    """A rule table already holds a rule for this op: each op has one rule per table.

    >>> str(DuplicateRuleError("budget", "aten.mm.default", "mm_budget", "my_rule"))
    'a budget rule for aten.mm.default is already registered (mm_budget); my_rule cannot replace it'
    """

    def __init__(self, table: str, op: Any, existing: str, new: str):
        super().__init__(f"a {table} rule for {op} is already registered ({existing}); {new} cannot replace it")
        self.table = table
        self.op = op
        self.existing = existing
        self.new = new


class Unsupported(Exception):
    """A replay rule cannot replay this call; carries the op and the reason for the report."""

    def __init__(self, op: str, reason: str):
        super().__init__(f"{op}: {reason}")
        self.op = op
        self.reason = reason


class NoReference(Exception):
    """This call cannot be spot-checked; carries the op and the reason (never a guessed value)."""

    def __init__(self, op: str, reason: str):
        super().__init__(f"{op}: {reason}")
        self.op = op
        self.reason = reason


class EmulationOrderError(RuntimeError):
    """An emulation entered while a ShadowMode is active: it must be entered first (outside)."""

    def __init__(self, emulation: str):
        self.emulation = emulation  # how the emulation is built, e.g. "TF32Mode()"
        super().__init__(
            f"{emulation} entered inside an active ShadowMode: the emulation would sit above ShadowMode and "
            f"ShadowMode would see its internal ops. Enter the emulation first: "
            f"`with {emulation}, ShadowMode() as sm:`"
        )


class ShadowMemoryError(MemoryError):
    """The shadows would exceed ``ShadowMode(max_shadow_bytes=...)``: raised before the op that needs more runs
    on the device (nothing of the user's is half-computed). Its message says how much was held and which
    options help."""


class ReproError(ValueError):
    """A reproduction cannot be written (``Report.repro``, ``shadow repro``); the message names the problem and
    the fix."""


class NoKeptInputsError(ReproError):
    """The report keeps no inputs to reproduce a call from (``why`` says which case)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class SidecarError(ReproError):
    """The file of kept inputs next to a report is missing, damaged or another run's."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class CallNotKeptError(ReproError):
    """A call was asked for whose inputs the report does not keep."""

    def __init__(self, call: Any, kept: list[int], detail: str):
        super().__init__(f"call {call}: {detail}; the calls kept: "
                         f"{', '.join(map(str, kept))} (give one of them, e.g. --call {kept[0]})" if kept else detail)
        self.call = call
        self.kept = kept
