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

for every sampled element: the reference's own error is at most 1% of the device's error, and an
exactly rounded (or luckier) device is measured against half an ulp of its dtype instead, so a device
result with a tiny or zero error does not make every reference untrusted. ``spacing_d`` is the one of
``shadow.metrics`` (``2**(floor(log2|x|) - p)``, the subnormal spacing below the smallest normal). A
non-finite ``x`` trusts a reference that equals it (the same infinity, or NaN for NaN); a reference
that is non-finite where ``x`` is finite (or the reverse) is untrusted with an infinite error; a
non-finite device result against a finite ``x`` trusts any finite reference (its error is infinite)
and is left out of the device figures, as ``shadow.metrics`` counts such elements apart. For a
float64 device the rule still holds, but float64 has no headroom over itself: a reference passes only
when its error is at most 1% of the device's (0.005 ulp where the device is exact), so with float64
devices expect untrusted verdicts wherever both round; their calls are never escalated.

Sampling (``SpotPolicy``): a few elements per op call (``DEFAULT_SAMPLES``), chosen deterministically
from a seed, the op's name, its call number and the output; the elements the caller ranks most
ill-conditioned (``priority``) go first. Escalation: when a sampled element shows cancellation beyond
what float64's headroom over the device covers (see ``SpotPolicy``), the same call gets up to
``ESCALATED_SAMPLES`` elements and the op's next ``ESCALATE_CALLS`` calls too. Cost stays bounded by
estimates, not clocks (so the samples are reproducible): an element whose estimated cost exceeds
``ELEMENT_CAP_US`` is not checked (the reason says so), a call's default samples stop at
``CALL_CAP_US``, and escalated samples draw on a budget that grows by ``ESCALATION_REFILL_US`` per op
call seen (at most ``ESCALATION_BUDGET_US`` banked).
"""


from .policy import (ALL_MAX_ELEMENTS, DEFAULT_SAMPLES, ESCALATE_CALLS, ESCALATED_SAMPLES, SpotConfig,
                     SpotPolicy)
from .sampling import sample_indices
from .verdict import Sample, SpotStats, spot_check

__all__ = ["ALL_MAX_ELEMENTS", "DEFAULT_SAMPLES", "ESCALATE_CALLS", "ESCALATED_SAMPLES", "Sample", "SpotConfig",
           "SpotPolicy", "SpotStats", "sample_indices", "spot_check"]
