"""Error budgets (shadow/budgets.py moved into a package; split by family in the next commit)."""

from .core import *  # noqa: F401,F403
from .core import __all__  # noqa: F401
