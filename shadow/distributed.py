"""Reports of several ranks as one: ``merge_reports``. How collectives are shadowed: docs/distributed.md."""

from __future__ import annotations

import os
from typing import Iterable, Mapping

from .records import RANK_FIELDS, Aggregate
from .report import Report
from .reportdata import ReportData

_COUNTS = ("calls", "internal_errors", "passthrough", "tensors_adopted", "unobserved_writes", "reinterpreted",
           "out_of_scope")


def merge_reports(reports: Iterable[ReportData]) -> Report:
    """One report from the per-rank reports of a distributed run: aggregates (by op, module, call site, phase)
    summed with ``Aggregate.merge``, coverage counts added, records kept rank after rank. Each report's rank is
    its ``meta["rank"]`` (set when shadow sees a collective), else its position in ``reports``. The merged
    meta names the ranks (``meta["ranks"]``), and ``meta["record_ranks"]`` gives the rank of each record.
    Each rank's cells are kept too, with the figures a table compares (``Report.per_rank``): the merged table
    shows them in a column per rank where the ranks differ (``Report.table``).

    >>> merged = shadow.merge_reports([shadow.load_report(f"rank{r}.json") for r in range(2)])  # doctest: +SKIP
    >>> merged.meta["ranks"]                                                                    # doctest: +SKIP
    [0, 1]
    >>> merged.per_rank[1].by_op["c10d.allreduce_.default"].max_budget_used                     # doctest: +SKIP
    """
    reports = list(reports)
    if not reports:
        raise ValueError("merge_reports: expected one report per rank, got none")
    ranks = [r.meta.get("rank", i) for i, r in enumerate(reports)]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"merge_reports: ranks {ranks} repeat; expected one report per rank")
    limits = [r.max_records for r in reports]
    cells: dict[tuple[str, str, str, str], Aggregate] = {}
    for rep in reports:
        for key, agg in rep.cells.items():
            mine = cells.get(key)
            if mine is None:
                mine = cells[key] = Aggregate()
            mine.merge(agg)
    out = Report(max_records=None if None in limits else sum(limits),
                 meta={**reports[0].meta, "ranks": ranks, "rank": None,
                       "world_size": reports[0].meta.get("world_size", len(reports))}, cells=cells)
    record_ranks: list[int] = []
    cov = out.coverage
    for rank, rep in zip(ranks, reports):
        out.per_rank[rank] = _figures(rep)
        out.records.extend(rep.records)
        record_ranks.extend([rank] * len(rep.records))
        out.dropped_records += rep.dropped_records
        out.events.extend(rep.events)
        c = rep.coverage
        for name in _COUNTS:
            if hasattr(cov, name):
                setattr(cov, name, getattr(cov, name) + getattr(c, name))
        for k, v in c.kinds.items():
            cov.kinds[k] = cov.kinds.get(k, 0) + v
        for op, reason in c.unsupported.items():
            cov.unsupported.setdefault(op, f"rank {rank}: {reason}")
        for name, n in c.compiled.items():
            cov.compiled[name] = cov.compiled.get(name, 0) + n
    out.meta["record_ranks"] = record_ranks
    return out


def _figures(rep: ReportData) -> ReportData:
    """What a merged report keeps of one rank: its cells, with only the figures a table compares."""
    return ReportData(cells={key: Aggregate(**{name: getattr(agg, name) for name in RANK_FIELDS})
                             for key, agg in rep.cells.items()})


def records_of_rank(report: ReportData, rank: int) -> list:
    """The records of one rank in a merged report."""
    return [rec for rec, r in zip(report.records, report.meta.get("record_ranks", [])) if r == rank]


def rank_path(path: str, meta: Mapping, environ: Mapping[str, str] = os.environ) -> str:
    """Where one rank of a distributed run writes the report meant for ``path``: ``run.json`` becomes
    ``run.rank1.json`` when the run has several ranks (the report's ``meta["rank"]`` and ``meta["world_size"]``, set
    at the first collective shadow sees; else torchrun's ``RANK`` and ``WORLD_SIZE``), ``path`` itself otherwise.
    Without it, every rank of ``torchrun -m shadow run`` would write the same file and the last to finish would be
    the one left.

    >>> rank_path("out/run.json", {"rank": 1, "world_size": 2})
    'out/run.rank1.json'
    """
    rank, world = meta.get("rank"), meta.get("world_size")
    if rank is None or world is None:
        rank, world = environ.get("RANK"), environ.get("WORLD_SIZE")
    try:
        several = int(world) > 1
    except (TypeError, ValueError):
        return path
    if not several:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


__all__ = ["merge_reports", "rank_path", "records_of_rank"]
