"""The report of a run (``shadow.Report``): its data (``shadow.reportdata``: records, aggregates, coverage, the saved
form) with its text renderings (``shadow.tables``); ``load_report`` reads one back.

>>> rep = sm.report                                          # doctest: +SKIP
>>> print(rep.summary(top=10)); rep.save("run.json")          # doctest: +SKIP
"""

from __future__ import annotations

import os

from . import reportformat, tables
from .reportdata import ReportData


class Report(ReportData):
    """The results of a ShadowMode run: per-call records, per-op and per-module aggregates, coverage
    (``ReportData``), and their tables.

    >>> rep = sm.report
    >>> print(rep.table())            # doctest: +SKIP
    >>> rep.save("run.json"); shadow.load_report("run.json")  # doctest: +SKIP
    """

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
                rich: bool = False, color: bool = False, width: int = 120) -> str:
        """What ``shadow show`` prints: the table (``table``), how its rows are sorted and what each column means,
        and the verdict (``shadow.verdict.conclude``: what is over budget, where NaN/Inf is born, what was not
        checked, or the all-clear). ``rich=True`` draws the table with the ``rich`` package (``pip install rich``),
        at most ``width`` characters wide, with ANSI colours if ``color`` (for a terminal).

        >>> print(rep.summary(top=10))     # doctest: +SKIP
        """
        return tables.summary(self, by, top, phase=phase, tree=tree, rich=rich, color=color, width=width)


def load_report(path: str | os.PathLike) -> Report:
    """Read a report written by ``Report.save``; checks its format name, version and every field against the
    format's declaration (``shadow.reportformat``), and says what is wrong with anything else
    (``ReportFormatError``).

    >>> rep = shadow.load_report("run.json")  # doctest: +SKIP
    """
    return Report.from_contents(reportformat.read_file(path))


def loads(data: bytes | str) -> Report:
    """A report from the text of a saved one (``load_report`` reads a file); what is wrong with anything else is a
    ``ReportFormatError``."""
    return Report.from_contents(reportformat.read_text(data))
