"""Which devices torch can use on this machine, and why the others cannot be used.

``discover()`` probes each backend (cpu, cuda, mps, xpu, directml) and returns one ``Backend`` record
each: available or not, the reason in plain words, the torch device, its name and whether it computes
in float64; then one more for a PrivateUse1 backend other than DirectML registered in this process (Ascend's
``npu``, PyTorch's ``openreg``, shadow's test stand-in), listed under its own name. It never raises: a broken
backend (a native library that fails to load, a driver error) is a finding, reported in ``reason``. ``choose()``
picks the device ``shadow demo`` uses; ``python -m shadow doctor`` renders all of it.

>>> [b.name for b in discover() if b.available]          # on a machine without GPU
['cpu']
>>> best_device()
device(type='cpu')
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
import warnings
from typing import Any, Callable

import torch

from .. import _compat

BACKENDS = ("cpu", "cuda", "mps", "xpu", "directml")  # probed and listed in this order
# demo takes the first available; a PrivateUse1 backend registered in this process (listed after BACKENDS, under its
# own name) comes before the CPU
PREFERENCE = ("cuda", "mps", "xpu", "directml", "cpu")


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend as found on this machine.

    >>> Backend("cpu", True, "2 threads", "cpu", "AMD EPYC", True).torch_device()
    device(type='cpu')
    """

    name: str  # one of BACKENDS, or the name of a PrivateUse1 backend registered in this process ("npu")
    available: bool
    reason: str  # plain words: what was found, or why it cannot be used
    device: str = ""  # the torch device: "cuda:0", "privateuseone:0" for DirectML; "" when unavailable
    device_name: str = ""  # "NVIDIA H100 80GB HBM3", the CPU's model name...; "" when unknown
    float64: bool | None = None  # whether the device computes in float64 (None: unavailable, or unknown)
    cpu_fallback: bool | None = None  # whether ops without a kernel of the device's own run on the CPU (None: unknown)

    def torch_device(self) -> torch.device:
        """The device to put tensors on (raises ValueError for an unavailable backend)."""
        if not self.available:
            raise ValueError(f"backend {self.name!r} is not available: {self.reason}")
        return torch.device(self.device)


Probe = Callable[[], Backend]
_PROBES: dict[str, Probe] = {}


def _probe(name: str) -> Callable[[Probe], Probe]:
    def register(fn: Probe) -> Probe:
        if name in _PROBES:
            raise ValueError(f"a probe for backend {name!r} is already registered ({_PROBES[name].__name__})")
        if name not in BACKENDS:
            raise ValueError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")
        _PROBES[name] = fn
        return fn

    return register


def discover() -> list[Backend]:
    """Probe every backend; one record each, in ``BACKENDS`` order. Never raises.

    >>> {b.name: b.available for b in discover()}["cpu"]
    True
    """
    found = []
    for name, probe in [*((name, _PROBES[name]) for name in BACKENDS), (_privateuse1_name(), _privateuse1)]:
        try:
            with warnings.catch_warnings():  # reasons go into the record, not onto the user's terminal
                warnings.simplefilter("ignore")
                backend = probe()
        except Exception as exc:  # a broken backend is a finding, never an error
            backend = Backend(name, False, f"probing it failed: {describe(exc)}")
        if backend is not None:
            found.append(backend)
    return found


def choose(backends: list[Backend] | None = None) -> Backend:
    """The backend ``shadow demo`` uses: the first available in ``PREFERENCE``, a PrivateUse1 backend registered in
    this process before the CPU."""
    backends = discover() if backends is None else backends
    by_name = {b.name: b for b in backends}
    for name in PREFERENCE:
        if name == "cpu":
            other = next((b for b in backends if b.name not in BACKENDS and b.available), None)
            if other is not None:
                return other
        if name in by_name and by_name[name].available:
            return by_name[name]
    return next(b for b in backends if b.name == "cpu")


def best_device() -> torch.device:
    """cuda if available, else mps, else xpu, else DirectML, else a PrivateUse1 backend registered in this process,
    else cpu."""
    return choose().torch_device()


@functools.lru_cache(maxsize=None)  # a device type holds the same dtypes all process long
def _holds(device_type: str, dtype: torch.dtype) -> bool:
    if device_type in ("cpu", "meta"):
        return True
    try:  # an empty tensor: no values asked of the device
        torch.empty(0, dtype=dtype, device=device_type)
    except Exception:
        return False
    return True


def holds_dtype(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can live on ``device``'s type: DirectML has no float64 and no bfloat16, MPS no
    float64. Asked once per device type and dtype (one empty tensor), then cached.

    >>> holds_dtype("cpu", torch.float64)
    True
    """
    return _holds(torch.device(device).type, dtype)


def describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _import_module(name: str) -> Any:  # a seam for the tests: a fake torch_directml with an adapter
    return importlib.import_module(name)


# --- the probes ---
@_probe("cpu")
def _cpu() -> Backend:
    isa = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else ""
    reason = f"{torch.get_num_threads()} threads" + (f", vector instructions {isa}" if isa else "")
    return Backend("cpu", True, reason, "cpu", _cpu_name(), True)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@_probe("cuda")
def _cuda() -> Backend:
    hip = getattr(torch.version, "hip", None)
    api = f"ROCm (HIP {hip})" if hip else f"CUDA {torch.version.cuda}"
    if not torch.backends.cuda.is_built():
        return Backend("cuda", False, f"CUDA is not built into this torch ({torch.__version__}): install a CUDA "
                                      "build of torch (https://pytorch.org/get-started/locally/)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            n = torch.cuda.device_count()
        except Exception as exc:
            return Backend("cuda", False, f"this torch is built with {api}, but the driver failed: {describe(exc)}")
    if n == 0:
        why = " ".join(str(caught[-1].message).split()) if caught else ""  # "CUDA initialization: ..."
        if not why:  # the driver's own words: initialization names the cause (no driver, no device, a mismatch)
            try:
                torch.cuda.init()
            except Exception as exc:
                why = describe(exc)
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if hidden is not None and not hidden.strip():
            why = f"CUDA_VISIBLE_DEVICES is empty{'; ' + why if why else ''}"
        return Backend("cuda", False, f"this torch is built with {api}, but finds no GPU" + (f": {why}" if why else ""))
    i = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(i)
    reason = f"{api}, {n} GPU{'s' if n > 1 else ''}; compute capability {props.major}.{props.minor}, " \
             f"{props.total_memory / 2**30:.0f} GiB"
    return Backend("cuda", True, reason, f"cuda:{i}", torch.cuda.get_device_name(i), True)


@_probe("mps")
def _mps() -> Backend:
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_built():
        return Backend("mps", False, f"MPS is not built into this torch ({torch.__version__}): it exists in the "
                                     "macOS builds only")
    if not mps.is_available():
        return Backend("mps", False, "this torch is built with MPS, but it is unavailable: it needs macOS 12.3 or "
                                     "later on a Mac with Apple silicon or an AMD GPU")
    return Backend("mps", True, "Metal Performance Shaders; no float64 on the device", "mps",
                   f"Apple GPU ({platform.machine()})", False)


@_probe("xpu")
def _xpu() -> Backend:
    if not _compat.xpu_compiled():
        return Backend("xpu", False, f"XPU (Intel GPU) is not built into this torch ({torch.__version__}): install "
                                     "an XPU build (https://pytorch.org/get-started/locally/)")
    try:
        n = torch.xpu.device_count()
    except Exception as exc:
        return Backend("xpu", False, f"this torch is built with XPU, but the driver failed: {describe(exc)}")
    if n == 0:
        return Backend("xpu", False, "this torch is built with XPU, but finds no Intel GPU (check its driver and the "
                                     "oneAPI runtime)")
    i = torch.xpu.current_device()
    props = torch.xpu.get_device_properties(i)
    fp64 = getattr(props, "has_fp64", None)
    return Backend("xpu", True, f"{n} Intel GPU{'s' if n > 1 else ''}", f"xpu:{i}", torch.xpu.get_device_name(i),
                   None if fp64 is None else bool(fp64))


@_probe("directml")
def _directml() -> Backend:
    if importlib.util.find_spec("torch_directml") is None:
        return Backend("directml", False, "torch-directml is not installed (pip install torch-directml: it runs on "
                                          f"Windows and WSL2 and pins torch==2.4.1; this torch is {torch.__version__})")
    version, pin = _distribution("torch-directml")
    installed = f"torch-directml {version}".rstrip()
    mismatch = f"it is built for torch{pin} and this torch is {torch.__version__}" \
        if pin and not _pin_matches(pin) else ""
    found = _directml_child()
    stage, error, crash = found.get("stage", ""), found.get("error", ""), found.get("crashed", "")
    if stage == "load":  # libdirectml.so needs libd3d12.so, which only WSL2 provides (/usr/lib/wsl/lib)
        return Backend("directml", False, f"{installed} is installed, but its native library failed to load: "
                                          f"{error} (DirectML runs on Windows and WSL2 only"
                                          f"{'; ' + mismatch if mismatch else ''})")
    if stage == "import":
        return Backend("directml", False, f"{installed} is installed, but importing it failed: {error}"
                                          f"{' (' + mismatch + ')' if mismatch else ''}")
    if stage == "loaded" and crash:
        return Backend("directml", False, f"{installed} loaded, but found no DirectX 12 adapter: looking for one "
                                          f"crashed the process ({crash})")
    if stage == "count":  # DXCore could not enumerate adapters: no /dev/dxg, no driver
        return Backend("directml", False, f"{installed} loaded, but found no DirectX 12 adapter"
                                          f"{': ' + error if error else ''}")
    if stage != "found":
        return Backend("directml", False, f"{installed} is installed, but probing it "
                                          f"{'crashed the process (' + crash + ')' if crash else 'failed: ' + error}")
    try:  # an adapter exists: load the backend here too, so that tensors can go to the device
        dml = _import_module("torch_directml")
    except Exception as exc:
        return Backend("directml", False, f"{installed} found an adapter in a child process, but importing it "
                                          f"here failed: {describe(exc)}")
    n, fp64 = found["count"], bool(found["float64"])
    reason = f"{installed}, {n} DirectX 12 adapter{'s' if n > 1 else ''}" + \
        ("" if fp64 else "; no float64 on the device (shadows live on the CPU anyway)")
    return Backend("directml", True, reason, str(dml.device(found["index"])), found["name"], fp64)


def _privateuse1_name() -> str:
    return torch._C._get_privateuse1_backend_name()


def _privateuse1() -> Backend | None:
    """A PrivateUse1 backend registered in this process (it registers an ``empty`` kernel), other than DirectML's
    (the directml probe's): under its own name, with what its dispatcher registrations and one empty float64
    tensor say. None when there is none."""
    name = _privateuse1_name()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::empty.memory_format", "PrivateUse1"):
        return None
    if "torch_directml" in sys.modules:
        return None
    module = getattr(torch, name, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else None
    if count == 0:
        return Backend(name, False, f"a PrivateUse1 backend named {name!r} is registered, but torch.{name}"
                                    ".device_count() is 0")
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    device = torch.device(name, index)
    ops = sum(n.startswith("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key("PrivateUse1"))
    fallback = torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.PrivateUse1)
    try:  # no values asked of the device: an empty tensor, refused where the backend has no float64 at all
        torch.empty(0, dtype=torch.float64, device=device)
        fp64, no_fp64 = True, ""
    except Exception as exc:
        fp64, no_fp64 = False, f"; no float64 on the device ({describe(exc)})"
    rest = "the others run through its CPU fallback" if fallback else "no CPU fallback: the others raise"
    devices = f"{count} device{'s' if count != 1 else ''}, " if count is not None else ""
    reason = f"a PrivateUse1 backend registered in this process: {devices}{ops} aten ops with kernels of its own, " \
             f"{rest}{no_fp64}"
    return Backend(name, True, reason, str(device), name, fp64, fallback)


# torch-directml is probed in a child process: without an adapter, its device_count() sometimes raises and
# sometimes crashes the process with SIGSEGV (torch-directml 0.2.5 on Linux without /dev/dxg). Each line it
# prints is the stage reached, so a crash still says where.
_DIRECTML_CHILD = r"""
import json, sys
def say(**kw): print(json.dumps(kw), flush=True)
def describe(e):
    t = " ".join(str(e).split())
    return f"{type(e).__name__}: {t[:300]}" if t else type(e).__name__
try:
    import torch_directml as d
except OSError as e:
    say(stage="load", error=describe(e)); sys.exit()
except Exception as e:
    say(stage="import", error=describe(e)); sys.exit()
say(stage="loaded")
try:
    n = d.device_count()
except Exception as e:
    say(stage="count", error=describe(e)); sys.exit()
if not n:
    say(stage="count", error=""); sys.exit()
i = d.default_device()
say(stage="found", count=n, index=i, name=d.device_name(i), float64=bool(d.has_float64_support(i)))
"""


@functools.lru_cache(maxsize=None)  # adapters do not come and go within a process
def _directml_child(timeout: float = 300) -> dict:
    """What a child process importing torch_directml reached: {"stage": ..., "error": ..., "crashed": ...}."""
    import signal
    import subprocess
    import sys

    try:
        proc = subprocess.run([sys.executable, "-c", _DIRECTML_CHILD], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"stage": "", "error": f"the probe took over {timeout:.0f} s"}
    found: dict = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            found = json.loads(line)
    if proc.returncode < 0:
        try:
            found["crashed"] = f"signal {-proc.returncode}, {signal.Signals(-proc.returncode).name}"
        except ValueError:
            found["crashed"] = f"signal {-proc.returncode}"
    elif proc.returncode and not found:
        tail = " ".join(proc.stderr.split())[-300:]
        found = {"stage": "", "error": f"exit status {proc.returncode}: {tail}"}
    return found


def _distribution(name: str) -> tuple[str, str]:
    """(version, the torch requirement such as "==2.4.1") of an installed distribution; "" where unknown."""
    try:
        version = importlib.metadata.version(name)
        requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return "", ""
    for req in requires:
        m = re.match(r"torch\s*([<>=!~].*?)\s*(;|$)", req)
        if m:
            return version, m.group(1).replace(" ", "")
    return version, ""


def _pin_matches(pin: str) -> bool:
    if not pin.startswith("=="):
        return True  # a range: not worth a parser here; the import's own error says more
    return torch.__version__.split("+")[0] == pin[2:]
