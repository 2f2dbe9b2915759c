"""The emulated cluster's command-line options, defined once: `python -m training.local run` parses with
them and `hetero local` both forwards to them and shows them as its help. Imports nothing beyond the
standard library, so that the help shows without the trainers' packages."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """Run a job spec on an emulated heterogeneous cluster on this machine: one process tree per host, each
with its own /opt/ml, loopback address and CPUs.

stdout: a short table at the end (each host's group, role and exit; the job's step time, samples/s, data
wait and an emulated $ per 1k steps), or with --json the chief DNN host's summary alone. stderr: the plan,
every host's log lines prefixed "[host group]" and, on a terminal, a live progress line. The full logs
and every host's /opt/ml tree stay under --workdir (logs/<host>.log), with result.json (status, reason,
hosts, summary).

A stop (Ctrl-C, SIGTERM) is SageMaker's StopTrainingJob: SIGTERM to every host, --stop-grace-s for the
DNN hosts to save a checkpoint and the model, then SIGKILL; a second Ctrl-C kills every host at once.
Continue a stopped run with --resume-from its --workdir (or rerun in the same --workdir).

Four outcomes, each its exit status: 0 Completed (every host exited 0, no orphan, within the deadline);
1 Failed; 124 TimedOut (the deadline killed it, as SageMaker's MaxRuntimeInSeconds stops a job); 130 or
143 Stopped (by Ctrl-C or SIGTERM). 2: the spec or an option is refused, before any host starts."""

EXAMPLES = """examples:
  %(prog)s examples/pytorch-heterogeneous.json --channel train=build/demo-images
  %(prog)s SPEC --channel train=DIR --cpus data_group=1 --set steps=20 --deadline-s 300
  %(prog)s SPEC --channel train=DIR --cpu-quota data_group=0.25   # a quarter core per data host
  %(prog)s SPEC --channel train=DIR --json | jq .step_time_ms
  %(prog)s SPEC --channel train=DIR --workdir run2 --resume-from run1   # carry on a stopped run"""


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key, value


# Temporary work folders (no --workdir) of one run name kept: enough to compare and resume the last few.
KEEP_RUNS = 5


def given_price_option(text: str) -> tuple[str, float]:
    """argparse's type for --price: lambdas/core/price_performance.py's check, its error argparse's."""
    from lambdas.core.price_performance import given_price

    try:
        return given_price(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_run_options(run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `run` command's arguments, on ``run`` (a subcommand's parser, or `hetero local`'s own)."""
    run.add_argument("spec", type=Path, help="job spec JSON (the platform's format: docs/reference/job-spec.md)")
    run.add_argument("--channel", type=key_value, action="append", default=[], metavar="NAME=DIR", help="local folder for an input channel")
    run.add_argument("--workdir", type=Path, help="where host trees and logs go (default: a new temporary folder; of those, the "
                                                 "newest --keep-runs of each run name are kept, older ones removed)")
    run.add_argument("--keep-runs", type=int, default=KEEP_RUNS, metavar="N",
                     help=f"temporary work folders of the same run name to keep, this one included (default {KEEP_RUNS}; "
                          "folders given with --workdir are never removed)")
    run.add_argument("--deadline-s", type=float, default=None,
                     help="kill everything and fail after this long (default: the spec's max_runtime_s, as SageMaker stops it)")
    run.add_argument("--orphan-grace-s", type=float, default=30.0, help="how long hosts may outlive the DNN group")
    run.add_argument("--stop-grace-s", type=float, default=120.0,
                     help="after Ctrl-C or SIGTERM, how long the hosts get to save before they are killed (StopTrainingJob's 120 s)")
    run.add_argument("--resume-from", type=Path, metavar="RUN_DIR",
                     help="an earlier run's --workdir: its DNN hosts' checkpoints seed this run's, as the spec's resume_from does in the cloud")
    run.add_argument("--cpus", type=key_value, action="append", default=[], metavar="GROUP=N", help="CPUs per host of a group (default 1)")
    run.add_argument("--cpu-quota", type=key_value, action="append", default=[], metavar="GROUP=CORES",
                     help="a fraction of a core per host of a group, e.g. data_group=0.25 (needs a writable cgroup CPU controller)")
    run.add_argument("--processes-per-host", type=int, default=0, help="trainer processes per DNN host (default: one per GPU, or 1)")
    run.add_argument("--set", type=key_value, action="append", default=[], metavar="NAME=VALUE", help="override a hyperparameter")
    run.add_argument("--code", type=Path, help="the workload's code folder (default: the spec's workload.code, relative to the spec file)")
    run.add_argument("--price", type=given_price_option, action="append", default=[], metavar="TYPE=USD_PER_HOUR",
                     help="your $/hour for an instance type, in place of the dated table's, for the emulated cost (repeatable)")
    run.add_argument("--json", action="store_true", help="the chief DNN host's summary as JSON, alone on stdout (for scripts)")
    return run


def parser() -> argparse.ArgumentParser:
    """`python -m training.local`'s parser: the `run` command."""
    root = argparse.ArgumentParser(prog="python -m training.local", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True)
    add_run_options(commands.add_parser("run", help="run a job spec on the emulated cluster", description=DESCRIPTION, epilog=EXAMPLES,
                                        formatter_class=argparse.RawDescriptionHelpFormatter))
    return root


def run_parser(prog: str) -> argparse.ArgumentParser:
    """The `run` command alone under another name (`hetero local`), for its help."""
    return add_run_options(argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EXAMPLES,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
