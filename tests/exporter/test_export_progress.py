"""`export` reports its progress through logging: the CLI prints the same lines as before, a library caller
gets them as log records and nothing printed."""

from __future__ import annotations

import logging
import re

from click.testing import CliRunner

from clover_export.exporter.export import export

LINES = [r"model: .+ \(clover_moe, \d+ layers\), graph dtype fp32, block \d+",
         r"traced on the meta device in \d+\.\d s"]


def test_the_cli_prints_the_progress_lines(tiny_fp32_dir, tmp_path):
    from clover_export.cli import main

    r = CliRunner().invoke(main, ["export", str(tiny_fp32_dir), "--out", str(tmp_path / "o"), "--dtype", "fp32",
                                  "--chunk", "8", "--max-batch", "1"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    for i, pattern in enumerate(LINES):
        assert re.fullmatch(pattern, lines[i]), (pattern, lines[:3])


def test_a_library_call_logs_them_and_prints_nothing(tiny_fp32_dir, tmp_path, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="clover_export"):
        export(tiny_fp32_dir, tmp_path / "o", dtype="fp32", chunk=8, max_batch=1)
    ours = [r for r in caplog.records if r.name == "clover_export.exporter.export"]
    assert [r.levelno for r in ours] == [logging.INFO] * len(LINES)
    for rec, pattern in zip(ours, LINES):
        assert re.fullmatch(pattern, rec.getMessage()), rec.getMessage()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
