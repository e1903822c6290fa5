"""``bench/scale.py --quick`` (issue 20's table, smaller sizes) runs to the end on this build and
prints every section's figures: a smoke run (about 12 s on a loaded 2-core machine), so that the
benchmark keeps working as the relay, the SDK and the proto change. The figures themselves are
not asserted (speed is measured in bench/, not tested)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A row of the table per figure (each printed as "| figure | size | ...").
FIGURES = (
    "relay RSS, start",
    "relay RSS, busy",
    "relay RSS, idle",
    "encrypt 1 KiB",
    "decrypt 1 KiB",
    "encrypt + decrypt",
    "encrypt + decrypt, CPU",
    "encrypt + decrypt, written",
    "add (commit + merge)",
    "add, CPU",
    "add, written",
    "join (Welcome)",
    "rotate (commit + merge)",
    "add commit size",
    "relay CPU per publish",
    "pipelined publishes",
    "relay disk (database + WAL)",
    "relay disk (database + WAL), 1-hour policy",
)


def test_scale_quick_prints_every_figure() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert "FAILED" not in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    for figure in FIGURES:
        assert any(row.startswith(f"| {figure} ") for row in rows), f"no {figure!r} row:\n{out}"
    if importlib.util.find_spec("mls_rs_uniffi") is not None:
        # The reference column is filled for the timings of both.
        timed = ("encrypt + decrypt", "encrypt + decrypt, CPU", "add (commit + merge)", "add, CPU")
        cells = [[c.strip() for c in r.split("|")] for r in rows]
        references = [c[5] for c in cells if c[1] in timed]
        assert len(references) == 2 * len(timed), out
        assert all(ref.endswith((" us", " ms")) for ref in references), out
