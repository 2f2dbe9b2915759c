"""A validated job spec → the CreateTrainingJob request that runs it. Pure: no AWS call, no clock, no
randomness (the job name comes in as an argument).

What the request carries, and why:

* ResourceConfig.InstanceGroups for a heterogeneous spec; InstanceType/InstanceCount for a single group
  (SageMaker refuses both together), which SageMaker then reports as group ``homogeneousCluster``;
* InputDataConfig with S3DataSource.InstanceGroupNames, so a channel lands only on the groups that read it,
  plus the platform channel on every host: the job's shutdown token as a file, which the launcher wrote
  to S3 (control/<job name>/) and only the job's role reads. The token is in no field of the request, so
  it never shows in DescribeTrainingJob, the execution's history or a log;
* for a script (script mode), the same code channel, the entry point or command among the platform
  settings and as the toolkit's ``sagemaker_program``, the user's own image when the spec names one,
  the script's step-time regex as its MetricDefinition, and launcher ports away from the ones scripts use;
* for a user workload, its packed code as the ``code`` channel on every host (as SageMaker's script mode
  ships a source_dir: data hosts import the module too), the one archive object exactly, with the module,
  its SHA-256 (every host refuses another archive) and its requirements file among the platform settings;
* the container contract as HyperParameters: the user's trainer settings plus the platform settings
  (role map, ports, timeouts), built by training/hyperparameters.py, the module the container parses
  them with;
* MetricDefinitions from training/metrics.py, the module the trainer prints them with (with at least one
  definition SageMaker keeps the metrics' time series: EnableSageMakerMetricsTimeSeries would add nothing);
* OutputDataConfig's compression stated, not left to SageMaker's default: the results are read back from
  output.tar.gz as gzip (lambdas/core/results.py);
* CheckpointConfig per run (checkpoints/<run id>/); ``resume_from`` adds a resume channel of the earlier
  run's checkpoints on the DNN hosts, which seed this run's own (training/dnn_host.py), a
  stopping condition, tags, and in VPC mode the VpcConfig (infra/constructs/training_network.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lambdas.core.catalog import CATALOG
from lambdas.core.job_spec import DISTRIBUTIONS, INPUT_MODES, JobSpec, role_map
from lambdas.core.service_limits import limit
from training.hyperparameters import CODE_CHANNEL, PLATFORM_CHANNEL, RESUME_CHANNEL, PlatformSettings, to_hyperparameter_string
from training.metrics import METRIC_DEFINITIONS

CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
# Session tags a state-machine launch puts on its own session (it assumes the job launcher role with them)
# and SageMaker chains into the job's session of the execution role (SessionChainingConfig, "ABAC for
# multi-tenancy training" in SageMaker's guide). The role's statements name the job's prefixes through
# ${aws:PrincipalTag/<key>} (infra/constructs/execution_role.py): a job reaches its own run's checkpoints,
# its own token and its own artifacts, and reads only the checkpoints of the run it resumes.
RUN_KEY_TAG = "run_key"  # checkpoints/<run id>/
CONTROL_KEY_TAG = "control_key"  # control/<key>/: the job's shutdown token
JOB_KEY_TAG = "job_key"  # artifacts/<job name>/: what SageMaker uploads
RESUME_KEY_TAG = "resume_key"  # checkpoints/<resumed run id>/, read only (the run's own when it resumes none)
SESSION_TAG_KEYS = (RUN_KEY_TAG, CONTROL_KEY_TAG, JOB_KEY_TAG, RESUME_KEY_TAG)
# A job launched without the state machine (hetero/direct.py) keeps its checkpoints, token and artifacts
# under this (checkpoints/direct.runs/<run id>/, ...), and its untagged session reaches only that: never a
# state-machine run's prefix, whose run id (an execution name: letters, digits, '-', '_') cannot be it.
DIRECT_RUNS = "direct.runs"


class RequestError(ValueError):
    """The platform's settings cannot make a valid request for this spec."""


@dataclass(frozen=True)
class LaunchSettings:
    """What the deployed platform supplies to every launch (the launch Lambda's environment)."""

    image_uris: Mapping[str, str]  # variant → training image URI in ECR
    role_arn: str  # the SageMaker execution role
    output_s3_uri: str  # s3://<results bucket>/artifacts/ (model.tar.gz, output.tar.gz)
    checkpoint_s3_uri: str  # s3://<results bucket>/checkpoints/
    control_s3_uri: str = ""  # s3://<results bucket>/control/: each job's shutdown token, under its name
    tags: Mapping[str, str] = field(default_factory=dict)
    volume_size_gb: int = 100
    data_service_port: int = 6000
    master_port: int = 29500
    data_idle_timeout_s: float = 120.0
    data_start_deadline_s: float = 900.0
    data_connect_timeout_s: float = 300.0
    # Encrypts traffic between the job's hosts (the batches and the shutdown token travel on it).
    inter_container_encryption: bool = True
    # s3://<results bucket>/neuron-cache/: compiled Neuron graphs persist there between jobs.
    neuron_cache_s3_uri: str = ""
    # VPC mode: {"SecurityGroupIds": [...], "Subnets": [...]} for every job; None: SageMaker's network.
    vpc_config: Mapping[str, Any] | None = None


def settings_from_environment(environ: Mapping[str, str]) -> LaunchSettings:
    """The launch settings from the launch function's environment, which the stack also exports (its
    LaunchSettings output) for launches without the state machine (hetero/direct.py)."""
    return LaunchSettings(
        image_uris=json.loads(environ["IMAGE_URIS"]),
        role_arn=environ["SAGEMAKER_ROLE_ARN"],
        output_s3_uri=environ["OUTPUT_S3_URI"],
        checkpoint_s3_uri=environ["CHECKPOINT_S3_URI"],
        control_s3_uri=environ["CONTROL_S3_URI"],
        tags=json.loads(environ.get("JOB_TAGS", "{}")),
        neuron_cache_s3_uri=environ.get("NEURON_CACHE_S3_URI", ""),
        vpc_config=json.loads(environ["VPC_CONFIG"]) if environ.get("VPC_CONFIG") else None,
    )


def job_name(prefix: str, run_name: str, suffix: str) -> str:
    """``<platform prefix>-<run name>-<suffix>``, unique per execution. The prefix lets IAM scope the
    platform's SageMaker permissions to its own jobs; run names are ≤ 40 characters, leaving room. The
    name is never cut: a cut suffix (the execution's hash) would let two executions share one job."""
    name = f"{prefix}-{run_name}-{suffix}"
    if problem := limit("TrainingJobName").problem(name):
        raise RequestError(f"{name!r} is not a valid training job name: {problem}")
    return name


def platform_settings(spec: JobSpec, **settings: Any) -> PlatformSettings:
    """The platform half of the container contract for a spec; ``settings`` are ports and timeouts. A user
    workload's module, archive hash and requirements file tell every host's launcher what to unpack,
    install and import (and so to run the workload trainer)."""
    return PlatformSettings(role_map=role_map(spec), variant=spec.variant, distribution=spec.distribution, **_workload_settings(spec),
                            **settings)


def _workload_settings(spec: JobSpec) -> dict[str, Any]:
    """PlatformSettings' workload fields for a user workload or a script (none for a built-in). Raises
    RequestError for code still in a local folder: only its uploaded archive can reach a job."""
    if spec.code is None:
        return {}
    if spec.code.is_local:
        raise RequestError(f"the workload's code {spec.code.source!r} is a local folder: `hetero run` packs and uploads it first")
    code = {"workload_sha256": spec.code.sha256, "workload_requirements": spec.code.requirements}
    if spec.is_script:
        return code | {"script_entry_point": spec.code.entry_point, "script_command": spec.code.command,
                       "script_step_time_regex": spec.code.step_time_regex, "script_step_time_unit": spec.code.step_time_unit,
                       "script_warmup_steps": spec.code.warmup_steps}
    return code | {"workload_module": spec.code.module}


# The platform images' entrypoint (training/images/Dockerfile), which a script's own image runs too.
LAUNCHER_ENTRYPOINT = ("python", "-m", "training.launcher")
# A script's own servers may take the ports the platform's launcher listens on for other jobs (a public
# heterogeneous sample's tf.data.service dispatcher is on 6000): a script job's launchers listen here.
SCRIPT_CONTROL_PORTS = {"data_service_port": 29600, "job_control_port": 29601}


def container_hyperparameters(spec: JobSpec, platform: PlatformSettings) -> dict[str, str]:
    """SageMaker's HyperParameters: the user's trainer settings (a script's own) and the platform's, as
    strings; a script's entry point also as the toolkit's ``sagemaker_program``, which it reads."""
    if spec.is_script:
        # As the SageMaker SDK writes a script's hyperparameters: JSON, which the toolkit decodes, so that
        # the string "true" reaches the script as true, not as the boolean True ("--flag True").
        user = {key: json.dumps(value) for key, value in spec.hyperparameters.items()}
        if spec.is_heterogeneous:
            # The trainer group is the one group SageMaker lets a job name for distribution (the SDK's
            # distribution={"instance_groups": [...]}): the toolkit's master (MASTER_ADDR) is its first host.
            user["sagemaker_distribution_instance_groups"] = json.dumps([spec.dnn_group.name])
    else:
        user = {key: to_hyperparameter_string(value) for key, value in spec.hyperparameters.items()}
    toolkit = {"sagemaker_program": json.dumps(platform.script_entry_point)} if platform.script_entry_point else {}
    return user | toolkit | platform.to_hyperparameters()


def metric_definitions(spec: JobSpec) -> list[dict[str, str]]:
    """The job's MetricDefinitions: the platform's line format, or for a script with a regex of its own,
    that regex as the step-time metric (step_time_ms, or step_time_s when its number is in seconds)."""
    definitions = dict(METRIC_DEFINITIONS)
    if spec.is_script and spec.code.step_time_regex:
        del definitions["step_time_ms"]
        definitions[f"step_time_{spec.code.step_time_unit}"] = spec.code.step_time_regex
    return [{"Name": metric, "Regex": regex} for metric, regex in definitions.items()]


def token_uri(settings: LaunchSettings, key: str) -> str:
    """The S3 prefix of a job's platform channel (control/<key>/, the key its job's name or, for a direct
    launch, its run's id): its shutdown token lies there."""
    if not settings.control_s3_uri:
        raise RequestError("no control location is configured for the jobs' shutdown tokens")
    return f"{settings.control_s3_uri.rstrip('/')}/{key}/"


def job_session_tags(spec: JobSpec, *, name: str, run_id: str, control_key: str | None = None) -> dict[str, str]:
    """The session tags of job ``name`` of run ``run_id`` (see SESSION_TAG_KEYS), the keys of its own
    S3 prefixes. Pure."""
    return {RUN_KEY_TAG: run_id, CONTROL_KEY_TAG: control_key or name, JOB_KEY_TAG: name, RESUME_KEY_TAG: spec.resume_from or run_id}


def create_training_job_request(spec: JobSpec, settings: LaunchSettings, *, name: str, run_id: str, control_key: str | None = None,
                                chain_session_tags: bool = False) -> dict[str, Any]:
    """The request for job ``name`` of run ``run_id``. Its shutdown token lies under control/<control_key>/,
    by default the job's name; a launch that learns the job's name only as it is sent (the SageMaker
    SDK's ModelTrainer names jobs <base>-<time>: hetero/sdk.py) keys it by the run instead.
    ``chain_session_tags``: the caller's session carries job_session_tags, which the job's session of the
    execution role inherits (a state-machine launch)."""
    try:
        image = (spec.code.image if spec.is_script else "") or settings.image_uris[spec.variant]
    except KeyError:
        raise RequestError(f"no training image is deployed for variant {spec.variant!r}") from None
    ports = SCRIPT_CONTROL_PORTS if spec.is_script else {"data_service_port": settings.data_service_port}
    platform = platform_settings(
        spec,
        **ports,
        master_port=settings.master_port,
        data_idle_timeout_s=settings.data_idle_timeout_s,
        data_start_deadline_s=settings.data_start_deadline_s,
        data_connect_timeout_s=settings.data_connect_timeout_s,
        **_neuron_settings(spec, settings),
    )
    specification: dict[str, Any] = {"TrainingImage": image, "TrainingInputMode": "File", "MetricDefinitions": metric_definitions(spec)}
    if spec.is_script and spec.code.image:
        # A user's image: its entrypoint may be its own (a DLC's toolkit, which would leave no guarantee):
        # the launcher is the job's, and an image without it fails at once instead of billing unguarded.
        specification["ContainerEntrypoint"] = list(LAUNCHER_ENTRYPOINT)
    request = {
        "TrainingJobName": name,
        "AlgorithmSpecification": specification,
        "HyperParameters": container_hyperparameters(spec, platform),
        "RoleArn": settings.role_arn,
        "InputDataConfig": [
            *(_channel(spec, channel) for channel in spec.inputs),
            _platform_channel(spec, PLATFORM_CHANNEL, token_uri(settings, control_key or name), spec.instance_groups),
            # Channel routing is all-or-none: the code, like the token, goes to every group (each imports the module).
            *([_platform_channel(spec, CODE_CHANNEL, spec.code.source, spec.instance_groups)] if spec.code else []),
            *([_platform_channel(spec, RESUME_CHANNEL, checkpoint_uri(settings, spec.resume_from), [spec.dnn_group])] if spec.resume_from else []),
        ],
        "OutputDataConfig": {"S3OutputPath": settings.output_s3_uri, "CompressionType": "GZIP"},
        "ResourceConfig": _resources(spec, settings.volume_size_gb),
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_runtime_s},
        "CheckpointConfig": {"S3Uri": checkpoint_uri(settings, run_id), "LocalPath": CHECKPOINT_LOCAL_PATH},
        "EnableInterContainerTrafficEncryption": settings.inter_container_encryption,
        "Tags": [{"Key": key, "Value": value} for key, value in ({"run_name": spec.run_name} | dict(settings.tags)).items()],
    }
    if chain_session_tags:
        request["SessionChainingConfig"] = {"EnableSessionTagChaining": True}
    if settings.vpc_config:
        request["VpcConfig"] = {"SecurityGroupIds": list(settings.vpc_config["SecurityGroupIds"]), "Subnets": list(settings.vpc_config["Subnets"])}
    return request


def checkpoint_uri(settings: LaunchSettings, run_id: str) -> str:
    """Checkpoints are the run's own (checkpoints/<run id>/): two runs of one spec never share them, so a
    weekly sweep does not resume last week's final step and train nothing; a resuming run reads the
    earlier run's through its resume channel and writes only its own."""
    return f"{settings.checkpoint_s3_uri.rstrip('/')}/{run_id}/"


def _neuron_settings(spec: JobSpec, settings: LaunchSettings) -> dict[str, Any]:
    """On Trainium: one trainer process per NeuronCore of the instance, and the shared compile cache."""
    instance = CATALOG[spec.dnn_group.instance_type]
    if not instance.is_trainium:
        return {}
    return {"processes_per_host": instance.neuron_cores, "neuron_compile_cache_uri": settings.neuron_cache_s3_uri}


def _resources(spec: JobSpec, volume_size_gb: int) -> dict[str, Any]:
    if not spec.is_heterogeneous:
        group = spec.dnn_group
        return {"InstanceType": group.instance_type, "InstanceCount": group.count, "VolumeSizeInGB": volume_size_gb}
    return {
        "InstanceGroups": [
            {"InstanceGroupName": group.name, "InstanceType": group.instance_type, "InstanceCount": group.count}
            for group in spec.instance_groups
        ],
        "VolumeSizeInGB": volume_size_gb,
    }


def _routed(spec: JobSpec) -> bool:
    """Whether the request assigns channels to groups: SageMaker takes all channels assigned, or none. A
    resuming run's checkpoints go to the DNN group alone, so then every channel is assigned (one the spec
    leaves unassigned, to every group)."""
    return spec.is_heterogeneous and (bool(spec.resume_from) or any(channel.groups for channel in spec.inputs))


def _platform_channel(spec: JobSpec, name: str, uri: str, groups: Any) -> dict[str, Any]:
    """A channel the platform adds, for ``groups`` (every host when no channel is routed)."""
    return _s3_channel(spec, name, uri, [group.name for group in groups])


def _channel(spec: JobSpec, channel: Any) -> dict[str, Any]:
    return _s3_channel(spec, channel.name, channel.s3_uri, list(spec.group_names_for(channel)),
                       INPUT_MODES[channel.input_mode], DISTRIBUTIONS[channel.distribution])


def _s3_channel(spec: JobSpec, name: str, uri: str, group_names: list[str], input_mode: str = "File",
                distribution: str = "FullyReplicated") -> dict[str, Any]:
    """One InputDataConfig entry: its hosts get the whole prefix (FullyReplicated) or ~1/n of its objects
    each (ShardedByS3Key), copied before training (File) or read from S3 as needed (FastFile)."""
    source: dict[str, Any] = {"S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": distribution}
    if _routed(spec):
        source["InstanceGroupNames"] = group_names
    return {"ChannelName": name, "DataSource": {"S3DataSource": source}, "InputMode": input_mode}
