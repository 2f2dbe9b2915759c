"""The job spec: what a user asks the platform to run, parsed into typed values with named refusals.

The same JSON starts a training run on SageMaker (the Step Functions input) and on the emulated cluster
(``python -m training.local run SPEC``). Version 1 (``"spec_version": 1``, the default):

    {"run_name": "mnist-hetero",               # letters, digits, hyphens; ≤ 40 characters
     "variant": "pytorch",                     # which image and trainer
     "workload": "vision",                     # what the trainer trains: a built-in, or a user's module:
        # {"code": "<folder>" | "s3://<results bucket>/code/<sha256>/sourcedir.tar.gz",
        #  "module": "workload", "requirements": "requirements.txt", "sha256": "<64 hex, with an s3:// code>"}
        # or a user's existing SageMaker script (script mode): {"code": ..., "entry_point": "train.py" | "command": "...",
        #  "requirements": ..., "image": "<ECR image built on the platform's>", "step_time_regex": "...", "warmup_steps": 1}
     "instance_groups": [                      # 1–5 groups, exactly one with role "dnn"
        {"name": "data_group", "role": "data", "instance_type": "ml.c5.9xlarge", "count": 1},
        {"name": "dnn_group",  "role": "dnn",  "instance_type": "ml.p3.2xlarge", "count": 1}],
     "distribution": "torchrun",               # per variant (training/variants.py); default: its first
     "hyperparameters": {"batch_size": 64, "steps": 500},   # scalar values only
     "inputs": {"train": {"s3_uri": "s3://bucket/prefix/", "groups": ["data_group"]}},   # ≤ 20 channels
     "max_runtime_s": 3600,                    # 60 s .. 5 days
     "max_cost_usd": 50,                       # optional: lowers the deployment's cost ceiling
     "resume_from": "<run id>"}                # optional: carry on an earlier run's checkpoints

Every refusal is a JobSpecError naming the field and what to do instead. ``parse_job_spec`` checks the
shape (types, names, and SageMaker's own limits, read from botocore's service model by
lambdas/core/service_limits.py); ``validate_job_spec`` adds the platform's rules: a known variant,
workload and distribution, instance types from the catalog, Trainium only with the neuron variant, data
groups only for variants with a data service and only on CPU instances, the "train" channel, on every
data host, channels the trainer names (model_channel, eval_channel) among the inputs, hyperparameters the
trainer knows with values in range, and the deployment's policy (SpecPolicy): input buckets on its
allow-list, and a worst-case cost (every instance for the whole max_runtime_s) under its ceiling.

A user workload (``"workload": {"code": ...}``: JobSpec.workload is USER_WORKLOAD, JobSpec.code says
where its code is) runs on the variants that train them (Variant.user_workloads), with data groups on
Trainium too (the gRPC data service serves the user's preprocessing). Its hyperparameters are the
platform loop's (WorkloadConfig, checked here) and the module's own, which only the module knows: they
pass here and are checked where the module is (``hetero validate``, every host). Its code is a local
folder until the client packs and uploads it (``hetero run``); with a deployment's policy
(``SpecPolicy.code_bucket``) only the uploaded archive is accepted, and only under code/<its SHA-256>/
of the platform's own results bucket: a job reads code nowhere else, and the state machine cannot read
the user's disk.

A script-mode job (``"entry_point"`` or ``"command"`` in the workload: JobSpec.is_script) runs the user's
existing SageMaker script as it is, in the variant's image or their own (``image``, an ECR image built on
the platform's, from the deployment's allow-list): the "dnn" group is the trainer group (the job ends when
its hosts have), "data" groups are every other group, whose scripts the launcher ends then. Its
hyperparameters are the script's own (only the platform's names and the toolkit's sagemaker_ prefix are
refused), its channels go where the spec routes them, and its step time comes from its own log lines
(``step_time_regex``, the platform's ``step_time_ms=`` by default).
Nothing here performs I/O.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lambdas.core.catalog import CATALOG, TRAINIUM, families
from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.service_limits import limit, training_instance_types
from training.cluster import HOMOGENEOUS_GROUP
from training.hyperparameters import (
    CODE_ARCHIVE,
    CODE_CHANNEL,
    DATA_CHANNEL,
    MODULE_NAME,
    PLATFORM_CHANNEL,
    RESUME_CHANNEL,
    SECRET_SETTINGS,
    SHA256,
    HyperparameterError,
    build,
    is_relative_path,
    platform_keys,
    to_hyperparameter_string,
)
from training.variants import USER_WORKLOAD, VARIANTS

SPEC_VERSION = 1
ROLES = ("data", "dnn")
MAX_GROUPS = 5  # SageMaker's limit on ResourceConfig.InstanceGroups
MAX_INSTANCES_PER_GROUP = 20
MAX_RUNTIME_S = 5 * 24 * 3600  # SageMaker's MaxRuntimeInSeconds limit for training jobs
# Every pattern is matched against the whole value (fullmatch: "$" would let a trailing newline through).
# Run names: SageMaker's TrainingJobName pattern, at most MAX_RUN_NAME characters in all, hyphens included
# (the job name adds a prefix of ≤ 10 and a suffix of 11: 10 + 1 + 40 + 11 = 62 ≤ 63, so no run name is
# ever cut and every job name keeps its per-execution hash).
RUN_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*")
MAX_RUN_NAME = 40
# Group names: SageMaker takes any 1–64 characters; the platform keeps them to ones a path and a log
# stream can carry.
GROUP_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
HYPERPARAMETER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# S3 bucket names (general purpose buckets): 3–63 lowercase letters, digits, dots and hyphens.
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# The bucket the example specs name (examples/*.json): a placeholder for the deployment's own.
EXAMPLES_PLACEHOLDER_BUCKET = "datasets-bucket"
# A run id: the Step Functions execution's name (results/<run id>/, checkpoints/<run id>/), restricted to
# what a SageMaker tag value, an S3 key and a job name's hash input all carry unchanged.
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,80}")
# Channels the platform adds to every job (the shutdown token's; a resuming run's checkpoints and a user
# workload's code besides); the user's share SageMaker's limit with them.
PLATFORM_CHANNELS = 1
# The names the platform's channels take: a spec's inputs may not.
RESERVED_CHANNELS = (PLATFORM_CHANNEL, RESUME_CHANNEL, CODE_CHANNEL)
# A user workload's fields (``"workload": {...}``) and the module imported when it names none; a script's.
# Each field with what it is: the validator's own lists, and the spec reference's tables (docs/generate.py).
CODE_FIELDS: Mapping[str, str] = {
    "code": "the workload's folder (relative to the spec's file), or `s3://<results bucket>/code/<sha256>/sourcedir.tar.gz` once uploaded",
    "module": "the module to import from the folder (default `workload`)",
    "requirements": "a requirements file in the folder, installed on every host (from `wheels/` alone in vpc_mode)",
    "sha256": "the archive's SHA-256 (64 hex digits), with an `s3://` code; `hetero run` fills it in",
}
SCRIPT_FIELDS: Mapping[str, str] = {
    "code": CODE_FIELDS["code"],
    "entry_point": "the script to run, a `.py` (the image's python) or `.sh` file in the folder",
    "command": "instead of `entry_point`: one line of shell run in the code folder (`torchrun --nproc_per_node 8 train.py`)",
    "requirements": CODE_FIELDS["requirements"] + "; a `requirements.txt` in the folder is installed anyway",
    "sha256": CODE_FIELDS["sha256"],
    "image": "an ECR image built on the platform's, from a repository cdk.json's `script_image_repositories` names",
    "step_time_regex": "a regex with one group, the step time in the script's log lines (default: the platform's `step_time_ms=`)",
    "step_time_unit": "`ms` (default) or `s`: the unit of the regex's group",
    "warmup_steps": "the script's first steps left out of step-time figures (default 0)",
}
DEFAULT_MODULE = "workload"
# What an entry point may be, as the toolkit runs it: a Python file with the image's python, a shell script with sh.
ENTRY_POINT_SUFFIXES = (".py", ".sh")
MAX_COMMAND = 1024
MAX_WARMUP_STEPS = 100_000
# An image in ECR (<account>.dkr.ecr.<region>.amazonaws.com/<repository>, by tag or digest): the
# execution role can pull only from repositories the deployment allows (cdk.json's script_image_repositories).
ECR_REPOSITORY = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")  # a repository's name
ECR_IMAGE = re.compile(rf"(?P<repository>\d{{12}}\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com(?:\.cn)?/{ECR_REPOSITORY.pattern})"
                       r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})")
# Where the client uploads a packed folder, below the results bucket (training/workload/code.py's PackedCode.key),
# and the archive's name.
CODE_PREFIX = "code/"
ARCHIVE_NAME = CODE_ARCHIVE
SPEC_FIELDS: Mapping[str, str] = {
    "spec_version": f"the spec's version; default and only value {SPEC_VERSION}",
    "run_name": "letters, digits and hyphens, at most 40 characters: the jobs' names start with it",
    "variant": "which image and trainer: `pytorch`, `tensorflow` or `neuron` (Trainium)",
    "workload": "what trains: a built-in (`vision`, `text`), a user's module (`{\"code\": ..., \"module\": ...}`) or an existing script "
                "(`{\"code\": ..., \"entry_point\": ...}`): the workload fields below",
    "instance_groups": "1 to 5 groups of `{name, role, instance_type, count}`, exactly one with role `dnn`; `data` groups are CPU instances",
    "distribution": "how the DNN hosts' processes start: `torchrun`, `horovod`, `mirrored` or `none` (per variant; default its first)",
    "hyperparameters": "scalar values only: the loop's settings, the workload's own, and the platform's (see Settings)",
    "inputs": "channels: `{name: {s3_uri, groups, ...}}`, at most 20; `train` goes to every data host (or the DNN group alone)",
    "max_runtime_s": "60 s to 5 days: SageMaker stops the job then; the worst-case cost bills every instance for all of it",
    "max_cost_usd": "optional: lowers the deployment's cost ceiling for this run (never raises it)",
    "resume_from": "optional: the run id of an earlier run whose checkpoints this run carries on from",
}
KNOWN_FIELDS = frozenset(SPEC_FIELDS)


@dataclass(frozen=True)
class SpecPolicy:
    """What a deployment adds to the spec's own rules; the Lambdas read it from their environment
    (``from_environment``), set from cdk.json. The default (no allow-list, no ceiling) is for checks
    without a deployment: the emulated cluster, offline validation."""

    # Buckets a channel may read from (the SageMaker role can read only these); None: any.
    input_buckets: frozenset[str] | None = None
    # Most a run may cost, every instance billed for its whole max_runtime_s; None: no ceiling.
    run_cost_ceiling_usd: float | None = None
    # Most a whole benchmark sweep may cost, its configurations' worst cases added up.
    sweep_cost_ceiling_usd: float | None = None
    # $/hour for the ceiling, on top of the fallback table (which has none for Trainium).
    prices_usd_per_hour: Mapping[str, float] = field(default_factory=dict)
    # The results bucket, where a user workload's packed code must lie (code/<sha256>/sourcedir.tar.gz):
    # set, a spec is one a deployment launches, which cannot read a local folder. None: no deployment.
    code_bucket: str | None = None
    # ECR repositories (<account>.dkr.ecr.<region>.amazonaws.com/<name>) a script-mode job's own image may
    # come from: the execution role can pull from these alone. None: any (no deployment).
    script_image_repositories: frozenset[str] | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> SpecPolicy:
        """The policy of the Lambdas' environment, or of the stack's LaunchSettings output (a direct
        launch), which names the results bucket by its artifacts location only."""
        def number(key: str) -> float | None:
            return float(environ[key]) if environ.get(key) else None

        buckets = json.loads(environ["INPUT_BUCKETS"]) if environ.get("INPUT_BUCKETS") else None
        results = environ.get("RESULTS_BUCKET") or (bucket_of(environ["OUTPUT_S3_URI"]) if environ.get("OUTPUT_S3_URI") else None)
        return cls(
            input_buckets=frozenset(buckets) if buckets is not None else None,
            run_cost_ceiling_usd=number("RUN_COST_CEILING_USD"),
            sweep_cost_ceiling_usd=number("SWEEP_COST_CEILING_USD"),
            prices_usd_per_hour=json.loads(environ.get("CEILING_PRICES", "{}")),
            code_bucket=results,
            # A deployment that names none allows none: its execution role can pull no other image.
            script_image_repositories=(frozenset(json.loads(environ["SCRIPT_IMAGE_REPOSITORIES"])) if environ.get("SCRIPT_IMAGE_REPOSITORIES")
                                       else frozenset() if results else None),
        )

    def price(self, instance_type: str) -> float | None:
        return self.prices_usd_per_hour.get(instance_type, FALLBACK_PRICES.usd_per_hour.get(instance_type))


# No deployment: any bucket, no ceiling (the emulated cluster; offline checks).
NO_POLICY = SpecPolicy()


class JobSpecError(ValueError):
    """A job spec the platform refuses; ``field`` is the JSON path of the offending value."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class GroupSpec:
    name: str
    role: str
    instance_type: str
    count: int


# How a channel reaches its hosts (InputDataConfig's InputMode and S3DataDistributionType). "pipe" streams a
# channel as a FIFO of concatenated records: no trainer here reads that, so it is refused by name.
INPUT_MODES = {"file": "File", "fastfile": "FastFile"}
DISTRIBUTIONS = {"replicated": "FullyReplicated", "sharded": "ShardedByS3Key"}


@dataclass(frozen=True)
class ChannelSpec:
    name: str
    s3_uri: str
    groups: tuple[str, ...]  # empty: every host gets the channel
    input_mode: str = "file"  # file: copied to the host before training; fastfile: streamed from S3 as read
    distribution: str = "replicated"  # replicated: every host gets every object; sharded: ~1/n of them each


@dataclass(frozen=True)
class WorkloadCode:
    """Where a user workload's code is and what to import from it. ``source``: the packed archive in S3
    (s3://<bucket>/code/<sha256>/sourcedir.tar.gz) or, before ``hetero run`` packs and uploads it, a local
    folder as the spec names it (relative to the spec file's folder)."""

    source: str
    module: str = DEFAULT_MODULE
    requirements: str = ""  # a path inside the folder; "": nothing to install
    sha256: str = ""  # of the packed archive; "" for a local folder (the client computes it when it packs)
    # Script mode: the entry point (a .py or .sh file in the folder, run with the hyperparameters as
    # --name value arguments) or a shell command run in the folder; the image to run it in ("": the
    # variant's); where its log says a step's time, and how many first steps are warm-up.
    entry_point: str = ""
    command: str = ""
    image: str = ""
    step_time_regex: str = ""  # "": the platform's own step_time_ms= lines
    step_time_unit: str = "ms"
    warmup_steps: int = 1

    @property
    def is_local(self) -> bool:
        return not self.source.startswith("s3://")

    @property
    def is_script(self) -> bool:
        return bool(self.entry_point or self.command)


@dataclass(frozen=True)
class JobSpec:
    run_name: str
    variant: str
    workload: str  # a built-in workload's name, or USER_WORKLOAD (then ``code`` says which)
    instance_groups: tuple[GroupSpec, ...]
    distribution: str
    hyperparameters: Mapping[str, str | int | float | bool]
    inputs: tuple[ChannelSpec, ...]
    max_runtime_s: int
    spec_version: int = SPEC_VERSION
    # The run id (execution name) whose checkpoints this run resumes and carries on; "" starts afresh.
    resume_from: str = ""
    # The spec's own cost ceiling (it can only lower the deployment's); None: the deployment's.
    max_cost_usd: float | None = None
    # A user workload's code; None for a built-in workload.
    code: WorkloadCode | None = None

    @property
    def is_user_workload(self) -> bool:
        """A workload module on the contract (not a built-in, not a script)."""
        return self.code is not None and not self.code.is_script

    @property
    def is_script(self) -> bool:
        return self.code is not None and self.code.is_script

    @property
    def dnn_group(self) -> GroupSpec:
        return next(group for group in self.instance_groups if group.role == "dnn")

    @property
    def data_groups(self) -> tuple[GroupSpec, ...]:
        return tuple(group for group in self.instance_groups if group.role == "data")

    @property
    def is_heterogeneous(self) -> bool:
        return len(self.instance_groups) > 1

    def group_names_for(self, channel: ChannelSpec) -> tuple[str, ...]:
        return channel.groups or tuple(group.name for group in self.instance_groups)


def role_map(spec: JobSpec) -> dict[str, str]:
    """The role map the container receives. A single-group spec runs as a classic homogeneous job
    (InstanceType/InstanceCount), whose one group SageMaker calls homogeneousCluster."""
    if not spec.is_heterogeneous:
        return {HOMOGENEOUS_GROUP: "dnn"}
    return {group.name: group.role for group in spec.instance_groups}


def is_run_name(name: str) -> bool:
    """Whether ``name`` can be a run's name (and so part of its jobs' names). Pure."""
    return len(name) <= MAX_RUN_NAME and RUN_NAME.fullmatch(name) is not None


def parse_job_spec(raw: Any) -> JobSpec:
    if not isinstance(raw, Mapping):
        raise JobSpecError("$", f"a job spec is a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - KNOWN_FIELDS)
    if unknown:
        raise JobSpecError(unknown[0], f"unknown field; a version {SPEC_VERSION} spec has {sorted(KNOWN_FIELDS)}")
    version = raw.get("spec_version", SPEC_VERSION)
    if isinstance(version, bool) or version != SPEC_VERSION:  # True == 1 in Python; not in a spec
        raise JobSpecError("spec_version", f"version {version!r} is not supported; use {SPEC_VERSION}")
    run_name = _string(raw, "run_name")
    if not is_run_name(run_name):
        raise JobSpecError("run_name", f"{run_name!r} must be 1–{MAX_RUN_NAME} letters, digits or hyphens, starting with a letter or digit")
    groups = _groups(raw.get("instance_groups"))
    resume_from = _resume_from(raw.get("resume_from", ""))
    workload, code = _workload(raw.get("workload"))
    return JobSpec(
        run_name=run_name,
        variant=_string(raw, "variant"),
        workload=workload,
        instance_groups=groups,
        # Absent: the variant's default, filled in by validate_job_spec.
        distribution=_string(raw, "distribution") if "distribution" in raw else "",
        hyperparameters=_hyperparameters(raw.get("hyperparameters", {}), script=code is not None and code.is_script),
        inputs=_inputs(raw.get("inputs", {}), groups, PLATFORM_CHANNELS + bool(resume_from) + (code is not None)),
        max_runtime_s=_max_runtime(raw.get("max_runtime_s", 3600)),
        spec_version=SPEC_VERSION,
        resume_from=resume_from,
        max_cost_usd=positive_usd(raw.get("max_cost_usd")),
        code=code,
    )


def _workload(raw: Any) -> tuple[str, WorkloadCode | None]:
    """(the workload's name, its code): a built-in's name as it is, or a user's module, USER_WORKLOAD."""
    if isinstance(raw, str) and raw == USER_WORKLOAD:
        raise JobSpecError("workload", f"{USER_WORKLOAD!r} stands for a module of your own: give "
                                       '{"code": "<folder>", "module": "workload"} instead')
    if not isinstance(raw, Mapping):
        return _string({"workload": raw}, "workload"), None
    script = is_script_workload(raw)
    fields_ = SCRIPT_FIELDS if script else CODE_FIELDS
    unknown = sorted(set(raw) - set(fields_))
    if unknown:
        if not script and unknown[0] in SCRIPT_FIELDS:
            raise JobSpecError(f"workload.{unknown[0]}", "belongs to script mode: give the script's entry_point (or command) too")
        kind = "your existing script" if script else "a workload of your own"
        nearest = difflib.get_close_matches(unknown[0], [*SCRIPT_FIELDS, *CODE_FIELDS], n=1)
        hint = f"did you mean {nearest[0]!r}? " if nearest else ""
        raise JobSpecError(f"workload.{unknown[0]}", f"unknown field; {hint}{kind} has {list(fields_)}")
    source = raw.get("code")
    if not isinstance(source, str) or not source or any(ord(character) < 32 for character in source):
        raise JobSpecError("workload.code", f"{source!r} must be the folder of your workload's code (relative to the spec's file) "
                                            f"or its packed archive s3://<bucket>/{CODE_PREFIX}<sha256>/{ARCHIVE_NAME}")
    module = raw.get("module", DEFAULT_MODULE)
    if not isinstance(module, str) or not MODULE_NAME.fullmatch(module):
        raise JobSpecError("workload.module", f"{module!r} must be a dotted Python module name inside the folder (workload, my_pkg.train)")
    requirements = raw.get("requirements", "")
    if not isinstance(requirements, str) or (requirements and not is_relative_path(requirements)):
        raise JobSpecError("workload.requirements", f"{requirements!r} must be a relative path inside the code folder (requirements.txt)")
    sha256 = raw.get("sha256", "")
    code = WorkloadCode(source, module, requirements, sha256 if isinstance(sha256, str) else "")
    if script:
        code = _script(raw, dataclasses.replace(code, module=""))
    if code.is_local:
        if "://" in source:
            raise JobSpecError("workload.code", f"{source!r}: code comes from a local folder or s3://, not another scheme")
        if "sha256" in raw:
            raise JobSpecError("workload.sha256", "is computed from the folder when `hetero run` packs it: leave it out with a local folder")
        return USER_WORKLOAD, code
    _check_s3_uri("workload.code", source)
    if not source.endswith(f"/{ARCHIVE_NAME}"):
        raise JobSpecError("workload.code", f"{source!r} must name the packed archive (.../{ARCHIVE_NAME}), as `hetero run` uploads it")
    if not isinstance(sha256, str) or not SHA256.fullmatch(sha256):
        raise JobSpecError("workload.sha256", f"{sha256!r} must be the 64 lowercase hex digits of the archive's SHA-256 "
                                              "(every host refuses another archive): required with an s3:// code")
    return USER_WORKLOAD, code


def is_script_workload(raw: Any) -> bool:
    """Whether a spec's raw ``workload`` is a script's (it names an entry point or a command). Pure."""
    return isinstance(raw, Mapping) and ("entry_point" in raw or "command" in raw)


def _script(raw: Mapping[str, Any], code: WorkloadCode) -> WorkloadCode:
    """A script-mode workload's own fields, checked (script mode: see the module's docstring)."""
    entry_point, command = raw.get("entry_point", ""), raw.get("command", "")
    if entry_point and command:
        raise JobSpecError("workload.command", "give the entry_point or a command, not both")
    if entry_point:
        if not isinstance(entry_point, str) or not is_relative_path(entry_point) or not entry_point.endswith(ENTRY_POINT_SUFFIXES):
            raise JobSpecError("workload.entry_point", f"{entry_point!r} must be a .py or .sh file inside the code folder (train.py, "
                                                       "scripts/train.py); anything else runs as a command")
    elif not isinstance(command, str) or not command.strip() or len(command) > MAX_COMMAND or any(ord(c) < 32 for c in command):
        raise JobSpecError("workload.command", f"{command!r} must be one line of shell (≤ {MAX_COMMAND} characters) run in the code "
                                               "folder, e.g. 'torchrun --nproc_per_node 8 train.py --epochs 3'")
    image = raw.get("image", "")
    if image and (not isinstance(image, str) or not ECR_IMAGE.fullmatch(image)):
        raise JobSpecError("workload.image", f"{image!r} must be an image in ECR, "
                                             "<account>.dkr.ecr.<region>.amazonaws.com/<repository>:<tag> (or @sha256:<digest>), "
                                             "built FROM the platform's image (its launcher is the entrypoint)")
    regex = raw.get("step_time_regex", "")
    if regex:
        if not isinstance(regex, str) or (problem := limit("MetricRegex").problem(regex)):
            raise JobSpecError("workload.step_time_regex", problem if isinstance(regex, str) else f"{regex!r} must be a string")
        try:
            groups = re.compile(regex).groups
        except re.error as error:
            raise JobSpecError("workload.step_time_regex", f"{regex!r} is not a regular expression: {error}") from None
        if groups != 1:
            raise JobSpecError("workload.step_time_regex", f"{regex!r} must have exactly one group, the step's time "
                                                           f"(as SageMaker's MetricDefinitions take it), not {groups}")
    unit = raw.get("step_time_unit", "ms")
    if unit not in ("ms", "s"):
        raise JobSpecError("workload.step_time_unit", f"{unit!r}: the regex's number is in ms or s")
    warmup = raw.get("warmup_steps", 1)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= MAX_WARMUP_STEPS:
        raise JobSpecError("workload.warmup_steps", f"{warmup!r} must be a whole number of first steps (0..{MAX_WARMUP_STEPS}) left "
                                                    "out of the step time: start-up and compilation")
    return dataclasses.replace(code, entry_point=entry_point, command=command if not entry_point else "", image=image,
                               step_time_regex=regex, step_time_unit=unit, warmup_steps=warmup)


def _string(raw: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not value:
        raise JobSpecError(key, f"must be a non-empty string, got {value!r}")
    return value


def _groups(raw: Any) -> tuple[GroupSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise JobSpecError("instance_groups", "must be a non-empty list of {name, role, instance_type, count}")
    if len(raw) > MAX_GROUPS:
        raise JobSpecError("instance_groups", f"{len(raw)} groups; SageMaker allows at most {MAX_GROUPS}")
    groups = []
    for index, item in enumerate(raw):
        where = f"instance_groups[{index}]"
        if not isinstance(item, Mapping):
            raise JobSpecError(where, "must be an object")
        extra = sorted(set(item) - {"name", "role", "instance_type", "count"})
        if extra:
            raise JobSpecError(f"{where}.{extra[0]}", "unknown field; a group has name, role, instance_type, count")
        name = item.get("name")
        if not isinstance(name, str) or not GROUP_NAME.fullmatch(name):
            raise JobSpecError(f"{where}.name", f"{name!r} must be 1–64 letters, digits, '_' or '-'")
        if name == HOMOGENEOUS_GROUP:
            raise JobSpecError(f"{where}.name", f"{HOMOGENEOUS_GROUP!r} is SageMaker's own group name; pick another")
        role = item.get("role")
        if role not in ROLES:
            raise JobSpecError(f"{where}.role", f"{role!r} must be one of {ROLES}")
        instance_type = item.get("instance_type")
        # The catalog's types count as known whatever botocore the runtime has (a test holds the catalog
        # within the model's enum).
        if not isinstance(instance_type, str) or instance_type not in training_instance_types() | CATALOG.keys():
            raise JobSpecError(f"{where}.instance_type", f"{instance_type!r} must be a SageMaker training instance type such as ml.c5.9xlarge")
        count = item.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_INSTANCES_PER_GROUP:
            raise JobSpecError(f"{where}.count", f"{count!r} must be an integer in 1..{MAX_INSTANCES_PER_GROUP}")
        groups.append(GroupSpec(name, role, instance_type, count))
    names = [group.name for group in groups]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate:
        raise JobSpecError("instance_groups", f"group name {duplicate!r} is used twice; names must be unique")
    dnn = [group.name for group in groups if group.role == "dnn"]
    if len(dnn) != 1:
        raise JobSpecError("instance_groups", f"exactly one group must have role 'dnn', found {len(dnn)}: {dnn}")
    return tuple(groups)


def _hyperparameters(raw: Any, script: bool = False) -> Mapping[str, str | int | float | bool]:
    """``script``: a script's own names may be any SageMaker takes (``batch-size``: argparse's --batch-size)."""
    if not isinstance(raw, Mapping):
        raise JobSpecError("hyperparameters", "must be an object of name → scalar value")
    # SageMaker's limit on HyperParameters counts the platform's settings too.
    room = limit("HyperParameters").max - len(platform_keys() - SECRET_SETTINGS)
    if len(raw) > room:
        raise JobSpecError("hyperparameters", f"{len(raw)} given; the platform's settings leave room for {room}")
    for name, value in raw.items():
        where = f"hyperparameters.{name}"
        if script and (limit("HyperParameterKey").problem(name) or not name or any(ord(c) < 32 or c.isspace() for c in name)):
            raise JobSpecError(where, "a script's hyperparameter names are 1–256 characters without spaces (--name value arguments)")
        if not script and (not HYPERPARAMETER_NAME.fullmatch(name) or limit("HyperParameterKey").problem(name)):
            raise JobSpecError(where, "names are letters, digits and '_', not starting with a digit, ≤ 256 characters")
        if value is None or not isinstance(value, str | int | float | bool):
            raise JobSpecError(where, f"{value!r} must be a string, number or boolean")
        if isinstance(value, float) and not math.isfinite(value):
            raise JobSpecError(where, f"{value!r} must be a finite number")
        if problem := limit("HyperParameterValue").problem(to_hyperparameter_string(value)):
            raise JobSpecError(where, problem)
    return MappingProxyType(dict(raw))


def _inputs(raw: Any, groups: tuple[GroupSpec, ...], platform_channels: int) -> tuple[ChannelSpec, ...]:
    if not isinstance(raw, Mapping):
        raise JobSpecError("inputs", "must be an object of channel name → {s3_uri, groups}")
    names = {group.name for group in groups}
    most = limit("InputDataConfig").max - platform_channels
    if len(raw) > most:
        raise JobSpecError("inputs", f"{len(raw)} channels; SageMaker takes at most {most} beside the platform's {platform_channels}")
    channels = []
    for name, item in raw.items():
        where = f"inputs.{name}"
        if limit("ChannelName").problem(name):
            raise JobSpecError(where, "channel names are 1–64 letters, digits, '.', '-' or '_'")
        if name in RESERVED_CHANNELS:
            raise JobSpecError(where, f"{name!r} is a channel the platform adds itself: pick another name")
        if not isinstance(item, Mapping):
            raise JobSpecError(where, "must be an object {s3_uri, groups}")
        extra = sorted(set(item) - {"s3_uri", "groups", "input_mode", "distribution"})
        if extra:
            raise JobSpecError(f"{where}.{extra[0]}", "unknown field; a channel has s3_uri, groups, input_mode and distribution")
        input_mode, distribution = item.get("input_mode", "file"), item.get("distribution", "replicated")
        for key, value in (("input_mode", input_mode), ("distribution", distribution)):
            if not isinstance(value, str):
                raise JobSpecError(f"{where}.{key}", f"must be a string, got {value!r}")
        if input_mode == "pipe":
            raise JobSpecError(f"{where}.input_mode", "pipe streams the channel as one FIFO of records, which no trainer "
                                                      "here reads: use file (copied before training) or fastfile (read from S3 as needed)")
        if input_mode not in INPUT_MODES:
            raise JobSpecError(f"{where}.input_mode", f"must be one of {sorted(INPUT_MODES)}, got {input_mode!r}")
        if distribution not in DISTRIBUTIONS:
            raise JobSpecError(f"{where}.distribution", f"must be one of {sorted(DISTRIBUTIONS)}, got {distribution!r}")
        _check_s3_uri(f"{where}.s3_uri", item.get("s3_uri"))
        if input_mode == "fastfile" and not item["s3_uri"].endswith("/"):
            # SageMaker: a FastFile prefix must not be a partial folder name.
            raise JobSpecError(f"{where}.s3_uri", "a fastfile channel's prefix must be a whole folder: end it with '/'")
        channel_groups = item.get("groups", [])
        if not isinstance(channel_groups, list) or not all(isinstance(group, str) for group in channel_groups):
            raise JobSpecError(f"{where}.groups", "must be a list of instance group names")
        if len(set(channel_groups)) != len(channel_groups):
            raise JobSpecError(f"{where}.groups", f"{channel_groups} names a group twice")
        missing = sorted(set(channel_groups) - names)
        if missing:
            raise JobSpecError(f"{where}.groups", f"{missing} are not instance groups of this spec: {sorted(names)}")
        channels.append(ChannelSpec(name, item["s3_uri"], tuple(channel_groups), input_mode, distribution))
    assigned = [channel.name for channel in channels if channel.groups]
    if assigned and len(assigned) != len(channels):
        unassigned = sorted({channel.name for channel in channels} - set(assigned))
        raise JobSpecError(
            f"inputs.{unassigned[0]}.groups",
            "SageMaker needs every channel assigned to groups, or none: give this channel its groups too",
        )
    return tuple(channels)


def _check_s3_uri(where: str, uri: Any) -> None:
    """s3://<bucket>/<prefix>, within SageMaker's S3Uri limits and with a valid bucket name."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise JobSpecError(where, f"{uri!r} must be an s3://<bucket>/<prefix> URI")
    if problem := limit("S3Uri").problem(uri):
        raise JobSpecError(where, problem)
    bucket = bucket_of(uri)
    if not BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        raise JobSpecError(where, f"{bucket!r} is not an S3 bucket name (3–63 lowercase letters, digits, '.', '-')")
    if any(ord(character) < 32 for character in uri):
        raise JobSpecError(where, "must not contain control characters")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key or prefix) of an s3:// URI."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def bucket_refusal(bucket: str, allowed: frozenset[str]) -> str:
    """Why a channel's bucket is refused, and how to find the ones this deployment allows: the stack's own
    datasets bucket and cdk.json's input_buckets are what its SageMaker role may read. The example specs'
    bucket is a placeholder a user is meant to replace, and is named as one. Pure."""
    problem = (f"bucket {bucket!r} is not one the platform's jobs may read: this deployment allows {sorted(allowed)} "
               "(its datasets bucket, the stack's DatasetsBucket output, and the buckets of cdk.json's "
               '"platform": {"input_buckets": [...]}, then `cdk deploy`)')
    if bucket == EXAMPLES_PLACEHOLDER_BUCKET:
        problem += (f"; s3://{EXAMPLES_PLACEHOLDER_BUCKET}/ is the example specs' placeholder: put your data in one of those "
                    "buckets and name it in the spec")
    return problem


def bucket_of(uri: str) -> str:
    return split_s3_uri(uri)[0]


def _resume_from(value: Any) -> str:
    if value != "" and (not isinstance(value, str) or not RUN_ID.fullmatch(value)):
        raise JobSpecError("resume_from", f"{value!r} must be the run id (execution name) of an earlier run: 1–80 letters, digits, - or _")
    return value


def positive_usd(value: Any) -> float | None:
    """A spec's or sweep's own ``max_cost_usd``, or None when it sets none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise JobSpecError("max_cost_usd", f"{value!r} must be a positive number of US dollars")
    return float(value)


def _max_runtime(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 60 <= value <= MAX_RUNTIME_S:
        raise JobSpecError("max_runtime_s", f"{value!r} must be an integer number of seconds in 60..{MAX_RUNTIME_S}")
    return value


def validate_job_spec(raw: Any, policy: SpecPolicy = NO_POLICY) -> JobSpec:
    """Parse, then apply the platform's rules and the deployment's policy; the spec a run may launch."""
    spec = parse_job_spec(raw)
    variant = VARIANTS.get(spec.variant)
    if variant is None:
        raise JobSpecError("variant", f"{spec.variant!r} is not a variant of this platform; use one of {sorted(VARIANTS)}")
    if spec.is_script:
        return _validate_script(spec, variant, policy)
    if spec.is_user_workload and not variant.user_workloads:
        takers = sorted(name for name, other in VARIANTS.items() if other.user_workloads)
        raise JobSpecError("workload", f"variant {variant.name!r} trains only its built-in workloads {list(variant.workloads)}: "
                                       f"use variant {' or '.join(map(repr, takers))}")
    if not spec.is_user_workload and spec.workload not in variant.workloads:
        raise JobSpecError("workload", f"variant {variant.name!r} trains {list(variant.workloads)}, not {spec.workload!r}")
    if not spec.distribution:
        spec = dataclasses.replace(spec, distribution=variant.distributions[0])
    if spec.distribution not in variant.distributions:
        raise JobSpecError("distribution", f"variant {variant.name!r} supports {list(variant.distributions)}, not {spec.distribution!r}")
    if spec.distribution in ("none", "mirrored") and spec.dnn_group.count > 1:
        multi_host = [name for name in variant.distributions if name not in ("none", "mirrored")]
        raise JobSpecError(
            "distribution",
            f"{spec.distribution!r} runs on one host but the dnn group has {spec.dnn_group.count} instances: use {multi_host[0]!r}",
        )
    for index, group in enumerate(spec.instance_groups):
        _check_instance_type(index, group, variant.accelerator, variant.name)
    # A user workload's preprocessing is served by the gRPC data service on any variant that trains it
    # (heterogeneous Trainium: CPU data hosts preprocess for trn1 hosts).
    if spec.data_groups and not (variant.has_data_service or (spec.is_user_workload and variant.user_workloads)):
        raise JobSpecError("instance_groups", f"variant {variant.name!r} has no data service: remove the data groups")
    _check_code(spec, policy)
    # The hyperparameters first: a channel they name (a misspelt eval_channel) is refused as theirs, not
    # read by the routing rules as an input the data groups lack.
    _check_hyperparameters(spec)
    _check_channels(spec, policy)
    _check_cost(spec, policy)
    return spec


def _validate_script(spec: JobSpec, variant: Any, policy: SpecPolicy) -> JobSpec:
    """A script-mode spec: the script starts its own processes and routes its own data, so the rules of the
    platform's trainers (a "train" channel on every data host, the variant's distributions, the loop's
    hyperparameters) do not apply; the cluster's, the code's, the image's and the cost's do."""
    if spec.distribution:
        raise JobSpecError("distribution", "a script starts its own processes: leave distribution out and run torchrun, mpirun or "
                                           "Horovod from the workload's command (the launcher runs the script once per host)")
    spec = dataclasses.replace(spec, distribution="none")
    for index, group in enumerate(spec.instance_groups):
        _check_instance_type(index, group, variant.accelerator, variant.name)
    _check_code(spec, policy)
    _check_image(spec, policy)
    reserved = sorted(set(spec.hyperparameters) & (platform_keys() | {"variant", "distribution"}))
    if reserved:
        raise JobSpecError(f"hyperparameters.{reserved[0]}", "is a setting of the platform's launcher (every host reads it): rename it")
    sagemaker = sorted(name for name in spec.hyperparameters if name.startswith("sagemaker_"))
    if sagemaker:
        raise JobSpecError(f"hyperparameters.{sagemaker[0]}", "the sagemaker_ prefix belongs to the SageMaker toolkit (the platform "
                                                              "sets sagemaker_program itself)")
    for channel in spec.inputs:
        if policy.input_buckets is not None and bucket_of(channel.s3_uri) not in policy.input_buckets:
            raise JobSpecError(f"inputs.{channel.name}.s3_uri", bucket_refusal(bucket_of(channel.s3_uri), policy.input_buckets))
    _check_cost(spec, policy)
    return spec


def _check_image(spec: JobSpec, policy: SpecPolicy) -> None:
    """A script's own image must come from a repository the deployment lets the execution role pull."""
    image = spec.code.image if spec.code else ""
    if not image or policy.script_image_repositories is None:
        return
    repository = ECR_IMAGE.fullmatch(image)["repository"]
    if repository not in policy.script_image_repositories:
        allowed = sorted(policy.script_image_repositories) or "none (cdk.json's script_image_repositories is empty)"
        raise JobSpecError("workload.image", f"{repository} is not a repository the platform's jobs may pull from: {allowed}; add "
                                             "its name to cdk.json's script_image_repositories and deploy")


def worst_case_cost_usd(spec: JobSpec, policy: SpecPolicy) -> float:
    """What the run costs if every instance is billed for the whole max_runtime_s. Raises JobSpecError
    for a type the policy has no price for: a ceiling that cannot be checked is no ceiling."""
    total = 0.0
    for index, group in enumerate(spec.instance_groups):
        price = policy.price(group.instance_type)
        if price is None:
            raise JobSpecError(f"instance_groups[{index}].instance_type",
                               f"no price known for {group.instance_type} to check the cost ceiling against: add it to "
                               "cdk.json's ceiling_prices_usd_per_hour")
        total += group.count * price
    return total * spec.max_runtime_s / 3600


def ceiling_usd(own: float | None, platform: float | None, ceiling: str = "ceiling", who: str = "a spec") -> float | None:
    """The ceiling that applies: the platform's, lowered by a spec's (or sweep's) own, which may not raise
    it; None when neither is set."""
    if own is not None and platform is not None and own > platform:
        raise JobSpecError("max_cost_usd", f"${own:,.2f} is above the platform's {ceiling} of ${platform:,.2f}; {who} can only lower it")
    ceilings = [value for value in (platform, own) if value is not None]
    return min(ceilings) if ceilings else None


def cost_ceiling_usd(spec: JobSpec, policy: SpecPolicy) -> float | None:
    return ceiling_usd(spec.max_cost_usd, policy.run_cost_ceiling_usd)


def _check_cost(spec: JobSpec, policy: SpecPolicy) -> None:
    ceiling = cost_ceiling_usd(spec, policy)
    if ceiling is None:
        return
    cost = worst_case_cost_usd(spec, policy)
    if cost > ceiling:
        cluster = " + ".join(f"{group.count}× {group.instance_type}" for group in spec.instance_groups)
        raise JobSpecError("max_runtime_s", f"{cluster} for {spec.max_runtime_s / 3600:g} h may cost ${cost:,.2f}, above the "
                                            f"ceiling of ${ceiling:,.2f}: lower max_runtime_s or the instance counts")


# What a data group is told to use instead: compute-optimised, current generations first (the fallback prices
# cover ml.c5.*). Burstable types (CPU credits) are refused for data groups.
DATA_HOST_FAMILIES = ("ml.c5.*", "ml.c6i.*", "ml.c7i.*", "ml.m6i.*")
BURSTABLE_FAMILIES = frozenset({"ml.t2", "ml.t3"})


def _check_instance_type(index: int, group: GroupSpec, accelerator: str, variant: str) -> None:
    where = f"instance_groups[{index}].instance_type"
    instance = CATALOG.get(group.instance_type)
    if instance is None:
        raise JobSpecError(where, f"{group.instance_type!r} is not in the platform's catalog (lambdas/core/catalog.py); its families: "
                                  f"{', '.join(families())}")
    if instance.is_arm64:
        raise JobSpecError(where, f"{group.instance_type} has Arm (Grace) host CPUs; the platform's images are built for x86_64 "
                                  "and would not start there: use an x86_64 type (ml.p5.*, ml.p6-b200.*, ...)")
    if group.role == "data" and instance.family in BURSTABLE_FAMILIES:
        raise JobSpecError(where, f"{group.instance_type} is burstable: its CPU credits run out under a data host's steady load "
                                  f"and it slows to a fraction of its vCPUs; use a compute type "
                                  f"({', '.join(DATA_HOST_FAMILIES)}, ...)")
    if group.role == "data" and not instance.is_cpu_only:
        raise JobSpecError(where, f"data group on {group.instance_type} would pay for idle accelerators: use a CPU type "
                                  f"({', '.join(DATA_HOST_FAMILIES)}, ...)")
    if group.role == "dnn" and instance.is_trainium and accelerator != "trainium":
        raise JobSpecError(where, f"{group.instance_type} is a Trainium instance: it needs variant 'neuron', not {variant!r}")
    if group.role == "dnn" and accelerator == "trainium" and not instance.is_trainium:
        raise JobSpecError(where, f"variant {variant!r} trains on Trainium: use an instance type of "
                                  f"{', '.join(f'{family}.*' for family in families(TRAINIUM))}")


def code_key(sha256: str) -> str:
    """The key of a packed folder below the results bucket, named by its SHA-256 (PackedCode.key). Pure."""
    return f"{CODE_PREFIX}{sha256}/{ARCHIVE_NAME}"


def _check_code(spec: JobSpec, policy: SpecPolicy) -> None:
    """With a deployment, a user workload's code is its packed archive in the platform's results bucket
    under code/<its sha256>/: the state machine cannot read the user's disk, and a job's role reads code
    nowhere else (the input-bucket allow-list is for data, not code)."""
    if spec.code is None or policy.code_bucket is None:
        return
    if spec.code.is_local:
        raise JobSpecError("workload.code", "a local folder: start the run with `hetero run`, which uploads it")
    expected = f"s3://{policy.code_bucket}/{code_key(spec.code.sha256)}"
    if spec.code.source != expected:
        raise JobSpecError("workload.code", f"{spec.code.source!r}: a job reads code only from its platform's results bucket, under "
                                            f"code/<the archive's sha256>/: {expected} (`hetero run` uploads a folder there)")


def eval_channel_of(spec: JobSpec) -> str:
    """The channel a PyTorch workload (built-in or a user's) validates on, on the DNN group: its
    eval_channel hyperparameter, "" when none or for the tensorflow variant's workload. Pure."""
    if not VARIANTS[spec.variant].user_workloads:
        return ""
    return str(spec.hyperparameters.get("eval_channel", ""))


def _check_channels(spec: JobSpec, policy: SpecPolicy) -> None:
    if DATA_CHANNEL not in {channel.name for channel in spec.inputs}:
        raise JobSpecError("inputs", f"the job trains from a {DATA_CHANNEL!r} channel: add {{\"{DATA_CHANNEL}\": {{\"s3_uri\": \"s3://...\"}}}}")
    data_groups = {group.name for group in spec.data_groups}
    # A PyTorch workload validates on the DNN group: its eval channel goes there, data groups need not read it.
    evaluated = eval_channel_of(spec)
    if evaluated == DATA_CHANNEL:
        # Routing the training channel to the DNN group for validation would leave the data groups
        # without it, and a score on the samples it trained on says nothing of held-out ones.
        raise JobSpecError("hyperparameters.eval_channel", f"{DATA_CHANNEL!r} is the channel the job trains on: validate on "
                                                           "held-out samples in a channel of their own")
    for channel in spec.inputs:
        if policy.input_buckets is not None and bucket_of(channel.s3_uri) not in policy.input_buckets:
            raise JobSpecError(f"inputs.{channel.name}.s3_uri", bucket_refusal(bucket_of(channel.s3_uri), policy.input_buckets))
        if channel.name == evaluated:
            if spec.dnn_group.name not in spec.group_names_for(channel):
                raise JobSpecError(f"inputs.{channel.name}.groups", f"the workload validates on this channel (eval_channel) on the dnn "
                                                                    f"group {spec.dnn_group.name!r}: add it")
            continue
        missing = sorted(data_groups - set(spec.group_names_for(channel)))
        if missing:
            raise JobSpecError(f"inputs.{channel.name}.groups", f"data groups {missing} preprocess this channel: add them")
        if not data_groups and spec.dnn_group.name not in spec.group_names_for(channel):
            raise JobSpecError(f"inputs.{channel.name}.groups", f"without data groups the dnn group {spec.dnn_group.name!r} reads it: add it")
        if channel.distribution == "sharded":
            _check_sharded(spec, channel)


def _check_sharded(spec: JobSpec, channel: ChannelSpec) -> None:
    """A sharded channel gives each host ~1/n of the objects: only a reader that serves what it has can
    take one. The gRPC data hosts can (each serves its shard); the DNN group's ranks cannot (every
    trainer splits the whole channel among its ranks, and the text trainer tokenises it once per node),
    and tf.data.service's workers cannot (the dispatcher hands every worker names from its own listing)."""
    where = f"inputs.{channel.name}.distribution"
    if spec.dnn_group.name in spec.group_names_for(channel):
        raise JobSpecError(where, f"the dnn group {spec.dnn_group.name!r} reads this channel, and its ranks split the whole "
                                  "channel among themselves: use replicated, or let only data groups read it sharded")
    if len({group.instance_type for group in spec.data_groups}) > 1:
        raise JobSpecError(where, "the trainers take batches as they arrive, so a faster data host's shard would be seen "
                                  "more often all run long: shard only across data groups of one instance type, or use replicated")
    if VARIANTS[spec.variant].data_service != "grpc":
        raise JobSpecError(where, "tf.data.service hands every data host file names from one listing, so each must hold "
                                  "every file: use replicated (each file is still read once per epoch across hosts)")


def trainer_config(spec: JobSpec, strict: bool = False) -> Any:
    """The trainer's settings as the trainer itself reads this spec's hyperparameters (its config
    dataclass; defaults for what the spec leaves out). For a user workload, the platform loop's settings
    (the variant's workload_config) from its keys alone: the others are the module's own. Raises HyperparameterError."""
    raw = {name: to_hyperparameter_string(value) for name, value in spec.hyperparameters.items()}
    if spec.is_user_workload:
        config = VARIANTS[spec.variant].workload_config
        loop = {item.name for item in dataclasses.fields(config)}
        return build(config, {name: value for name, value in raw.items() if name in loop})
    return build(VARIANTS[spec.variant].config, raw, strict=strict)


def _check_hyperparameters(spec: JobSpec) -> None:
    reserved = sorted(set(spec.hyperparameters) & (platform_keys() | {"variant", "distribution"}))
    if reserved:
        raise JobSpecError(f"hyperparameters.{reserved[0]}", "is set by the platform; use the spec's own fields instead")
    sagemaker = sorted(name for name in spec.hyperparameters if name.startswith("sagemaker_"))
    if sagemaker:
        raise JobSpecError(f"hyperparameters.{sagemaker[0]}", "the sagemaker_ prefix belongs to the SageMaker toolkit")
    try:
        trainer = trainer_config(spec, strict=True)
    except HyperparameterError as error:
        raise JobSpecError("hyperparameters", str(error)) from None
    # Channels the trainer reads by name must be inputs of this job (the text trainer's; its one group
    # receives every channel).
    channels = sorted(channel.name for channel in spec.inputs)
    for setting in ("model_channel", "eval_channel"):
        name = getattr(trainer, setting, "")
        if name and name not in channels:
            raise JobSpecError(f"hyperparameters.{setting}", f"{name!r} is not a channel of this job's inputs {channels}")
    _check_trainer_settings(spec, trainer)


def _check_trainer_settings(spec: JobSpec, trainer: Any) -> None:
    """Settings a host would refuse only after the instances were billed, or that would quietly do harm."""
    trainium = VARIANTS[spec.variant].accelerator == "trainium"
    if getattr(trainer, "precompile_steps", 0) and not trainium:
        raise JobSpecError("hyperparameters.precompile_steps", "pre-compiles the Neuron graphs of a Trainium job (neuron_parallel_compile): "
                                                               f"variant {spec.variant!r} has none to compile; leave it out")
    if trainium and getattr(trainer, "precision", "") == "fp16":
        raise JobSpecError("hyperparameters.precision", "Trainium computes in bf16 (or fp32), and PyTorch/XLA has no fp16 loss scaling "
                                                        "there: use bf16 or auto")
