"""A DirectML-like PrivateUse1 backend for the tests: ``device()`` builds the C++ extension ``standin.cpp`` (once per
machine, torch version and source, into ``~/.cache/shadow/privateuse1``), loads it and returns
``torch.device("privateuseone:0")``.

torch-directml pins torch 2.4.1 and its native library loads only on Windows and WSL2, so the device shadow exists
for never ran in CI. This backend behaves like it where shadow can tell:

- memory of its own (its own allocator): no CPU tensor holds a device storage; values leave through its copies;
- the device type stays ``privateuseone``; float64 is refused with DirectML's message ("The GPU device does not
  support Double (Float64) operations!"): a float64 allocation, and a copy between the device and the CPU that
  converts to or from float64 (DirectML converts on the device); there is no bfloat16;
- the ops torch-directml 0.2.5 registers (``DIRECTML_OPS``, read from its dispatcher registrations) are device
  kernels: most run the CPU kernel on the device memory (so their arithmetic is float32, as DirectML's); a few
  compute as a GPU does (``GPU_ARITHMETIC``); every other op goes through a boxed CPU fallback, with DirectML's
  warning; ``reshape`` is registered for AutogradPrivateUse1 too, as DirectML does;
- views share storage, in-place and out= ops work, random ops draw from a generator of the device's own,
  ``.item()`` works; ``counters()`` counts the copies and ``.item()`` reads asked for from outside its kernels.

Tests using it carry the ``privateuse1`` marker; on a machine without a C++ compiler or ninja they skip saying
why (tests/conftest.py), except under CI, where they fail.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import pathlib
import shutil
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "standin.cpp"
# torch-directml 0.2.5's registrations for PrivateUse1 (its aten operators; c10d and torchvision ones aside)
DIRECTML_OPS = frozenset(name.removeprefix("aten::") for name in json.loads((HERE / "directml_ops.json").read_text())
                         if name.startswith("aten::"))
# ops whose device kernel computes as a GPU does rather than as the CPU: a matmul summing K in blocks of 16
# added pairwise (float32), or accumulating in float16 (float16); exp as exp2(x * log2 e) in float32
GPU_ARITHMETIC = frozenset({"mm.out", "bmm.out", "addmm.out", "baddbmm.out", "dot", "exp.out"})
CACHE = pathlib.Path(os.environ.get("SHADOW_PRIVATEUSE1_CACHE", pathlib.Path.home() / ".cache/shadow/privateuse1"))
NAME = "privateuseone"  # DirectML's device type: torch's own name for PrivateUse1

# one module under both names it is imported by (tests import helpers from their folder, outside checks from the
# repository root): the extension registers its kernels once per process
sys.modules.setdefault("privateuse1", sys.modules[__name__])
sys.modules.setdefault("tests.privateuse1", sys.modules[__name__])


def unavailable() -> str | None:
    """Why the extension cannot be built on this machine (no C++ compiler, no ninja), or None."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH; install g++) to build the privateuseone stand-in"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja): torch.utils.cpp_extension builds the stand-in with it"
    return None


def _exists(name: str) -> bool:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return packet is not None and (overload or "default") in packet.overloads()


STALE_LOCK_S = 20 * 60  # a build takes 1-3 minutes on 2 cores: a lock this old is a killed build's


@functools.cache
def extension():
    """The built extension, its kernels registered (once per process)."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    from torch.utils import cpp_extension

    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:12]
    build = CACHE / f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{tag}"
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"  # torch's FileBaton: a build killed midway leaves it, and every later build waits forever
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    ext = cpp_extension.load(name=f"shadow_privateuse1_{tag}", sources=[str(SOURCE)], build_directory=str(build),
                             extra_cflags=["-O2"], verbose=False)
    own = set(ext.own_kernels())
    ext.register_device_kernels(sorted(n for n in DIRECTML_OPS - own if _exists(n)))
    if os.environ.get("SHADOW_PRIVATEUSE1_NO_AUTOGRAD_RESHAPE") != "1":  # set only to show what losing it breaks
        ext.register_autograd_reshape()
    return ext


def load(name: str = NAME):
    """The extension, with PrivateUse1 named ``name`` and its device module registered as ``torch.<name>``
    (torch 2.13's autograd engine asks the accelerator's module for its device). A process names PrivateUse1
    once: ``name`` other than "privateuseone" (a renamed backend such as "npu") belongs in a process of its own."""
    ext = extension()
    if torch._C._get_privateuse1_backend_name() != name:
        torch.utils.rename_privateuse1_backend(name)
    elif name == NAME and not hasattr(torch, NAME):
        torch.utils.rename_privateuse1_backend(NAME)  # same name: torch >= 2.5 then knows the backend is set up
    if not hasattr(torch, name):
        from . import runtime

        torch._register_device_module(name, runtime.module(ext))
        atexit.register(runtime.let_autograd_threads_finish)
    return ext


def device(name: str = NAME) -> torch.device:
    """``torch.device("privateuseone:0")``: the stand-in, built or loaded."""
    load(name)
    return torch.device(name, 0)


def counters() -> dict[str, int]:
    """Copies device -> host and host -> device, and ``.item()`` reads, asked for from outside the backend's own
    kernels since the last ``reset_counters()``; and the device bytes allocated now."""
    return dict(extension().counters())


def reset_counters() -> None:
    """Zero the counters and forget the ops run through the fallback."""
    extension().reset_counters()


def fallback_ops() -> set[str]:
    """The ops ("aten::lerp.Scalar_out") the backend ran through its CPU fallback since ``reset_counters()``."""
    return set(extension().fallback_ops())


def device_kernels() -> frozenset[str]:
    """The overloads registered as device kernels, as this torch names them: DirectML's list and the fused RNN
    cells aten's LSTM and GRU call on any PrivateUse1 device (``extra_kernels``)."""
    ext = extension()
    return frozenset(n for n in DIRECTML_OPS if _exists(n)) | frozenset(ext.extra_kernels())
