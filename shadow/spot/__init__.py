"""Spot checks: sampled output elements recomputed at high precision, to validate the float64 reference.

The float64 replay is shadow's reference, and float64 has only ~29 bits of headroom over float32:
under cancellation it can itself be wrong by more than the device. A spot check takes a few output
elements of one op call, recomputes each from the op's inputs with ``shadow.references`` (exact sums
and dot products, mpmath elsewhere), and measures both the float64 reference and the device result
against that value:

>>> import torch; aten = torch.ops.aten
>>> x = torch.tensor([[1e16, 1.0, -1e16]], dtype=torch.float64)
>>> policy = SpotPolicy.from_option("default")
>>> dev, ref = torch.zeros(1), torch.zeros(1, dtype=torch.float64)  # both sums lose the 1.0
>>> s, samples = policy.check(aten.sum.dim_IntList, (x, [1]), {}, [dev], [ref], torch.float32)
>>> s.samples, s.trusted, s.device_err_abs        # exact sum: 1.0; the device is off by 1.0, and so is float64
(1, False, 1.0)

Verdict (``SpotStats.trusted``), per sampled element with exact value ``x`` (the high-precision
value), float64 reference ``r`` and device result ``y`` (dtype ``d``)::

    trusted  <=>  |r - x|  <=  0.01 * max(|y - x|, spacing_d(|x|) / 2)

for every sampled element: the reference's own error is at most 1% of the device's, and an exactly rounded
device is measured against half an ulp of its dtype instead. Sampling (``SpotPolicy``): a few elements
per call, deterministic (seeded by the op, its call number and the output), the most ill-conditioned
first; by default on each op's first calls, then on one call in ``THEN_ONE_IN`` drawn the same way (not for
ops whose float64 kernel rounds once: ``Reference.rounds_once``);
escalated where float64's headroom is at risk; cost bounded by estimates, not clocks. Non-finite
cases, float64 devices, escalation and the cost caps: ``docs/spot-checks.md``.
"""

from .policy import (ALL_MAX_ELEMENTS, DEFAULT_SAMPLES, ESCALATE_CALLS, ESCALATED_SAMPLES, EVERY_CALL_FIRST,
                     THEN_ONE_IN, SpotConfig, SpotPolicy)
from .sampling import drawn, next_drawn, sample_indices
from .verdict import Sample, SpotStats, spot_check

__all__ = ["ALL_MAX_ELEMENTS", "DEFAULT_SAMPLES", "ESCALATE_CALLS", "ESCALATED_SAMPLES", "EVERY_CALL_FIRST", "Sample",
           "SpotConfig", "SpotPolicy", "SpotStats", "THEN_ONE_IN", "drawn", "next_drawn", "sample_indices",
           "spot_check"]
