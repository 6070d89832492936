"""Where shadows live: ``ShadowMode(shadow_device="auto" | "cpu" | device)``.

No GPU here: the option's validation, "auto"'s resolution under replaced capability and memory probes, and
that every place the mirror and the engine make a shadow asks the placement (a shadow device of "meta" makes
the place visible without a GPU). The device path of the comparison (torch passes where the reference lives,
read back once) runs on the CPU by replacing ``metrics._off_cpu``. tests/test_cuda.py runs shadows on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shadow.mirror as mirror_module
from shadow import ShadowMode, metrics
from shadow.engine import EngineHooks
from shadow.engine.prepare import InputShadows, remap
from shadow.errors import ShadowOptionError
from shadow.mirror import AUTO_FREE_SHARE, CPU, Mirror, Placement, parse_shadow_device, resolve_auto
from shadow.options import Options
from shadow.plan import plan_of

aten = torch.ops.aten
META = torch.device("meta")
GiB = 1 << 30


# --- the option ---
def test_option_values():
    assert Options().shadow_device == "auto"
    assert Options(shadow_device="auto").shadow_device == "auto"
    assert Options(shadow_device="cpu").shadow_device == CPU
    assert Options(shadow_device=torch.device("cpu")).shadow_device == CPU


@pytest.mark.parametrize("value, words", [
    ("bogus", ["shadow_device='bogus' is not a device torch knows", "'auto'", "'cpu'", "'cuda:1'"]),
    ("mps", ["MPS has no float64", "use 'auto'", "or 'cpu'"]),
    ("mps:0", ["MPS has no float64"]),
    ("privateuseone", ["DirectML", "no float64"]),
    ("meta", ["meta tensors hold no values"]),
    (3, ["shadow_device=3", "expected 'auto'"]),
    (None, ["shadow_device=None", "expected 'auto'"]),
])
def test_option_errors_name_the_problem_and_the_fix(value, words):
    with pytest.raises(ShadowOptionError) as info:
        Options(shadow_device=value)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_a_device_type_not_available_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ShadowOptionError, match=r"shadow_device='cuda': no cuda device is available on this "
                                                r"machine \(torch.cuda.is_available\(\) is not True\); use 'auto'"):
        Options(shadow_device="cuda")


def test_a_device_index_beyond_the_machine_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert parse_shadow_device("cuda:0") == torch.device("cuda", 0)
    assert parse_shadow_device("cuda") == torch.device("cuda", 1)  # the current device, named
    with pytest.raises(ShadowOptionError, match=r"has 2 cuda device\(s\) \(cuda:0 to cuda:1\)"):
        parse_shadow_device("cuda:2")


# --- "auto" ---
def _memory(free: int, total: int, calls: list | None = None):
    def info(device):
        if calls is not None:
            calls.append(device)
        return free, total
    return info


def test_auto_keeps_a_gpu_with_room_and_the_cpu_otherwise(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(mirror_module, "_memory_info", _memory(70 * GiB, 80 * GiB))
    assert resolve_auto(cuda) == cuda
    assert resolve_auto(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert resolve_auto(cuda, min_free=75 * GiB) == CPU  # max_shadow_bytes larger than what is free
    # the share: 2/3 of the device free (a float32 program's shadows take twice its bytes)
    assert resolve_auto(cuda) == cuda
    monkeypatch.setattr(mirror_module, "_memory_info", _memory(int(AUTO_FREE_SHARE * 80 * GiB) - 1, 80 * GiB))
    assert resolve_auto(cuda) == CPU
    monkeypatch.setattr(mirror_module, "_memory_info", _memory(10 * GiB, 80 * GiB))
    assert resolve_auto(cuda) == CPU


@pytest.mark.parametrize("device", ["mps", "privateuseone", "xpu", "cpu"])
def test_auto_keeps_other_devices_shadows_on_the_cpu(monkeypatch, device):
    calls = []
    monkeypatch.setattr(mirror_module, "_memory_info", _memory(80 * GiB, 80 * GiB, calls))
    assert resolve_auto(torch.device(device, 0) if device != "cpu" else CPU) == CPU
    assert not calls  # no memory probe for them


def test_auto_without_an_answer_from_the_driver_is_the_cpu(monkeypatch):
    def fails(device):
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(mirror_module, "_memory_info", fails)
    assert resolve_auto(torch.device("cuda", 0)) == CPU


def test_placement_resolves_each_device_once(monkeypatch):
    calls = []
    monkeypatch.setattr(mirror_module, "_memory_info", _memory(70 * GiB, 80 * GiB, calls))
    place = Placement("auto", min_free=0)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert [place(cuda0) for _ in range(5)] == [cuda0] * 5
    assert place(cuda1) == cuda1 and place(CPU) == CPU
    assert calls == [cuda0, cuda1]  # cached per device: the per-op path reads a dict
    monkeypatch.setattr(mirror_module, "_memory_info", _memory(1 * GiB, 80 * GiB, calls))
    assert place(cuda0) == cuda0  # decided once, never moved (the shadows already there stay)
    assert place.resolved == {cuda0: cuda0, cuda1: cuda1, CPU: CPU}


def test_a_chosen_device_is_every_shadows_device(monkeypatch):
    monkeypatch.setattr(mirror_module, "_memory_info", _memory(0, 80 * GiB))  # never asked
    place = Placement(torch.device("cuda", 1))
    assert place(CPU) == place(torch.device("cuda", 0)) == torch.device("cuda", 1)
    assert Placement()(torch.device("cuda", 0)) == CPU  # the default placement: the CPU


def test_the_options_reach_the_placement():
    eng = ShadowMode(shadow_device="cpu")._engine
    assert eng.mirror.place.fixed == CPU
    sm = ShadowMode(shadow_device="auto", max_shadow_bytes=5 * GiB)
    assert sm._engine.mirror.place.choice == "auto" and sm._engine.mirror.place.min_free == 5 * GiB


def test_observers_keep_auto_on_the_cpu():
    """shadow.attribute's and shadow.audit's observers compute with CPU tensors of their own: "auto" stays on the
    CPU under them; an explicit device is the caller's choice."""
    eng = ShadowMode(hooks=EngineHooks(observe=lambda rec, outputs, p: None))._engine
    assert eng.mirror.place.fixed == CPU and eng.mirror.place(torch.device("cuda", 0)) == CPU
    chosen = Placement(META)
    chosen.on_cpu_unless_chosen()  # what the engine asks of its placement under an observer
    assert chosen.fixed == META


# --- every shadow the mirror and the engine make goes where the placement says ---
@pytest.fixture
def on_meta(monkeypatch):
    """A mirror whose shadows live on "meta": where a shadow lands is visible without a GPU (meta tensors hold no
    values, so the non-finite scan of adopted storages is skipped)."""
    monkeypatch.setattr(mirror_module, "any_nonfinite", lambda values: False)
    return Mirror(False, Placement(META))


def test_the_mirror_makes_its_shadows_on_the_shadow_device(on_meta):
    m = on_meta
    x = torch.randn(4, 3)
    e = m.entry(x)  # adoption
    assert e.base.device == META and e.base.dtype == torch.float64
    assert m.view(x[1:], e).device == META
    assert m.upcast(x).device == META  # the local reference's inputs
    assert m.upcast(torch._efficientzerotensor(3)).device == META
    y = torch.randn(6)[1:5]  # an output that does not cover its storage: the rest is read from the device
    m.assign(y, torch.zeros(4, dtype=torch.float64, device=META), exact=True, fresh=False)
    assert m.known(y).base.device == META


def test_the_engine_makes_its_argument_shadows_on_the_shadow_device(on_meta):
    eng = ShadowMode()._engine
    eng.mirror = on_meta
    inputs = InputShadows(eng, plan_of(aten.add.Tensor))
    assert inputs.shadow(torch.tensor([1, 2]), False, False).device == META  # discrete, following the device
    assert inputs.shadow(torch._efficientzerotensor(2), False, False).device == META
    assert inputs.shadow(torch.randn(2), False, False).device == META


def test_device_arguments_are_remapped_to_the_shadow_device():
    chosen = Placement(torch.device("cuda", 7))  # never run: only where the replay would put its result
    to_copy, zeros = plan_of(aten._to_copy.default), plan_of(aten.zeros.default)
    assert remap(to_copy, "device", CPU, chosen) == torch.device("cuda", 7)
    assert remap(to_copy, "device", None, chosen) is None  # _to_copy: None is "where the input is", its shadow's
    assert remap(zeros, "device", None, chosen) == torch.device("cuda", 7)  # a factory's default: the CPU
    assert remap(zeros, "dtype", torch.float32, chosen) == torch.float64
    cpu = Placement(CPU)
    assert remap(zeros, "device", None, cpu) is None and remap(zeros, "device", torch.device("cuda", 0), cpu) == CPU


def test_the_shadow_data_path_hard_codes_no_cpu():
    """Every "cpu" left in the files that make shadows is about the CPU itself (compare_cpu's kernel run, the
    placement's own definitions), and every tensor they create names its device."""
    root = Path(__file__).resolve().parent.parent / "shadow"
    allowed = {
        "engine/prepare.py": ('lambda t, _: t.detach().to("cpu", copy=True))  # the kernel may write',  # compare_cpu
                              'spec.put(a, kw, torch.device("cpu"))', 'place.fixed.type != "cpu"'),
        "mirror.py": ('CPU = torch.device("cpu")', 'if device.type == "cpu":', '# --- where shadows live'),
        "transfer.py": ('elif t.is_cuda and to.type == "cpu":', 'shadow_device="cpu"'),  # pinned memory, the docstring
    }
    files = [str(f.relative_to(root)) for f in sorted((root / "engine").glob("*.py"))]
    files += ["mirror.py", "transfer.py", "replay/noncompute.py", "replay/recurrent.py", "replay/attention.py"]
    for name in files:
        for i, line in enumerate((root / name).read_text().splitlines(), 1):
            if '"cpu"' in line:
                assert any(a in line for a in allowed.get(name, ())), f"shadow/{name}:{i}: {line.strip()}"
            for factory in ("torch.zeros(", "torch.ones(", "torch.empty(", "torch.full(", "torch.arange("):
                if factory in line and "device=" not in line and "shadow_dtype(t.dtype))" not in line:
                    pytest.fail(f"shadow/{name}:{i}: {factory} without a device: {line.strip()}")


# --- a CPU run with shadow_device="cpu" gives the default's figures ---
def _step_records(sm: ShadowMode) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(5, 6), torch.tensor([0, 2, 1, 1, 0])
    with sm:
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return [(r.op, r.local, r.drift, r.budget, r.flips) for r in sm.report.records]


def test_cpu_shadows_give_the_default_figures():
    default, cpu = _step_records(ShadowMode()), _step_records(ShadowMode(shadow_device="cpu"))
    assert len(default) > 50 and default == cpu


# --- the comparison of a reference off the CPU: torch passes where it lives, the figures read back once ---
def _pair(n: int, seed: int, special: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, generator=g, dtype=torch.float64)
    y = r.to(torch.float32)
    y[:: 3] += torch.randn(len(y[:: 3]), generator=g) * 1e-5
    if special:
        r[1], y[2], y[4], r[4] = 0.0, math.inf, math.nan, math.nan  # a zero reference, non-finite both ways
        y[1] = 1e-30
    return y, r


@pytest.mark.parametrize("n", [1, 17, 64, 65, 4000, 40000])
@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("special", [False, True])
def test_device_path_figures_equal_the_cpu_paths(monkeypatch, n, bounded, special):
    if special and n < 5:
        pytest.skip("needs 5 elements")
    y, r = _pair(n, n, special)
    bound = r.abs() * 1e-7 + 1e-12 if bounded else None
    host = metrics.compare(y, r, torch.float32, bound)
    monkeypatch.setattr(metrics, "_off_cpu", lambda t: True)
    dev = metrics.compare(y, r, torch.float32, bound)
    for f in dataclasses.fields(metrics.ErrorStats):
        a, b = getattr(host, f.name), getattr(dev, f.name)
        if f.name in ("rel_norm", "norm"):  # sums in another order: float64 reassociation only
            assert a == pytest.approx(b, rel=1e-12), f.name
        else:
            assert a == b or (a != a and b != b), (f.name, a, b)


@pytest.mark.parametrize("n", [40, 40000])
def test_device_path_reads_back_once(monkeypatch, n):
    y, r = _pair(n, 3)
    bound = r.abs() * 1e-7 + 1e-12
    monkeypatch.setattr(metrics, "_off_cpu", lambda t: True)
    reads = []
    for name in ("tolist", "item", "__float__", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    stats = metrics.compare(y, r, torch.float32, bound)
    monkeypatch.undo()
    assert stats.max_abs > 0 and stats.budget_used > 0
    assert reads == ["tolist"]


def test_shadow_of_is_a_cpu_copy():
    with ShadowMode() as sm:
        x = torch.randn(3) * 2
    s = sm.shadow_of(x)
    assert s.device == CPU and s.dtype == torch.float64
    s += 1  # a copy: the mirror's shadow is not touched
    assert torch.equal(sm.shadow_of(x), x.double())
