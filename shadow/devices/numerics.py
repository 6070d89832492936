"""The process-wide switches (TF32, reduced-precision reductions, deterministic algorithms) that change a
device's arithmetic: they belong in a report."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np
import torch

from .discovery import describe


def _attr(path: str) -> Callable[[], Any]:
    def get() -> Any:
        obj: Any = torch
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        return obj

    return get


def _call(path: str) -> Callable[[], Any]:
    return lambda: _attr(path)()()


def flushes_subnormals() -> bool:
    """Whether this thread's CPU flushes subnormal numbers to zero: ``torch.set_flush_denormal(True)`` sets it,
    and so does loading code compiled with ``-ffast-math`` (torch 2.4's Inductor compiles its C++ that way, so
    a ``torch.compile`` call there turns it on for the rest of the process). Read with numpy: no torch op."""
    return bool(np.float64(1e-310) * np.float64(1.0) == 0.0)


# name -> reader; a name whose API this torch lacks is left out. The fp32_precision API (torch >= 2.9)
# sits beside the legacy flags; after the new API has been used, reading a legacy flag may raise.
NUMERICS: dict[str, Callable[[], Any]] = {
    **{f"{p}()": _call(p) for p in (
        "torch.get_float32_matmul_precision",
        "torch.are_deterministic_algorithms_enabled",
        "torch.is_deterministic_algorithms_warn_only_enabled",
        "torch.backends.cuda.flash_sdp_enabled",
        "torch.backends.cuda.mem_efficient_sdp_enabled",
        "torch.backends.cuda.math_sdp_enabled",
        "torch.backends.cuda.cudnn_sdp_enabled",
        "torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed",
        # oneDNN runs CPU bfloat16 convolutions only where its instruction set has AVX-512 (and it is enabled);
        # elsewhere PyTorch's own kernels round more (docs/budgets.md: Kernel findings)
        "torch.ops.mkldnn._is_mkldnn_bf16_supported",
    )},
    "torch.set_flush_denormal": flushes_subnormals,
    **{p: _attr(p) for p in (
        "torch.backends.cuda.matmul.allow_tf32",
        "torch.backends.cudnn.allow_tf32",
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        "torch.backends.cuda.matmul.allow_fp16_accumulation",
        "torch.backends.fp32_precision",
        "torch.backends.cuda.matmul.fp32_precision",
        "torch.backends.cudnn.fp32_precision",
        "torch.backends.cudnn.conv.fp32_precision",
        "torch.backends.cudnn.rnn.fp32_precision",
        "torch.backends.mkldnn.fp32_precision",
        "torch.backends.mkldnn.matmul.fp32_precision",
        "torch.backends.mkldnn.conv.fp32_precision",
        "torch.backends.mkldnn.rnn.fp32_precision",
        "torch.backends.mkldnn.enabled",
        "torch.backends.cudnn.enabled",
        "torch.backends.cudnn.deterministic",
        "torch.backends.cudnn.benchmark",
    )},
}


def numerics_settings() -> dict[str, Any]:
    """The process-wide switches that change a device's arithmetic, as this torch reports them: TF32 for
    matmuls and cuDNN (``torch.backends.cudnn.allow_tf32`` is True by default: convolutions run in TF32 on
    Ampere and later unless turned off), reduced-precision reductions, the SDPA kernels allowed, and
    deterministic algorithms. Never raises: a setting that cannot be read is given as "error: ...".

    >>> numerics_settings()["torch.backends.cudnn.allow_tf32"]     # doctest: +SKIP
    True
    """
    out: dict[str, Any] = {}
    for name, read in NUMERICS.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = read()
        except AttributeError:  # not in this torch
            continue
        except Exception as exc:  # e.g. a legacy TF32 flag read after the fp32_precision API was used
            value = f"error: {describe(exc)}"
        out[name] = value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
    return out
