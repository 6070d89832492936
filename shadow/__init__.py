"""shadow: how far your accelerator's arithmetic is from the true result, op by op.

>>> from shadow import ShadowMode
>>> with ShadowMode() as sm:
...     y = model(x)                      # doctest: +SKIP
>>> print(sm.report.table())              # doctest: +SKIP
"""

__version__ = "0.1.0"

from .metrics import ErrorStats
from .modes import ShadowMode
from .options import ShadowOptionError
from .report import Report, ReportFormatError, load_report

__all__ = ["ShadowMode", "Report", "ErrorStats", "load_report", "ShadowOptionError", "ReportFormatError"]
