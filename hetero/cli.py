"""`hetero`: the whole life of a run from a terminal.

    hetero validate examples/*.json                         # the platform's checks, offline
    hetero run examples/pytorch-heterogeneous.json --follow # start, watch, print the result
    hetero runs                                             # recent runs: status, step time, $ per 1k steps
    hetero show RUN | hetero stop RUN | hetero logs RUN --host algo-2 --group data_group
    hetero sweep examples/sweep.json --follow ; hetero report SWEEP_ID --open
    hetero prices --types ml.p4d.24xlarge ml.c5.18xlarge
    hetero local examples/pytorch-heterogeneous.json --channel train=build/images ; hetero demo

The deployed stack (`--stack`, default HeteroTrainingPlatform) is found in `--region` with `--profile`'s
credentials, as the AWS CLI finds them. Read commands take `--json` for scripts. Results go to stdout,
progress to stderr; colour only on a terminal (and never with NO_COLOR). An error is one line on stderr
and a non-zero exit: 1 when the run or the request failed, 2 when the input was refused.
"""

from __future__ import annotations

import json
import webbrowser
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetero import api

app = typer.Typer(help="The whole life of a training run on the platform: validate, run and follow, inspect, stop, sweep, report.",
                  no_args_is_help=True, rich_markup_mode="markdown",
                  epilog="Examples: hetero run examples/pytorch-heterogeneous.json --follow · hetero runs --json · hetero logs RUN --host algo-2")
out = Console()
err = Console(stderr=True)

Stack = Annotated[str, typer.Option(help="The platform's CloudFormation stack.", envvar="HETERO_STACK")]
Region = Annotated[str | None, typer.Option(help="The stack's AWS region.", envvar="AWS_REGION")]
Profile = Annotated[str | None, typer.Option(help="AWS CLI profile for the credentials.", envvar="AWS_PROFILE")]
AsJson = Annotated[bool, typer.Option("--json", help="JSON on stdout, for scripts.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")]

SUCCEEDED = "SUCCEEDED"


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]hetero:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def platform(stack: str, region: str | None, profile: str | None) -> api.Platform:
    return api.Platform(stack=stack, region=region, profile=profile)


def emit_json(value: Any) -> None:
    out.print_json(json.dumps(value, default=str))


# Offline ---------------------------------------------------------------------------------------------


@app.command()
def validate(specs: Annotated[list[Path], typer.Argument(help="Job spec files (a sweep's when it has sweep_name).")],
             as_json: AsJson = False) -> None:
    """Check specs with the platform's own rules, offline; each refusal names its field."""
    verdicts = []
    for path in specs:
        try:
            _name, raw = api.read_json(path)
            (api.validate_sweep if isinstance(raw, dict) and "sweep_name" in raw else api.validate)(path)
            verdicts.append({"spec": str(path), "ok": True})
        except api.SpecRefused as error:
            verdicts.append({"spec": str(path), "ok": False, "field": error.field, "error": str(error)})
        except api.ClientFacingError as error:
            verdicts.append({"spec": str(path), "ok": False, "field": None, "error": str(error)})
    if as_json:
        emit_json(verdicts)
    else:
        for verdict in verdicts:
            if verdict["ok"]:
                out.print(f"[green]ok[/]      {verdict['spec']}", highlight=False)
            else:
                out.print(f"[red]refused[/] {verdict['error']}", highlight=False, soft_wrap=True)
    if not all(verdict["ok"] for verdict in verdicts):
        raise typer.Exit(2)


# Runs ------------------------------------------------------------------------------------------------


@app.command()
def run(spec: Annotated[Path, typer.Argument(help="The job spec (JSON).")],
        name: Annotated[str | None, typer.Option(help="The run's id (default: run_name and the time).")] = None,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Watch it to the end; exit 0 only if it succeeded.")] = False,
        poll_s: Annotated[float, typer.Option(help="Seconds between looks when following.", min=0.1)] = 5.0,
        stack: Stack = api.DEFAULT_STACK, region: Region = None, profile: Profile = None, quiet: Quiet = False,
        as_json: AsJson = False) -> None:
    """Start a training run from a spec (refused before anything starts if the spec is bad)."""
    try:
        api.validate(spec)
    except api.ClientFacingError as error:
        fail(str(error), 2)
    target = platform(stack, region, profile)
    started = guarded(lambda: api.launch(spec, target, name))
    if not quiet:
        err.print(f"started run [bold]{started.name}[/]", highlight=False)
    if not follow:
        emit_json({"run": started.name, "execution_arn": started.execution_arn}) if as_json else out.print(started.name, highlight=False)
        return
    status = watch(started, target, poll_s, quiet)
    show_result(started, target, as_json)
    raise typer.Exit(0 if status == SUCCEEDED else 1)


@app.command()
def sweep(spec: Annotated[Path, typer.Argument(help="The sweep input (JSON).")],
          name: Annotated[str | None, typer.Option(help="The sweep's id (default: sweep_name and the time).")] = None,
          follow: Annotated[bool, typer.Option("--follow", "-f", help="Wait for the end; exit 0 only if it succeeded.")] = False,
          poll_s: Annotated[float, typer.Option(min=0.1)] = 10.0,
          stack: Stack = api.DEFAULT_STACK, region: Region = None, profile: Profile = None, quiet: Quiet = False) -> None:
    """Start a benchmark sweep; `hetero report SWEEP_ID` shows its report when it ends."""
    try:
        api.validate_sweep(spec)
    except api.ClientFacingError as error:
        fail(str(error), 2)
    target = platform(stack, region, profile)
    started = guarded(lambda: api.launch_sweep(spec, target, name))
    out.print(started.name, highlight=False)
    if follow:
        status = watch(started, target, poll_s, quiet)
        raise typer.Exit(0 if status == SUCCEEDED else 1)


@app.command()
def runs(limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
         stack: Stack = api.DEFAULT_STACK, region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """Recent runs, newest first: status, step time, cost per 1k steps."""
    rows = guarded(lambda: api.runs(platform(stack, region, profile), limit))
    if as_json:
        emit_json(rows)
        return
    table = Table("run", "status", "started", "job", "step p50 (ms)", "$ per 1k steps")
    for row in rows:
        table.add_row(row["run"], coloured(row["status"]), row["started"][:16].replace("T", " "), row["job_status"] or "–",
                      number(row["step_time_ms"], 1), number(row["cost_per_1k_steps_usd"], 4))
    out.print(table)


@app.command()
def show(run_id: Annotated[str, typer.Argument(metavar="RUN")], stack: Stack = api.DEFAULT_STACK, region: Region = None,
         profile: Profile = None, as_json: AsJson = False) -> None:
    """A run's status and result."""
    target = platform(stack, region, profile)
    described = guarded(lambda: api.describe(api.run_of(run_id, target), target))
    outcome = guarded(lambda: api.result(run_id, target))
    if as_json:
        emit_json({"run": run_id, "status": described["status"], "started": described["startDate"],
                   "stopped": described.get("stopDate"), "error": described.get("error"), "result": outcome})
        return
    out.print(f"[bold]{run_id}[/]  {coloured(described['status'])}  started {described['startDate']:%Y-%m-%d %H:%M:%S}", highlight=False)
    if described.get("error"):
        out.print(f"{described['error']}: {described.get('cause', '')}", highlight=False, soft_wrap=True)
    if outcome:
        out.print(result_table(outcome))


@app.command()
def stop(run_id: Annotated[str, typer.Argument(metavar="RUN")], stack: Stack = api.DEFAULT_STACK, region: Region = None,
         profile: Profile = None) -> None:
    """Stop a run: its execution ends and the platform stops its training job."""
    target = platform(stack, region, profile)
    was = guarded(lambda: api.stop(api.run_of(run_id, target), target))
    if was == "RUNNING":
        out.print(f"stopping {run_id}: its training job is stopped by the platform", highlight=False)
    else:
        fail(f"run {run_id!r} is not running ({was})")


@app.command()
def logs(run_id: Annotated[str, typer.Argument(metavar="RUN")],
         host: Annotated[list[str] | None, typer.Option(help="Only this host's lines (algo-2); repeatable.")] = None,
         group: Annotated[list[str] | None, typer.Option(help="Only this instance group's hosts; repeatable.")] = None,
         stack: Stack = api.DEFAULT_STACK, region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """The job's log lines, host by host tagged, filterable by host and by instance group."""
    target = platform(stack, region, profile)
    lines = guarded(lambda: api.log_lines(api.run_of(run_id, target), target, set(host or ()), set(group or ())))
    if as_json:
        emit_json([{"host": name, "line": line} for name, line in lines])
        return
    for name, line in lines:
        out.print(f"[cyan]\\[{name}][/] {line}", highlight=False, markup=True, soft_wrap=True)


@app.command()
def report(sweep_id: Annotated[str, typer.Argument(metavar="SWEEP_ID")],
           open_chart: Annotated[bool, typer.Option("--open", help="Open the saved chart.")] = False,
           out_dir: Annotated[Path, typer.Option(help="Where chart.png is saved.")] = Path("."),
           stack: Stack = api.DEFAULT_STACK, region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """A finished sweep's report, rendered; its chart saved as <SWEEP_ID>-chart.png."""
    markdown, report_json, chart = guarded(lambda: api.sweep_report(sweep_id, platform(stack, region, profile)))
    saved = None
    if chart:
        saved = out_dir / f"{sweep_id}-chart.png"
        saved.write_bytes(chart)
    if as_json:
        emit_json(report_json | {"chart": str(saved) if saved else None})
    else:
        out.print(Markdown(markdown))
        if saved:
            err.print(f"chart: {saved}", highlight=False)
    if open_chart and saved:
        webbrowser.open(saved.resolve().as_uri())


@app.command()
def prices(types: Annotated[list[str] | None, typer.Option("--types", help="Instance types (default: the catalog's).")] = None,
           stack: Stack = api.DEFAULT_STACK, region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """$/hour of SageMaker training instances: the Price List API (cached by the platform), else the dated
    fallback table; always with the source and date."""
    from lambdas.core.catalog import CATALOG
    from lambdas.core.pricing import prices_for

    target = platform(stack, region, profile)
    wanted = list(types or sorted(CATALOG))
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    quoted = guarded(lambda: prices_for(wanted, region=target.session.region_name or "us-east-1", day=day,
                                       pricing=target.client("pricing"), s3=target.client("s3"), bucket=target.results_bucket))
    rows = {name: quoted.usd_per_hour.get(name) for name in wanted}
    if as_json:
        emit_json({"source": quoted.source, "date": quoted.date, "usd_per_hour": rows})
        return
    table = Table("instance type", "$/hour", caption=f"{quoted.source}, {quoted.date}")
    for name, price in rows.items():
        table.add_row(name, number(price, 3))
    out.print(table)


# The emulated cluster ------------------------------------------------------------------------------


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def local(ctx: typer.Context, spec: Annotated[Path, typer.Argument(help="The job spec (JSON).")]) -> None:
    """Run a spec on the emulated cluster on this machine (the options of `python -m training.local run`:
    --channel train=DIR, --set key=value, --processes-per-host, --cpus ...)."""
    from training.local.__main__ import main as local_main

    raise typer.Exit(local_main(["run", str(spec), *ctx.args]) or 0)


@app.command()
def demo() -> None:
    """The demo: the example specs on the emulated cluster, compared, offline."""
    from training.local.demo import main as demo_main

    raise typer.Exit(demo_main([]) or 0)


# Rendering -------------------------------------------------------------------------------------------


def guarded(action):
    try:
        return action()
    except api.SpecRefused as error:
        fail(str(error), 2)
    except api.ClientFacingError as error:
        fail(str(error))


def watch(started: api.Run, target: api.Platform, poll_s: float, quiet: bool) -> str:
    """Follow a run to its end, a progress bar over its steps on stderr; its final status."""
    status = "RUNNING"
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=err, disable=quiet, transient=False) as bar:
        task = bar.add_task(started.name, total=None, metrics="")
        for event in guarded(lambda: list_follow(started, target, poll_s)):
            if event.kind == "progress":
                shown = " ".join(f"{key}={value:g}" for key, value in event.metrics.items() if key in ("step_time_ms", "samples_per_s", "loss"))
                bar.update(task, completed=event.step, total=event.steps, metrics=shown)
            elif event.kind in ("execution", "job") and not quiet:
                bar.console.print(f"{event.kind}: {coloured(event.status)} {event.message}".rstrip(), highlight=False)
            elif event.kind == "done":
                status = event.status
    return status


def list_follow(started: api.Run, target: api.Platform, poll_s: float):
    # A generator's errors surface while iterating: wrap each step so they reach `guarded` as one line.
    events = api.follow(started, target, poll_s)
    while True:
        try:
            yield next(events)
        except StopIteration:
            return
        except api.ClientFacingError as error:
            fail(str(error))


def show_result(started: api.Run, target: api.Platform, as_json: bool) -> None:
    outcome = guarded(lambda: api.result(started, target))
    if as_json:
        emit_json({"run": started.name, "result": outcome})
    elif outcome:
        out.print(result_table(outcome))
    else:
        err.print("no result.json for this run", highlight=False)


def result_table(outcome: dict[str, Any]) -> Table:
    table = Table("", "", show_header=False, box=None)
    step = outcome.get("step_time_ms") or {}
    startup = outcome.get("startup") or {}
    for label, value in (
        ("status", coloured(outcome.get("status") or "–")),
        ("job", f"{outcome.get('job_name') or '–'} ({outcome.get('job_status')})"),
        ("failure", outcome.get("failure_reason") or "–"),
        ("step time p50 / p90", f"{number(step.get('p50'), 1)} / {number(step.get('p90'), 1)} ms"),
        ("samples/s", number(outcome.get("samples_per_s"), 1)),
        ("$/hour", number(outcome.get("usd_per_hour"), 3)),
        ("$ per 1k steps", number(outcome.get("cost_per_1k_steps_usd"), 4)),
        ("run cost", f"${number(outcome.get('run_cost_usd'), 2)}"),
        ("first batch", "–" if startup.get("billed_to_first_batch_s") is None else f"{startup['billed_to_first_batch_s']:.1f} s after billing began"),
    ):
        table.add_row(label, value)
    return table


def coloured(status: str) -> str:
    colour = {"SUCCEEDED": "green", "Completed": "green", "FAILED": "red", "Failed": "red", "TIMED_OUT": "red",
              "ABORTED": "yellow", "Stopped": "yellow", "RUNNING": "cyan", "InProgress": "cyan"}.get(status)
    return f"[{colour}]{status}[/]" if colour else status


def number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def main() -> None:
    app(prog_name="hetero")


if __name__ == "__main__":
    main()
