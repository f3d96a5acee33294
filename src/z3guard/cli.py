"""The `z3guard` command: formatting only; the work lives in the library."""
from __future__ import annotations

import json
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Keep DeepSpeed ZeRO-3 training alive through resume and skipped steps.")
console = Console()


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        console.print(f"z3guard {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="print z3guard's version and exit")) -> None:
    """z3guard: reproduce, prevent and diagnose ZeRO-3 trace failures; verify exact resume."""


@app.command("env")
def env(as_json: bool = typer.Option(False, "--json", help="print the same as JSON")) -> None:
    """What is installed, what z3guard would do with this DeepSpeed and why; paste it into bug reports."""
    import contextlib
    import sys

    from .environment import report

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger prints to stdout as it loads
        data = report()
    if as_json:
        print(json.dumps(data, indent=1))
        return
    versions = ", ".join(f"{k} {v or '(not installed)'}" for k, v in data["versions"].items())
    console.print(f"[bold]z3guard env[/]: {versions}; Python {data['python']}")
    ds = data["deepspeed"]
    if "error" in ds:
        console.print(f"DeepSpeed: {ds['error']}")
    else:
        tested = f"tested ({ds['tested_on']})" if ds["tested"] else "not in the tested list: guarded if the self-check passes"
        console.print(f"DeepSpeed {ds['release']}: {tested}; self-check {ds['self_check'] if ds['self_check'] == 'passed' else 'FAILED: ' + '; '.join(ds['self_check'])}")
        console.print(f"crash fix: {ds['crash_fix']}" + (f"; lifecycle: {ds['lifecycle']}" if "lifecycle" in ds else ""))
        if "speed_paths" in ds:
            table = Table("speed path", "on", "why not", "fingerprint")
            for name, p in ds["speed_paths"].items():
                table.add_row(name, "yes" if p["on"] else "no", p["why_off"] or "", p["fingerprint"] or "")
            console.print(table)
    hook = data["startup_hook"]
    console.print(f"start-up hook: {hook['installed'] or 'not installed (pip install z3guard, not editable, installs it)'}; "
                  f"Z3GUARD={hook['Z3GUARD'] or '(unset)'} -> {'enabled' if hook['enabled'] else 'disabled'}; "
                  f"options: {hook['options']}")


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Dtype(str, Enum):
    fp16 = "fp16"
    bf16 = "bf16"


class Launcher(str, Enum):
    torchrun = "torchrun"
    deepspeed = "deepspeed"


def _check_scenario(scenario: str, model: str | None, batch: str | None, hidden: int,
                    hf: Path | None = None, loss: str | None = None, layers: int | None = None,
                    dtype: str = "fp16") -> None:
    """Resolve the scenario here, as the ranks will (`python -m` imports from the current directory), and
    call the user's functions once, so that a wrong name, signature or batch is reported against its flag
    before any rank starts."""
    import os
    import sys

    from .scenarios import catalog, preflight

    here = os.getcwd()
    sys.path.insert(0, here)
    try:
        found = catalog.resolve(scenario, model, batch, hidden, str(hf) if hf else None, loss, layers)
        preflight.check(found, dtype, model, batch, loss)
    except Exception as exc:  # whatever a user's module raises on import is about the flag that named it
        flag = "--hf" if hf else None if model or batch or loss or layers else "--scenario"  # others name themselves
        raise typer.BadParameter(str(exc).strip('"'), param_hint=flag) from exc
    finally:
        if here in sys.path:
            sys.path.remove(here)


def _user_config(path: Path | None, dtype: str, nproc: int) -> tuple[dict | None, str]:
    """The user's DeepSpeed config (checked here, "auto" resolved in the ranks) and the precision it fixes,
    else `dtype`."""
    if path is None:
        return None, dtype
    from .scenarios import config

    try:
        cfg = config.load(str(path))
        config.resolve_auto(512, dtype, 4, nproc, base=cfg)  # stage 3, every "auto" resolvable, batch sizes
    except config.ConfigError as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"--config {path}: "), param_hint="--config") from exc
    return cfg, config.config_dtype(cfg) or dtype


def _print_failure(failure: dict) -> None:
    """A run that failed for a reason other than the one under study: which, where, and its traceback."""
    step = failure.get("step")
    when = "while starting" if step in (None, 0) else f"at step {step}"
    rank = "" if failure.get("rank") is None else f" (rank {failure['rank']})"
    console.print(f"[red]run '{failure['run']}' failed {when}{rank}[/], for a reason other than a ZeRO-3 trace "
                  f"hazard: {failure.get('exception')}: {failure.get('summary')}", soft_wrap=True)
    if failure.get("user_frames"):
        console.print("[bold]in your code[/] (innermost last):")
        for frame in failure["user_frames"]:
            console.print(f"  {frame}", soft_wrap=True, highlight=False)
    console.print(failure.get("traceback", "").rstrip(), soft_wrap=True, highlight=False, markup=False)
    console.print("[yellow]no conclusion is drawn from this run[/]; fix the cause and run again")


@contextmanager
def _tracking(total: int) -> Iterator[Callable[[str, int], None]]:
    """A progress bar per job while the ranks run; yields the launcher's on_progress callback."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        tasks: dict[str, TaskID] = {}

        def on_progress(job: str, step: int) -> None:
            if job not in tasks:
                tasks[job] = progress.add_task(job, total=total, step="")
            progress.update(tasks[job], completed=total if step < 0 else step,
                            step="done" if step < 0 else f"step {step}")

        yield on_progress


@app.command()
def repro(
    device: Device = typer.Option(Device.cpu, help="cpu: 2 gloo ranks; cuda: NCCL, one GPU per rank"),
    dtype: Dtype = typer.Option(Dtype.fp16, help="fp16 (the report's) or bf16"),
    nproc: int = typer.Option(2, help="ranks"),
    launcher: Launcher = typer.Option(Launcher.torchrun, help="what starts the ranks: torchrun or DeepSpeed's "
                                                              "own launcher"),
    save_after: int = typer.Option(4, help="phase 1 trains this many steps, then saves"),
    skip_at: int = typer.Option(6, help="step that overflows (and is skipped) after the resume"),
    overflow: str = typer.Option("forced", help="forced: a non-finite loss; natural: an outlier batch "
                                                "(inputs x1e4) that overflows fp16 on its own"),
    steps: int = typer.Option(10, help="last step of the run"),
    out: Path = typer.Option(Path("runs/repro"), help="working folder (checkpoints, logs)"),
    json_out: Path = typer.Option(None, "--json", help="also write the verdict here as JSON"),
) -> None:
    """Reproduce the report's crash on stock DeepSpeed and show the guarded run completing."""
    from .scenarios import repro as r

    if not save_after < skip_at <= steps:
        raise typer.BadParameter(f"need save_after < skip_at <= steps, got {save_after}, {skip_at}, {steps}")
    if overflow not in ("forced", "natural"):
        raise typer.BadParameter(f"--overflow must be forced or natural, got {overflow!r}")
    plan = r.ReproPlan(dtype=dtype.value, device=device.value, nproc=nproc, save_after=save_after,
                       skip_at=skip_at, steps=steps, out=out, overflow=overflow, launcher=launcher.value)
    from .adapter import installed_release

    console.print(f"[bold]z3guard repro[/]: CLIP-style model, ZeRO-3 + CPU offload, {dtype.value}, "
                  f"{nproc} ranks on {device.value} ({launcher.value}), DeepSpeed {installed_release()}; "
                  f"save after step {save_after}, resume, step {skip_at} overflows ({overflow})")
    with _tracking(steps) as on_progress:
        verdict = r.run(plan, on_progress)
    table = Table(title="Verdict", show_lines=True)
    for col in ("run", "outcome", "detail"):
        table.add_column(col, overflow="fold")
    colours = {"completed": "green", "crashed": "red"}
    for row in verdict.rows:
        table.add_row(row.run, f"[{colours.get(row.outcome, 'white')}]{row.outcome}[/]", row.detail)
    console.print(table)
    console.print(("[green]as expected[/]: stock DeepSpeed crashed, z3guard completed bit-identically"
                   if verdict.as_expected else "[red]NOT as expected[/]") + f" ({verdict.seconds:.0f} s)")
    if json_out:
        json_out.write_text(json.dumps(verdict.to_dict(), indent=1))
    raise typer.Exit(0 if verdict.as_expected else 1)


class Construct(str, Enum):
    zero_init = "zero-init"
    plain = "plain"


CONFIG_HELP = "your DeepSpeed config (JSON; Trainer's \"auto\" values resolved as Trainer does); default: " \
              "Hugging Face's ZeRO-3 example with CPU offload"
INIT_HELP = "zero-init: build the model under deepspeed.zero.Init with the config, as Hugging Face does; " \
            "plain: build it, then hand it to deepspeed.initialize"
LOSS_HELP = "your loss, 'pkg.module:function' (output, target) -> loss; default: the model's own loss (a " \
            "scalar or .loss), else cross-entropy of the logits"


@app.command("verify-resume")
def verify_resume(
    scenario: str = typer.Option("clip", help="built-in scenario (clip, tied, skip-block, side-read, ...)"),
    model: str = typer.Option(None, help="your model factory, 'pkg.module:function' (with --batch)"),
    batch: str = typer.Option(None, help="your batch factory (step, micro, rank, dtype) -> (args, kwargs, target)"),
    loss: str = typer.Option(None, help=LOSS_HELP),
    config: Path = typer.Option(None, help=CONFIG_HELP),
    init: Construct = typer.Option(Construct.zero_init, help=INIT_HELP),
    hidden: int = typer.Option(512, help="hidden size for Trainer-style 'auto' ZeRO sizes (custom models)"),
    device: Device = typer.Option(Device.cpu),
    dtype: Dtype = typer.Option(Dtype.fp16, help="where the config leaves it \"auto\""),
    nproc: int = typer.Option(2, min=1, help="ranks"),
    resume_ranks: int = typer.Option(None, min=1, help="resume on this many ranks instead: the state after the "
                                                      "load bit for bit, the losses after it within a tolerance"),
    steps: int = typer.Option(8, help="N: steps of the straight run"),
    save_after: int = typer.Option(4, help="K: the resumed run saves after K steps and resumes"),
    skip_at: list[int] = typer.Option([6], help="steps forced to skip (repeatable)"),
    guard: bool = typer.Option(True, help="--no-guard: the same comparison on stock DeepSpeed"),
    json_out: Path = typer.Option(None, "--json", help="also write the verdict here as JSON"),
    out: Path = typer.Option(Path("runs/verify-resume")),
) -> None:
    """Train N steps straight and as K + save + resume + (N-K); compare everything bit for bit.

    Exit status: 0 bit-identical; 1 a difference (or a run stopped by a trace failure); 2 bad input;
    3 a run failed for another reason."""
    from .scenarios import verify as v

    if not 0 < save_after < steps:
        raise typer.BadParameter(f"need 0 < --save-after < --steps (something to compare after the resume), "
                                 f"got --save-after {save_after}, --steps {steps}")
    ds_config, precision = _user_config(config, dtype.value, nproc)
    _check_scenario(scenario, model, batch, hidden, loss=loss, dtype=precision)

    plan = v.VerifyPlan(scenario=scenario, dtype=precision, device=device.value, nproc=nproc, steps=steps,
                        save_after=save_after, skip_at=tuple(skip_at), guard=guard, model=model, batch=batch,
                        loss=loss, hidden=hidden, out=out, ds_config=ds_config, construct=init.value,
                        resume_ranks=resume_ranks)
    label = f"{model}+{batch}" if model else scenario
    console.print(f"[bold]z3guard verify-resume[/]: {label}, {precision}, {nproc} ranks on {device.value}, "
                  f"{steps} steps straight vs {save_after} + save + resume; skipped steps {list(skip_at)}"
                  f"{'' if guard else ' (stock DeepSpeed, no z3guard)'}")
    with _tracking(steps) as on_progress:
        result = v.run(plan, on_progress)
    if json_out:
        json_out.write_text(json.dumps(result.to_dict(), indent=1))
    if result.failure:
        _print_failure(result.failure)
    elif result.crash:
        crash = result.crash
        console.print(f"[red]a run did not complete[/]: {crash.get('summary') or crash['message'].strip()}")
    else:
        table = Table(title="Compared")
        table.add_column("what")
        for item in result.checked:
            table.add_row(item)
        console.print(table)
        if result.losses:
            losses = Table("step", f"loss, {nproc} ranks straight", f"loss, resumed on {resume_ranks}", "relative",
                           title="after the resume (global batch)")
            for step, a, b in result.losses:
                losses.add_row(str(step), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b) / abs(a):.1e}")
            console.print(losses)
        same = "bit-identical" if result.tolerance is None else "state bit-identical, losses within tolerance"
        console.print(f"[green]{same}[/] ({result.seconds:.0f} s)" if result.identical
                      else f"[red]first divergence[/]: {result.difference}")
    raise typer.Exit(result.status)


@app.command("check-checkpoint")
def check_checkpoint(
    path: Path = typer.Argument(..., help="a save folder (with 'latest') or one checkpoint's folder"),
    tag: str = typer.Option(None, help="a tag inside PATH instead of the one 'latest' names"),
    json_out: Path = typer.Option(None, "--json", help="also write the verdict here as JSON"),
) -> None:
    """Show what a checkpoint holds and whether it verifies against its manifest (exit 0 if it does)."""
    from dataclasses import asdict

    from .checkpoint.inspect import inspect

    found = inspect(path, tag)
    if json_out:
        json_out.write_text(json.dumps({"folder": str(found.folder), "ok": found.ok, "verdict": found.verdict,
                                        "loads_on": found.loads_on,
                                        "manifest": None if found.manifest is None else vars(found.manifest),
                                        "files": [asdict(f) for f in found.files]}, indent=1, default=str))
    m = found.manifest
    if m is not None:
        head = Table(title=f"{found.folder}", show_header=False)
        for key in ("tag", "global_step", "world_size", "zero_stage", "dtype", "deepspeed", "torch", "z3guard"):
            head.add_row(key, str(getattr(m, key)))
        if m.storages > 1:
            head.add_row("storage", f"{m.storage + 1} of {m.storages} (a node's folder: its ranks' files only)")
        console.print(head)
    files = Table(title="files")
    for col in ("file", "bytes", "status"):
        files.add_column(col)
    colours = {"ok": "green", "unverified": "yellow"}
    for row in found.files:
        files.add_row(row.name, f"{row.size:,}", f"[{colours.get(row.status, 'red')}]{row.status}[/]")
    console.print(files)
    console.print(("[green]" if found.ok else "[red]") + found.verdict + "[/]")
    if found.loads_on:
        console.print(f"loads on: {found.loads_on}")
    raise typer.Exit(0 if found.ok else 1)


@app.command()
def doctor(
    scenario: str = typer.Option("clip", help="a built-in scenario (clip, mlp, tied, skip-block, side-read, twice)"),
    model: str = typer.Option(None, help="your model factory, 'pkg.module:function' (with --batch)"),
    batch: str = typer.Option(None, help="your batch factory (step, micro, rank, dtype) -> (args, kwargs, target)"),
    loss: str = typer.Option(None, help=LOSS_HELP),
    hf: Path = typer.Option(None, help="a local Hugging Face config/model folder (causal LM, built from config)"),
    layers: int = typer.Option(None, min=1, help="with --hf: build this many of its layers (they repeat the "
                                                 "same hazards)"),
    config: Path = typer.Option(None, help=CONFIG_HELP),
    init: Construct = typer.Option(Construct.zero_init, help=INIT_HELP),
    hidden: int = typer.Option(512, help="hidden size for Trainer-style 'auto' ZeRO sizes (custom models)"),
    dtype: Dtype = typer.Option(Dtype.fp16, help="where the config leaves it \"auto\""),
    nproc: int = typer.Option(2, min=1, help="ranks"),
    verify: bool = typer.Option(False, help="re-run stock DeepSpeed with the suggested changes applied"),
    json_out: Path = typer.Option(None, "--json", help="also write the report here"),
    out: Path = typer.Option(Path("runs/doctor")),
) -> None:
    """Find the ZeRO-3 trace hazards in a model: names, causes, what crashes stock, and the fixes.

    Exit status: 0 no hazards; 1 hazards found (or stock crashed, or the guarded run did not complete);
    2 bad input; 3 a run failed for a reason other than a trace hazard."""
    from . import doctor as d

    ds_config, precision = _user_config(config, dtype.value, nproc)
    _check_scenario(scenario, model, batch, hidden, hf, loss, layers, precision)

    plan = d.DoctorPlan(scenario=scenario, model=model, batch=batch, loss=loss, hf_path=str(hf) if hf else None,
                        layers=layers, hidden=hidden, nproc=nproc, dtype=precision, ds_config=ds_config,
                        construct=init.value, verify=verify, out=out)
    with _tracking(7) as on_progress:
        report = d.run(plan, on_progress)
    if json_out:
        json_out.write_text(json.dumps(report.to_dict(), indent=1))
    if report.failure:
        _print_failure(report.failure)
        raise typer.Exit(report.status)
    console.print(f"[bold]z3guard doctor[/]: {report.label}")
    stock = Table(title="stock DeepSpeed ZeRO-3 on this model")
    stock.add_column("event")
    stock.add_column("outcome", overflow="fold")
    for event, outcome in report.stock.items():
        stock.add_row(event, outcome if outcome == "ok" else f"[red]{outcome}[/]")
    console.print(stock)
    if report.status == 0:
        console.print("[green]no ZeRO-3 trace hazards found[/]")
    elif not report.hazards:
        console.print("[red]no hazard could be named, yet a run above did not complete[/]")
    else:
        table = Table(title="hazards", show_lines=True)
        for col in ("kind", "module", "parameters", "crashes stock on", "z3guard"):
            table.add_column(col, overflow="fold")
        for h in report.hazards:
            params = "\n".join(p + (" (persistent)" if p in h.persistent else "") for p in h.params)
            where = f"\n{h.source}" if h.source else ""
            table.add_row(h.kind, h.module + where, params or "-", "\n".join(h.crashes_stock_on) or "-",
                          "covered" if h.covered_by_z3guard else "NOT covered")
        console.print(table)
        fixes = list(dict.fromkeys(f for h in report.hazards for f in h.fix))
        console.print("[bold]to remove them without z3guard[/] (after the model is built, before "
                      "deepspeed.initialize):")
        for f in fixes:
            console.print(f"  {f}", soft_wrap=True)
    if report.verified is not None:
        console.print("[green]verified[/]: with the suggested register_external_parameter calls stock DeepSpeed "
                      "no longer crashes" if report.verified else "[red]not verified[/]: stock still crashes")
    if not report.z3guard_completed:
        console.print("[red]the guarded run did not complete[/]: see the log under " + str(out / "observe"))
    raise typer.Exit(report.status)


if __name__ == "__main__":
    app()
