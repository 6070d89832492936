"""shadow: how far your accelerator's arithmetic is from the true result, op by op.

>>> from shadow import ShadowMode
>>> with ShadowMode() as sm:
...     y = model(x)                      # doctest: +SKIP
>>> print(sm.report.table())              # doctest: +SKIP
"""

__version__ = "0.1.0"

from .errors import ReportFormatError, ShadowOptionError, ShadowWarning
from .metrics import ErrorStats
from .modes import ShadowMode
from .records import BudgetInfo, Kind, Phase, Record
from .report import Aggregate, Coverage, Report, load_report
from .spot import SpotStats
from .attribution.share import AttributionResult, Share, attribute
from .audit import AuditReport, AuditRow, audit
from .audit.plan import Plan

__all__ = ["ShadowMode", "Report", "Record", "Aggregate", "Coverage", "BudgetInfo", "ErrorStats", "SpotStats", "Kind",
           "Phase", "load_report", "ShadowOptionError", "ReportFormatError", "ShadowWarning", "attribute",
           "AttributionResult", "Share", "audit", "AuditReport", "AuditRow", "Plan"]
