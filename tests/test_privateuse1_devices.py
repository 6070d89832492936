"""shadow.devices on a PrivateUse1 backend: discovery and ``shadow doctor`` list it under its name with its facts,
``cpu_fallback`` reads its registrations (checked against the stand-in's own list), and a renamed backend is found
under its new name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shadow import devices
from shadow.cli import main
from shadow.devices import KernelSource, kernel_source

import privateuse1
from privateuse1 import device, device_kernels

pytestmark = pytest.mark.privateuse1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


@pytest.fixture(scope="module")
def dml():
    return device()


def test_discovery_lists_the_registered_backend_with_its_facts(dml):
    found = {b.name: b for b in devices.discover()}
    b = found["privateuseone"]
    ops = len(device_kernels())
    assert (b.available, b.device, b.float64, b.cpu_fallback) == (True, "privateuseone:0", False, True)
    assert f"{ops} aten ops with kernels of its own, the others run through its CPU fallback" in b.reason
    assert "no float64 on the device (RuntimeError: The GPU device does not support Double" in b.reason
    assert list(found)[:len(devices.BACKENDS)] == list(devices.BACKENDS)  # after the fixed probes
    gpus = [n for n in ("cuda", "mps", "xpu", "directml") if found[n].available]
    assert devices.choose().name == (gpus[0] if gpus else "privateuseone")
    assert devices.best_device() == (found[gpus[0]].torch_device() if gpus else dml)


def test_doctor_lists_it(dml, capsys):
    assert main(["doctor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    row = next(b for b in doc["backends"] if b["name"] == "privateuseone")
    assert row["available"] and row["float64"] is False and row["cpu_fallback"] is True
    assert doc["uses"] == devices.choose().name
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "\nprivateuseone " in text and "aten ops with kernels of its own" in " ".join(text.split())


def _overloads_with_a_cpu_kernel_only() -> list[torch._ops.OpOverload]:
    """Every aten overload with a CPU kernel and no composite one: on PrivateUse1 it runs the backend's kernel when
    the backend registers one, else the fallback."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not has(name, "CPU") or any(has(name, k) for k in COMPOSITE_KEYS):
            continue
        base, _, overload = name.removeprefix("aten::").partition(".")
        packet = getattr(torch.ops.aten, base, None)
        if packet is not None and (overload or "default") in packet.overloads():
            found.append(getattr(packet, overload or "default"))
    return found


def test_cpu_fallback_reads_the_registrations(dml):
    """Every op the stand-in registers is a device kernel; every op with only a CPU kernel that it does not register
    goes through its fallback, hundreds of them, as DirectML's "about 600" do."""
    kernels = device_kernels()
    for name in kernels:
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        assert kernel_source(op, dml) is KernelSource.DEVICE, name
    plain = _overloads_with_a_cpu_kernel_only()
    falling = [op for op in plain if devices.cpu_fallback(op, dml)]
    own = [op for op in plain if not devices.cpu_fallback(op, dml)]
    assert {op.name().removeprefix("aten::") for op in own} <= kernels
    assert len(falling) > 300 and len(own) > 50
    aten = torch.ops.aten
    assert devices.cpu_fallback(aten.erfinv.default, dml) and not devices.cpu_fallback(aten.mm.default, dml)
    # foreach ops loop over their per-tensor op: Adam's lerp is the fallback's, its mul DirectML's mul.out
    assert devices.cpu_fallback(aten._foreach_lerp_.Scalar, dml)
    assert not devices.cpu_fallback(aten._foreach_mul_.Scalar, dml)


_RENAMED = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from privateuse1 import device
from shadow import devices
d = device("npu")
x = torch.ones(3, device=d)
print(json.dumps({"device": str(x.device), "backends": [b.__dict__ for b in devices.discover()],
                  "uses": devices.choose().name}))
"""


def test_a_renamed_backend_is_listed_under_its_name(dml):
    """Renamed (torch.utils.rename_privateuse1_backend, as Ascend's npu is), in a process of its own."""
    proc = subprocess.run([sys.executable, "-c", _RENAMED], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["device"] == "npu:0"
    npu = next(b for b in found["backends"] if b["name"] == "npu")
    assert npu["available"] and npu["device"] == "npu:0" and npu["float64"] is False and npu["cpu_fallback"]
    assert all(b["name"] != "privateuseone" for b in found["backends"])


def test_directml_is_left_to_its_own_probe(dml, monkeypatch):
    """With torch_directml imported, the PrivateUse1 backend is DirectML's: the directml row describes it."""
    monkeypatch.setitem(sys.modules, "torch_directml", privateuse1)
    assert all(b.name != "privateuseone" for b in devices.discover())
