"""pytest plugin (registered through the ``pytest11`` entry point): numeric regression tests for models.

    import pytest

    @pytest.mark.shadow(max_budget_used=1.0)
    def test_model_numerics():                      # the whole test runs under ShadowMode
        loss = model(x).sum(); loss.backward()      # fails if an op's own error uses more than 1.0 of its budget

    @pytest.mark.shadow(emulate="tf32")             # what TF32 would do to this model
    def test_tf32(shadow_mode):
        model = make_model()
        with shadow_mode:                           # only this block is shadowed and judged
            model(x).sum().backward()
        assert shadow_mode.report.by_op["aten.addmm.default"].max_budget_used < 200

A failing test says which op classes went over, how far, what their error reads like and where, then the
report's table and verdict (``shadow.verdict``).

Marker arguments: ``max_budget_used`` (default 1.0: a correct kernel's budget), ``nonfinite`` (default False:
the verdict's NaN/Inf finding fails the test: NaN/Inf that reaches the loss, a gradient or a parameter, or device
and shadow disagreeing on one past the kept records; a -inf attention mask that softmax absorbs does not; True
allows it), ``ignore``
(op names excused: "aten.mm", "mm" or "aten.mm.default"), ``emulate`` (an emulated device by name, entered outside
ShadowMode: shadow.modes.emulate), and any ShadowMode option (``local=``, ``spot_checks=``...).

A loss held to the band of correct implementations rather than to a hand-picked ``atol``:
``shadow.testing.assert_within_envelope(losses, "tests/envelope.json")``, the envelope made once by
``shadow envelope`` or ``shadow.envelope(...).save(path)`` (docs/envelope.md).

The fixture ``shadow_mode`` is a ShadowMode, not yet entered, with the marker's options; a test that uses it
decides what is shadowed, and a marked one is judged on that. Tests that use neither pay nothing: this module
imports torch and shadow's engine only when one does.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

_CHECKS = ("max_budget_used", "nonfinite", "ignore", "emulate")  # the marker's own arguments; the rest: ShadowMode's


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "shadow(max_budget_used=1.0, nonfinite=False, ignore=(), emulate=None, **options): run the test "
        "under shadow.ShadowMode (or judge its shadow_mode fixture) and fail it when an op's own error uses more "
        "than max_budget_used of its error budget, or NaN/Inf is born; options go to ShadowMode")


class _Check:
    """A marker's arguments, validated: what to judge and how to build the ShadowMode."""

    def __init__(self, max_budget_used: float = 1.0, nonfinite: bool = False, ignore: Any = (),
                 emulate: str | None = None, **options: Any):
        if isinstance(max_budget_used, bool) or not isinstance(max_budget_used, (int, float)) or max_budget_used < 0:
            raise pytest.UsageError(f"@pytest.mark.shadow(max_budget_used={max_budget_used!r}): expected a number "
                                    ">= 0 (1.0: the error a correct kernel may make)")
        self.max_budget_used = float(max_budget_used)
        self.nonfinite = nonfinite
        self.ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
        self.emulate = emulate
        self.options = options

    @classmethod
    def of(cls, marker: pytest.Mark) -> _Check:
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.shadow takes keyword arguments only ({', '.join(_CHECKS)}, or "
                                    f"ShadowMode options), got {marker.args!r}")
        return cls(**marker.kwargs)

    def mode(self) -> Any:
        from shadow import ShadowMode

        return ShadowMode(**self.options)

    def device(self) -> contextlib.AbstractContextManager:
        from shadow.modes.emulate import emulate

        return emulate(self.emulate) if self.emulate else contextlib.nullcontext()

    def judge(self, report: Any) -> str | None:
        """Why the test fails (None: it passes): the op classes over the limit, NaN/Inf, then the report's summary."""
        from shadow.verdict import conclude, op_classes

        over = [c for c in op_classes(report) if c.budget_used > self.max_budget_used and not self._ignored(c.op)]
        verdict = conclude(report)
        problems = []
        if over:
            problems.append(f"shadow: {len(over)} op class{'es' if len(over) > 1 else ''} over max_budget_used="
                            f"{self.max_budget_used:g} (the op's own error / the error a correct kernel may make):")
            problems += [f"  {c}" for c in over]
        if not self.nonfinite and (verdict.nonfinite is not None or verdict.first_nonfinite_op):
            problems.append(f"shadow: {verdict.nonfinite or 'device and shadow disagree on NaN/Inf'} "
                            "(nonfinite=True allows it)")
        if not problems:
            return None
        return "\n".join(problems + ["", report.summary(top=10)])

    def _ignored(self, op: str) -> bool:
        """``op`` (an op class: "aten.mm") is excused by ``ignore``: as "aten.mm", "mm" or an overload of it."""
        from shadow.verdict import op_class

        return any(op in (op_class(name), "aten." + name) for name in self.ignore)


@pytest.fixture
def shadow_mode(request: pytest.FixtureRequest) -> Any:
    """A ShadowMode (not entered) with the options of the test's ``shadow`` marker; ``with shadow_mode:`` shadows a
    block, and a marked test is judged on what it shadowed. ``shadow_mode.report`` holds the results."""
    marker = request.node.get_closest_marker("shadow")
    check = _Check.of(marker) if marker is not None else _Check()
    with check.device():
        yield check.mode()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Marked tests: run under ShadowMode (unless the test enters its ``shadow_mode`` itself), then judged."""
    marker = item.get_closest_marker("shadow")
    if marker is None:
        return (yield)
    check = _Check.of(marker)
    mode = getattr(item, "funcargs", {}).get("shadow_mode")
    if mode is None:
        with check.device(), check.mode() as mode:
            result = yield
    else:
        result = yield
    failure = check.judge(mode.report)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    return result
