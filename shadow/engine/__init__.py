"""The per-op engine behind ShadowMode (docs/architecture.md: One op call).

One call runs through flat steps, each a function that returns an immutable typed value (``values``):

- ``prepare.prepare`` -> ``Prepared``: the shadow inputs, the device's own inputs upcast, the inputs as before an
  in-place op, before the device op runs;
- the device op, untouched;
- ``conclude.replay`` -> ``Replayed``: the op on the shadow inputs (drift's reference) and on the device's own
  (the local error's);
- ``outputs.read_outputs`` -> ``Outputs`` (``outputs.direct_outputs``: the same values, read faster for the calls
  of most ops);
- ``judge.judge`` -> ``Judged``: the comparisons, the budget (``budget``), the spot check (``spotcheck``); a large
  fused optimizer or ``_foreach_`` call's local replay, budget and comparisons piece by piece instead
  (``pieces.judge_pieces``);
- ``commit.commit``: the shadows the mirror keeps; ``record.record``: the ``Record``, by keyword.

``conclude.conclude`` is the one conclusion path. ``EngineHooks`` is how the scope, the trajectory,
``shadow.attribute`` and ``shadow.audit`` take part in each call.
"""

from .core import Engine
from .hooks import EngineHooks
from .values import Args, Output, Prepared

__all__ = ["Args", "Engine", "EngineHooks", "Output", "Prepared"]
