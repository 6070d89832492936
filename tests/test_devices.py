"""Device discovery (shadow/devices/), ``shadow doctor``, CPU-fallback detection and numerics settings.

Discovery is checked against what this machine really has: the expected reason for each unavailable backend
is computed here independently (torch.backends.cuda.is_built(), the error torch.cuda.init() gives, whether
torch-directml is installed and what importing it raises). Failures that cannot be produced here (a driver
error, DirectML loaded with an adapter) are injected through the same calls the probes make.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from shadow import devices
from shadow.cli import main
from shadow.devices import discovery, dispatch
from shadow.devices import BACKENDS, Backend, KernelSource, cpu_fallback, discover, kernel_source, numerics_settings

aten = torch.ops.aten
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def by_name(backends: list[Backend]) -> dict[str, Backend]:
    return {b.name: b for b in backends}


def first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:120]


# --- discovery on this machine ---
def test_discover_lists_every_backend_and_cpu_is_available():
    found = discover()
    # the fixed probes, then a PrivateUse1 backend registered in this process (the suite's stand-in, once loaded)
    assert [b.name for b in found][:len(BACKENDS)] == list(BACKENDS) and len(found) - len(BACKENDS) <= 1
    cpu = by_name(found)["cpu"]
    assert cpu.available and cpu.device == "cpu" and cpu.float64 is True and cpu.device_name
    assert cpu.torch_device() == torch.device("cpu")
    for b in found:
        assert b.reason  # plain words for every backend, available or not
        assert b.available == bool(b.device)


def test_cuda_reason_is_the_real_one():
    cuda = by_name(discover())["cuda"]
    if torch.cuda.is_available():
        assert cuda.available and cuda.device.startswith("cuda:") and cuda.float64 is True
        assert cuda.device_name == torch.cuda.get_device_name(torch.cuda.current_device())
        return
    assert not cuda.available and cuda.float64 is None and cuda.device == ""
    with pytest.raises(ValueError, match="not available"):
        cuda.torch_device()
    if not torch.backends.cuda.is_built():  # torch 2.13.0+cpu here
        assert cuda.reason.startswith(f"CUDA is not built into this torch ({torch.__version__})")
        return
    # a CUDA build without a usable GPU (torch 2.4.1+cu121 here): the driver's own words
    assert f"built with CUDA {torch.version.cuda}, but finds no GPU" in cuda.reason
    with pytest.raises(Exception) as info:
        torch.cuda.init()
    assert first_line(info.value) in " ".join(cuda.reason.split()), (cuda.reason, str(info.value))


def _directml_import_error() -> BaseException | None:
    try:
        importlib.import_module("torch_directml")
    except Exception as exc:
        return exc
    return None


def test_directml_reason_is_the_real_one():
    dml = by_name(discover())["directml"]
    if importlib.util.find_spec("torch_directml") is None:  # the torch 2.13 environment
        assert not dml.available
        assert dml.reason.startswith("torch-directml is not installed")
        assert torch.__version__ in dml.reason and "torch==2.4.1" in dml.reason
        return
    error = _directml_import_error()
    if isinstance(error, OSError):  # installed (the torch 2.4.1 environment) but libd3d12.so is WSL2's
        assert not dml.available
        assert "is installed, but its native library failed to load" in dml.reason
        assert first_line(error) in dml.reason, (dml.reason, error)
    elif error is not None:
        assert not dml.available and "importing it failed" in dml.reason and first_line(error) in dml.reason
    else:
        import torch_directml

        try:
            n = torch_directml.device_count()
        except RuntimeError:
            n = 0
        assert dml.available == (n > 0), dml
        if n:
            assert dml.device == str(torch_directml.device(torch_directml.default_device()))
            assert dml.device.startswith("privateuseone:")
        else:
            assert "loaded, but found no DirectX 12 adapter" in dml.reason


def _directml_dir() -> str | None:
    spec = importlib.util.find_spec("torch_directml")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


_PROBE_LOADED = r"""
import json, torch, torch_directml
from shadow import devices
aten = torch.ops.aten
ops = {name: devices.kernel_source(eval("aten." + name), "privateuseone").value
       for name in ("add.Tensor", "add_.Tensor", "mm.default", "erfinv.default", "_fused_adam_.default",
                    "linear.default", "convolution.default", "_foreach_add_.List")}
print(json.dumps({"directml": [b.__dict__ for b in devices.discover() if b.name == "directml"][0], "ops": ops,
                  "fallback": torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.PrivateUse1)}))
"""


def test_directml_loaded_without_an_adapter_and_its_real_registrations():
    """With torch-directml installed (the torch 2.4.1 environment), its libdirectml.so loads once the directory
    holding the bundled libd3d12.so is on LD_LIBRARY_PATH; without /dev/dxg DXCore then finds no adapter.
    That process also holds DirectML's real kernel registrations: check cpu_fallback against them."""
    where = _directml_dir()
    if where is None:
        pytest.skip("torch-directml is not installed in this environment (.ci/run installs it with torch 2.4.1)")
    if not os.path.exists(os.path.join(where, "libd3d12.so")):
        pytest.skip(f"this torch-directml ({where}) bundles no libd3d12.so to load it with")
    env = dict(os.environ, LD_LIBRARY_PATH=where, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _PROBE_LOADED], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    dml = found["directml"]
    if dml["available"]:
        pytest.skip(f"a DirectX 12 adapter is here ({dml['device_name']}): the no-adapter path cannot be shown")
    assert "loaded, but found no DirectX 12 adapter" in dml["reason"], dml  # an error or a SIGSEGV, at random
    assert found["fallback"] is True  # torch-directml registers a CPU fallback for PrivateUse1
    ops = found["ops"]
    # add.Tensor: no PrivateUse1 kernel, but its structured default kernel calls add.out, which DirectML has
    assert ops["add.Tensor"] == "device" and ops["add_.Tensor"] == "device" and ops["mm.default"] == "device"
    # neither erfinv(.out) nor the fused Adam kernel is registered by DirectML: the CPU fallback runs them
    assert ops["erfinv.default"] == "fallback" and ops["_fused_adam_.default"] == "fallback"
    # composites: linear calls other ops; convolution reaches DirectML's convolution_overrideable; a foreach op's
    # default kernel loops over its per-tensor op (add_.Tensor: DirectML's add.out)
    assert ops["linear.default"] == "composite" and ops["_foreach_add_.List"] == "device"
    assert ops["convolution.default"] == "device"


# --- failures injected where the probes look ---
@pytest.fixture
def directml_installed(monkeypatch):
    """torch-directml looks installed to the probe; the test gives what its child process reached."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "torch_directml":
            return importlib.machinery.ModuleSpec("torch_directml", None)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    def install(child: dict, module: types.ModuleType | None = None):
        monkeypatch.setattr(discovery, "_directml_child", lambda: child)
        monkeypatch.setattr(discovery, "_import_module", lambda name: module)

    return install


def test_directml_native_library_that_fails_to_load(directml_installed):
    directml_installed({"stage": "load", "error": "OSError: libd3d12.so: cannot open shared object file"})
    dml = by_name(discover())["directml"]
    assert not dml.available
    assert "is installed, but its native library failed to load: OSError: libd3d12.so: cannot open" in dml.reason


def test_directml_built_for_another_torch(directml_installed):
    directml_installed({"stage": "import", "error": "ImportError: undefined symbol: _ZN3c1017RegisterOperators"})
    dml = by_name(discover())["directml"]
    assert not dml.available and "importing it failed: ImportError: undefined symbol" in dml.reason


def test_directml_loaded_but_no_adapter(directml_installed):
    # the three ways torch-directml 0.2.5 answers without /dev/dxg: an error, a crash, or no adapter
    directml_installed({"stage": "count", "error": "RuntimeError: Unknown error -1163588112"})
    assert "loaded, but found no DirectX 12 adapter: RuntimeError: Unknown error -1163588112" in \
        by_name(discover())["directml"].reason
    directml_installed({"stage": "loaded", "crashed": "signal 11, SIGSEGV"})
    assert "loaded, but found no DirectX 12 adapter: looking for one crashed the process (signal 11, SIGSEGV)" in \
        by_name(discover())["directml"].reason
    directml_installed({"stage": "count", "error": ""})
    assert by_name(discover())["directml"].reason.endswith("loaded, but found no DirectX 12 adapter")
    directml_installed({"crashed": "signal 6, SIGABRT"})
    assert "is installed, but probing it crashed the process (signal 6, SIGABRT)" in \
        by_name(discover())["directml"].reason


def test_directml_available_is_chosen_after_cuda_mps_xpu(directml_installed):
    fake = types.ModuleType("torch_directml")
    fake.device = lambda i=0: torch.device("privateuseone", i)
    directml_installed({"stage": "found", "count": 1, "index": 0, "name": "Fake Radeon RX", "float64": False}, fake)
    found = discover()
    dml = by_name(found)["directml"]
    assert dml == Backend("directml", True, dml.reason, "privateuseone:0", "Fake Radeon RX", False)
    assert "1 DirectX 12 adapter; no float64 on the device" in dml.reason
    gpus = [b.name for b in found if b.available and b.name in ("cuda", "mps", "xpu")]
    assert devices.choose(found).name == (gpus[0] if gpus else "directml")


def test_directml_child_process_reports_its_stage():
    """The real child: in this environment it stops at the stage this test computes on its own."""
    discovery._directml_child.cache_clear()
    found = discovery._directml_child()
    if importlib.util.find_spec("torch_directml") is None:
        assert found["stage"] == "import" and "No module named 'torch_directml'" in found["error"]
    elif isinstance(_directml_import_error(), OSError):
        assert found == {"stage": "load", "error": discovery.describe(_directml_import_error())}
    else:
        assert found["stage"] in ("import", "loaded", "count", "found"), found


def test_a_driver_error_is_a_reason_not_an_exception(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed, you might not have a CUDA gpu.")

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    cuda = by_name(discover())["cuda"]
    assert not cuda.available
    assert "but the driver failed: RuntimeError: CUDA driver initialization failed" in cuda.reason


def test_a_cuda_warning_is_the_reason(monkeypatch):
    """torch.cuda.device_count() returns 0 with a warning when the driver is too old: that text is the reason."""
    import warnings

    def too_old():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).")
        return 0

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", too_old)
    cuda = by_name(discover())["cuda"]
    assert not cuda.available
    assert cuda.reason.endswith("but finds no GPU: CUDA initialization: The NVIDIA driver on your system is too old "
                                "(found version 11040).")


def test_a_probe_that_breaks_is_reported(monkeypatch):
    def boom():
        raise AttributeError("module 'torch.backends' has no attribute 'mps'")

    monkeypatch.setitem(discovery._PROBES, "mps", boom)
    mps = by_name(discover())["mps"]
    assert mps == Backend("mps", False, "probing it failed: AttributeError: module 'torch.backends' has no "
                                        "attribute 'mps'")


def test_registering_a_probe_twice_is_an_error():
    with pytest.raises(ValueError, match="a probe for backend 'cpu' is already registered"):
        discovery._probe("cpu")(lambda: None)
    with pytest.raises(ValueError, match="backend 'tpu': expected one of cpu, cuda, mps, xpu, directml"):
        discovery._probe("tpu")(lambda: None)


# --- the CLI ---
def test_doctor_prints_every_backend_and_the_choice(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    found = discover()
    for b in found:
        assert f"\n{b.name} " in out
        assert " ".join(b.reason.split()[:6]) in " ".join(out.split())  # the reason, wrapped
    chosen = devices.choose(found)
    assert f"demo will use: {chosen.name}" in out
    assert "torch.backends.cudnn.allow_tf32" in out


def test_doctor_json_and_exit_status_from_a_fresh_process():
    proc = subprocess.run([sys.executable, "-m", "shadow", "doctor", "--json"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout)
    assert found["torch"] == torch.__version__
    assert [b["name"] for b in found["backends"]] == list(BACKENDS)  # a fresh process registers no stand-in
    fixed = [b for b in devices.discover() if b.name in BACKENDS]
    assert found["backends"][0]["available"] is True and found["uses"] == devices.choose(fixed).name
    assert found["numerics"]["torch.backends.cudnn.allow_tf32"] == torch.backends.cudnn.allow_tf32


def test_demo_names_the_reason_a_device_is_missing(capsys):
    dml = by_name(discover())["directml"]
    if dml.available:
        pytest.skip("DirectML is available here: no missing device to ask for")
    assert main(["demo", "--device", "directml", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "demo: --device directml is not available on this machine: " + dml.reason[:40] in err
    assert "available: cpu" in err


# --- numerics settings ---
# torch.testing._internal.common_utils (imported by the OpInfo tests) freezes torch.backends.cudnn's flags
# (disable_global_flags); setting one then needs the unfreezing that torch.backends.cudnn.flags() uses inside
cudnn_mutable = getattr(torch.backends, "__allow_nonbracketed_mutation")


@pytest.fixture
def restore_numerics():
    m = torch.backends.cuda.matmul
    old = (m.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
           torch.are_deterministic_algorithms_enabled(), getattr(m, "fp32_precision", None))
    yield
    if old[4] is not None:
        m.fp32_precision = old[4]
    m.allow_tf32 = old[0]
    with cudnn_mutable():
        torch.backends.cudnn.allow_tf32 = old[1]
    torch.set_float32_matmul_precision(old[2])
    torch.use_deterministic_algorithms(old[3])


def test_numerics_settings_follow_the_switches(restore_numerics):
    s = numerics_settings()
    for key in ("torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32",
                "torch.get_float32_matmul_precision()", "torch.are_deterministic_algorithms_enabled()",
                "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
                "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"):
        assert key in s
    assert ("torch.backends.cuda.matmul.fp32_precision" in s) == hasattr(torch.backends.cuda.matmul,
                                                                          "fp32_precision")
    json.dumps(s)  # a report's meta is saved as JSON
    torch.backends.cuda.matmul.allow_tf32 = True
    with cudnn_mutable():
        torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    s = numerics_settings()
    assert s["torch.backends.cuda.matmul.allow_tf32"] is True and s["torch.backends.cudnn.allow_tf32"] is False
    assert s["torch.get_float32_matmul_precision()"] == "high"  # allow_tf32 = True is precision "high"
    assert s["torch.are_deterministic_algorithms_enabled()"] is True


def test_numerics_settings_never_raise_on_mixed_tf32_apis(restore_numerics):
    m = torch.backends.cuda.matmul
    if not hasattr(m, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API (added in 2.9) to mix with allow_tf32")
    m.fp32_precision = "tf32"  # after this, torch refuses to read the legacy flag: "mix of the legacy and new APIs"
    with pytest.raises(RuntimeError):
        m.allow_tf32
    s = numerics_settings()
    assert s["torch.backends.cuda.matmul.fp32_precision"] == "tf32"
    assert s["torch.backends.cuda.matmul.allow_tf32"].startswith("error: RuntimeError")


def test_numerics_settings_read_whether_subnormals_are_flushed():
    """Flush-to-zero is read from the arithmetic itself (torch.set_flush_denormal has no getter): on, a float32
    product of 1e-20 and 1e-20 (a subnormal, 1e-40) is 0 on the CPU."""
    tiny = torch.tensor([1e-20])
    assert numerics_settings()["torch.set_flush_denormal"] is False and (tiny * tiny).item() > 0
    try:
        if not torch.set_flush_denormal(True):
            pytest.skip("this CPU has no flush-to-zero mode torch can set (x86 with SSE3 has)")
        assert numerics_settings()["torch.set_flush_denormal"] is True and (tiny * tiny).item() == 0
    finally:
        torch.set_flush_denormal(False)
    assert numerics_settings()["torch.set_flush_denormal"] is False


# --- CPU fallback detection ---
@pytest.fixture(scope="module")
def ops():
    """Custom ops with kernels for PrivateUse1 (the DirectML key) in every way the dispatcher can find one."""
    lib = torch.library.Library("shadow_devices_test", "DEF")
    f = lambda x: x.clone()  # noqa: E731

    def define(schema: str, **impls):
        lib.define(schema)
        name = schema.split("(")[0]
        for key, fn in impls.items():
            lib.impl(name, fn, key)

    define("own(Tensor x) -> Tensor", PrivateUse1=f, CPU=f)
    define("cpu_only(Tensor x) -> Tensor", CPU=f)
    define("implicit(Tensor x) -> Tensor", CompositeImplicitAutograd=f)
    define("explicit(Tensor x) -> Tensor", CompositeExplicitAutograd=f)
    # structured ops: the functional and in-place forms get a default kernel that calls the out= form
    define("st(Tensor x) -> Tensor", CompositeExplicitAutogradNonFunctional=f)
    define("st.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)", PrivateUse1=lambda x, out: out)
    define("st_(Tensor(a!) x) -> Tensor(a!)", CompositeExplicitAutogradNonFunctional=lambda x: x)
    define("st2(Tensor x) -> Tensor", CompositeExplicitAutogradNonFunctional=f)
    define("st2.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)", CPU=lambda x, out: out)
    yield torch.ops.shadow_devices_test
    lib._destroy()


def test_kernel_source_reads_the_dispatcher(ops):
    dev = torch.device("privateuseone", 0)
    assert kernel_source(ops.own.default, dev) is KernelSource.DEVICE
    assert kernel_source(ops.cpu_only.default, dev) is KernelSource.FALLBACK
    assert kernel_source(ops.implicit.default, dev) is KernelSource.COMPOSITE
    assert kernel_source(ops.explicit.default, dev) is KernelSource.COMPOSITE
    assert kernel_source(ops.st.default, dev) is KernelSource.DEVICE  # through st.out's PrivateUse1 kernel
    assert kernel_source(ops.st_.default, dev) is KernelSource.DEVICE
    assert kernel_source(ops.st2.default, dev) is KernelSource.FALLBACK  # st2.out has a CPU kernel only
    assert [cpu_fallback(op.default, dev) for op in (ops.own, ops.cpu_only, ops.implicit, ops.st, ops.st2)] == \
        [False, True, False, False, True]
    # the CPU runs everything itself, with or without a CPU kernel of the op's own
    assert not cpu_fallback(ops.implicit.default, "cpu") and not cpu_fallback(ops.own.default, "cpu")


def test_out_variants_of_structured_aten_ops():
    assert dispatch._out_variant(aten.add.Tensor) is aten.add.out
    assert dispatch._out_variant(aten.add_.Tensor) is aten.add.out
    assert dispatch._out_variant(aten.add.Scalar) is aten.add.Scalar_out  # Scalar `other`: not add.out
    assert dispatch._out_variant(aten.sum.dim_IntList) is aten.sum.IntList_out
    assert dispatch._out_variant(aten.zeros_like.default) is None


def test_cpu_fallback_on_real_aten_registrations():
    # CUDA kernels exist exactly when this torch is built with CUDA (2.13.0+cpu here: none; 2.4.1+cu121: all)
    assert cpu_fallback(aten.mm.default, "cuda") is not torch.backends.cuda.is_built()
    assert cpu_fallback(aten.add.Tensor, "cuda") is not torch.backends.cuda.is_built()  # via add.out
    assert not cpu_fallback(aten.linear.default, "cuda")  # CompositeImplicitAutograd: decomposed before
    assert not cpu_fallback(aten.zeros_like.default, "cuda")  # CompositeExplicitAutograd: calls other ops
    assert not cpu_fallback(aten.mm.default, "cpu") and not cpu_fallback(aten.erfinv.default, "meta")
    if not torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.PrivateUse1):  # no backend loaded
        assert cpu_fallback(aten.erfinv.default, "privateuseone")
    assert kernel_source(aten.__and__.bool, "privateuseone") is KernelSource.DEVICE  # TorchScript-only: no raise


def test_kernel_source_is_cached_per_op_and_device_type():
    dispatch._kernel_source.cache_clear()
    for _ in range(3):
        kernel_source(aten.mul.Tensor, torch.device("privateuseone", 0))
        kernel_source(aten.mul.Tensor, "privateuseone:1")
    info = dispatch._kernel_source.cache_info()
    assert info.hits == 5 and info.misses == 2  # mul.Tensor, then the mul.out it resolves through
