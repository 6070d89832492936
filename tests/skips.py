"""Skips that state torch's own reason (the models themselves stay free of pytest: benchmarks import them)."""

import pytest
import torch

from models import impl_unsupported


def skip_unsupported(name: str, impl: str, *dtypes: torch.dtype) -> None:
    """Skip the test, saying why, when optimizer ``name`` cannot run as ``impl`` here for every dtype given."""
    if (reason := impl_unsupported(name, impl, *dtypes)) is not None:
        pytest.skip(reason)
