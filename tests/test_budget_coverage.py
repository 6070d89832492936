"""Budget coverage (issue 53): every computing call (a floating result judged by a budget) of op_db's float32
samples, forward and backward, and of module_db's float32 training steps is judged by a derived bound, not by the
default guess (``Budget.is_default``), but for the ops of ``GUESS_ALLOWED``, each with its reason.

The sweeps run the samples as tests/test_budgets.py and tests/test_moduledb.py do (their helpers, imported); each
takes minutes on two shared cores (measured on the loaded machine: op_db 8.8 min for 12 samples of every entry, module_db 4.2 min): ``slow``.
The fast subset, the ops named in issue 53, is tests/test_budgets_ops.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from shadow import ShadowMode

from test_budgets import SWEPT, _run_opinfo
from test_moduledb import _run as run_module
from test_moduledb import _samples as module_samples

pytestmark = pytest.mark.usefixtures("one_thread")

# op -> why its calls stay on the guess: empty, every computing op the sweeps run has a derived bound; an op added
# here must say why no bound can be derived for it
GUESS_ALLOWED: dict[str, str] = {}


class Guesses:
    """The ops whose floating calls were judged by the default guess, with the first place each was seen."""

    def __init__(self):
        self.seen: dict[str, str] = {}

    def read(self, sm: ShadowMode, where: str) -> None:
        for rec in sm.report.records:
            # a guess, or no budget at all where a floating result was compared (budgets are on)
            unjudged = rec.budget.is_default if rec.budget is not None else rec.local is not None
            if unjudged and rec.dtype in SWEPT:
                self.seen.setdefault(rec.op, where)

    def unexcused(self) -> dict[str, str]:
        return {op: where for op, where in self.seen.items() if op not in GUESS_ALLOWED}


@pytest.mark.slow
def test_opdb_float32_calls_have_derived_budgets():
    from torch.testing._internal.common_methods_invocations import op_db

    guesses = Guesses()  # _run_opinfo only calls its read(sm, where), as a Worst's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in op_db:
            if torch.float32 in op.supported_dtypes("cpu"):
                _run_opinfo(op, torch.float32, guesses)
    assert not guesses.unexcused(), guesses.unexcused()


@pytest.mark.slow
def test_moduledb_float32_training_has_derived_budgets():
    from torch.testing._internal.common_modules import module_db

    guesses = Guesses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mi in module_db:
            for i, sample in enumerate(module_samples(mi, torch.float32, True, None)):
                sm = ShadowMode(spot_checks="off", drift=False)
                run_module(mi, sample, torch.float32, True, sm)
                guesses.read(sm, f"{mi.name}[{i}]")
    assert not guesses.unexcused(), guesses.unexcused()


@pytest.mark.slow
def test_corpus_calls_have_derived_budgets():
    """Every model of the corpus (Hugging Face's with tiny random configs, hand-written GPTs, RNNs, CNNs), a
    training run in float32 and in bfloat16: no computing call on the guess (about 4 min on two cores)."""
    import corpus

    guesses = Guesses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in (torch.float32, torch.bfloat16):
            for name in corpus.MODELS:
                if corpus.unavailable(name) is not None:
                    continue
                program = corpus.build(name, dtype=dtype)
                lstm = any(isinstance(m, torch.nn.LSTM) for m in program.model.modules())
                if dtype == torch.bfloat16 and lstm and corpus.no_bf16_lstm() is not None:
                    continue  # no oneDNN bfloat16 LSTM below AVX-512
                with ShadowMode(spot_checks="off") as sm:
                    corpus.run(program)
                guesses.read(sm, f"{name} {dtype}")
    assert not guesses.unexcused(), guesses.unexcused()
