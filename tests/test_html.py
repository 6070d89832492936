"""shadow.html and the ``html`` command: the page's content and escaping, that it is self-contained, the
command's errors, and the page opened in headless Chromium (no console error, the plots on screen, the matmuls in
the over-budget table)."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("matplotlib")

import shadow.html  # noqa: E402  (registers the command, as the CLI's import of it will)
from shadow import Kind, Phase, Record, Report, ShadowMode, cli, plots  # noqa: E402
from shadow.report import LEGEND  # noqa: E402
from shadow.verdict import conclude  # noqa: E402
from test_plots import tf32_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("report") / "tf32.json")
    tf32_step().save(path)
    return path


@pytest.fixture(scope="module")
def page(saved) -> str:
    return shadow.html.render(shadow.load_report(saved))


def _section(page: str, heading: str) -> str:
    start = page.index(f"<h2>{heading}</h2>")
    end = page.find("<h2>", start + 1)
    return page[start:end if end >= 0 else None]


def test_page_holds_verdict_meta_coverage_tables_and_plots(page, saved):
    rep = shadow.load_report(saved)
    verdict = re.search(r'<pre class="verdict suspicious">(.*?)</pre>', page, re.S).group(1)
    assert verdict == html.escape(conclude(rep).text) and "\n  aten.mm " in verdict
    assert f"<td>{torch.__version__}</td>" in _section(page, "Run")
    assert "<summary>options</summary>" in page
    assert str(rep.coverage).splitlines()[0] in _section(page, "Coverage")
    over = _section(page, "Calls over budget")
    assert over.count("<tr>") == len(rep.records_over_budget()) + 1  # + the header row
    assert "aten.mm.default" in over and "aten.addmm.default" in over and "MLP.fc1" in over
    per_op = _section(page, "Per op")
    assert all(f"<td>{op}</td>" in per_op for op in rep.by_op)
    assert per_op.count('<tr class="over">') == 2  # mm and addmm
    assert all(f"<td>{m}</td>" in _section(page, "Per module") for m in rep.by_module if m)
    assert all(f"<dt>{name}</dt><dd>{html.escape(LEGEND[name])}</dd>" in page for name in LEGEND)
    assert "No kept call produced NaN or Inf" in page
    assert page.count('src="data:image/png;base64,') == len(plots.FIGURES)


def test_page_is_self_contained(page):
    assert not re.search(r"https?://", page)
    refs = re.findall(r'\b(?:src|href)="([^"]*)"', page)
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_strings_from_the_report_are_escaped():
    rep = Report(meta={"script": "<script>alert(1)</script>", "options": {"note": "a & b"}})
    rep.add(Record(0, "aten.mm.default", "<img src=x onerror=alert(2)>", Phase.FORWARD, Kind.REPLAYED,
                   callsite="<b>x.py</b>:1"))
    page = shadow.html.render(rep)
    assert f'<pre class="verdict">{html.escape(conclude(rep).text)}</pre>' in page  # no budget: not suspicious
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a &amp; b" in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page


def test_nonfinite_origin():
    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.log(x)

    with ShadowMode() as sm:
        Net()(torch.tensor([1.0, -1.0]))
    text = _section(shadow.html.render(sm.report), "Where NaN/Inf is born")
    assert "born in aten.log at Net (forward" in text and "a math problem: float64 gives NaN/Inf there too" in text
    assert "it reaches the result (aten.log, call #" in text  # a run without backward: its last result


def test_html_command_writes_page_and_pngs(saved, tmp_path, capsys):
    out, pngs = tmp_path / "r.html", tmp_path / "png"
    assert cli.main(["html", saved, "-o", str(out), "--png", str(pngs)]) == 0
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(os.listdir(pngs)) == sorted(f"{name}.png" for name in plots.FIGURES)
    assert capsys.readouterr().out.splitlines()[0] == f"wrote {out}"


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such file; give a report saved by `shadow run` or Report.save"),
    ("not json", "not a shadow report: not JSON"),
    ("output folder", "does not exist; give a file path in a writable folder"),
    ("png is a file", "is a file; give a directory"),
])
def test_html_command_errors(case, expected, saved, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    args = {"missing": [str(tmp_path / "nope.json"), "-o", str(tmp_path / "r.html")],
            "not json": [str(text), "-o", str(tmp_path / "r.html")],
            "output folder": [saved, "-o", str(tmp_path / "no" / "r.html")],
            "png is a file": [saved, "-o", str(tmp_path / "r.html"), "--png", str(text)]}[case]
    assert cli.main(["html", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shadow: error: html: ") and expected in err and err.count("\n") == 1
    assert not (tmp_path / "r.html").exists()


def test_html_command_needs_output(saved, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["html", saved])
    assert exc.value.code == 2 and "-o/--output" in capsys.readouterr().err


def test_without_matplotlib(saved, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = shadow.html.render(shadow.load_report(saved))
    assert "pip install matplotlib" in _section(page, "Plots") and "data:image/png" not in page
    assert cli.main(["html", saved, "-o", str(tmp_path / "r.html"), "--png", str(tmp_path / "png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
def test_page_in_headless_chromium(page, tmp_path):
    from matplotlib.image import imread
    import numpy as np

    out, shot = tmp_path / "r.html", tmp_path / "shot.png"
    out.write_text(page, encoding="utf-8")
    # one launch: the DOM after load on stdout, the console on stderr (--enable-logging), and a screenshot
    run = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", f"--screenshot={shot}", "--window-size=1200,3000",
         out.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not console, console  # the page logs nothing: any console line is an error (or a CSP refusal)

    over = _section(run.stdout, "Calls over budget")
    assert re.search(r"<td>aten\.(add)?mm\.default</td>", over), over[:2000]

    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (3000, 1200)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 1
    red = np.all(np.abs(pixels - np.array([0xc4, 0x4e, 0x52]) / 255) < 0.03, axis=-1)
    assert red.sum() > 500  # the budget plot's over-budget bars (#c44e52) are on screen
    rows = np.flatnonzero(red.any(axis=1))
    plot = pixels[rows.min() - 300:rows.max() + 50]  # the budget plot and what is above it: the drift plot
    assert (plot < 0.95).any(axis=-1).mean() > 0.05  # not white: axes, labels, bands, bars
