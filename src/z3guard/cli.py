"""The `z3guard` command: formatting only; the work lives in the library."""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Keep DeepSpeed ZeRO-3 training alive through resume and skipped steps.")
console = Console()


@app.callback()
def main() -> None:
    """z3guard: reproduce, prevent and diagnose ZeRO-3 trace failures; verify exact resume."""


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Dtype(str, Enum):
    fp16 = "fp16"
    bf16 = "bf16"


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
                    TimeElapsedColumn(), console=console, transient=True)


@app.command()
def repro(
    device: Device = typer.Option(Device.cpu, help="cpu: 2 gloo ranks; cuda: NCCL, one GPU per rank"),
    dtype: Dtype = typer.Option(Dtype.fp16, help="fp16 (the report's) or bf16"),
    nproc: int = typer.Option(2, help="ranks"),
    save_after: int = typer.Option(4, help="phase 1 trains this many steps, then saves"),
    skip_at: int = typer.Option(6, help="step forced to skip (non-finite loss) after the resume"),
    steps: int = typer.Option(10, help="last step of the run"),
    out: Path = typer.Option(Path("runs/repro"), help="working folder (checkpoints, logs)"),
    json_out: Path = typer.Option(None, "--json", help="also write the verdict here as JSON"),
) -> None:
    """Reproduce the report's crash on stock DeepSpeed and show the guarded run completing."""
    from .scenarios import repro as r

    if not save_after < skip_at <= steps:
        raise typer.BadParameter(f"need save_after < skip_at <= steps, got {save_after}, {skip_at}, {steps}")
    plan = r.ReproPlan(dtype=dtype.value, device=device.value, nproc=nproc, save_after=save_after,
                       skip_at=skip_at, steps=steps, out=out)
    console.print(f"[bold]z3guard repro[/]: CLIP-style model, ZeRO-3 + CPU offload, {dtype.value}, "
                  f"{nproc} ranks on {device.value}; save after step {save_after}, resume, step {skip_at} skipped")
    with _progress() as progress:
        tasks: dict[str, int] = {}

        def on_progress(job: str, step: int) -> None:
            if job not in tasks:
                tasks[job] = progress.add_task(job, total=steps, step="")
            if step < 0:
                progress.update(tasks[job], completed=steps, step="done")
            else:
                progress.update(tasks[job], completed=step, step=f"step {step}")

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


if __name__ == "__main__":
    app()
