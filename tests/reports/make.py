"""Writes the saved reports of every format version this shadow reads (``v1.json`` to ``v8.json``) and what the
loader read from each (``vN.loaded.json``: ``Report.to_dict()`` of the loaded report, saved as ``Report.save``
writes it). tests/test_report_format.py loads them (every version keeps loading, with the same values) and fuzzes
them. Versions 1 to 7 were written once, by the loader before the format's schema (commit 2e19a34): run this again
only to add a version, naming it, and keep the older files as they are.

    PYTHONPATH=. python tests/reports/make.py tests/reports 8
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

import shadow
from shadow import ShadowMode, reportformat


def run(rank: int) -> shadow.Report:
    """A training step that fills every part of a record: forward, backward and optimizer phases, modules and
    call sites, spot checks, budgets (a bfloat16 matmul over its float32-accumulation budget is not needed: the
    figures are what they are), CPU comparisons, an .item(), an infinity, a write behind shadow's back, one
    optimizer step of trajectory, and records capped (dropped_records)."""
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    side = torch.ones(3)
    with ShadowMode(compare_cpu=True, max_records=12) as sm:
        big = torch.tensor([3e38]) * 10.0  # inf on the device and in float64's float32 rounding
        (side * big).sum().item()
        with torch._C._DisableTorchDispatch():
            side.add_(1.0)  # a write shadow does not see, found by the version it moved
        side * 2.0
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    sm.report.meta.update(rank=rank, world_size=2)
    return sm.report


def versions() -> dict[int, dict]:
    ranks = [run(0), run(1)]
    merged = shadow.merge_reports(ranks)
    out = {8: merged.to_dict()}
    d = copy.deepcopy(out[8])
    for agg in _aggregates(d):  # 8 added the calls judged by a guessed budget
        del agg["guessed_calls"]
    out[7] = d
    d = ranks[0].to_dict()
    for agg in _aggregates(d):
        del agg["guessed_calls"]
    del d["per_rank"]
    out[6] = copy.deepcopy(d)
    del d["trajectory"]
    out[5] = copy.deepcopy(d)
    del d["cells"]  # 5 added the cells, call sites and input drift
    for r in d["records"]:
        del r["callsite"], r["inputs_drift"]
    out[4] = copy.deepcopy(d)
    for r in d["records"]:  # 4 added dtype and shape, renamed the budget's "kind" and "over_budget"
        del r["dtype"], r["shape"]
        if r["budget"] is not None:
            r["budget"]["kind"] = r["budget"].pop("family")
    for agg in (*d["by_op"].values(), *d["by_module"].values()):
        agg["over_budget"] = agg.pop("over_budget_calls")
        del agg["dtypes"], agg["max_local_ulp_nonzero"], agg["budgeted_calls"]
    out[3] = copy.deepcopy(d)
    for r in d["records"]:  # 3 added the budgets
        del r["budget"]
    for agg in (*d["by_op"].values(), *d["by_module"].values()):
        del agg["max_budget_used"], agg["over_budget"], agg["min_effective_bits"]
    out[2] = copy.deepcopy(d)
    for r in d["records"]:  # 2 added the spot checks (and the CPU comparison)
        del r["spot"], r["cpu_fallback"], r["cpu"]
    for agg in (*d["by_op"].values(), *d["by_module"].values()):
        del agg["spot_checked"], agg["spot_untrusted"]
    out[1] = d
    for v, saved in out.items():
        saved["version"] = v
    return out


def _aggregates(d: dict) -> list[dict]:
    """Every aggregate of a saved report: its cells', its ranks' cells', by op and by module."""
    cells = [c["aggregate"] for c in d["cells"]] + [c["aggregate"] for r in d.get("per_rank", ()) for c in r["cells"]]
    return cells + list(d["by_op"].values()) + list(d["by_module"].values())


def encoded(d: dict) -> str:
    """``d`` as ``Report.save`` writes it (non-finite figures as "inf", "-inf", "nan"), compact."""
    return json.dumps(reportformat.saved(d), separators=(",", ":"))


def main(folder: str, *only: int) -> None:
    for v, d in versions().items():
        if only and v not in only:
            continue
        with open(os.path.join(folder, f"v{v}.json"), "w") as f:
            f.write(encoded(d) + "\n")
        loaded = shadow.load_report(os.path.join(folder, f"v{v}.json"))
        with open(os.path.join(folder, f"v{v}.loaded.json"), "w") as f:
            f.write(encoded(loaded.to_dict()) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
