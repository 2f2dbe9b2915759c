"""The SageMaker Python SDK's way to one job: the platform's CreateTrainingJob request expressed as a
`sagemaker-train` ModelTrainer (SDK v3: Compute with instance groups, channels with their instance group
names, the platform's image and role, its container contract as hyperparameters), and sent only if what
the SDK sends *is* that request. hetero/direct.py uses it when the SDK is installed:

    pip install -e '.[sdk]'     # in the repository: requirements/sdk.txt, sagemaker-train and the client

The proof, on every launch: a handler on the botocore events of the client the SDK sends with
(``before-parameter-build.sagemaker.CreateTrainingJob``, after which only botocore's own generic
handlers and its serialization run) sees the SDK's request once the SDK has built it and before it leaves, compares it field by field with the builder's request for the job name the
SDK chose (lambdas/core/training_request.py), and stops the call (RequestMismatch, nothing sent) on any
difference. hetero/direct.py then sends the builder's request itself and says why.

What ModelTrainer does not express, and how the two meet (found by comparing the captured requests of
the example specs: tests/sdk/):

* the job's exact name: ModelTrainer names it ``<base_job_name>-<YYYYmmddHHMMSS>``; so the builder keys
  the job's shutdown token by the run (``control_key``), which is known before the name;
* ``AlgorithmSpecification.EnableSageMakerMetricsTimeSeries``: ModelTrainer builds its
  AlgorithmSpecification without it (sagemaker-core's shape has the field; ModelTrainer has no way to it). The builder leaves it out: SageMaker keeps the time series of any job with
  MetricDefinitions (CreateTrainingJob's documentation), and every request of the platform has them;
* its role check: ModelTrainer simulates the role (iam:SimulatePrincipalPolicy) against the SDK's generic
  training policy (EC2 network interfaces and PutMetricData on ``*``, ...) and refuses a role without
  them. The platform's role is least-privilege (EC2 only in VPC mode) and is the stack's own, so the
  check is turned off for the trainer's construction (SAGEMAKER_VALIDATE_ROLE, the SDK's own switch);
* the per-group settings of a distribution (``distributed=Torchrun(...)`` is the job's, every host): the
  platform does not use it: its launcher reads the role map and distribution from the hyperparameters
  and starts the trainers on the DNN group alone. Channel routing (all channels assigned to groups, or
  none) is expressed as it is: each channel with its instance group names, or none;
* a user workload's code: the builder's ``code`` channel (the packed folder hetero/api.py uploaded, on
  every group) is passed as one of the channels, not as ModelTrainer's ``source_code``, which would pack
  and upload the folder itself and add its own driver channel and entry point: the request would not be
  the builder's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# The most specific event before botocore validates and serializes a request (only its own generic
# handlers come after): the parameters as they will leave.
CHECKED = "before-parameter-build.sagemaker.CreateTrainingJob"
CREATED = "after-call.sagemaker.CreateTrainingJob"
# The SDK's job names: <base_job_name>-<14 digits of local time>, cut at SageMaker's 63 characters.
NAME_PATTERN_DIGITS = 14
MAX_NAME = 63


class RequestMismatch(RuntimeError):
    """The SDK would have sent another request than the builder's: nothing was sent. Its message names the
    fields only: it is raised inside ModelTrainer.train, whose telemetry reports the failure's text to
    the SDK's endpoint; the values are in ``differences``."""

    def __init__(self, differences: list[str]) -> None:
        fields = sorted({line.split(":", 1)[0] for line in differences})
        super().__init__(f"the SDK's request differs in {', '.join(fields)}")
        self.differences = differences


class SdkRefused(RuntimeError):
    """The SDK refused the request (a field it cannot take) or failed before sending it: nothing was sent."""


class NameInUse(RuntimeError):
    """SageMaker answered ResourceInUse: a job of the name the SDK chose exists (``name``)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"ResourceInUse: {message}")
        self.name = name


class _Captured(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__("captured")
        self.params = params


def available() -> bool:
    """Whether `sagemaker-train` is installed in this environment and imports."""
    try:
        if importlib.util.find_spec("sagemaker.train") is None:
            return False
        import sagemaker.core.resources  # noqa: F401 - what send() needs, imported now rather than mid-launch
        import sagemaker.train  # noqa: F401
    except Exception:  # no `sagemaker` package, or one that does not import
        return False
    return True


def sdk_version() -> str:
    from importlib.metadata import version

    return f"sagemaker-train {version('sagemaker-train')}"


def differences(expected: Any, sent: Any, where: str = "") -> list[str]:
    """Each field where ``sent`` differs from ``expected``, by its path (``a.b[2].c``). Pure."""
    if isinstance(expected, Mapping) and isinstance(sent, Mapping):
        found = []
        for key in sorted(set(expected) | set(sent)):
            path = f"{where}.{key}" if where else str(key)
            if key not in sent:
                found.append(f"{path}: not sent (the builder's: {expected[key]!r})")
            elif key not in expected:
                found.append(f"{path}: sent {sent[key]!r}, not in the builder's request")
            else:
                found += differences(expected[key], sent[key], path)
        return found
    if isinstance(expected, list) and isinstance(sent, list):
        if len(expected) != len(sent):
            return [f"{where}: {len(sent)} items sent, the builder's has {len(expected)}"]
        return [line for index, (a, b) in enumerate(zip(expected, sent, strict=True)) for line in differences(a, b, f"{where}[{index}]")]
    if expected != sent or type(expected) is not type(sent):
        return [f"{where}: sent {sent!r}, the builder's is {expected!r}"]
    return []


_ROLE_SWITCH = threading.Lock()


@contextlib.contextmanager
def _role_check_off() -> Iterator[None]:
    """The SDK's switch for its role check (an environment variable, so process-wide: one trainer is built
    under it at a time), off for the trainer's construction only (see the module's docstring); the
    variable's earlier value comes back after."""
    with _ROLE_SWITCH:
        before = os.environ.get("SAGEMAKER_VALIDATE_ROLE")
        os.environ["SAGEMAKER_VALIDATE_ROLE"] = "false"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("SAGEMAKER_VALIDATE_ROLE", None)
            else:
                os.environ["SAGEMAKER_VALIDATE_ROLE"] = before


def model_trainer(request: Mapping[str, Any], boto_session: Any, base_job_name: str) -> Any:
    """A ModelTrainer that sends ``request`` (but for its name: <base_job_name>-<time>)."""
    from sagemaker.core.helper.session_helper import Session
    from sagemaker.core.training.configs import (
        CheckpointConfig,
        Compute,
        InstanceGroup,
        MetricDefinition,
        Networking,
        OutputDataConfig,
        StoppingCondition,
        Tag,
    )
    from sagemaker.train import ModelTrainer

    algorithm, resources = request["AlgorithmSpecification"], request["ResourceConfig"]
    if "InstanceGroups" in resources:
        compute = Compute(instance_groups=[InstanceGroup(instance_group_name=group["InstanceGroupName"], instance_type=group["InstanceType"],
                                                         instance_count=group["InstanceCount"]) for group in resources["InstanceGroups"]],
                          volume_size_in_gb=resources["VolumeSizeInGB"])
    else:
        compute = Compute(instance_type=resources["InstanceType"], instance_count=resources["InstanceCount"],
                          volume_size_in_gb=resources["VolumeSizeInGB"])
    vpc = request.get("VpcConfig") or {}
    with _role_check_off():
        trainer = ModelTrainer(
            sagemaker_session=Session(boto_session=boto_session),
            role=request["RoleArn"],
            base_job_name=base_job_name,
            training_image=algorithm["TrainingImage"],
            training_input_mode=algorithm["TrainingInputMode"],
            compute=compute,
            networking=Networking(enable_inter_container_traffic_encryption=request["EnableInterContainerTrafficEncryption"],
                                  **({"security_group_ids": vpc["SecurityGroupIds"], "subnets": vpc["Subnets"]} if vpc else {})),
            stopping_condition=StoppingCondition(max_runtime_in_seconds=request["StoppingCondition"]["MaxRuntimeInSeconds"]),
            output_data_config=OutputDataConfig(s3_output_path=request["OutputDataConfig"]["S3OutputPath"],
                                                compression_type=request["OutputDataConfig"]["CompressionType"]),
            checkpoint_config=CheckpointConfig(s3_uri=request["CheckpointConfig"]["S3Uri"], local_path=request["CheckpointConfig"]["LocalPath"]),
            hyperparameters=dict(request["HyperParameters"]),
            tags=[Tag(key=tag["Key"], value=tag["Value"]) for tag in request["Tags"]],
            input_data_config=channels(request),
        )
    return trainer.with_metric_definitions([MetricDefinition(name=metric["Name"], regex=metric["Regex"])
                                            for metric in algorithm["MetricDefinitions"]])


def channels(request: Mapping[str, Any]) -> list[Any]:
    """The request's InputDataConfig as the SDK's channels: each with its input mode, distribution and
    instance group names (ModelTrainer's InputData takes neither an input mode nor a group)."""
    from sagemaker.core.training.configs import Channel, DataSource, S3DataSource

    made = []
    for channel in request["InputDataConfig"]:
        source = channel["DataSource"]["S3DataSource"]
        groups = {"instance_group_names": list(source["InstanceGroupNames"])} if "InstanceGroupNames" in source else {}
        made.append(Channel(channel_name=channel["ChannelName"], input_mode=channel["InputMode"], data_source=DataSource(
            s3_data_source=S3DataSource(s3_data_type=source["S3DataType"], s3_uri=source["S3Uri"],
                                        s3_data_distribution_type=source["S3DataDistributionType"], **groups))))
    return made


def _sagemaker_client(boto_session: Any) -> Any:
    """The SageMaker client ModelTrainer creates jobs with: sagemaker-core caches one per boto3 session
    (and region and config: TrainingJob.create passes neither), for the life of the process."""
    from sagemaker.core.resources import Base

    return Base.get_sagemaker_client(session=boto_session)


@contextlib.contextmanager
def _handlers(boto_session: Any, handlers: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """``handlers`` (event → handler) on the client the SDK will send with, for the block only. A
    botocore client copies its session's handlers when it is made, and sagemaker-core keeps the client:
    handlers are put on that client itself, and taken off it after (else a later call would meet them).
    They go on the session too, so that a client the SDK made anew (another release's cache) is checked
    as well: fail closed. One unique id per handler (botocore drops a second registration of an id)."""
    emitters = [_sagemaker_client(boto_session).meta.events, boto_session.events]
    registered = []
    try:
        for event, handler in handlers.items():
            unique = f"hetero-{uuid.uuid4()}"
            for emitter in emitters:
                emitter.register(event, handler, unique_id=unique)
                registered.append((emitter, event, unique))
        yield
    finally:
        for emitter, event, unique in registered:
            emitter.unregister(event, unique_id=unique)


def captured_request(request: Mapping[str, Any], boto_session: Any, base_job_name: str) -> dict[str, Any]:
    """What the SDK would send for ``request``, stopped before it leaves (nothing is created)."""
    def capture(params: dict[str, Any], **_: Any) -> None:
        raise _Captured(dict(params))

    trainer = model_trainer(request, boto_session, base_job_name)
    with _handlers(boto_session, {CHECKED: capture}):
        try:
            _train(trainer)
        except _Captured as captured:
            return captured.params
    raise RuntimeError("the SDK finished without a CreateTrainingJob call")


def send(request_for: Callable[[str], dict[str, Any]], boto_session: Any, base_job_name: str) -> str:
    """Create the job through ModelTrainer, if the SDK's request is ``request_for(<the name it chose>)``
    field by field; returns the job's name. Raises RequestMismatch or SdkRefused when nothing was sent;
    once the request has left, the service's errors as botocore raises them (ResourceInUse: this name's
    job exists, which a retried create of ours meets: the caller tells whose it is)."""
    seen: dict[str, Any] = {}

    def check(params: dict[str, Any], **_: Any) -> None:
        found = differences(request_for(params["TrainingJobName"]), params)
        if found:
            raise RequestMismatch(found)
        seen["name"] = params["TrainingJobName"]

    def created(http_response: Any = None, parsed: Any = None, **_: Any) -> None:
        # after-call follows every answer, a refusal too: only a 2xx one without an error created the job.
        if http_response is not None and http_response.status_code < 300 and not (parsed or {}).get("Error"):
            seen["created"] = True

    try:
        # The request but for its name, which the SDK picks: <base>-<time>, cut at 63 characters.
        trainer = model_trainer(request_for(f"{base_job_name}-{'0' * NAME_PATTERN_DIGITS}"[:MAX_NAME]), boto_session, base_job_name)
        checked = contextlib.ExitStack()
        checked.enter_context(_handlers(boto_session, {CHECKED: check, CREATED: created}))
    except Exception as error:  # a field it refuses (pydantic), its role check, another SDK release's API
        raise SdkRefused(f"ModelTrainer refused the request ({_first_line(error)})") from error
    with checked:
        try:
            _train(trainer)
        except RequestMismatch:
            raise
        except Exception as error:
            if seen.get("created"):  # the job exists; what failed came after (the SDK's describe of it)
                return seen["name"]
            if "name" not in seen:  # it failed before its request was built: nothing was sent
                raise SdkRefused(f"ModelTrainer failed before sending ({_first_line(error)})") from error
            answer = getattr(error, "response", {}).get("Error", {})
            if answer.get("Code") == "ResourceInUse":
                raise NameInUse(seen["name"], answer.get("Message", "")) from None
            raise  # sent and refused by SageMaker, or lost on the way (the job may exist): never sent again here
    if "name" not in seen:  # the check never ran: the SDK sent through another client (a new SDK release)
        raise RuntimeError("ModelTrainer sent CreateTrainingJob through a client hetero does not check; use --no-sdk")
    return seen["name"]


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def _train(trainer: Any) -> None:
    trainer.train(wait=False, logs=False)
