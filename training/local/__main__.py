"""Run a job spec on an emulated heterogeneous cluster on this machine.

    python -m training.local run examples/pytorch-heterogeneous.json --channel train=build/demo-images
    python -m training.local run SPEC --channel train=DIR --cpus data_group=1 --set steps=20 --deadline-s 300
    python -m training.local run SPEC --channel train=DIR --cpu-quota data_group=0.25   # a quarter core per data host

Each host's log lines are prefixed with "[host group]"; the full logs and every host's /opt/ml tree stay
under --workdir. Exits 0 only if every host exited 0 with no orphan and within the deadline.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lambdas.core.job_spec import JobSpecError, validate_job_spec
from training.local.cluster import EmulatedCluster, EmulationError, EmulationOptions


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key, value


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m training.local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a job spec on the emulated cluster")
    run.add_argument("spec", type=Path, help="job spec JSON (the platform's format, see README)")
    run.add_argument("--channel", type=key_value, action="append", default=[], metavar="NAME=DIR", help="local folder for an input channel")
    run.add_argument("--workdir", type=Path, help="where host trees and logs go (default: a new temporary folder)")
    run.add_argument("--deadline-s", type=float, default=600.0, help="kill everything and fail after this long")
    run.add_argument("--orphan-grace-s", type=float, default=30.0, help="how long hosts may outlive the DNN group")
    run.add_argument("--cpus", type=key_value, action="append", default=[], metavar="GROUP=N", help="CPUs per host of a group (default 1)")
    run.add_argument("--cpu-quota", type=key_value, action="append", default=[], metavar="GROUP=CORES",
                     help="a fraction of a core per host of a group, e.g. data_group=0.25 (needs a writable cgroup CPU controller)")
    run.add_argument("--processes-per-host", type=int, default=0, help="trainer processes per DNN host (default: one per GPU, or 1)")
    run.add_argument("--set", type=key_value, action="append", default=[], metavar="NAME=VALUE", help="override a hyperparameter")
    run.add_argument("--code", type=Path, help="the workload's code folder (default: the spec's workload.code, relative to the spec file)")
    return root


def resolve_code(raw: object, spec_path: Path) -> object:
    """A spec whose workload code is a folder relative to the spec file, with that folder's path as
    seen from here (as `hetero run` resolves it before packing). Pure."""
    if isinstance(raw, dict) and isinstance(raw.get("workload"), dict):
        code = raw["workload"].get("code")
        if isinstance(code, str) and not code.startswith("s3://") and not Path(code).expanduser().is_absolute():
            raw = {**raw, "workload": {**raw["workload"], "code": str(spec_path.parent / code)}}
        elif isinstance(code, str) and not code.startswith("s3://"):
            raw = {**raw, "workload": {**raw["workload"], "code": str(Path(code).expanduser())}}
    return raw


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        raw = resolve_code(json.loads(args.spec.read_text()), args.spec)
        if args.set and isinstance(raw, dict):
            raw["hyperparameters"] = {**raw.get("hyperparameters", {}), **dict(args.set)}
        # The platform's own validation: what it would refuse to launch is refused here too.
        spec = validate_job_spec(raw)
        options = EmulationOptions(
            # Absolute: every host runs from its own folder, and a relative tree would be looked for there.
            workdir=(args.workdir or Path(tempfile.mkdtemp(prefix=f"{spec.run_name}-"))).resolve(),
            channels={name: Path(folder) for name, folder in args.channel},
            deadline_s=args.deadline_s,
            orphan_grace_s=args.orphan_grace_s,
            cpus_per_host={group: int(count) for group, count in args.cpus},
            cpu_quota={group: float(cores) for group, cores in args.cpu_quota},
            processes_per_host=args.processes_per_host,
            code_dir=args.code,
        )
        cluster = EmulatedCluster(spec, options)
    except (OSError, json.JSONDecodeError, JobSpecError, EmulationError, ValueError) as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(cluster.plan_report(), flush=True)
    try:
        result = cluster.run()
    except EmulationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.report())
    summary = cluster.summary()
    if summary:
        print(json.dumps(summary, indent=2))
    if summary and summary.get("mode") == "script":
        # What the platform would record for this run in the cloud (result.json), said here too.
        from lambdas.core.results import run_verdict

        status, reason = run_verdict("Completed" if result.ok else "Failed", summary, None)
        if reason and result.ok:
            print(f"the platform would record this run as {status}: {reason}", file=sys.stderr)
            return 1
    print(f"host trees and logs: {options.workdir}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
