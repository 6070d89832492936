"""Tolerances for tests from the envelope of correct implementations: a loss held to the band correct rounding
spans at each step (``shadow.envelope``), not to a hand-picked ``atol``. The band is made once, saved, and loaded in
the test, so CI need not run it again.

    env = shadow.envelope(step, runs=8, steps=20)      # once, then env.save("tests/envelope.json")

    def test_training_matches_the_true_result():
        losses = train(steps=20)                         # this run's loss per step
        shadow.testing.assert_within_envelope(losses, "tests/envelope.json")
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from .band import Envelope, load_envelope


def assert_within_envelope(losses: Sequence[Any], envelope: Envelope | str | os.PathLike, *, start: int = 1) -> None:
    """Fail (``AssertionError``) where ``losses`` (floats or one-element tensors, the first at step ``start``) leave
    ``envelope``'s band at a step: the message names the first such step, how far outside it lies, and the band's
    table with the losses beside it. ``envelope``: an ``Envelope``, or the path of one saved by ``Envelope.save``
    or ``shadow envelope -o``.

    >>> assert_within_envelope([0.91, 0.85], "tests/envelope.json")   # doctest: +SKIP
    """
    env = envelope if isinstance(envelope, Envelope) else load_envelope(envelope)
    left = env.leaves(losses, start=start)
    if left is None:
        return
    loss, low, high = float(losses[left - start]), env.low[left - 1], env.high[left - 1]
    where = "NaN or infinite" if loss != loss or abs(loss) == float("inf") else \
        f"{loss - high:.3e} above its upper edge" if loss > high else f"{low - loss:.3e} below its lower edge"
    raise AssertionError(
        f"the loss leaves the {env.confidence:.0%} band of correct implementations ({env.runs} {env.device} runs) "
        f"at step {left}: {loss!r} is {where} (band [{low!r}, {high!r}], float64 loss {env.float64[left - 1]!r}): "
        f"further from the true result than correct rounding takes a run\n{env.table(losses, start=start)}")
