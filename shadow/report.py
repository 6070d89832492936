"""The report of a run (``shadow.Report``): its data (``shadow.reportdata``: records, aggregates, coverage, the saved
form) with its text renderings (``shadow.tables``); ``load_report`` reads one back.

>>> rep = sm.report                                          # doctest: +SKIP
>>> print(rep.summary(top=10)); rep.save("run.json")          # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import reportformat, tables
from .errors import NoKeptInputsError
from .reportdata import ReportData
from .sidecar import KeptInputs, sidecar_path

if TYPE_CHECKING:
    from .band import Envelope
    from .repro import ReproFiles


class Report(ReportData):
    """The results of a ShadowMode run: per-call records, per-op and per-module aggregates, coverage
    (``ReportData``), and their tables.

    >>> rep = sm.report
    >>> print(rep.table())            # doctest: +SKIP
    >>> rep.save("run.json"); shadow.load_report("run.json")  # doctest: +SKIP
    """

    kept: KeptInputs | None = None  # the inputs kept of the worst calls over budget, during a run (shadow repro)
    sidecar: str | None = None  # where a loaded report's kept inputs live (the file next to it)

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as versioned JSON, whole or not at all (``ReportData.save``), and, where it keeps the
        inputs of calls over budget, those in one sidecar next to it (``PATH.inputs.pt``, written first)."""
        kept = self.kept if self.kept is not None and self.kept.calls else None
        if kept is None and self.sidecar is not None and os.path.exists(self.sidecar):
            kept = KeptInputs.load(self.sidecar, self.meta["repro"].get("token"))
        if kept is not None:
            kept.save(sidecar_path(path))
            self.meta["repro"] = {**self.meta.get("repro", {}), "sidecar": os.path.basename(sidecar_path(path))}
        super().save(path)

    def kept_inputs(self) -> KeptInputs:
        """The kept inputs (in memory after a run, else the sidecar next to the loaded report); a
        ``NoKeptInputsError`` or ``SidecarError`` says why there are none and what to do."""
        if self.kept is not None and self.kept.calls:
            return self.kept
        info = self.meta.get("repro")
        if not info or not info.get("kept"):
            raise NoKeptInputsError(_why_none(self.meta))
        if self.sidecar is None:
            raise NoKeptInputsError("this report keeps its inputs in a sidecar file and was not read from one: "
                                    "load it with shadow.load_report(PATH) from beside its PATH.inputs.pt")
        return KeptInputs.load(self.sidecar, info.get("token"))

    def repro(self, call: int | None = None, directory: str | os.PathLike | None = None) -> ReproFiles:
        """Write a reproduction of call ``call`` (its record index; None: the worst call kept) into ``directory``
        (None: ./repro-OP-CALL): ``repro.py``, which needs torch alone and exits 1 when the call is over budget,
        and ``inputs.pt`` (docs/repro.md).

        >>> rep.repro(None, "repro-mm").script      # doctest: +SKIP
        'repro-mm/repro.py'
        """
        from .repro import write

        return write(self.kept_inputs(), call, directory, self.coverage.calls)

    def table(self, by: str = "op", top: int | None = None, *, phase: str | None = None, tree: bool = False) -> str:
        """A text table of the aggregates ``by`` "op", "module", "callsite" or "phase" (``Report.view``), over the
        calls of one ``phase`` (None: all), rows held to derived budgets first, sorted by the worst budget used,
        then the worst local ulp, then the worst drift. ``tree=True`` (by="module"): every module path with its
        submodules folded in, in tree order, indented by depth. ``summary`` adds the legend and the verdict.

        columns (``shadow.tables.LEGEND`` says the same in a user's words): calls, the result dtypes (only when the run mixes
        floating dtypes, as under autocast), max local ulp (over elements whose reference is not 0; ``z``: some
        reference is exactly 0 where the device is not, whose error is in abs and the budget; ``c``: many ulps a
        derived budget allows, a result smaller than its terms), max budget used (``!``: some call over budget;
        ``?``: calls with only the guessed budget of ops no rule knows; ``-``: no budget), the fewest effective bits
        of a call (``-``: exact or no budget; a long TF32 matmul within its worst-case budget still reads ~10 here), max drift
        rel_norm, flips, non-finite, unsupported calls, calls whose float64 reference a spot check found
        untrustworthy (``!`` marks rows with any).

        A merged report (``shadow.merge_reports``) adds, after each figure the rows are ranked by (local ulp,
        budget, drift rel) on which its ranks differ in some row, one column per rank ("budget r0", "budget r1",
        ...; ``=`` on the rows where the ranks agree on it), and a line under the table saying where the ranks
        differ, or that they agree (``shadow.tables.RANK_RTOL``; docs/reports.md, "Merged reports")."""
        return tables.table(self, by, top, phase=phase, tree=tree)

    def summary(self, by: str = "op", top: int | None = None, *, phase: str | None = None, tree: bool = False,
                rich: bool = False, color: bool = False, width: int = 120, envelope: Envelope | None = None) -> str:
        """What ``shadow show`` prints: the table (``table``), how its rows are sorted and what each column means,
        and the verdict (``shadow.verdict.conclude``: what is over budget, where NaN/Inf is born, what was not
        checked, or the all-clear). ``rich=True`` draws the table with the ``rich`` package (``pip install rich``),
        at most ``width`` characters wide, with ANSI colours if ``color`` (for a terminal). With ``envelope``
        (``shadow.envelope``), the verdict says whether the run's loss stays in its band, and the band's table
        follows it.

        >>> print(rep.summary(top=10))     # doctest: +SKIP
        """
        return tables.summary(self, by, top, phase=phase, tree=tree, rich=rich, color=color, width=width,
                              envelope=envelope)


def load_report(path: str | os.PathLike) -> Report:
    """Read a report written by ``Report.save``; checks its format name, version and every field against the
    format's declaration (``shadow.reportformat``), and says what is wrong with anything else
    (``ReportFormatError``).

    >>> rep = shadow.load_report("run.json")  # doctest: +SKIP
    """
    rep = Report.from_contents(reportformat.read_file(path))
    named = (rep.meta.get("repro") or {}).get("sidecar")
    if isinstance(named, str):  # the kept inputs, read when a reproduction asks for them
        rep.sidecar = os.path.join(os.path.dirname(os.fspath(path)), os.path.basename(named))
    return rep


def _why_none(meta: dict) -> str:
    """Why a report keeps no inputs, and what to do, in one line."""
    info, options = meta.get("repro"), meta.get("options") or {}
    rerun = "re-run with ShadowMode(max_repro_bytes=N) or shadow run --max-repro-bytes N (N > 0, default 64 MiB)"
    if "max_repro_bytes" not in options:
        return "this report was saved by a shadow that keeps no inputs: re-run the program with this shadow"
    if options["max_repro_bytes"] == 0:
        return f"this run kept no inputs (max_repro_bytes=0): {rerun}"
    if not info:
        return "no call of this run was over its budget: there is nothing to reproduce"
    left = "; ".join(f"{c['calls']} calls of {c['op']}: {c['why']}" for c in info.get("left_out", []))
    return f"no call's inputs were kept ({left}); where the cap left them out, {rerun}"


def loads(data: bytes | str) -> Report:
    """A report from the text of a saved one (``load_report`` reads a file); what is wrong with anything else is a
    ``ReportFormatError``."""
    return Report.from_contents(reportformat.read_text(data))
