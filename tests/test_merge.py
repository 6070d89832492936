"""A merged report (shadow.merge_reports) keeps each rank's figures (Report.per_rank) and its table shows them in a
column per rank where the ranks differ: per-rank reports made in one process, no process group needed."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import shadow
from shadow import Aggregate, Phase, Report, ReportFormatError, ShadowMode, load_report
from shadow.cli import main
from shadow.modes import FaultMode
from shadow.records import RANK_FIELDS
from shadow.reportdata import VIEWS
from shadow.tables import RANK_RTOL

pytestmark = pytest.mark.usefixtures("one_thread")

GELU = "aten.gelu.default"


def _rank(rank: int, *, fault: float = 0.0, extra: bool = False) -> Report:
    """One rank's training step of the same small net on the same batch; ``fault``: its gelu's outputs off by that
    relative error (rank 1's kernel off budget while rank 0's is fine); ``extra``: one more op (an exp)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    with FaultMode(rel=fault, op="gelu"), ShadowMode(spot_checks="off") as sm:
        loss = net(x).sum()
        if extra:
            loss = loss + x.exp().sum()
        loss.backward()
        opt.step()
    sm.report.meta["rank"] = rank
    return sm.report


@pytest.fixture(scope="module")
def ranks() -> list[Report]:
    """Rank 0 correct; rank 1 with its gelu 1e-3 off (~2000x its float32 budget)."""
    return [_rank(0), _rank(1, fault=1e-3)]


@pytest.fixture(scope="module")
def merged(ranks) -> Report:
    return shadow.merge_reports(ranks)


def _parse(text: str) -> tuple[list[str], dict[str, dict[str, str]], str]:
    """A plain table's header, its cells by row key and column, and the line under it (its ranks)."""
    lines = text.splitlines()
    head = re.split(r"\s{2,}", lines[0].strip())
    rows = {}
    for line in lines[2:]:
        if line.startswith("ranks "):
            return head, rows, line
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(head), line
        rows[cells[0]] = dict(zip(head, cells))
    raise AssertionError(f"no line on the ranks under the table:\n{text}")


def _figures(a: Aggregate) -> dict:
    return {name: getattr(a, name) for name in RANK_FIELDS}


def test_per_rank_figures_are_each_ranks_own(ranks, merged):
    assert list(merged.per_rank) == [0, 1]
    for rank, rep in zip((0, 1), ranks):
        part = merged.per_rank[rank]
        for by in VIEWS:
            for phase in [None] + [p.value for p in Phase]:
                own = rep.view(by, phase)
                assert {k: _figures(a) for k, a in part.view(by, phase).items()} == \
                    {k: _figures(a) for k, a in own.items()}, (rank, by, phase)
        assert {k: _figures(a) for k, a in part.module_tree().items()} == \
            {k: _figures(a) for k, a in rep.module_tree().items()}
    # the fault: rank 1's gelu over budget, rank 0's within it
    assert merged.per_rank[1].by_op[GELU].over_budget_calls == 1 < merged.per_rank[1].by_op[GELU].max_budget_used
    assert merged.per_rank[0].by_op[GELU].over_budget_calls == 0 and merged.per_rank[0].by_op[GELU].max_budget_used < 1
    # the merged aggregates are what they were: each rank's merged
    for key, a in merged.by_op.items():
        assert a.calls == sum(rep.by_op[key].calls for rep in ranks if key in rep.by_op)
        assert a.max_budget_used == max(rep.by_op[key].max_budget_used for rep in ranks if key in rep.by_op)


def test_columns_per_rank_where_ranks_differ(ranks, merged):
    head, rows, line = _parse(merged.table())
    for name in ("local ulp", "budget", "drift rel"):  # the fault moves the figures the rows are ranked by
        i = head.index(name)
        assert head[i + 1:i + 3] == [f"{name} r0", f"{name} r1"]
    gelu = rows[GELU]
    assert gelu["budget r1"].endswith("!") and not gelu["budget r0"].endswith("!")
    assert gelu["budget r0"] == shadow.tables.budget_cell(ranks[0].by_op[GELU])
    assert gelu["budget r1"] == shadow.tables.budget_cell(ranks[1].by_op[GELU])
    # rows where the ranks agree (the ops before the fault, exact views) say = in the rank columns
    same = [k for k, a in ranks[0].by_op.items()
            if all(_figures(a) == _figures(rep.by_op[k]) for rep in ranks)]
    assert same and all(rows[k][f"{name} r{r}"] == "=" for k in same for name in ("budget", "drift rel")
                        for r in (0, 1))
    differ = [k for k in rows if any(rows[k][f"budget r{r}"] != "=" for r in (0, 1))]
    assert GELU in differ and not set(differ) & set(same)
    assert line.startswith("ranks 0, 1 differ on ") and f"of {len(merged.by_op)} rows in " in line
    # summary: the table, the same line under it, a legend entry per figure shown by rank
    text = merged.summary()
    assert text.startswith(merged.table() + "\n")
    assert all(f"\n  {name} rK" in text for name in ("local ulp", "budget", "drift rel"))


def test_ranks_that_agree_give_the_single_report_table(ranks):
    twin = _rank(1)
    merged = shadow.merge_reports([ranks[0], twin])
    assert {k: _figures(a) for k, a in merged.per_rank[1].by_op.items()} == \
        {k: _figures(a) for k, a in ranks[0].by_op.items()}
    table = merged.table()
    *rows, line = table.splitlines()
    assert rows[0] == ranks[0].table().splitlines()[0] and " r0" not in table
    assert line.startswith("ranks 0, 1 agree on every row")
    for by in VIEWS:
        assert " r1" not in merged.table(by=by)
    assert " r1" not in merged.table(by="module", tree=True) and " r1" not in merged.summary()


def test_a_rank_without_calls_in_a_row_differs(ranks):
    merged = shadow.merge_reports([ranks[0], _rank(1, extra=True)])
    head, rows, line = _parse(merged.table())
    exp = rows["aten.exp.default"]
    assert exp["budget r0"] == "no call" and exp["budget r1"] != "no call"
    assert "aten.exp.default" not in merged.per_rank[0].by_op and merged.per_rank[1].by_op["aten.exp.default"].calls


def _made(used: float = 0.5, over: int = 0, ulp: float = 3.0, drift: float = 1e-7) -> Report:
    """A report of one hand-made cell: two matmuls, the worst at a budget use of ``used``, ``over`` over it."""
    rep = Report()
    rep.cells[("aten.mm.default", "Net.fc", "model.py:3", Phase.FORWARD)] = Aggregate(
        calls=2, budgeted_calls=2, max_budget_used=used, over_budget_calls=over, max_local_ulp_nonzero=ulp,
        max_drift_rel=drift)
    return rep


@pytest.mark.parametrize("rank0, rank1, differ", [
    ({}, {}, set()),
    ({}, {"used": 0.5 * (1 + RANK_RTOL / 10)}, set()),  # within the tolerance
    ({}, {"used": 0.5 * (1 + RANK_RTOL * 10)}, {"budget"}),
    ({}, {"drift": 1e-7 * (1 + 1e-6)}, {"drift rel"}),
    ({}, {"ulp": 4.0}, {"local ulp"}),
    ({}, {"used": 1.5, "over": 1}, {"budget"}),
    ({"used": 1.5, "over": 1}, {"used": 1.5, "over": 2}, {"budget"}),  # the same worst call, one more over budget
    ({"used": float("inf"), "over": 1}, {"used": float("inf"), "over": 1}, set()),
])
def test_the_tolerance(rank0, rank1, differ):
    head, rows, line = _parse(shadow.merge_reports([_made(**rank0), _made(**rank1)]).table())
    shown = {name for name in ("local ulp", "budget", "drift rel") if f"{name} r1" in head}
    assert shown == differ
    assert line.startswith("ranks 0, 1 differ on 1 of 1 rows" if differ else "ranks 0, 1 agree on every row")


def test_save_and_load_keep_the_ranks(merged, tmp_path):
    path = tmp_path / "merged.json"
    merged.save(path)
    back = load_report(path)
    assert list(back.per_rank) == list(merged.per_rank)
    for rank, part in merged.per_rank.items():
        assert back.per_rank[rank].cells == part.cells
    assert back.table() == merged.table() and back.to_dict() == merged.to_dict()
    saved = merged.to_dict()["per_rank"][1]["cells"][0]["aggregate"]
    assert set(saved) == set(RANK_FIELDS)  # compact: only what a table compares


def test_reports_saved_before_per_rank_cells_still_load(merged):
    d = merged.to_dict()
    del d["per_rank"]
    d["version"] = 6
    old = Report.from_dict(d)
    assert old.per_rank == {} and old.by_op.keys() == merged.by_op.keys()
    assert " r1" not in old.table() and "ranks 0, 1" not in old.table()
    d = merged.to_dict()
    d["per_rank"][1] = {"cells": []}
    with pytest.raises(ReportFormatError, match=r"per_rank\[1\]: missing field 'rank'"):
        Report.from_dict(d)
    d["per_rank"][1] = {"rank": 1, "cells": [{"op": "aten.mm.default", "module": "", "callsite": "", "phase": "other"}]}
    with pytest.raises(ReportFormatError, match=r"per_rank\[1\]\.cells\[0\]: missing field 'aggregate'"):
        Report.from_dict(d)


def test_show_of_two_files_prints_the_rank_columns(ranks, tmp_path, capsys):
    paths = [str(tmp_path / f"rank{r}.json") for r in (0, 1)]
    for rep, path in zip(ranks, paths):
        rep.save(path)
    assert main(["show", *paths, "--top", "all", "--plain"]) == 0
    out = capsys.readouterr().out
    head, rows, _ = _parse(out.split("\n\n")[1])
    assert {"budget r0", "budget r1", "drift rel r0", "drift rel r1"} <= set(head)
    assert rows[GELU]["budget r1"].endswith("!") and not rows[GELU]["budget r0"].endswith("!")
    assert "\nranks 0, 1 differ on " in out and "\n  budget rK" in out
