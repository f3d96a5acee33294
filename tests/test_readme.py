"""The README stays true: its compatibility table is the generated one, its links resolve, the commands and
options it names exist, the cheap commands it shows run, and its performance numbers come from the records
it names. Fast: no rank group; three short `z3guard` processes, run side by side."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from z3guard.adapter.releases import markdown
from z3guard.options import GuardOptions, from_environment

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
Z3GUARD = Path(sys.executable).parent / "z3guard"  # the entry point of the Python running the tests


def _code(text: str) -> list[str]:
    """The fenced blocks and the inline code spans of a markdown text."""
    blocks = FENCED.findall(text)
    prose = FENCED.sub("", text)
    return blocks + re.findall(r"`([^`]+)`", prose)


def _fenced(text: str) -> str:
    return "\n".join(FENCED.findall(text))


def test_the_compatibility_table_is_the_generated_one():
    assert markdown() in README, "paste the output of: python -m z3guard.adapter.releases"


def test_the_tested_versions_named_are_the_pinned_ones():
    pins = {}
    for name in ("requirements-cpu.txt", "requirements-trainers.txt"):
        for line in (ROOT / name).read_text().splitlines():
            package, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                pins[package.lower()] = version
    for package, shown in (("torch", "torch"), ("transformers", "transformers"), ("accelerate", "accelerate"),
                           ("trl", "TRL"), ("deepspeed", "DeepSpeed")):
        assert f"{shown} {pins[package]}" in " ".join(README.split()), f"{shown} {pins[package]} (pinned)"


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md"])
def test_every_relative_link_points_to_a_file_that_exists(doc):
    text = (ROOT / doc).read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    assert relative or doc != "README.md"
    missing = [link for link in relative if not (ROOT / link.split("#")[0]).exists()]
    assert missing == []


def _cli_commands() -> set[str]:
    import typer.main

    from z3guard.cli import app

    return set(typer.main.get_command(app).commands)


def test_every_z3guard_command_shown_exists_and_every_command_is_shown():
    shown = set()
    for code in _code(README):
        # `z3guard <word>` where z3guard is the program: at the start, or after a space, a path or a backtick
        shown |= set(re.findall(r"(?:^|(?<=[\s/`]))z3guard[ \t]+([a-z][\w-]*)", code, re.M))
    commands = _cli_commands()
    assert shown - commands == set(), f"not commands of z3guard: {shown - commands}"
    assert commands - shown == set(), f"commands the README does not show: {commands - shown}"


def test_every_flag_shown_is_an_option_of_its_command():
    import typer.main

    from z3guard.cli import app

    commands = typer.main.get_command(app).commands
    checked = 0
    for code in _code(README):
        for command, rest in re.findall(r"^z3guard[ \t]+([a-z][\w-]*)(.*)$", code, re.M):
            flags = {o for p in commands[command].params for o in (*p.opts, *p.secondary_opts)}
            shown = set(re.findall(r"(?<!\S)(--[a-z][\w-]*)", rest.split("#")[0]))
            assert shown <= flags, f"z3guard {command}: no such option {shown - flags}"
            checked += len(shown)
    assert checked


def test_every_option_named_is_a_guard_options_field_and_every_setting_parses():
    known = {f.name for f in fields(GuardOptions)}
    settings = [next(filter(None, m)) for m in
                re.findall(r"""Z3GUARD_OPTIONS=(?:"([^"]*)"|'([^']*)'|([^\s`"';,)]+(?:,[^\s`"';)]+)*))""", README)]
    assert "fast_paths=off" in settings
    named = set()
    for text in settings:
        from_environment(text)  # raises on an unknown field or a bad value, by name
        named |= {item.partition("=")[0].strip() for item in text.split(",") if item.strip()}
    for call in re.findall(r"GuardOptions\(([^)]*)\)", README):
        named |= {arg.partition("=")[0].strip() for arg in call.split(",") if "=" in arg}
    named |= set(re.findall(r"\bfast_[a-z_]*[a-z]\b", README))  # every fast_* switch mentioned
    assert named, "the README names no option"
    assert named - known == set(), f"not GuardOptions fields: {named - known}"


def test_the_cheap_cpu_commands_shown_run():
    code = "\n".join(_code(README))
    assert re.search(r"^z3guard env\b.*--json", _fenced(README), re.M), "show `z3guard env` and its --json"
    assert "z3guard --version" in code
    env = {k: v for k, v in os.environ.items() if not k.startswith("Z3GUARD")}
    env.setdefault("DS_ACCELERATOR", "cpu")
    assert Z3GUARD.is_file(), f"no z3guard entry point beside {sys.executable}: pip install this project"
    runs = {args: subprocess.Popen([str(Z3GUARD), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=ROOT)
            for args in (("env",), ("env", "--json"), ("--version",))}
    done = {args: (p.wait(timeout=120), *p.communicate()) for args, p in runs.items()}
    for args, (rc, out, err) in done.items():
        assert rc == 0, f"z3guard {' '.join(args)}: exit {rc}\n{err[-3000:]}"
    import z3guard

    assert done[("--version",)][1].strip() == f"z3guard {z3guard.__version__}"
    report = json.loads(done[("env", "--json")][1])
    assert report["versions"]["z3guard"] == z3guard.__version__ and "deepspeed" in report
    assert "self-check" in done[("env",)][1]


def _performance_rows() -> list[list[str]]:
    """The rows of the README's table whose last column names a record in bench/results."""
    rows = []
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[-1].strip("`").endswith(".json"):
            rows.append(cells)
    return rows


def _section_citing(doc: str, record: str) -> str:
    """The `## ` sections of `doc` that name `record`: where its table is."""
    sections = re.split(r"^## ", doc, flags=re.M)
    return "\n".join(s for s in sections if record in s)


def test_every_performance_number_is_in_the_record_the_readme_names():
    rows = _performance_rows()
    assert len(rows) >= 3
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    for cells in rows:
        record = cells[-1].strip("`")
        path = ROOT / "bench" / "results" / record
        assert path.is_file(), record
        assert record in benchmarks, f"docs/benchmarks.md does not cite {record}"
        # what the record says: each configuration's median step in ms, and the ratio of any two of them
        runs = json.loads(path.read_text())
        medians = [r["median_step_s"] * 1000 for r in (runs if isinstance(runs, list) else [])]
        found = {f"{m:.1f}" for m in medians} | {f"{a / b:.2f}" for a in medians for b in medians}
        # ... and what docs/benchmarks.md's table for that record says
        found |= set(re.findall(r"\d+(?:\.\d+)?", _section_citing(benchmarks, record)))
        numbers = [n for cell in cells[1:-1] for n in re.findall(r"\d+(?:\.\d+)?", cell)]
        assert numbers, cells
        assert [n for n in numbers if n not in found] == [], f"{record}: {cells}"
