"""``shadow html REPORT -o FILE``: a report as one self-contained HTML page (``shadow.html``), its plots as PNG
files too with ``--png``."""

from __future__ import annotations

import argparse
import os

from .. import plots
from ..errors import ReportFormatError
from ..html import render
from ..report import load_report
from .common import envelope, envelope_argument, unwritable
from .registry import command, fail


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", metavar="REPORT", help="a report saved as JSON (shadow run -o PATH, Report.save)")
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="the HTML file to write")
    p.add_argument("--png", metavar="DIR", default=None,
                   help="also write the plots as PNG files into DIR (created if missing)")
    envelope_argument(p)


@command("html", "write a self-contained HTML report", arguments)
def execute(args: argparse.Namespace) -> int:
    try:
        report = load_report(args.report)
    except FileNotFoundError:
        return fail(f"html: {args.report}: no such file; give a report saved by `shadow run` or Report.save")
    except OSError as exc:
        return fail(f"html: {args.report}: cannot be read ({exc.strerror}); give a report file you can read")
    except ReportFormatError as exc:
        return fail(f"html: {exc}; give a report saved by `shadow run` or Report.save")
    if problem := unwritable(args.output):
        return fail(f"html: -o {args.output}: {problem}; give a file path in a writable folder")
    if args.png is not None:
        if os.path.exists(args.png) and not os.path.isdir(args.png):
            return fail(f"html: --png {args.png}: is a file; give a directory (created if missing)")
        try:
            plots.require_matplotlib()
        except ImportError as exc:
            return fail(f"html: --png: {exc}")
    env = envelope(args.envelope)
    page = render(report, envelope=env)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {args.output}")
    if args.png is not None:
        for path in plots.write_pngs(report, args.png, envelope=env):
            print(f"wrote {path}")
    return 0
