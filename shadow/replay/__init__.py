"""How each aten op is recomputed in float64: the rule table (``table``), the rules for views,
uninitialized memory and randomness (``noncompute``), and, by family (``shadow.opsets.Family``), fused device
kernels with no float64 CPU kernel (``attention``: scaled dot product attention; ``recurrent``: oneDNN LSTM, the
fused LSTM and GRU cells; ``amp``: GradScaler's bookkeeping and the fused optimizers' scale) and the collectives
(``collectives``)."""

import torch

from . import amp, attention, noncompute, recurrent  # noqa: F401  (their rules register in the table)

if torch.distributed.is_available():  # the c10d collectives, replayed on shadow's own process groups
    from . import collectives  # noqa: F401
from .defined import DEFINED, defined_regions  # noqa: F401  (which output elements an op defines)
from .noncompute import EMPTY_OPS, view_rule
from .table import REPLAY, Replay, default_rule, register_predicate, register_rule

__all__ = ["REPLAY", "Replay", "register_rule", "register_predicate", "default_rule", "view_rule", "EMPTY_OPS"]
