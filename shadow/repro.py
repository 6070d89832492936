"""A reproduction of one call over budget (``Report.repro``, ``shadow repro``): DIR/repro.py, which needs torch
alone (the code of ``shadow.reproscript`` after the call's facts), and DIR/inputs.pt: the kept inputs, the
arguments of the float64 reference, the budget's bound (computed here, by shadow, from that reference) and the
checksums of the device's recorded outputs (docs/repro.md).

>>> files = write(rep.kept_inputs(), None, "repro-mm")     # doctest: +SKIP
>>> files.script, files.budget_used                          # doctest: +SKIP
('repro-mm/repro.py', 12.5)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import os
import pprint
import re
from typing import Any

import torch

from . import reproscript
from .budgets import budget_for
from .budgets.core import BUDGETS
from .budgets.units import KAPPA, accumulation_dtype, unit_roundoff
from .engine.prepare import remap_args
from .engine.values import Args
from .errors import CallNotKeptError, ReproError
from .metrics import precision_bits
from .mirror import Placement
from .plan import plan_of
from .rules import rule_name
from .reportformat import write_atomically
from .sidecar import KeptCall, KeptInputs, TensorSlot, encode

_CPU = Placement(torch.device("cpu"))  # the reference's dtype and device arguments, as shadow's replay takes them


@dataclasses.dataclass(frozen=True)
class ReproFiles:
    """What ``write`` wrote: the script, its inputs, and the call they reproduce."""

    script: str
    inputs: str
    call: int
    op: str
    budget_used: float


def write(kept: KeptInputs, call: int | None, directory: str | os.PathLike | None, calls: int | None = None
          ) -> ReproFiles:
    """Write the reproduction of kept call ``call`` (None: the worst kept) into ``directory`` (None:
    ./repro-OP-CALL); ``calls``: how many calls the run made (for the message of a call out of range)."""
    c = _chosen(kept, call, calls)
    directory = os.fspath(directory) if directory is not None else f"repro-{c.op.split('.')[1]}-{c.index}"
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ReproError(f"{directory}: not a directory; give -o a folder to write repro.py and inputs.pt into")
    os.makedirs(directory, exist_ok=True)
    data, facts = _contents(kept, c)
    script, inputs = os.path.join(directory, "repro.py"), os.path.join(directory, "inputs.pt")
    buffer = io.BytesIO()
    torch.save(data, buffer)
    write_atomically(inputs, lambda f: f.write(buffer.getvalue()), binary=True)
    write_atomically(script, lambda f: f.write(_script(facts)))
    return ReproFiles(script, inputs, c.index, c.op, c.budget_used)


def _chosen(kept: KeptInputs, call: int | None, calls: int | None) -> KeptCall:
    worst = sorted(kept.calls, key=lambda i: -kept.calls[i].budget_used)
    if call is None:
        return kept.calls[worst[0]]
    if call in kept.calls:
        return kept.calls[call]
    if isinstance(call, bool) or not isinstance(call, int) or call < 0 or (calls is not None and call >= calls):
        detail = f"out of range: the run made {calls} calls, numbered from 0" if calls is not None else \
            "not a call number (a record's index, from 0)"
    else:
        detail = "its inputs were not kept: only the worst calls over budget are (report.meta['repro'])"
    raise CallNotKeptError(call, worst, detail)


def _contents(kept: KeptInputs, c: KeptCall) -> tuple[dict, dict]:
    """inputs.pt's contents and the script's facts: the reference's arguments, the budget from its outputs."""
    namespace, name, overload = c.op.split(".")
    func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    plan = plan_of(func)
    dtype = getattr(torch, c.dtype)
    slots = [TensorSlot(i) for i in range(len(c.tensors))]
    reference = Args(*reproscript.arguments(c.args, c.kwargs, slots))
    remap_args(plan, _CPU, reference)  # float dtypes to float64, devices to the CPU, as shadow's replay has them
    tree = Args(encode(reference.args), encode(reference.kwargs))
    wide = [reproscript.rebuild(t, wide=True) for t in c.tensors]
    before = [reproscript.rebuild(t, wide=True) for t in c.tensors]  # the budget reads the inputs before the op
    try:
        a, kw = reproscript.arguments(tree.args, tree.kwargs, wide)
        result = func(*a, **kw)
    except Exception as exc:
        raise ReproError(f"{c.op} has no float64 CPU kernel to compute its reference with torch alone "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
    references = reproscript.outputs(result, wide, c.written)
    budget = budget_for(func, *reproscript.arguments(tree.args, tree.kwargs, before), references, dtype)
    compared = [s for s, r in enumerate(references) if s in c.checksums and (r.is_floating_point() or r.is_complex())
                and budget.bound[s] is not None]
    scale_sq, acc_sq = budget.scales()
    real = dtype.to_real() if dtype.is_complex else dtype
    data = {"tensors": c.tensors, "args": c.args, "kwargs": c.kwargs, "reference_args": tree.args,
            "reference_kwargs": tree.kwargs, "written": c.written, "checksums": c.checksums, "ulps": budget.ulps,
            "bounds": {s: None if budget.ulps is not None else budget.bound[s] for s in compared},
            "bits": {"scale_sq": scale_sq, "acc_sq": acc_sq, "ua": unit_roundoff(accumulation_dtype(dtype)),
                     "kappa": KAPPA, "stored": float(precision_bits(real)),
                     "n_out": sum(references[s].numel() for s in compared)},
            "numerics": kept.numerics}
    local = c.record.get("local") or {}
    facts = {"call": c.index, "op": c.op, "device": c.device, "dtype": c.dtype, "torch": kept.torch,
             "budget": {"family": budget.family, "formula": _formula(func, budget)},
             "recorded": {"max_abs": local.get("max_abs"), "max_ulp": local.get("max_ulp"),
                          "rel_norm": local.get("rel_norm"), "effective_bits": local.get("effective_bits"),
                          "budget_used": c.budget_used},
             "emulation": list(kept.emulation)}
    return data, facts


def _formula(func: Any, budget: Any) -> str:
    """The budget's rule in words: its bound in ulps, or the rule's name and its docstring's first line."""
    if budget.ulps is not None:
        return f"{budget.ulps:g} ulps of the result at each element"
    rules = [r for r in BUDGETS.chain(func) if r.family == budget.family] or list(BUDGETS.chain(func))
    fn = rules[0].fn
    name = re.sub(r"<function .*? at 0x[0-9a-f]+>", "...", rule_name(fn))  # a partial's bound functions: no address to paste
    doc = inspect.getdoc(fn.func if isinstance(fn, functools.partial) else fn) or ""
    doc = doc.split("\n\n")[0].replace("\n", " ")
    return f"{name}: {doc} (shadow's bound per element, derived in docs/budgets.md)" if doc else name


def _script(facts: dict) -> str:
    """repro.py: what it reproduces, the facts, then the code of ``shadow.reproscript``."""
    source = inspect.getsource(reproscript)
    body = source[source.index('"""', 3) + 3:].lstrip("\n")
    rec = facts["recorded"]

    def figure(x: Any, spec: str) -> str:
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    emulation = "".join(f"\nThe recorded error came from an emulation, {e['repr']}, which repro.py applies where "
                        "shadow is installed (--no-emulation: not)." for e in facts["emulation"])
    head = (f'#!/usr/bin/env python3\n"""Reproduction of call {facts["call"]} of a shadow run: {facts["op"]} on '
            f'{facts["device"]}, {figure(rec["budget_used"], ".3g")}x its error budget.\n\n'
            f'Recorded (torch {facts["torch"]}): max abs error {figure(rec["max_abs"], ".6g")}, max ulp '
            f'{figure(rec["max_ulp"], ".6g")} of {facts["dtype"]}, effective bits {figure(rec["effective_bits"], ".3g")}.'
            f'\nBudget ({facts["budget"]["family"]}): {facts["budget"]["formula"]}{emulation}\n\n'
            "    python repro.py [--device cpu] [--setup MODULE[:FUNCTION]] [--json] [--no-emulation]\n\n"
            "runs the op on the run's device (or another), its float64 reference on the CPU from the same inputs "
            "upcast\nexactly, and prints the error against the budget: exit status 1 over budget, 0 within. Needs "
            "torch alone;\ninputs.pt beside it holds the inputs (shapes, strides, storage offsets), the budget's bound "
            'and the\nchecksum of the output the device recorded.\n"""\n')
    head = head.replace("\\", "\\\\")
    start = head.index('"""') + 3  # the text between the docstring's quotes: a sidecar's strings never end it
    head = head[:start] + head[start:-4].replace('"""', '\\"\\"\\"') + head[-4:]
    facts_text = "FACTS = " + pprint.pformat(facts, width=110, sort_dicts=False) + "\n"
    return head + "\n" + body.replace("import torch\n", "import torch\n\n" + facts_text, 1) + \
        '\n\nif __name__ == "__main__":\n    sys.exit(main(sys.argv[1:], FACTS))\n'
