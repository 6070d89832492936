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
from shadow.tables import LEGEND  # noqa: E402
from shadow.verdict import conclude  # noqa: E402
import corpus  # noqa: E402
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


@pytest.fixture(scope="module")
def bf16_page() -> str:
    """A hand-written causal transformer (its mask by masked_fill(-inf)) on the emulated bfloat16 device."""
    from shadow.modes.emulate import BF16Mode

    program = corpus.build("gpt_masked_fill", steps=1)
    with BF16Mode(), ShadowMode() as sm:
        corpus.run(program)
    return shadow.html.render(sm.report)


# a repr of an internal object: "SpotConfig(mode='default', ...", "mappingproxy({})", "<Phase.FORWARD: ...>",
# "<object at 0x7f...>"
REPR = re.compile(r"\b[A-Za-z_]\w*\((?:[A-Za-z_]\w*=|\{|\[)|mappingproxy|<\w+\.[A-Z_]+: | object at 0x[0-9a-f]+")


def _text(page: str) -> str:
    """What the page shows: its markup, scripts and styles dropped, entities read."""
    body = re.sub(r"<(script|style)>.*?</\1>", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]*>", " ", body))


def test_no_repr_of_an_internal_object_on_the_page(page, bf16_page):
    for shown in (page, bf16_page):
        text = _text(shown)
        assert "options" in text and "spot_checks" in text
        assert not REPR.search(text), REPR.search(text)
    assert "spot_checks default " in " ".join(_text(bf16_page).split())  # the option as the user gives it


def test_bfloat16_page_opens_with_the_verdict_and_its_plot(bf16_page):
    """The verdict (one cause, its exception, the mask as information) and the bits plot that shows it come
    first, before the run's meta."""
    verdict = html.unescape(re.search(r'<pre class="verdict suspicious">(.*?)</pre>', bf16_page, re.S).group(1))
    classes = int(re.match(r"verdict: bfloat16-like arithmetic throughout: (\d+) op classes read ~7 bits", verdict)[1])
    assert classes >= 15 and len(verdict.splitlines()) < 8  # 15 and more classes said in a line, not a line each
    assert verdict.splitlines()[-1].startswith("info: NaN/Inf made in aten.masked_fill at GPT.h.0.attn, GPT.h.1.attn")
    head = bf16_page[:bf16_page.index("<h2>")]
    assert head.count("data:image/png;base64,") == 1 and '<figure id="plot-bits" class="verdict">' in head
    assert bf16_page.count('id="plot-bits"') == 1  # not again under Plots
    born = _section(bf16_page, "Where NaN/Inf is born")
    assert "not a finding" in born and "<td>aten.masked_fill</td>" in born and "<td>aten._softmax</td>" in born


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


CHROMIUM = pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed (Debian: "
                              "apt-get install chromium; .ci/run installs it)")
# measures the first screen once the page and its images have loaded, into the DOM that --dump-dom prints
_MEASURE = """<script>window.addEventListener("load", function () {
  var img = document.querySelector("figure.verdict img"), pre = document.querySelector("pre.verdict");
  var out = document.createElement("pre"); out.id = "fold";
  out.textContent = JSON.stringify({height: window.innerHeight, verdict: pre.getBoundingClientRect().bottom,
    plot: img.getBoundingClientRect().bottom, plotHeight: img.getBoundingClientRect().height,
    loaded: img.complete && img.naturalHeight > 0, text: document.body.innerText});
  document.body.appendChild(out);
});</script>"""


def _chromium(page: str, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    out = tmp_path / "r.html"
    out.write_text(page, encoding="utf-8")
    run = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                          f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", *flags,
                          out.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


@CHROMIUM
@pytest.mark.parametrize("which", ("tf32", "bf16"))
def test_first_screen_holds_the_verdict_and_its_plot(which, page, bf16_page, tmp_path):
    """In a 1280x720 window, the verdict and the plot that shows it are on screen before any scrolling, and no repr
    of an internal object is in the text the browser shows."""
    import json

    shown = {"tf32": page, "bf16": bf16_page}[which].replace("</body>", _MEASURE + "</body>")
    run = _chromium(shown, tmp_path, "--window-size=1280,720", "--dump-dom")
    fold = json.loads(html.unescape(re.search(r'<pre id="fold">(.*?)</pre>', run.stdout, re.S).group(1)))
    assert fold["loaded"] and 550 <= fold["height"] <= 720  # the viewport: the window less what headless keeps
    assert 0 < fold["verdict"] < fold["plot"] <= fold["height"] and fold["plotHeight"] > 250
    assert not REPR.search(fold["text"]), REPR.search(fold["text"])


@CHROMIUM
def test_page_in_headless_chromium(page, tmp_path):
    from matplotlib.image import imread
    import numpy as np

    shot = tmp_path / "shot.png"
    # one launch: the DOM after load on stdout, the console on stderr (--enable-logging), and a screenshot
    run = _chromium(page, tmp_path, "--dump-dom", f"--screenshot={shot}", "--window-size=1200,3000")
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


def test_tables_rank_guessed_ops_after_derived_ones():
    """An op no budget rule knows (a guess: no evidence) ranks below those held to derived budgets, even an exact
    one, however many ulps it reads; its budget cell says ?, and the verdict does not count it as judged."""
    from shadow.metrics import ErrorStats
    from shadow.records import BudgetInfo

    rep = Report()
    for i, (op, ulp, guess) in enumerate([("aten._fused_adamw_.default", 2.25e4, True),
                                          ("aten.clone.default", 0.0, False)]):
        rep.add(Record(i, op, "Net", Phase.OPTIMIZER, Kind.REPLAYED, local=ErrorStats(max_ulp=ulp, n=4),
                       budget=BudgetInfo("default" if guess else "movement", ulp / 4, guess), dtype="torch.float32"))
    per_op = _section(shadow.html.render(rep), "Per op")
    assert per_op.index("<td>aten.clone.default</td>") < per_op.index("<td>aten._fused_adamw_.default</td>")
    assert '">?</td>' in per_op
    assert "not judged: 1 call of aten._fused_adamw_" in shadow.html.render(rep)
