"""`hetero`: the whole life of a run from a terminal.

    hetero validate examples/*.json                         # the platform's checks, offline
    hetero run examples/pytorch-heterogeneous.json --follow # start, watch, print the result
    hetero run examples/pytorch-heterogeneous.json --direct # one job without the state machine (SageMaker SDK)
    hetero runs                                             # recent runs: status, billed ms per step, $ per 1k steps
    hetero show RUN | hetero follow RUN | hetero stop RUN | hetero logs RUN --host algo-2 --group data_group
    hetero sweep examples/sweep.json --follow ; hetero report SWEEP_ID --open
    hetero prices g5 ml.c6i.8xlarge --json                    # hardware and $/hour, offline (--live: the Price List API)
    hetero local examples/pytorch-heterogeneous.json --channel train=build/images ; hetero demo

The deployed stack (`--stack`, default HeteroTrainingPlatform) is found in `--region` with `--profile`'s
credentials, as the AWS CLI finds them. Read commands take `--json` for scripts. Results go to stdout,
progress to stderr; colour only on a terminal (and never with NO_COLOR). An error is one line on stderr
and a non-zero exit: 1 when the run or the request failed, 2 when the input was refused.
"""

from __future__ import annotations

import itertools
import json
import sys
import webbrowser
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import click
import typer
import typer.core
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetero import api, direct
from training.stop_signals import restore_stop_signals


class Guarded(typer.core.TyperGroup):
    """Every command's refusals and AWS errors as one line and an exit code, wherever they are raised: a
    command that forgets to guard one of its calls still never shows a traceback for them."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except api.InputRefused as error:
            fail(str(error), 2)
        except api.ClientFacingError as error:
            fail(str(error))


app = typer.Typer(cls=Guarded, help="The whole life of a training run on the platform: validate, run and follow, inspect, stop, sweep, report.",
                  no_args_is_help=True, rich_markup_mode="markdown",
                  epilog="Examples: hetero run examples/pytorch-heterogeneous.json --follow · hetero runs --json · hetero logs RUN --host algo-2")
# Text from outside (log lines, AWS errors, spec fields, failure reasons) is escaped before Rich sees it:
# "[rank0]" or "[/]" in a line is text, not markup.
out = Console(emoji=False)
err = Console(stderr=True, emoji=False)

Stack = Annotated[str | None, typer.Option(help="The platform's CloudFormation stack (default HeteroTrainingPlatform).", envvar="HETERO_STACK")]
Region = Annotated[str | None, typer.Option(help="The stack's AWS region.", envvar="AWS_REGION")]
Profile = Annotated[str | None, typer.Option(help="AWS CLI profile for the credentials.", envvar="AWS_PROFILE")]
AsJson = Annotated[bool, typer.Option("--json", help="JSON on stdout, for scripts.")]
GivenPrices = Annotated[list[str] | None, typer.Option("--price", metavar="TYPE=USD_PER_HOUR", help=(
    "Your $/hour for an instance type (a negotiated or newer price), in place of the dated table's; repeatable."))]


def given_prices(items: list[str] | None) -> dict[str, float]:
    """``--price`` options as {instance type: $/hour}; a malformed one ends the command with its reason (exit 2)."""
    from lambdas.core.price_performance import given_price

    try:
        return dict(given_price(item) for item in items or [])
    except ValueError as error:
        fail(str(error), 2)
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")]
Direct = Annotated[bool, typer.Option("--direct", help="RUN is a job launched with `run --direct` (its job name).")]

SUCCEEDED = "SUCCEEDED"


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]hetero:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback()
def where(ctx: typer.Context, stack: Stack = None, region: Region = None, profile: Profile = None) -> None:
    """--stack, --region and --profile may come before the command too, as the AWS CLI takes them."""
    ctx.obj = {"stack": stack, "region": region, "profile": profile}


def platform(ctx: typer.Context, stack: str | None, region: str | None, profile: str | None) -> api.Platform:
    """The platform the command's options name, else the ones given before the command, else the defaults."""
    given = (ctx.parent.obj if ctx.parent is not None else None) or {}
    return api.Platform(stack=stack or given.get("stack") or api.DEFAULT_STACK, region=region or given.get("region"),
                        profile=profile or given.get("profile"))


def emit_json(value: Any) -> None:
    # Written as it is: no colour or wrapping ever (FORCE_COLOR included), so that a pipe reads JSON.
    sys.stdout.write(json.dumps(value, default=str, indent=2) + "\n")


# Offline ---------------------------------------------------------------------------------------------


@app.command()
def validate(specs: Annotated[list[Path], typer.Argument(help="Job spec files (a sweep's when it has sweep_name).")],
             channel: Annotated[list[str] | None, typer.Option(
                 "--channel", metavar="NAME=DIR", help="A local folder for a channel: the workload's hooks (a user's, or a PyTorch built-in's) then run on its first samples.")] = None,
             code: Annotated[Path | None, typer.Option(help="A user workload's code folder, in place of the spec's.")] = None,
             install: Annotated[bool, typer.Option(help="Check that the workload's requirements resolve (pip --dry-run).")] = True,
             deployment: Annotated[bool, typer.Option(help="Apply the cost policy a deployment would: cdk.json's ceilings and "
                                                          "ceiling prices, from --settings, else the cdk.json found from each spec's "
                                                          "folder up (never the working directory's).")] = True,
             settings_file: Annotated[Path | None, typer.Option("--settings", metavar="CDK_JSON", help="The deployment settings "
                                                                "(a cdk.json with the platform's context) to check against.")] = None,
             price: GivenPrices = None, as_json: AsJson = False) -> None:
    """Check specs with the platform's own rules, offline; each refusal names its field.

    A spec of a user workload is checked as every host will check it: its code imported and checked
    against the workload contract, its hyperparameters split, and with `--channel train=DIR` its hooks
    run on a few local samples (listing, preprocessing, one training step on the CPU).

    Each spec's worst case is printed: every instance billed for its whole max_runtime_s. Run inside the
    repository (a cdk.json with the platform's settings in the spec's folder or above), or with
    `--settings cdk.json`, a spec is held to the run and sweep ceilings the deployment would hold it to,
    and refused (exit 2) above them. The verdict depends on the spec and those settings alone, wherever it
    is run from; the output names the settings it used."""
    import dataclasses

    from lambdas.core.job_spec import NO_POLICY

    folders = dict(key_value(item) for item in channel or [])
    given = given_prices(price)
    verdicts = []
    announced: set[Path | None] = set()
    for path in specs:
        policy, settings = spec_policy(path, settings_file) if deployment else (NO_POLICY, None)
        # The user's $/hour price the worst case printed; the verdict stays the deployment's, whose launch
        # checks the ceiling with its own settings' prices.
        estimating = dataclasses.replace(policy, prices_usd_per_hour={**policy.prices_usd_per_hour, **given}) if given else policy
        if settings not in announced and not as_json:
            announced.add(settings)
            if settings is not None:
                err.print(f"policy of {escape(str(settings))}: run ceiling {usd(policy.run_cost_ceiling_usd)}, sweep ceiling "
                          f"{usd(policy.sweep_cost_ceiling_usd)} (--no-deployment: none)", highlight=False, soft_wrap=True)
            else:
                err.print("policy: none (no cdk.json of the platform's in the spec's folder or above it: for a spec kept outside "
                          "the checkout, name the deployment's settings with --settings cdk.json)", highlight=False, soft_wrap=True)
        try:
            raw = api.validate_any(path, policy)
            verdict: dict[str, Any] = ({"spec": str(path), "ok": True, "settings": str(settings) if settings else None}
                                       | cost_fields(api.estimate_cost(raw, estimating)))
            if given:
                verdict["priced_with"] = sorted(given)
            workload = workload_check(path, raw, code, folders, install)
            if workload:
                verdict["workload"] = workload
            here = local_runtime_note(raw)
            if here:
                verdict["local"] = here
            verdicts.append(verdict)
        except api.SpecRefused as error:
            verdicts.append({"spec": str(path), "ok": False, "field": error.field, "error": str(error), "settings": str(settings) if settings else None})
        except api.ClientFacingError as error:
            verdicts.append({"spec": str(path), "ok": False, "field": None, "error": str(error), "settings": str(settings) if settings else None})
    if as_json:
        emit_json(verdicts)
    else:
        for verdict in verdicts:
            if verdict["ok"]:
                out.print(f"[green]ok[/]      {escape(verdict['spec'])}", highlight=False)
                priced_with = f" (priced with your --price for {', '.join(verdict['priced_with'])}; the deployment checks its ceiling with its own prices)" \
                    if verdict.get("priced_with") else ""
                out.print(f"        {escape(cost_line(verdict) + priced_with)}", highlight=False, soft_wrap=True)
                if "workload" in verdict:
                    out.print(f"        {escape(workload_line(verdict['workload']))}", highlight=False, soft_wrap=True)
                if "local" in verdict:
                    out.print(f"        [yellow]note[/]: not on this machine yet: {escape(verdict['local'])}", highlight=False, soft_wrap=True)
            else:
                out.print(f"[red]refused[/] {escape(verdict['error'])}", highlight=False, soft_wrap=True)
    if not all(verdict["ok"] for verdict in verdicts):
        raise typer.Exit(2)


def spec_policy(spec: Path, settings_file: Path | None) -> tuple[Any, Path | None]:
    """The deployment policy a spec is checked against, and the cdk.json it came from: ``settings_file``,
    else the nearest platform cdk.json in the spec's folder or above it (None: none). Not the working
    directory's: one spec gets one verdict wherever `hetero validate` runs."""
    if settings_file is not None:
        if not settings_file.is_file():
            fail(f"--settings {settings_file}: no such file (a cdk.json with the platform's context)", 2)
        policy = guarded(lambda: api.settings_policy(settings_file))
        if policy is None:
            fail(f"--settings {settings_file}: holds no platform settings (its context has no 'platform')", 2)
        return policy, settings_file
    return guarded(lambda: api.deployment_policy(api.spec_folder(spec).resolve()))


def usd(value: float | None) -> str:
    return "none" if value is None else f"${value:,.2f}"


def cost_fields(estimate: api.CostEstimate) -> dict[str, Any]:
    return {"worst_case_usd": None if estimate.worst_case_usd is None else round(estimate.worst_case_usd, 2),
            "ceiling_usd": estimate.ceiling_usd, "unpriced": list(estimate.unpriced), "runs": estimate.runs}


def cost_line(verdict: dict[str, Any]) -> str:
    """The worst case of a valid spec, in a line. Pure."""
    runs = f"its {verdict['runs']} runs together, " if verdict["runs"] > 1 else ""
    if verdict["worst_case_usd"] is None:
        return (f"worst case unknown: no price for {', '.join(verdict['unpriced'])} in the fallback table (see `hetero prices --live`; "
                "a deployment's ceiling prices it from cdk.json's ceiling_prices_usd_per_hour)")
    ceiling = f"; ceiling {usd(verdict['ceiling_usd'])}" if verdict["ceiling_usd"] is not None else "; no ceiling"
    return f"worst case {usd(verdict['worst_case_usd'])} ({runs}every instance for the whole max_runtime_s){ceiling}"


def key_value(text: str) -> tuple[str, Path]:
    name, sep, folder = text.partition("=")
    if not sep or not name:
        fail(f"--channel takes NAME=DIR, got {text!r}", 2)
    return name, Path(folder)


def workload_check(path: Path, raw: Any, code: Path | None, channels: dict[str, Path], install: bool) -> dict[str, Any] | None:
    """A workload spec's dry run (training/workload/dry_run.py): a user workload's, or with --channel a
    PyTorch built-in's; None for a sweep, or the tensorflow variant's built-in. Its refusals are the
    spec's, under the field ``workload``."""
    if not isinstance(raw, dict) or "sweep_name" in raw:
        return None
    from lambdas.core.job_spec import validate_job_spec
    from training.variants import VARIANTS

    spec = validate_job_spec(raw)
    if not isinstance(raw.get("workload"), dict):
        if not channels or not VARIANTS[spec.variant].user_workloads or VARIANTS[spec.variant].contract != "pytorch":
            return None
        try:
            return _dry_run_module().dry_run_builtin(spec, channels)
        except (ValueError, LookupError) as error:
            raise api.SpecRefused(str(path), "workload", f"{type(error).__name__}: {error}") from None
    if code is None and not spec.code.is_local:
        return None  # uploaded already: its folder is not here (give it with --code to check it)
    folder = code or api.code_folder(spec.code.source, api.spec_folder(path))
    dry_run = _dry_run_module()
    try:
        return dry_run.dry_run(spec, folder, channels, install=install)
    except (ValueError, LookupError) as error:  # WorkloadError, CodeError, HyperparameterError: ValueErrors, each named
        raise api.SpecRefused(str(path), "workload", f"{type(error).__name__}: {error}") from None


def local_runtime_note(raw: Any) -> str | None:
    """What this machine lacks to run a valid job spec on the emulated cluster (`hetero local`), naming the
    command that installs it; None for a sweep, or when nothing is missing. The spec stays valid: the
    platform's image has it."""
    if not isinstance(raw, dict) or "sweep_name" in raw:
        return None
    from lambdas.core.job_spec import validate_job_spec

    try:
        from training.local.cluster import missing_runtime
    except ImportError:  # the client alone (no .venv): `hetero local` says what it needs itself
        return None
    return missing_runtime(validate_job_spec(raw).distribution)


def _dry_run_module():
    import importlib

    try:
        return importlib.import_module("training.workload.dry_run")
    except ImportError as error:
        fail(f"checking a workload needs the platform's environment ({error.name} is missing): run `make venv` and use .venv/bin/hetero")


def workload_line(report: dict[str, Any]) -> str:
    if "script" in report:
        checked = [*(["compiles"] if report.get("compiles") else []), *(["requirements install"] if report.get("requirements") else [])]
        return f"script {report['script']} ({report['files']} files, sha256 {report['sha256'][:12]})" + (f": {', '.join(checked)}" if checked else "")
    if report.get("builtin"):
        parts = [f"built-in workload {report['module']}: hooks {', '.join(report['hooks'])}"]
    else:
        parts = [f"workload {report['module']} ({report['files']} files, sha256 {report['sha256'][:12]}): hooks {', '.join(report['hooks'])}"]
    if "features" in report:
        features = ", ".join(f"{name} {spec}" for name, spec in report["features"].items())
        parts.append(f"{report['samples']} samples → {features}; trial step loss {report['trial_loss']:.4g}")
    if "trial_eval" in report:
        parts.append("eval " + ", ".join(f"{name}={value:.4g}" for name, value in report["trial_eval"].items()))
    return "; ".join(parts)


# Runs ------------------------------------------------------------------------------------------------


@app.command()
def run(ctx: typer.Context, spec: Annotated[Path, typer.Argument(help="The job spec (JSON).")],
        name: Annotated[str | None, typer.Option(help="The run's id (default: run_name and the time).")] = None,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Watch it to the end; exit 0 only if it succeeded.")] = False,
        poll_s: Annotated[float, typer.Option(help="Seconds between looks when following.", min=1.0)] = 5.0,
        launch_direct: Annotated[bool, typer.Option("--direct", help="One training job, without the state machine.")] = False,
        sdk: Annotated[bool, typer.Option(help="With --direct: through the SageMaker SDK when installed (--no-sdk: boto3).")] = True,
        stack: Stack = None, region: Region = None, profile: Profile = None, quiet: Quiet = False,
        as_json: AsJson = False) -> None:
    """Start a training run from a spec (refused before anything starts if the spec or the name is bad).

    With `--direct`, one training job without the state machine: the same request, sent through the
    SageMaker Python SDK's ModelTrainer when it is installed (`pip install -e '.[sdk]'`)
    and sends exactly that request, else by boto3; no watchdog, relaunch or result.json (docs/guides/deploying.md).

    A workload of your own in a local folder (`"workload": {"code": "my_workload"}`, relative to the
    spec's file) is packed and uploaded first, once per content (code/<sha256>/ of the results bucket).

    Example: `hetero run examples/pytorch-heterogeneous.json --follow`"""
    if not sdk and not launch_direct:
        fail("--no-sdk goes with --direct (a run is launched by the platform's state machine)", 2)
    target = platform(ctx, stack, region, profile)
    if launch_direct:
        run_direct(spec, target, name, follow, poll_s, quiet, as_json, sdk)
        return
    started = guarded(lambda: api.launch(spec, target, name))  # validates the spec and name before any AWS call
    if not quiet:
        err.print(f"started run [bold]{escape(started.name)}[/]", highlight=False)
    if not follow:
        emit_json({"run": started.name, "execution_arn": started.execution_arn}) if as_json else out.print(started.name, highlight=False, markup=False)
        return
    final = watch(started, target, poll_s, quiet)
    show_result(started, target, as_json, final)
    raise typer.Exit(0 if final.status == SUCCEEDED else 1)


@app.command("follow")
def follow_run(ctx: typer.Context, run_id: Annotated[str, typer.Argument(metavar="RUN")],
               poll_s: Annotated[float, typer.Option(help="Seconds between looks.", min=1.0)] = 5.0,
               is_job: Direct = False,
               stack: Stack = None, region: Region = None, profile: Profile = None, quiet: Quiet = False,
               as_json: AsJson = False) -> None:
    """Follow a run already started (after Ctrl-C, or from another terminal) to its end; exit 0 only if it
    succeeded."""
    target = platform(ctx, stack, region, profile)
    checked_id(run_id, is_job)
    if is_job:
        follow_direct(run_id, target, poll_s, quiet, as_json)
        return
    started = guarded(lambda: api.run_of(run_id, target))
    final = watch(started, target, poll_s, quiet)
    show_result(started, target, as_json, final)
    raise typer.Exit(0 if final.status == SUCCEEDED else 1)


@app.command()
def sweep(ctx: typer.Context, spec: Annotated[Path, typer.Argument(help="The sweep input (JSON).")],
          name: Annotated[str | None, typer.Option(help="The sweep's id (default: sweep_name and the time).")] = None,
          follow: Annotated[bool, typer.Option("--follow", "-f", help="Wait for the end; exit 0 only if it succeeded.")] = False,
          poll_s: Annotated[float, typer.Option(min=1.0)] = 10.0,
          stack: Stack = None, region: Region = None, profile: Profile = None, quiet: Quiet = False) -> None:
    """Start a benchmark sweep; `hetero report SWEEP_ID` shows its report when it ends. Local workload
    folders of its configurations are packed and uploaded first, each once."""
    target = platform(ctx, stack, region, profile)
    started = guarded(lambda: api.launch_sweep(spec, target, name))
    out.print(started.name, highlight=False, markup=False)
    if follow:
        final = watch(started, target, poll_s, quiet)
        raise typer.Exit(0 if final.status == SUCCEEDED else 1)


@app.command()
def runs(ctx: typer.Context, limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
         stack: Stack = None, region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """Recent runs, newest first: status, billed ms per step, cost per 1k steps."""
    rows = guarded(lambda: api.runs(platform(ctx, stack, region, profile), limit))
    if as_json:
        emit_json(rows)
        return
    headers = ("run", "status", "started", "job", "ms per step (billed)", "$ per 1k steps")
    cells = [(row["run"], row["status"], row["started"][:16].replace("T", " "), row["job_status"] or "–",
              number(row["billed_ms_per_step"], 1), number(row["cost_per_1k_steps_usd"], 4)) for row in rows]
    if not out.is_terminal:  # a pipe: tab-separated lines, every id whole (as gh prints for scripts)
        sys.stdout.write("".join("\t".join(line) + "\n" for line in [headers, *cells]))
        return
    table = Table(*headers)
    for run_id, status, *rest in cells:
        table.add_row(escape(run_id), coloured(status), *rest)
    # The run id is what show, stop and logs take: a narrow terminal wraps the table instead of cutting it.
    out.print(table, crop=False, width=max(out.width, 60 + max([3, *(len(row["run"]) for row in rows)])))


@app.command()
def show(ctx: typer.Context, run_id: Annotated[str, typer.Argument(metavar="RUN")], is_job: Direct = False, stack: Stack = None,
         region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """A run's status and result."""
    target = platform(ctx, stack, region, profile)
    checked_id(run_id, is_job)
    if is_job:
        outcome = guarded(lambda: direct.job_result(run_id, target))
        emit_json(outcome) if as_json else out.print(result_table(outcome))
        return
    described = guarded(lambda: api.describe(api.run_of(run_id, target), target))
    outcome = guarded(lambda: api.result(run_id, target))
    if as_json:
        emit_json({"run": run_id, "status": described["status"], "started": described["startDate"].isoformat(timespec="seconds"),
                   "stopped": described["stopDate"].isoformat(timespec="seconds") if described.get("stopDate") else None,
                   "error": described.get("error"), "cause": described.get("cause"), "result": outcome})
        return
    out.print(f"[bold]{escape(run_id)}[/]  {coloured(described['status'])}  started {described['startDate']:%Y-%m-%d %H:%M:%S}", highlight=False)
    if described.get("error"):
        out.print(f"{described['error']}: {described.get('cause', '')}", highlight=False, soft_wrap=True, markup=False)
    if outcome:
        out.print(result_table(outcome))


@app.command()
def stop(ctx: typer.Context, run_id: Annotated[str, typer.Argument(metavar="RUN")], is_job: Direct = False, stack: Stack = None,
         region: Region = None, profile: Profile = None) -> None:
    """Stop a run: its execution ends and the platform stops its training job."""
    target = platform(ctx, stack, region, profile)
    checked_id(run_id, is_job)
    if is_job:
        was = guarded(lambda: direct.stop_job(run_id, target))
        if was != "InProgress":
            fail(f"job {run_id!r} is not running ({was})")
        out.print(f"stopping job {run_id}", highlight=False, markup=False)
        return
    was = guarded(lambda: api.stop(api.run_of(run_id, target), target))
    if was == "RUNNING":
        out.print(f"stopping {run_id}: its training job is stopped by the platform", highlight=False)
    else:
        fail(f"run {run_id!r} is not running ({was})")


@app.command()
def logs(ctx: typer.Context, run_id: Annotated[str, typer.Argument(metavar="RUN")],
         host: Annotated[list[str] | None, typer.Option(help="Only this host's lines (algo-2); repeatable.")] = None,
         group: Annotated[list[str] | None, typer.Option(help="Only this instance group's hosts; repeatable.")] = None,
         tail: Annotated[int | None, typer.Option(help="Only the last N lines.", min=1)] = None,
         since: Annotated[str | None, typer.Option(help="Only lines of the last 30s, 10m, 2h or 1d.")] = None,
         is_job: Direct = False,
         stack: Stack = None, region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """The job's log lines, host by host tagged, filterable by host and by instance group."""
    target = platform(ctx, stack, region, profile)
    checked_id(run_id, is_job)
    start = None
    if since is not None:
        try:
            start = datetime.now(UTC).timestamp() - api.seconds(since)
        except ValueError as error:
            fail(str(error), 2)
    if is_job:
        lines = guarded(lambda: api.job_log_lines(run_id, target, set(host or ()), set(group or ()), since=start))
    else:
        lines = guarded(lambda: api.log_lines(api.run_of(run_id, target), target, set(host or ()), set(group or ()), since=start))
    if tail is not None:
        lines = lines[-tail:]
    if as_json:
        emit_json([{"host": name, "line": line} for name, line in lines])
        return
    for name, line in lines:
        out.print(f"[cyan]\\[{name}][/] {escape(line)}", highlight=False, soft_wrap=True)


@app.command()
def report(ctx: typer.Context, sweep_id: Annotated[str, typer.Argument(metavar="SWEEP_ID")],
           open_chart: Annotated[bool, typer.Option("--open", help="Open the saved chart.")] = False,
           out_dir: Annotated[Path, typer.Option(help="Where chart.png is saved.")] = Path("."),
           stack: Stack = None, region: Region = None, profile: Profile = None, as_json: AsJson = False) -> None:
    """A finished sweep's report, rendered; its chart saved as <SWEEP_ID>-chart.png."""
    guarded(lambda: api.check_name(sweep_id, api.SWEEP_ID_LENGTH, what="SWEEP_ID"))
    markdown, report_json, chart = guarded(lambda: api.sweep_report(sweep_id, platform(ctx, stack, region, profile)))
    saved = None
    if chart:
        saved = out_dir / f"{sweep_id}-chart.png"
        try:
            saved.write_bytes(chart)
        except OSError as error:
            fail(f"cannot save the chart to {saved}: {error.strerror or error}", 2)
    if as_json:
        emit_json(report_json | {"chart": str(saved) if saved else None})
    else:
        out.print(Markdown(markdown))
        if saved:
            err.print(f"chart: {saved}", highlight=False)
    if open_chart and saved:
        webbrowser.open(saved.resolve().as_uri())


@app.command()
def prices(ctx: typer.Context,
           types: Annotated[list[str] | None, typer.Argument(help="Instance types or families (ml.g5.xlarge, ml.g5, g5; default: every type).",
                                                             show_default=False)] = None,
           live: Annotated[bool, typer.Option("--live", help="Today's prices from the AWS Price List API (needs AWS credentials).")] = False,
           region: Region = None, profile: Profile = None, price: GivenPrices = None, as_json: AsJson = False) -> None:
    """Every SageMaker training instance type: its hardware and $/hour, offline from the dated fallback
    table (none for a type it has no sourced price for), or with `--live` from the AWS Price List API for
    `--region` (default us-east-1); always with the source and date.

    Example: `hetero prices g5 c6i` · `hetero prices ml.p4d.24xlarge --live --json`"""
    from lambdas.core.catalog import HARDWARE_DATE, HARDWARE_SOURCE, UnknownInstanceTypeError, select
    from lambdas.core.price_performance import FALLBACK_PRICES, with_given

    if live and not types:  # one Price List query per type: 200-odd of them would take minutes and be throttled
        fail("--live asks the Price List API type by type: name the types or families to price (hetero prices g5 c6i --live)", 2)
    try:
        chosen = select(tuple(types or ()))
    except UnknownInstanceTypeError as error:
        fail(error.args[0], 2)
    given = given_prices(price)
    quoted = with_given(live_prices_of(ctx, [item.name for item in chosen], region, profile) if live else FALLBACK_PRICES, given)
    rows = [{"instance_type": item.name, "family": item.family, "vcpus": item.vcpus, "memory_gib": item.memory_gib,
             "accelerator_kind": item.accelerator_kind or "cpu", "accelerators": item.accelerators, "accelerator": item.accelerator,
             "accelerator_memory_gb": item.accelerator_memory_gb, "neuron_cores": item.neuron_cores,
             "usd_per_hour": quoted.usd_per_hour.get(item.name)} for item in chosen]
    if as_json:
        emit_json({"source": quoted.source, "date": quoted.date, "usd_per_hour": {row["instance_type"]: row["usd_per_hour"] for row in rows},
                   "hardware": {"source": HARDWARE_SOURCE, "date": HARDWARE_DATE}, "instance_types": rows})
        return
    header = ("instance type", "vCPUs", "memory GiB", "accelerators", "NeuronCores", "$/hour")
    caption = (f"$/hour: {quoted.source}, {quoted.date} (–: none known{'' if live else '; try --live'}). "
               f"Hardware: AWS's EC2 instance-type specifications, compiled {HARDWARE_DATE} (lambdas/core/catalog.py).")
    cells = [(row["instance_type"], str(row["vcpus"]), f"{row['memory_gib']:g}",
              f"{row['accelerators']}× {row['accelerator']} {row['accelerator_memory_gb']:g} GB" if row["accelerators"] else "",
              str(row["neuron_cores"] or ""), number(row["usd_per_hour"], 3)) for row in rows]
    if not out.is_terminal:  # a pipe or a file: whole names in plain columns, for grep, awk and sort
        sys.stdout.write(plain_columns([header, *cells]) + caption + "\n")
        return
    table = Table(*header, caption=caption)
    for line in cells:
        table.add_row(*line)
    out.print(table)


def plain_columns(lines: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns two spaces apart, nothing cut, no box characters. Pure."""
    widths = [max(len(line[index]) for line in lines) for index in range(len(lines[0]))]
    return "".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() + "\n" for line in lines)


def live_prices_of(ctx: typer.Context, names: list[str], region: str | None, profile: str | None) -> Any:
    """Today's Price List API prices of ``names`` in the region (the fallback table's for any it does not
    price, as the source then says), with the caller's credentials; one line and exit 1 without them."""
    from lambdas.core.pricing import PRICING_REGION, PriceListError, combine, live_prices

    target = platform(ctx, None, region, profile)
    session = guarded(lambda: target.session)
    if session.get_credentials() is None:
        fail("live prices need AWS credentials: run `aws configure` or `aws sso login`, or pass --profile "
             "(without --live, the dated fallback table needs none)")
    # The Price List API answers in a few regions only, for every region.
    pricing = session.client("pricing", region_name=PRICING_REGION, config=api.RETRIES)
    where = session.region_name or "us-east-1"
    err.print(f"asking the AWS Price List API for {len(names)} types in {where} ...", highlight=False)
    try:
        live = guarded(lambda: api.call(live_prices, pricing=pricing, region=where, instance_types=names))
    except PriceListError as error:
        fail(f"the Price List API's answer is unreadable: {error}")
    return combine(live, datetime.now(UTC).strftime("%Y-%m-%d"), names)


# The emulated cluster ------------------------------------------------------------------------------


class EmulatorHelp(typer.core.TyperCommand):
    """`hetero local`'s help is the emulated cluster's own (training/local/options.py, standard library only),
    where its options are defined once and parsed: the options forwarded there cannot drift from a copy."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from training.local.options import run_parser

        formatter.write(run_parser(f"hetero {ctx.info_name}").format_help())


@app.command(cls=EmulatorHelp, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def local(ctx: typer.Context, spec: Annotated[Path, typer.Argument(help="The job spec (JSON).")]) -> None:
    """Run a spec on the emulated cluster on this machine: a short result table on stdout (`--json`: the
    summary), the hosts' logs on stderr; `hetero local --help` lists its options."""
    local_main = emulator("training.local.__main__")
    raise typer.Exit(local_main([str(spec), *ctx.args], prog="hetero local") or 0)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile(ctx: typer.Context, spec: Annotated[Path, typer.Argument(help="The job spec (JSON).")]) -> None:
    """Measure a spec's workload on this machine, for the sweep's sizing advisor: its preprocessing per batch
    on one CPU (as a data host runs it) and its train-only step (`--channel train=DIR`, `--code DIR`)."""
    profile_main = emulator("training.local.profile")
    raise typer.Exit(profile_main([str(spec), *ctx.args], prog="hetero profile") or 0)


class DemoHelp(typer.core.TyperCommand):
    """`hetero demo`'s help is the demo's own (training/local/demo.py's demo_parser), as `hetero local`'s is."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from training.local.demo import demo_parser

        formatter.write(demo_parser(f"hetero {ctx.info_name}").format_help())


@app.command(cls=DemoHelp, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def demo(ctx: typer.Context) -> None:
    """The demo: the example specs on the emulated cluster, compared, offline (`hetero demo --help` lists
    its options: --workload DIR for your own workload, --steps, --rounds, --variant, --workdir)."""
    demo_main = emulator("training.local.demo")
    raise typer.Exit(demo_main(list(ctx.args), prog="hetero demo") or 0)


def emulator(module: str):
    """The emulated cluster's entry point; it needs the trainers' packages (torch, grpc, ...), which the
    client alone does not install."""
    import importlib

    try:
        return importlib.import_module(module).main
    except ImportError as error:
        fail(f"the emulated cluster needs the platform's environment ({error.name} is missing): run `make venv` and use .venv/bin/hetero")


# Rendering -------------------------------------------------------------------------------------------


def checked_id(run_id: str, is_job: bool) -> None:
    """A RUN argument refused (exit 2) before any AWS call when no run or job could have that name."""
    guarded(lambda: direct.check_job_name(run_id) if is_job else api.check_name(run_id, what="RUN"))


def guarded(action):
    try:
        return action()
    except api.InputRefused as error:
        fail(str(error), 2)
    except api.ClientFacingError as error:
        fail(str(error))


def watch(started: api.Run, target: api.Platform, poll_s: float, quiet: bool, events: Any = None, direct: bool = False) -> api.Event:
    """Follow a run (or with ``direct`` a job, whose ``events`` are given) to its end, a progress bar over
    its steps on stderr; its "done" event. Ctrl-C leaves the run going and says how to come back to it."""
    final = api.Event("done", status="UNKNOWN")
    try:
        stream = events_of(started, target, poll_s, events)
        # The first look before the bar: when it fails (no credentials, no such run), its one line is all.
        first = next(stream, None)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[steps]}"),
                      TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=err, disable=quiet) as bar:
            task = bar.add_task(escape(started.name), total=None, steps="", metrics="")
            for event in itertools.chain([] if first is None else [first], stream):
                if event.kind == "progress":
                    shown = " ".join(f"{key}={value:g}" for key, value in event.metrics.items() if key in ("step_time_ms", "samples_per_s", "loss"))
                    bar.update(task, completed=event.step, total=event.steps, steps=f"{event.step}/{event.steps} steps", metrics=shown)
                elif event.kind in ("execution", "job") and not quiet:
                    bar.console.print(f"{event.kind}: {coloured(event.status)} {escape(event.message)}".rstrip(), highlight=False)
                elif event.kind == "warning":
                    bar.console.print(f"[yellow]warning:[/] {escape(event.message)} (still following)", highlight=False)
                elif event.kind == "done":
                    final = event
    except KeyboardInterrupt:
        kind, flag = ("job", " --direct") if direct else ("run", "")
        err.print(f"{kind} {escape(started.name)} goes on: `hetero follow {escape(started.name)}{flag}` to come back, "
                  f"`hetero stop {escape(started.name)}{flag}` to stop it", highlight=False)
        raise typer.Exit(130) from None
    if final.message:
        err.print(f"{coloured(final.status)}: {escape(final.message)}", highlight=False, soft_wrap=True)
    return final


def run_direct(spec: Path, target: api.Platform, name: str | None, follow: bool, poll_s: float, quiet: bool, as_json: bool,
               use_sdk: bool) -> None:
    job = guarded(lambda: direct.launch_direct(spec, target, name, use_sdk=use_sdk))
    if not quiet:
        err.print(f"started job [bold]{escape(job.job_name)}[/] (run {escape(job.run_id)}), sent by {escape(job.sent_by)}", highlight=False, soft_wrap=True)
    if job.fallback:  # said even with --quiet: the user asked for the SDK
        err.print(f"[yellow]note:[/] {escape(job.fallback)}", highlight=False, soft_wrap=True)
    launched = {"job_name": job.job_name, "run": job.run_id, "sent_by": job.sent_by, "fallback": job.fallback}
    if not follow:
        emit_json(launched) if as_json else out.print(job.job_name, highlight=False, markup=False)
        return
    follow_direct(job.job_name, target, poll_s, quiet, as_json, raw_spec=dict(job.raw_spec), launched=launched)


def follow_direct(job: str, target: api.Platform, poll_s: float, quiet: bool, as_json: bool, raw_spec: Any = None,
                  launched: dict[str, Any] | None = None) -> None:
    """Follow a direct job to its end, then its result; exit 0 only if it completed with figures."""
    final = watch(api.Run(job, ""), target, poll_s, quiet, events=lambda: api.follow_job(job, target, poll_s), direct=True)
    outcome = guarded(lambda: direct.job_result(job, target, raw_spec))
    emit_json((launched or {}) | outcome) if as_json else out.print(result_table(outcome))
    raise typer.Exit(0 if final.status == "Completed" and outcome["status"] == "Completed" else 1)


def events_of(started: api.Run, target: api.Platform, poll_s: float, events: Any = None):
    # A generator's errors surface while iterating: each becomes one line and an exit here.
    events = events() if events else api.follow(started, target, poll_s)
    while True:
        try:
            yield next(events)
        except StopIteration:
            return
        except api.ClientFacingError as error:
            fail(str(error))


def show_result(started: api.Run, target: api.Platform, as_json: bool, final: api.Event) -> None:
    outcome = guarded(lambda: api.result(started, target))
    if as_json:
        error, _, cause = final.message.partition(": ")
        emit_json({"run": started.name, "status": final.status, "error": error or None, "cause": cause or None, "result": outcome})
    elif outcome:
        out.print(result_table(outcome))
    else:
        err.print("no result.json for this run (it ended before a job ran: see the error above)", highlight=False)


def result_table(outcome: dict[str, Any]) -> Table:
    table = Table("", "", show_header=False, box=None)
    step = outcome.get("step_time_ms") or {}
    startup = outcome.get("startup") or {}
    for label, value in (
        ("status", coloured(outcome.get("status") or "–")),
        ("job", escape(f"{outcome.get('job_name') or '–'} ({outcome.get('job_status')})")),
        ("failure", escape(outcome.get("failure_reason") or "–")),
        # What the cost is computed from (the wall per timed step, evaluations and checkpoints included), and the
        # step-time distribution beside it.
        ("ms per step (billed)", number(outcome.get("billed_ms_per_step"), 1)),
        ("step time p50 / p90", f"{number(step.get('p50'), 1)} / {number(step.get('p90'), 1)} ms"),
        ("samples/s", number(outcome.get("samples_per_s"), 1)),
        ("$/hour", number(outcome.get("usd_per_hour"), 3)),
        ("$ per 1k steps", number(outcome.get("cost_per_1k_steps_usd"), 4)),
        ("run cost", "–" if outcome.get("run_cost_usd") is None else f"${outcome['run_cost_usd']:.2f}"),
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
    restore_stop_signals()  # Ctrl-C and a stop act alike, however the shell started this (training/stop_signals.py)
    app(prog_name="hetero")


if __name__ == "__main__":
    main()
