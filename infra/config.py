"""The platform's settings, read from cdk context (cdk.json, or -c on the command line) into a frozen
dataclass. Everything the stacks vary by lives here, with its default and what it means."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from lambdas.core.deadlines import worst_case_run_s
from lambdas.core.job_spec import BUCKET_NAME, ECR_REPOSITORY, MAX_RUNTIME_S, SpecPolicy
from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.sweep import plan_sweep

CONTEXT_KEY = "platform"


class PlatformConfigError(ValueError):
    """A context value the platform cannot be built with."""


@dataclass(frozen=True)
class PlatformConfig:
    # Prefix of every resource name and of every training job name (IAM scopes permissions by it).
    prefix: str = "hetero"
    # Region the stacks deploy to; the DLC base images are pulled from this region's ECR.
    region: str = "us-east-1"
    # variant → AWS Deep Learning Container image the training image extends; {region} is filled in. The
    # framework releases match what the tests run (tests/infra/test_image_pins.py holds them together):
    # PyTorch 2.9 (pytorch; the image installs the tests' torch in its CUDA 12.6 build, which still has
    # kernels for the V100 of ml.p3: the DLC is CUDA 13, which dropped Volta), PyTorch/XLA 2.9 on Neuron SDK
    # 2.28 (neuron). No TensorFlow DLC carries 2.21: the tensorflow image installs the tests' TensorFlow
    # release over the newest one. Each variant's training/images/<variant>/framework.txt says what.
    base_images: Mapping[str, str] = field(
        default_factory=lambda: {
            "pytorch": "763104351884.dkr.ecr.{region}.amazonaws.com/pytorch-training:2.9.0-gpu-py312-cu130-ubuntu22.04-sagemaker",
            "neuron": "763104351884.dkr.ecr.{region}.amazonaws.com/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04",
            "tensorflow": "763104351884.dkr.ecr.{region}.amazonaws.com/tensorflow-training:2.19.0-gpu-py312-cu125-ubuntu22.04-sagemaker",
        }
    )
    # Seconds between two DescribeTrainingJob polls of a running job.
    poll_interval_s: int = 60
    # Longest a training run's execution may take end to end. None: the worst case of the longest spec
    # the platform accepts (5 days of runtime, the start window, grace, relaunches, retries: see
    # run_timeout_s); a value below that is refused, since a timed-out execution writes no result.
    run_timeout_h: int | None = None
    # Past a spec's max_runtime_s, how long SageMaker gets to stop the job itself before the state machine
    # stops it and fails the run with RunTimedOut.
    deadline_grace_s: int = 900
    # How long a job may take to start training (instances, image and data download) before the run
    # stops it (StartTimedOut); the spec's max_runtime_s is counted from its training start.
    start_timeout_s: int = 7200
    # Times a job that failed for want of capacity (CapacityError) is launched again, with doubling backoff.
    capacity_relaunches: int = 3
    # Seconds before the first relaunch (doubling for each further one, up to 30 minutes).
    capacity_backoff_s: int = 120
    # Days before checkpoints in the results bucket expire (a finished run needs them no more).
    checkpoint_retention_days: int = 30
    # Days of Lambda and state machine logs kept.
    log_retention_days: int = 90
    # Benchmark sweeps: configurations running at once, and the longest a whole sweep may take.
    sweep_max_concurrency: int = 2
    sweep_timeout_h: int = 336
    # A schedule for the sweep, or none: {"expression": "cron(0 6 ? * MON *)", "input": <sweep input>,
    # "enabled": false}. Created only when given, and disabled unless "enabled" is true.
    sweep_schedule: Mapping[str, Any] | None = None
    # Mail address told of every alarm (lost job stops, reconciler errors, failed or unstarted sweeps);
    # none: subscribe to the AlarmTopic output yourself.
    alarm_email: str | None = None
    # Run every job in private subnets of a VPC of the platform's own, reaching only S3 and its own hosts
    # (infra/constructs/training_network.py). Off: SageMaker's network, with internet access.
    vpc_mode: bool = False
    # Buckets, besides the platform's datasets bucket, that job specs may read their channels from; the
    # SageMaker role gets read access to these and no others.
    input_buckets: tuple[str, ...] = ()
    # ECR repositories of this account and region (their names) whose images script-mode jobs may run
    # (``"workload": {"image": ...}``: images built FROM the platform's); the SageMaker role may pull from
    # these and no others. None given: a script runs in the platform's images only.
    script_image_repositories: tuple[str, ...] = ()
    # The most one run may cost (every instance billed for its whole max_runtime_s), and a whole sweep;
    # a spec or sweep input may lower these with max_cost_usd, never raise them.
    run_cost_ceiling_usd: float = 1000.0
    sweep_cost_ceiling_usd: float = 5000.0
    # $/hour the ceiling uses for types the fallback table does not price (it has no Trainium prices):
    # SageMaker on-demand training, us-east-1, as published in 2025. A type priced nowhere is refused
    # under a ceiling.
    ceiling_prices_usd_per_hour: Mapping[str, float] = field(
        default_factory=lambda: {"ml.trn1.2xlarge": 1.5484, "ml.trn1.32xlarge": 24.7726}
    )

    def __post_init__(self) -> None:
        if not self.prefix.isalnum() or not self.prefix.islower() or len(self.prefix) > 10:
            raise PlatformConfigError(f"prefix {self.prefix!r} must be 1-10 lowercase letters or digits (it starts job names)")
        if self.log_retention_days not in (30, 90, 180, 365):
            raise PlatformConfigError(f"log_retention_days must be 30, 90, 180 or 365, got {self.log_retention_days}")
        if not 1 <= self.sweep_max_concurrency <= 16:
            raise PlatformConfigError(f"sweep_max_concurrency must be in 1..16, got {self.sweep_max_concurrency}")
        if not 1 <= self.poll_interval_s <= 3600:
            raise PlatformConfigError(f"poll_interval_s must be in 1..3600, got {self.poll_interval_s}")
        if not 600 <= self.start_timeout_s <= 24 * 3600:
            raise PlatformConfigError(f"start_timeout_s must be in 600..86400, got {self.start_timeout_s}")
        if not 1 <= self.capacity_backoff_s <= 1800:
            raise PlatformConfigError(f"capacity_backoff_s must be in 1..1800, got {self.capacity_backoff_s}")
        if not 0 <= self.capacity_relaunches <= 5:
            raise PlatformConfigError(f"capacity_relaunches must be in 0..5, got {self.capacity_relaunches}")
        if self.run_timeout_h is not None and self.run_timeout_h * 3600 < self.worst_case_run_s():
            raise PlatformConfigError(f"run_timeout_h {self.run_timeout_h} is shorter than the longest run the platform accepts "
                                      f"({self.worst_case_run_s() / 3600:.1f} h): leave it out, or raise it")
        for name in ("run_cost_ceiling_usd", "sweep_cost_ceiling_usd"):
            if not 0 < getattr(self, name) < 10_000_000:
                raise PlatformConfigError(f"{name} must be a positive number of US dollars, got {getattr(self, name)}")
        if any(not isinstance(price, int | float) or price <= 0 for price in self.ceiling_prices_usd_per_hour.values()):
            raise PlatformConfigError(f"ceiling_prices_usd_per_hour must map instance types to positive $/hour, got {self.ceiling_prices_usd_per_hour}")
        if self.sweep_schedule is not None:
            self._check_schedule(self.sweep_schedule)

    def _check_schedule(self, schedule: Mapping[str, Any]) -> None:
        """A schedule that would fail every week fails here, before anything is synthesized."""
        if not isinstance(schedule, Mapping):
            raise PlatformConfigError(f"sweep_schedule must be an object with 'expression', 'input' and 'enabled'; got {schedule!r}")
        unknown = sorted(set(schedule) - {"expression", "enabled", "input"})
        if unknown or "expression" not in schedule or "input" not in schedule:
            raise PlatformConfigError(f"sweep_schedule takes 'expression', 'input' and 'enabled' (default false); got {sorted(schedule)}")
        if not isinstance(schedule.get("enabled", False), bool):
            raise PlatformConfigError(f"sweep_schedule.enabled must be true or false, got {schedule['enabled']!r}")
        plan_sweep(schedule["input"], self.policy_for_synthesis())  # raises SweepSpecError naming the field

    def base_image(self, variant: str) -> str:
        return self.base_images[variant].format(region=self.region)

    @classmethod
    def from_context(cls, raw: Mapping[str, Any] | None) -> PlatformConfig:
        raw = dict(raw or {})
        unknown = sorted(set(raw) - {item.name for item in fields(cls)})
        if unknown:
            raise PlatformConfigError(f"unknown platform settings {unknown}; known: {sorted(item.name for item in fields(cls))}")
        if "input_buckets" in raw:
            buckets = raw["input_buckets"]
            if not isinstance(buckets, list | tuple) or not all(isinstance(b, str) and BUCKET_NAME.fullmatch(b) for b in buckets):
                raise PlatformConfigError(f"input_buckets must be a list of S3 bucket names, got {buckets!r}")
            raw["input_buckets"] = tuple(buckets)
        if "script_image_repositories" in raw:
            names = raw["script_image_repositories"]
            if not isinstance(names, list | tuple) or not all(isinstance(name, str) and ECR_REPOSITORY.fullmatch(name) for name in names):
                raise PlatformConfigError(f"script_image_repositories must be a list of ECR repository names (team/train), got {names!r}")
            raw["script_image_repositories"] = tuple(names)
        if "ceiling_prices_usd_per_hour" in raw:  # on top of the defaults, not instead of them
            raw["ceiling_prices_usd_per_hour"] = dict(cls().ceiling_prices_usd_per_hour) | dict(raw["ceiling_prices_usd_per_hour"])
        return cls(**raw)

    def worst_case_run_s(self) -> int:
        """The longest run the platform accepts, end to end (lambdas/core/deadlines.py)."""
        return worst_case_run_s(
            max_runtime_s=MAX_RUNTIME_S, grace_s=self.deadline_grace_s, poll_interval_s=self.poll_interval_s,
            start_timeout_s=self.start_timeout_s, relaunches=self.capacity_relaunches, first_backoff_s=self.capacity_backoff_s,
        )

    @property
    def run_timeout_s(self) -> int:
        return self.run_timeout_h * 3600 if self.run_timeout_h else math.ceil(self.worst_case_run_s() / 3600) * 3600

    def priced_instance_types(self) -> list[str]:
        """The types this deployment can price for its cost ceiling: the fallback table's and the ceiling
        prices'; the only ones its launch accepts (and the direct-launch policy allows)."""
        return sorted(set(FALLBACK_PRICES.usd_per_hour) | set(self.ceiling_prices_usd_per_hour))

    def policy_for_synthesis(self) -> SpecPolicy:
        """The policy a scheduled sweep is checked against at synthesis (bucket names are not known yet)."""
        return SpecPolicy(run_cost_ceiling_usd=self.run_cost_ceiling_usd, sweep_cost_ceiling_usd=self.sweep_cost_ceiling_usd,
                          prices_usd_per_hour=dict(self.ceiling_prices_usd_per_hour))

    def policy_environment(self, input_buckets: str, script_images: str = "[]") -> dict[str, str]:
        """The Lambdas' environment for SpecPolicy.from_environment (lambdas/core/job_spec.py);
        ``input_buckets``: the allowed buckets as a JSON list, ``script_images`` the allowed script
        image repositories' URIs (deploy-time tokens)."""
        return {
            "INPUT_BUCKETS": input_buckets,
            "SCRIPT_IMAGE_REPOSITORIES": script_images,
            "RUN_COST_CEILING_USD": str(self.run_cost_ceiling_usd),
            "SWEEP_COST_CEILING_USD": str(self.sweep_cost_ceiling_usd),
            "CEILING_PRICES": json.dumps(dict(self.ceiling_prices_usd_per_hour), sort_keys=True),
        }
