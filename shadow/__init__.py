"""shadow: how far your accelerator's arithmetic is from the true result, op by op.

>>> from shadow import ShadowMode
>>> with ShadowMode() as sm:
...     y = model(x)                      # doctest: +SKIP
>>> print(sm.report.table())              # doctest: +SKIP

The names below are imported on first use (PEP 562): importing ``shadow`` alone (as pytest does to load the
plugin in every session) costs neither torch nor numba.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {  # name -> the module that defines it
    "ShadowMode": "modes",
    "Report": "report", "load_report": "report",
    "Record": "records", "BudgetInfo": "records", "Kind": "records", "Phase": "records", "Aggregate": "records",
    "Coverage": "records",
    "ErrorStats": "metrics",
    "SpotStats": "spot",
    "ShadowOptionError": "errors", "ReportFormatError": "errors", "ShadowWarning": "errors",
    "attribute": "attribution.share", "AttributionResult": "attribution.share", "Share": "attribution.share",
    "merge_reports": "distributed",
    "audit": "precision", "AuditReport": "precision", "AuditRow": "precision", "Plan": "precision.lowering",
    "explain": "explanation", "Explanation": "explanation",
    "envelope": "attribution.envelope", "Envelope": "band", "load_envelope": "band",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:  # a submodule (shadow.engine, shadow.modes...), as plain attribute access finds it
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'shadow' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
