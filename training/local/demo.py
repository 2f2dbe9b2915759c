"""`make demo`: the saving, shown offline on an emulated heterogeneous cluster.

1. writes a small dataset of real JPEG files (4 classes × 64 images of 320 px);
2. profiles the two halves of the work: the data pipeline alone on one data host's CPU, and the model
   alone on the DNN host's CPU with input already in memory (training/local/profile.py);
3. runs the example job specs on the emulated cluster: homogeneous (the DNN host decodes and augments on
   its own CPU, between training steps) and heterogeneous (+ data hosts streaming batches: over our gRPC
   service for pytorch, through tf.data.service for tensorflow);
4. prints step time, samples/s, speed-up against the ideal, and cost per 1k steps;
   (with ``--workload``, a user workload's own specs instead, validated on held-out images);
   the two configurations run in interleaved rounds (A B B A ...: a drift of the machine's speed
   falls on both), each figure the median round's, with the rounds' spread; while they run, the CPU
   that other programs take is measured (training/local/machine_load.py), and a busy machine or rounds
   that disagree give "too busy to measure" instead of a recommendation;
5. writes the same report a cloud benchmark sweep writes (report.json, report.md, chart.png, through
   lambdas/core/sweep.py and chart.py) into the work folder, prices labelled as emulated.

The job specs are examples/<variant>-{homogeneous,heterogeneous}.json, shrunk to fit a laptop CPU by
LOCAL_OVERRIDES. Costs are *emulated*: local step times × SageMaker list prices of the spec's instance
types, a price-performance estimate of the same shape as the cloud's, not a cloud measurement. Data hosts
that share cores here (2 data hosts on one spare core) count for the cores they really have in the ideal.

    python -m training.local.demo [--variant pytorch|tensorflow] [--workdir build/demo] [--steps 40] [--rounds 2]
    python -m training.local.demo --workload examples/workloads/augmented_cnn     # a user workload's specs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from lambdas.core.chart import render_chart
from lambdas.core.job_spec import JobSpec, trainer_config, validate_job_spec
from lambdas.core.price_performance import FALLBACK_PRICES, Prices, cost_per_1k_steps, hourly_cost, with_given
from lambdas.core.results import billed_ms_per_step
from lambdas.core.sweep import compare, render_markdown
from training.local.__main__ import resolve_code
from training.local.cluster import EmulatedCluster, EmulatedHost, EmulationOptions, plan_hosts
from training.local.images import write_dataset
from training.local.machine_load import OtherLoad
from training.local.options import given_price_option
from training.local.profile import (
    Profile,
    data_host_cpus,
    preprocess_ms_per_batch,
    train_ms_per_step,
)
from training.metrics import parse_metric_line
from training.stop_signals import Stopped, restore_stop_signals, stopped_by_signals
from training.variants import VARIANTS

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
# The example specs train resnet18 on 224 px crops, sized for a GPU. On one CPU core per host we keep
# the shape of the problem (preprocessing and training of similar cost) at a size that runs in seconds.
LOCAL_OVERRIDES = {"model": "cnn", "cnn_width": 8, "image_size": 64, "augment": "heavy", "batch_size": 32, "warmup_steps": 10}
# The demo's DNN hosts run one trainer process each (no GPUs here), which Horovod would only wrap: the
# tensorflow specs run without it, so `make demo` needs no Horovod build (`make test` builds it, and
# tests/training/local/test_tensorflow_cluster.py runs the specs as they are, Horovod ranks included).
DEMO_DISTRIBUTION = {"tensorflow": "none"}
# When a measurement cannot back a recommendation: other programs took this many CPUs on average while
# the jobs ran (a quarter of a core is a quarter of a data host here), or one configuration's rounds
# differ by this fraction of their median.
BUSY_CORES = 0.25
SPREAD_LIMIT = 0.20


@dataclass(frozen=True)
class RunFigures:
    label: str
    spec: JobSpec
    step_ms: float  # billed: the wall time per timed step (lambdas/core/results.billed_ms_per_step)
    samples_per_s: float
    p50_ms: float | None = None  # the step-time median, shown beside it
    rounds_ms: tuple[float, ...] = ()  # each round's billed ms per step (step_ms is their median)
    prices: Prices = FALLBACK_PRICES  # the dated table, or with the user's --price in it

    @property
    def spread(self) -> float:
        """(slowest − fastest round) / the median: 0 for one round."""
        return spread(self.rounds_ms)

    @property
    def usd_per_hour(self) -> float:
        return hourly_cost([(group.instance_type, group.count) for group in self.spec.instance_groups], self.prices)

    @property
    def cost_per_1k_steps(self) -> float:
        return cost_per_1k_steps(self.usd_per_hour, self.step_ms)

    @property
    def data_hosts(self) -> int:
        return sum(group.count for group in self.spec.data_groups)


@dataclass(frozen=True)
class Comparison:
    profile: Profile
    homogeneous: RunFigures
    heterogeneous: RunFigures
    # Data hosts' worth of CPUs the emulated data group really has (hosts sharing a core count once).
    effective_data_hosts: float = 0.0
    # Mean CPUs' worth other programs used while the jobs ran (machine_load.OtherLoad).
    other_cores: float = 0.0

    @property
    def data_capacity(self) -> float:
        return self.effective_data_hosts or self.heterogeneous.data_hosts

    @property
    def speed_up(self) -> float:
        return self.homogeneous.step_ms / self.heterogeneous.step_ms

    @property
    def ideal_speed_up(self) -> float:
        return self.profile.ideal_step_ms(0) / self.profile.ideal_step_ms(self.data_capacity)

    @property
    def offload_efficiency(self) -> float:
        """Heterogeneous median step / the ideal one (the profile's, of single steps too); 1.0 means the
        data service costs nothing. A speed ratio: the billed figures price the runs."""
        step = self.heterogeneous.p50_ms if self.heterogeneous.p50_ms is not None else self.heterogeneous.step_ms
        return step / self.profile.ideal_step_ms(self.data_capacity)


def spread(values: tuple[float, ...]) -> float:
    if len(values) < 2:
        return 0.0
    ordered = sorted(values)
    return (ordered[-1] - ordered[0]) / statistics.median(ordered)


def disturbance(comparison: Comparison) -> str | None:
    """Why this measurement cannot back a recommendation, or None. Pure."""
    reasons = []
    if comparison.other_cores > BUSY_CORES:
        reasons.append(f"other programs used {comparison.other_cores:.2f} CPUs on average while the jobs ran (limit {BUSY_CORES:g})")
    for run in (comparison.homogeneous, comparison.heterogeneous):
        if run.spread > SPREAD_LIMIT:
            rounds = ", ".join(f"{value:.1f}" for value in run.rounds_ms)
            reasons.append(f"the {run.label} rounds disagree by {run.spread:.0%} ({rounds} ms/step; limit {SPREAD_LIMIT:.0%})")
    return "; ".join(reasons) or None


class Progress:
    """One line per run, redrawn in place on a terminal, every quarter of the run otherwise."""

    def __init__(self, label: str, steps: int) -> None:
        self.label, self.steps = label, steps
        self.tty = sys.stdout.isatty()
        self._lock = threading.Lock()
        self._shown = -1

    def __call__(self, host: EmulatedHost, line: str) -> None:
        if host.role != "dnn" or not line.startswith("step="):
            return
        step = int(line.split()[0].split("=")[1].split("/")[0])
        metrics = parse_metric_line(line)
        timing = f"{metrics['step_time_ms']:7.1f} ms/step" if "step_time_ms" in metrics else "  warming up"
        filled = round(24 * step / self.steps)
        text = f"  {self.label:<14} [{'#' * filled}{'.' * (24 - filled)}] {step:>4}/{self.steps} {timing}"
        with self._lock:
            if self.tty:
                print("\r" + text, end="\n" if step == self.steps else "", flush=True)
            elif step * 4 // self.steps > self._shown:
                self._shown = step * 4 // self.steps
                print(text, flush=True)


def quiet(host: EmulatedHost, line: str) -> None:
    """Host logs still go to <workdir>/logs; nothing on the terminal."""


def load_spec(name: str | Path, overrides: dict | None = None, validation: str = "") -> JobSpec:
    """An example spec (a name under examples/, or a path) with local overrides, validated as the platform
    would; a user workload's code folder is relative to the spec file, as for `hetero local`.
    ``validation``: a channel added to the spec, on its DNN group, for the workload to validate on."""
    path = EXAMPLES / name if isinstance(name, str) else name
    raw = resolve_code(json.loads(path.read_text()), path)
    raw["hyperparameters"] = {**raw.get("hyperparameters", {}), **(overrides or {})}
    if raw.get("variant") in DEMO_DISTRIBUTION:
        raw["distribution"] = DEMO_DISTRIBUTION[raw["variant"]]
    if validation:
        dnn = next(group["name"] for group in raw["instance_groups"] if group.get("role") == "dnn")
        # SageMaker routes every channel to groups or none: a spec whose channels go everywhere (one group)
        # gets its validation channel everywhere too.
        routed = any(channel.get("groups") for channel in raw["inputs"].values())
        raw["inputs"] = {**raw["inputs"], validation: {"s3_uri": f"s3://local-demo/{validation}/", **({"groups": [dnn]} if routed else {})}}
        raw["hyperparameters"]["eval_channel"] = validation
    return validate_job_spec(raw)


def run_job(label: str, spec: JobSpec, options: EmulationOptions, progress: bool = True) -> RunFigures:
    steps = int(spec.hyperparameters.get("steps", 100))
    cluster = EmulatedCluster(spec, options, on_line=Progress(label, steps) if progress else quiet)
    result = cluster.run()
    summary = cluster.summary()
    if not result.ok or not summary:
        logs = options.workdir / "logs"
        raise SystemExit(f"{label} run failed:\n{result.report()}\nlogs: {logs}")
    # What a step costs (its wall time, evaluations and checkpoints included), as the cloud's results price it.
    return RunFigures(label, spec, billed_ms_per_step(summary), summary["samples_per_s"], summary["step_time_ms"]["p50"])


def interleaved(rounds: int) -> list[tuple[str, int]]:
    """(configuration, round) in the order they run: A B, B A, A B, ... Pure."""
    order = []
    for index in range(rounds):
        pair = ("homogeneous", "heterogeneous") if index % 2 == 0 else ("heterogeneous", "homogeneous")
        order += [(label, index) for label in pair]
    return order


def combined(label: str, spec: JobSpec, runs: list[RunFigures]) -> RunFigures:
    """One configuration's rounds as one figure: each field the median of its rounds', with every round's
    billed ms per step."""
    p50s = [run.p50_ms for run in runs if run.p50_ms is not None]
    return RunFigures(label, spec, statistics.median([run.step_ms for run in runs]), statistics.median([run.samples_per_s for run in runs]),
                      statistics.median(p50s) if p50s else None, tuple(run.step_ms for run in runs))


def cluster_cpus(spec: JobSpec, options: EmulationOptions) -> set[int]:
    """The CPUs the emulated cluster gives a spec's hosts on this machine, as it plans them."""
    return {cpu for host in plan_hosts(spec, options, sorted(os.sched_getaffinity(0)), 0) for cpu in host.cpus}


def run_comparison(workdir: Path, steps: int, variant: str = "pytorch", workload: Path | None = None, rounds: int = 2) -> Comparison:
    """The comparison of a variant's example specs, or of a user workload's (``workload``: its folder, with
    homogeneous.json and heterogeneous.json beside its code, as examples/workloads/* have them), in
    ``rounds`` interleaved rounds."""
    images = write_dataset(workdir / "images", classes=4, per_class=64, size=320)
    channels = {"train": images}
    if workload is None:
        overrides = LOCAL_OVERRIDES | {"steps": steps}
        # The PyTorch built-in validates at the end on held-out images, as a user workload does.
        validation = "validation" if VARIANTS[variant].user_workloads and VARIANTS[variant].contract == "pytorch" else ""
        homogeneous, heterogeneous = (load_spec(f"{variant}-{kind}.json", overrides, validation) for kind in ("homogeneous", "heterogeneous"))
        if validation:
            channels["validation"] = write_dataset(workdir / "held-out", classes=4, per_class=8, size=320, seed=1)
    else:
        # The workload's own settings, run for ``steps``, validated halfway and at the end on held-out images.
        overrides = {"steps": steps, "warmup_steps": 10, "log_every": 5, "eval_every": max(1, steps // 2)}
        homogeneous, heterogeneous = load_spec(workload / "homogeneous.json", overrides), load_spec(workload / "heterogeneous.json", overrides)
        channels["validation"] = write_dataset(workdir / "held-out", classes=4, per_class=8, size=320, seed=1)

    def options(name: str) -> EmulationOptions:
        shutil.rmtree(workdir / name, ignore_errors=True)
        return EmulationOptions(workdir=workdir / name, channels=channels)

    data_cpus = data_host_cpus(heterogeneous, options("plan"))
    one_host = data_cpus[0]
    effective = min(len(data_cpus), len(set().union(*data_cpus)) / len(one_host))
    # Others' load is watched from the profile (which sets the ideal) to the last run, on the CPUs the
    # emulated hosts take.
    with OtherLoad(cpus=frozenset(cluster_cpus(heterogeneous, options("plan")))) as load:
        print("profiling: the data pipeline alone on one data host's CPU, the model alone on the DNN host's", flush=True)
        preprocess = preprocess_ms_per_batch(homogeneous, images, one_host)
        train = train_ms_per_step(homogeneous, options("train-only"), on_line=Progress("train-only", steps))
        profile = Profile(preprocess, train)
        print(f"  preprocessing {preprocess:.1f} ms/batch, training {train:.1f} ms/step", flush=True)
        print(f"running the example specs on the emulated cluster, {rounds} interleaved round{'s' if rounds > 1 else ''}", flush=True)
        specs = {"homogeneous": homogeneous, "heterogeneous": heterogeneous}
        runs: dict[str, list[RunFigures]] = {label: [] for label in specs}
        for label, index in interleaved(rounds):
            # The first round's folders keep the plain names (the validation is read from "heterogeneous").
            name = label if index == 0 else f"{label}-round{index + 1}"
            runs[label].append(run_job(f"{label} {index + 1}" if rounds > 1 else label, specs[label], options(name)))
    return Comparison(profile, combined("homogeneous", homogeneous, runs["homogeneous"]),
                      combined("heterogeneous", heterogeneous, runs["heterogeneous"]),
                      effective_data_hosts=effective, other_cores=load.other_cores)


def render(comparison: Comparison) -> str:
    base = comparison.homogeneous
    header = (f"{'configuration':<52} {'ms/step':>10} {'spread':>7} {'samples/s':>10} {'speed-up':>9} {'ideal':>7} {'$/hour':>8} "
              f"{'$ per 1k steps':>15}")
    rows = [header, "-" * len(header)]
    for run, ideal in ((base, 1.0), (comparison.heterogeneous, comparison.ideal_speed_up)):
        groups = " + ".join(f"{g.count}× {g.instance_type}" for g in run.spec.instance_groups)
        rows.append(
            f"{run.label + ': ' + groups:<52} {run.step_ms:>7.1f} ms {run.spread:>6.0%} {run.samples_per_s:>10.1f} "
            f"{base.step_ms / run.step_ms:>8.2f}× {ideal:>6.2f}× {run.usd_per_hour:>8.3f} {run.cost_per_1k_steps:>15.4f}"
        )
    saving = 1 - comparison.heterogeneous.cost_per_1k_steps / base.cost_per_1k_steps
    rows += [
        "",
        f"profile: preprocessing {comparison.profile.preprocess_ms_per_batch:.1f} ms/batch on one data-host CPU "
        f"({images_per_s(base.spec, comparison.profile.preprocess_ms_per_batch):.0f} samples/s per vCPU: the sizing advisor's "
        f"samples_per_s_per_vcpu), "
        f"training {comparison.profile.train_ms_per_step:.1f} ms/step with input in memory",
        f"ideal = (preprocess + train) / max(train, preprocess / data hosts) with {comparison.data_capacity:g} data hosts' "
        f"worth of CPUs here; "
        f"heterogeneous median step / ideal step = {comparison.offload_efficiency:.3f}",
        f"price-performance: {abs(saving):.0%} {'lower' if saving >= 0 else 'higher'} cost per step with the data host "
        f"(EMULATED: local step times × {base.prices.source}, {base.prices.date})",
        f"rounds: {len(base.rounds_ms) or 1} per configuration, interleaved; ms/step is the median round's, spread (slowest − "
        f"fastest) / median; other programs used {comparison.other_cores:.2f} CPUs on average meanwhile",
        "ms/step: the billed time per step (the timed steps' wall time, with the evaluations, checkpoints and stalls between "
        "them), which is why it is above hetero local's step time p50 (the median step alone); speed-up: the homogeneous "
        "ms/step over this one's; $ per 1k steps: ms/step × the spec's list prices, EMULATED (docs/reference/glossary.md)",
    ]
    return "\n".join(rows)


def comparison_validation(workdir: Path) -> dict | None:
    """The heterogeneous run's validation metrics (its chief DNN host's summary), if it validated."""
    for summary in sorted((workdir / "heterogeneous").glob("algo-*/opt/ml/output/data/summary.json")):
        validation = json.loads(summary.read_text()).get("validation")
        if validation:
            return validation["metrics"]
    return None


def images_per_s(spec: JobSpec, ms_per_batch: float) -> float:
    """Images per second from one batch's milliseconds, at the batch size the spec's trainer uses. Pure."""
    return trainer_config(spec).batch_size * 1000 / ms_per_batch


def emulated_prices(prices: Prices = FALLBACK_PRICES) -> Prices:
    return Prices(
        usd_per_hour=prices.usd_per_hour,
        source=f"EMULATED: step times measured on this machine × {prices.source}",
        date=prices.date,
    )


def priced(comparison: Comparison, given: dict[str, float]) -> Comparison:
    """The comparison with the user's $/hour (--price) in place of the table's. Pure."""
    prices = with_given(FALLBACK_PRICES, given)
    return replace(comparison, homogeneous=replace(comparison.homogeneous, prices=prices),
                   heterogeneous=replace(comparison.heterogeneous, prices=prices))


def spec_document(spec: JobSpec) -> dict:
    return {
        "variant": spec.variant,
        "instance_groups": [
            {"name": group.name, "role": group.role, "instance_type": group.instance_type, "count": group.count} for group in spec.instance_groups
        ],
    }


def write_report(comparison: Comparison, folder: Path, title: str) -> tuple[Path, Path, Path, str]:
    """The sweep report of the emulated runs: report.json, report.md and chart.png in ``folder``."""
    outcomes = [
        {"name": run.label, "spec": spec_document(run.spec), "status": "SUCCEEDED",
         "result": {"billed_ms_per_step": run.step_ms, "step_time_ms": {"p50": run.p50_ms}}}
        for run in (comparison.homogeneous, comparison.heterogeneous)
    ]
    report = compare(outcomes, emulated_prices(comparison.homogeneous.prices), step_time_target_ms=None)
    disturbed = disturbance(comparison)
    if disturbed:
        report |= {"recommended": None, "recommended_data_hosts": None, "recommendation_basis": None, "disturbed": disturbed}
    report["measurement"] = {"rounds": {run.label: list(run.rounds_ms) for run in (comparison.homogeneous, comparison.heterogeneous)},
                             "other_cpus": round(comparison.other_cores, 3)}
    markdown = render_markdown(report, title)
    folder.mkdir(parents=True, exist_ok=True)
    paths = (folder / "report.json", folder / "report.md", folder / "chart.png")
    paths[0].write_text(json.dumps(report, indent=2))
    paths[1].write_text(markdown)
    paths[2].write_bytes(render_chart(report, title))
    return (*paths, markdown)


def demo_parser(prog: str = "python -m training.local.demo") -> argparse.ArgumentParser:
    """The demo's options, defined once: `hetero demo` parses and shows them under its own name."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "demo", help="where the runs, logs and report go (default: build/demo)")
    parser.add_argument("--steps", type=int, default=40, help="steps per job")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of each configuration (median and spread)")
    parser.add_argument("--variant", choices=[name for name, variant in VARIANTS.items() if variant.has_data_service], default="pytorch",
                        help="the built-in workload's variant to compare (default: pytorch)")
    parser.add_argument("--workload", type=Path, help="a user workload's folder (homogeneous.json and heterogeneous.json beside its code)")
    parser.add_argument("--price", type=given_price_option, action="append", default=[], metavar="TYPE=USD_PER_HOUR",
                        help="your $/hour for an instance type, in place of the dated table's (repeatable)")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m training.local.demo") -> int:
    parser = demo_parser(prog)
    args = parser.parse_args(argv)
    if args.workload is not None:
        workdir = args.workdir / f"workload-{args.workload.resolve().name}"
        title = f"Emulated sweep of the workload {args.workload.name}"
    else:
        workdir = args.workdir / args.variant if args.variant != "pytorch" else args.workdir
        title = f"Emulated {args.variant} sweep"
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    restore_stop_signals()
    try:
        with stopped_by_signals():  # each run's cluster is closed (every host killed) on the way out
            comparison = priced(run_comparison(workdir, args.steps, args.variant, workload=args.workload, rounds=args.rounds),
                                dict(args.price))
    except Stopped as stop:
        print(f"\n{stop.what}: stopped the demo and its emulated cluster; host trees and logs: {workdir}", file=sys.stderr)
        return stop.exit_code
    print()
    print(render(comparison))
    accuracy = (comparison_validation(workdir) or {}).get("accuracy")
    if accuracy is not None:
        print(f"validation accuracy of the heterogeneous run's model: {accuracy:.3f} (4 classes: chance 0.25)")
    *_, chart, markdown = write_report(comparison, workdir / "report", title)
    disturbed = disturbance(comparison)
    if disturbed:
        # A figure taken on a busy machine says nothing of the saving: no recommendation, and why.
        # Others' load is a busy machine; rounds that disagree on a quiet one are a measurement too short or unsteady.
        heading = "TOO BUSY TO MEASURE" if comparison.other_cores > BUSY_CORES else "MEASUREMENT NOT STEADY"
        print(f"\n{heading}: {disturbed}.\nNo recommendation from this run: run it again with nothing else using the CPUs, "
              "or with more --steps and --rounds.")
        print(f"\nreport (not a recommendation): {workdir / 'report'}/report.md, chart: {chart}")
    else:
        print(f"\n{markdown}\nreport: {workdir / 'report'}/report.md, chart: {chart}")
    print(f"host trees and logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
