"""The command line refuses bad input by its flag before any rank starts (in-process, no group)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from z3guard.cli import app


@pytest.mark.parametrize("args,expected", [
    (["verify-resume", "--save-after", "8", "--steps", "8"], "need 0 < --save-after < --steps"),
    (["verify-resume", "--model", "no_such_module:f", "--batch", "x:y"],
     "--model 'no_such_module:f': cannot import it"),
    (["verify-resume", "--model", "z3guard.scenarios.models:PlainMLP"], "needs both --model"),
    (["doctor", "--scenario", "no-such-scenario"], "unknown scenario 'no-such-scenario'"),
    (["doctor", "--hf", "/no/such/folder"], "--hf /no/such/folder: not a folder"),
])
def test_bad_input_is_refused_before_any_rank_starts(tmp_path, args, expected):
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "out").exists()  # nothing launched
