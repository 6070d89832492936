"""The pytest plugin (shadow.pytest_plugin), run by pytest's own ``pytester``: a marked test whose model goes over
budget fails with a per-op explanation; one within budget passes; unmarked tests run as without the plugin.

The plugin is loaded explicitly (``-p shadow.pytest_plugin``, its entry point blocked with ``-p no:shadow``), so
these tests run where shadow is installed (entry point registered) and where it is only on PYTHONPATH."""

from __future__ import annotations

import importlib.metadata
import textwrap

import pytest
import torch

pytest_plugins = ["pytester"]

PLUGIN = ("-p", "no:shadow", "-p", "shadow.pytest_plugin")

MODEL = """
import pytest
import torch
from torch import nn


def train_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model(torch.randn(16, 32)).square().mean().backward()
"""


@pytest.fixture(scope="module", autouse=True)
def imported_once():
    """Run shadow here once before the in-process pytest runs: each of those forgets the modules it imported, and
    torch's lazily imported ones (dynamo, inductor's test operators) register C++ op libraries that refuse a
    second registration when imported again."""
    from shadow import ShadowMode
    from shadow.modes import TF32Mode

    namespace: dict = {}
    exec(MODEL, namespace)
    with TF32Mode(), ShadowMode():
        namespace["train_step"]()
        torch.log(torch.tensor([-1.0])).sum()


def run(pytester: pytest.Pytester, tests: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_model=MODEL + textwrap.dedent(tests))
    return pytester.runpytest_inprocess(*PLUGIN, *args)


def test_over_budget_fails_with_the_explanation(pytester):
    result = run(pytester, """
        @pytest.mark.shadow(emulate="tf32")
        def test_tf32_step():
            train_step()
    """)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "shadow: 2 op classes over max_budget_used=1 (the op's own error / the error a correct kernel may make):",
        "  aten.* budget in * calls (reads ~10 bits: TF32-like; worst: Sequential.*, call #*)",
        "  aten.* budget in * calls (reads ~10 bits: TF32-like; worst: Sequential.*, call #*)",
        "op * calls * local ulp * budget *",
        "verdict: 2 op classes over budget*",
    ])
    assert "aten.mm " in out and "aten.addmm " in out
    assert "Traceback" not in out  # the explanation, not the plugin's stack


def test_within_budget_passes(pytester):
    result = run(pytester, """
        @pytest.mark.shadow(max_budget_used=1.0)
        def test_fp32_step():
            train_step()

        @pytest.mark.shadow(emulate="tf32", ignore=["mm", "aten.addmm.default"])
        def test_tf32_with_the_matmuls_excused():
            train_step()

        @pytest.mark.shadow(emulate="tf32", max_budget_used=1e6)
        def test_tf32_with_a_loose_limit():
            train_step()
    """)
    result.assert_outcomes(passed=3)


def test_fixture_region_is_what_is_judged(pytester):
    result = run(pytester, """
        from shadow.modes import TF32Mode


        @pytest.mark.shadow
        def test_region_over_budget(shadow_mode):
            with TF32Mode(), shadow_mode:          # the emulation outside ShadowMode
                train_step()

        @pytest.mark.shadow
        def test_region_within_budget(shadow_mode):
            with TF32Mode():
                train_step()                       # not shadowed: not judged
            with shadow_mode:
                train_step()
            assert shadow_mode.report.coverage.calls > 0

        def test_fixture_without_marker_judges_nothing(shadow_mode):
            with TF32Mode(), shadow_mode:
                train_step()
            assert shadow_mode.report.records_over_budget()    # the test's own assertion decides
    """)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_region_over_budget*", "shadow: 2 op classes over max_budget_used=1*"])


def test_nonfinite(pytester):
    result = run(pytester, """
        @pytest.mark.shadow
        def test_log_of_negative():
            torch.log(torch.tensor([-1.0, 2.0])).sum()

        @pytest.mark.shadow(nonfinite=True)
        def test_log_of_negative_allowed():
            torch.log(torch.tensor([-1.0, 2.0])).sum()

        @pytest.mark.shadow
        def test_masked_attention():              # the -inf of a causal mask is absorbed by softmax: no finding
            q = torch.randn(1, 4, 8, requires_grad=True)
            scores = (q @ q.transpose(1, 2)).masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
            torch.softmax(scores, dim=-1).sum().backward()
    """)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["shadow: NaN/Inf born in aten.log at (no module) (other, call #*): a math problem: "
                                 "float64 gives NaN/Inf there too* (nonfinite=True allows it)"])


def test_unmarked_tests_run_as_without_the_plugin(pytester):
    result = run(pytester, """
        def test_plain():
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
            assert _get_current_dispatch_mode_stack() == []     # no ShadowMode around an unmarked test
            train_step()
    """, "--strict-markers")
    result.assert_outcomes(passed=1)
    assert "shadow(max_budget_used=1.0" in run(pytester, "", "--markers").stdout.str()  # the marker is registered


def test_bad_marker_arguments(pytester):
    result = run(pytester, """
        @pytest.mark.shadow(max_budget_used="tight")
        def test_bad_limit():
            train_step()

        @pytest.mark.shadow(colour="red")
        def test_unknown_option():
            train_step()
    """)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*@pytest.mark.shadow(max_budget_used='tight'): expected a number >= 0*"])
    result.stdout.fnmatch_lines(["*unexpected keyword argument 'colour'*"])


def test_entry_point_declared():
    try:
        dist = importlib.metadata.distribution("shadow")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("shadow is not installed here (only on PYTHONPATH): no entry points to read")
    points = [ep for ep in dist.entry_points if ep.group == "pytest11"]
    if not points:
        pytest.skip("shadow's installed metadata predates its pytest11 entry point: reinstall (pip install -e .)")
    assert [(ep.name, ep.value) for ep in points] == [("shadow", "shadow.pytest_plugin")]
