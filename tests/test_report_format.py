"""The saved report's format (``shadow.reportformat``): every version this shadow reads keeps loading with the same
values, every malformed or hostile input is refused with a ``ReportFormatError`` naming the field and its path, and
a save is whole or not at all.

``tests/reports/vN.json`` are saved reports of format versions 1 to 8 of one small training step (every phase, spot
checks, budgets, CPU comparisons, ``.item()``, an infinity, an unobserved write, a trajectory, records capped; v7
and v8 merged from two ranks), and ``vN.loaded.json`` what the loader before the format's schema read from each
(``tests/reports/make.py`` wrote both). The fuzz mutates and truncates them: 200 cases in the default run, 10,000
in the slow one; nothing but a ReportFormatError may escape, and what loads saves and loads back the same.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shadow import Report, ReportFormatError, load_report, reportformat
from shadow.metrics import ErrorStats
from shadow.records import Aggregate, BudgetInfo, Coverage, Event, Record, StepDrift
from shadow.report import loads
from shadow.spot import SpotStats

REPORTS = os.path.join(os.path.dirname(__file__), "reports")
VERSIONS = reportformat.READS


def _path(version: int, loaded: bool = False) -> str:
    return os.path.join(REPORTS, f"v{version}{'.loaded' if loaded else ''}.json")


def _text(version: int) -> str:
    with open(_path(version), encoding="utf-8") as f:
        return f.read()


def _saved(rep: Report) -> dict:
    """The report as its file holds it (JSON types: non-finite figures as strings, tuples as lists)."""
    return json.loads(json.dumps(reportformat.saved(rep.to_dict()), allow_nan=False))


# --- every version keeps loading, with the same values ---
@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_loads_with_the_same_values(version):
    rep = load_report(_path(version))
    got = _saved(rep)
    with open(_path(version, loaded=True), encoding="utf-8") as f:
        want = json.load(f)
    if version < 5:  # saved as 4 now (the loader before the schema wrote 7 with no cells, losing the aggregates)
        assert (got.pop("version"), want.pop("version")) == (4, 7)
        assert [want.pop(name) for name in ("cells", "per_rank", "trajectory")] == [[], [], []]
    elif version < 8:  # saved as the current version, its aggregates with guessed calls counted as none
        assert (got.pop("version"), want.pop("version")) == (reportformat.VERSION, 7)
    if version < 8:
        assert {agg.pop("guessed_calls") for agg in _aggregates(got)} == {0}
    assert got == want
    assert rep.records and rep.coverage.calls > len(rep.records) and rep.dropped_records > 0
    assert rep.table()  # the views work on what was read


def _aggregates(d: dict) -> list[dict]:
    """Every aggregate of a saved report: its cells', its ranks' cells', by op and by module."""
    cells = [c["aggregate"] for c in d.get("cells", ())]
    cells += [c["aggregate"] for r in d.get("per_rank", ()) for c in r["cells"]]
    return cells + list(d["by_op"].values()) + list(d["by_module"].values())


def test_the_fixtures_cover_what_a_record_holds():
    rep = load_report(_path(reportformat.VERSION))
    recs = rep.records
    assert any(r.item is not None and math.isinf(r.item[0]) for r in recs)  # .item() of an infinity
    assert any(r.spot is not None and r.spot.checked for r in recs) and any(r.cpu is not None for r in recs)
    assert any(r.budget is not None for r in recs) and rep.events and rep.per_rank.keys() == {0, 1}
    assert load_report(_path(6)).trajectory and load_report(_path(3)).records[-1].budget.family


def test_the_declaration_covers_every_field_of_the_types_it_saves():
    """A field added to a saved type without its declaration would be lost by save and refused by load."""
    for spec, cls in ((reportformat.RECORD, Record), (reportformat.ERROR_STATS, ErrorStats),
                      (reportformat.SPOT, SpotStats), (reportformat.BUDGET, BudgetInfo),
                      (reportformat.AGGREGATE, Aggregate), (reportformat.COVERAGE, Coverage),
                      (reportformat.EVENT, Event), (reportformat.STEP, StepDrift)):
        fields = dataclasses.fields(cls)
        assert list(spec.fields) == [f.name for f in fields], cls
        required = {f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        assert {name for name, f in spec.fields.items() if f.required} == required, cls


@pytest.mark.parametrize("version", VERSIONS)
def test_a_loaded_report_saves_and_loads_back_the_same(tmp_path, version):
    """Versions 5 to 7 are saved as the current version; reports of earlier versions have no cells (aggregates by
    op and module only) and are saved as version 4, which holds what they have."""
    rep = load_report(_path(version))
    path = tmp_path / "r.json"
    rep.save(path)
    back = load_report(path)
    assert _saved(back) == _saved(rep) and back.table() == rep.table()
    assert json.loads(path.read_text())["version"] == (reportformat.VERSION if version >= 5 else 4)


# --- malformed and hostile input: a ReportFormatError naming the field and its path ---
def _good() -> dict:
    return json.loads(_text(reportformat.VERSION))


def _refused(d, says: str) -> None:
    with pytest.raises(ReportFormatError, match=says):
        loads(d if isinstance(d, (str, bytes)) else json.dumps(d))


def test_a_record_whose_index_is_a_string_is_refused():
    d = _good()
    d["records"][3]["index"] = "3"
    _refused(d, r"^records\[3\]\.index: expected a whole number from 0 to 9223372036854775807, got the string '3'$")


@pytest.mark.parametrize("where,value,says", [
    (("records", 7, "local", "max_ulp"), "NaN", r"records\[7\]\.local\.max_ulp: expected a number .*the string 'NaN'"),
    (("records", 7, "local", "max_ulp"), "Infinity", r"records\[7\]\.local\.max_ulp: .*got the string 'Infinity'"),
    (("records", 7, "local", "max_ulp"), "+inf", r"records\[7\]\.local\.max_ulp: .*got the string '\+inf'"),
    (("records", 7, "local", "max_ulp"), " nan", r"records\[7\]\.local\.max_ulp: .*got the string ' nan'"),
    (("records", 7, "local", "max_ulp"), 10**400, r"records\[7\]\.local\.max_ulp: .*an integer of 401 digits"),
    (("records", 7, "local", "max_ulp"), True, r"records\[7\]\.local\.max_ulp: .*got true"),
    (("records", 7, "local", "n"), 2.0, r"records\[7\]\.local\.n: expected a whole number .*got 2\.0"),
    (("records", 7, "local", "n"), -1, r"records\[7\]\.local\.n: expected a whole number from 0 .*got -1"),
    (("records", 7, "local", "n"), 2**63, r"records\[7\]\.local\.n: .*got 9223372036854775808"),
    (("records", 7, "local", "n"), False, r"records\[7\]\.local\.n: .*got false"),
    (("records", 7, "shape"), [2, -3], r"records\[7\]\.shape\[1\]: expected a whole number from 0"),
    (("records", 7, "item"), [1.0, 2.0, 3.0], r"records\[7\]\.item: expected a list of 2, .*got a list of 3"),
    (("records", 7, "phase"), "sideways", r"records\[7\]\.phase: the string 'sideways' is not a valid Phase"),
    (("records", 7, "op"), ["aten.mm"], r"records\[7\]\.op: expected a string, got a list of 1"),
    (("records", 7, "op"), "x" * (2**20 + 1), r"records\[7\]\.op: .*a string of 1048577 characters"),
    (("records", 7, "spot", "trusted"), "false", r"records\[7\]\.spot\.trusted: expected true or false"),
    (("records", 7, "budget"), [], r"records\[7\]\.budget: expected an object \(BudgetInfo\), got a list of 0"),
    (("by_op", "aten.addmm.default", "kinds", "replayed"), "1",
     r"by_op\['aten\.addmm\.default'\]\.kinds\['replayed'\]: expected a whole number"),
    (("cells", 2, "phase"), None, r"cells\[2\]\.phase: null is not a valid Phase"),
    (("per_rank", 1, "rank"), "1", r"per_rank\[1\]\.rank: expected a whole number from 0 .*, got the string '1'"),
    (("coverage", "unsupported", "aten.x"), 3, r"coverage\.unsupported\['aten\.x'\]: expected a string"),
    (("trajectory",), {}, r"^trajectory: expected a list"),
    (("meta", "run"), {"argv": "python x.py"}, r"meta\.run\.argv: expected a list"),
    (("meta", "rank"), "0", r"meta\.rank: expected a whole number"),
    (("events", 0, "detail"), None, r"events\[0\]\.detail: expected a string, got null"),
    (("max_records",), -5, r"^max_records: expected a whole number from 0 to 9223372036854775807, got -5$"),
])
def test_hostile_values_are_refused_by_path(where, value, says):
    d = _good()
    if "trajectory" in where:
        d["version"] = 6
        d.pop("per_rank")
    node = d
    for key in where[:-1]:
        node = node[key] if not isinstance(node, dict) or key in node else node.setdefault(key, {})
    node[where[-1]] = value
    _refused(d, says)


def test_a_lone_surrogate_is_refused():
    d = _text(7).replace('"aten.addmm.default"', '"aten.addmm.\\ud800"', 1)
    _refused(d, r"a string holding a lone surrogate")


@pytest.mark.parametrize("nesting,says", [
    ('{"format": "shadow-report", "version": 7, "meta": {"x": ' + "[" * 40 + "]" * 40 + "}}",
     r"^meta\.x(\[0\]){32}: nested deeper than 32 levels$"),
    ("[" * 100_000 + "]" * 100_000, r"^(\[0\]){32}: nested deeper than 32 levels$"),
    ('{"records": [{"local": ' + "[" * 5000, r"^records\[0\]\.local(\[0\]){29}: nested deeper than 32 levels$"),
])
def test_deep_nesting_is_refused_where_it_is(nesting, says):
    _refused(nesting, says)


def test_fields_unknown_missing_or_of_other_versions():
    d = _good()
    d["records"][1]["colour"] = 1
    _refused(d, r"^records\[1\]: unknown field 'colour' in an object \(Record\)$")
    d = _good()
    del d["cells"][0]["aggregate"]
    _refused(d, r"^cells\[0\]: missing field 'aggregate'$")
    d = _good()
    d["surplus"] = []
    _refused(d, r"^the report: unknown field 'surplus'$")
    for version in (True, 7.0, "7", 0, reportformat.VERSION + 1):
        _refused(dict(_good(), version=version), "cannot be read by this shadow")
    d = json.loads(_text(4))
    d["trajectory"] = "a field of version 6: unread in version 4"  # as before the schema
    assert loads(json.dumps(d)).trajectory == []


@pytest.mark.parametrize("text,says", [
    (b"\xff\xfe{}", "not UTF-8"),
    ('{"format": "shadow-report", "version": 7, "meta": {', "not JSON"),
    ("", "not JSON"),
    ("[1, 2]", "expected a JSON object, got a list of 2"),
    ('{"format": "shadow-report", "version": 7, "meta": {"x": [' + "9" * 5000 + "]}}",
     r"^meta\.x\[0\]: expected a number, got an integer too long to read$"),
])
def test_text_that_is_not_a_report(text, says):
    _refused(text, says)


def test_pythons_json_literals_are_the_figures_they_name():
    """``json.dump(rep.to_dict(), f)`` writes NaN and Infinity literals: they read as those figures (and only
    where a figure may be: a count is a whole number)."""
    rep = load_report(_path(7))
    text = json.dumps(rep.to_dict())
    assert "Infinity" in text
    assert _saved(loads(text)) == _saved(rep)
    d = json.loads(text)
    d["records"][0]["flips"] = math.nan
    with pytest.raises(ReportFormatError, match=r"records\[0\]\.flips: expected a whole number .*got nan"):
        loads(json.dumps(d))


def test_saving_refuses_what_the_format_cannot_hold(tmp_path):
    rep = load_report(_path(7))
    rep.meta["options"]["device"] = object()
    with pytest.raises(ReportFormatError, match=r"^meta\.options\['device'\]: expected a JSON value, got a Python"):
        rep.save(tmp_path / "r.json")
    assert not os.listdir(tmp_path)  # nothing written, no temporary file left


# --- a save is whole or not at all ---
def test_a_save_interrupted_mid_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    old = load_report(_path(6))
    old.save(path)
    before = path.read_bytes()

    def failing_dump(obj, f, **kw):  # a serializer that dies half-way, as a full disk or a signal would
        f.write(json.dumps(obj, **kw)[:1000])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reportformat.json, "dump", failing_dump)
    with pytest.raises(OSError, match="No space left"):
        load_report(_path(7)).save(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["r.json"]
    monkeypatch.undo()
    load_report(_path(7)).save(path)
    assert load_report(path).per_rank.keys() == {0, 1}


def test_a_save_keeps_the_files_mode_and_writes_through_a_link(tmp_path):
    target = tmp_path / "runs" / "r.json"
    target.parent.mkdir()
    rep = load_report(_path(5))
    rep.save(target)
    os.chmod(target, 0o640)
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    rep.save(link)
    assert link.is_symlink() and os.stat(target).st_mode & 0o777 == 0o640
    assert sorted(os.listdir(target.parent)) == ["r.json"]


# --- the fuzz: random mutations and truncations of real reports ---
_SPELLINGS = ["inf", "-inf", "nan", "NaN", "Infinity", "-Infinity", "+inf", "INF", " nan", "1e999", "3", "true", "",
              "torch.float32", "forward", "replayed", "aten.mm.default", "\ud800", "x" * 70]
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                     st.sampled_from(_SPELLINGS))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_TOKENS = [b"[", b"{", b"]", b"}", b'"', b",", b":", b"NaN", b"Infinity", b"-", b"\\u", b"\\ud800", b"\xff", b"\x00",
           b"1e999", b"9" * 25, b"null", b"[" * 3000]


_TREES: dict[int, dict] = {}
_NODES: dict[int, list] = {}


def _tree(version: int) -> dict:
    if version not in _TREES:
        _TREES[version] = json.loads(_text(version))
        nodes: list[tuple] = []

        def walk(x, at: tuple) -> None:
            nodes.append(at)
            items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
            for k, v in items:
                walk(v, at + (k,))

        walk(_TREES[version], ())
        _NODES[version] = nodes
    return _TREES[version]


@st.composite
def _mutated(draw) -> bytes:
    version = draw(st.sampled_from(VERSIONS))
    if draw(st.booleans()):  # the text: truncated, or bytes replaced or inserted
        data = _text(version).encode()
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["truncate", "replace", "insert"]))
        if how == "truncate":
            return data[:at]
        token = draw(st.sampled_from(_TOKENS) | st.binary(min_size=1, max_size=4))
        return data[:at] + token + data[at + (len(token) if how == "replace" else 0):]
    tree = copy.deepcopy(_tree(version))
    nodes = _NODES[version]
    for _ in range(draw(st.integers(1, 3))):
        at = nodes[draw(st.integers(0, len(nodes) - 1))]
        if not at:
            continue
        parent = tree
        try:
            for k in at[:-1]:
                parent = parent[k]
            key = at[-1]
            old = parent[key]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation moved it
        how = draw(st.sampled_from(["replace", "delete", "add", "nest", "retype"]))
        if how == "replace":
            parent[key] = draw(_VALUES)
        elif how == "delete":
            del parent[key]
        elif how == "add" and isinstance(old, dict):
            old[draw(st.text(max_size=8))] = draw(_VALUES)
        elif how == "nest":
            for _ in range(draw(st.sampled_from([1, 2, 40, 300]))):  # deeper: the text insertions
                old = [old]
            parent[key] = old
        elif how == "retype":
            parent[key] = json.dumps(old) if not isinstance(old, str) else [old]
    return json.dumps(tree).encode("utf-8", "surrogatepass")


def _load_or_refuse(data: bytes) -> None:
    """Only ReportFormatError may escape; a report that loads can be shown, and saves and loads back the same."""
    try:
        rep = loads(data)
    except ReportFormatError:
        return
    rep.table()
    first = _saved(rep)
    assert _saved(Report.from_dict(first)) == first


_FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=200, **_FUZZ)
@given(_mutated())
def test_fuzz_mutated_reports(data):
    _load_or_refuse(data)


@pytest.mark.slow
@settings(max_examples=10_000, **_FUZZ)
@given(_mutated())
def test_fuzz_mutated_reports_10000(data):
    _load_or_refuse(data)
