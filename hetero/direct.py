"""One training job from the client, without the training-run state machine: `hetero run SPEC --direct`,
or from a notebook:

    from hetero import Platform, launch_direct, follow_job, job_result
    platform = Platform(region="us-east-1")
    job = launch_direct("examples/pytorch-heterogeneous.json", platform)    # sent through the SageMaker SDK
    for event in follow_job(job.job_name, platform):
        print(event)
    print(job_result(job.job_name, platform)["cost_per_1k_steps_usd"])

The request is the platform's own (lambdas/core/training_request.py) with the deployed stack's settings
(its LaunchSettings output: images, SageMaker role, locations, spec policy). With `sagemaker-train`
installed it goes through the SDK's ModelTrainer (hetero/sdk.py), which may send it only if it is that
request, field by field; where it is not, or the SDK refuses it, boto3 sends the builder's request and
the job says why (``fallback``). Without the SDK, boto3 sends it.

Before anything is written or billed, the checks of a state-machine launch: the spec with the
deployment's policy (input bucket allow-list, cost ceiling), the run id (no checkpoints of it: a second
job of one id would resume the first's last step and train nothing); a resume_from is refused. A user
workload's local code folder is packed first and uploaded (once: code/<sha256>/) after those checks,
before the token, as `hetero run` does (hetero/api.py); the request routes it to every group. A direct
run keeps its checkpoints, token and artifacts under checkpoints/direct.runs/<run id>/,
control/direct.runs/<run id>/ and artifacts/direct.runs/, where no state-machine run's id (letters,
digits, "-" and "_") can reach; its job's session (untagged: no SessionChainingConfig) reaches only those
direct.runs/ prefixes, never a state-machine run's (infra/constructs/execution_role.py). The token is written once
(an id launched before is refused there), then the job is created; a create SageMaker refuses takes the
token back so the id can be used again. These checks are the client's: the caller's own IAM permissions
are what the account enforces (the stack's DirectLaunchPolicy, docs/guides/deploying.md).

What a direct job goes without, being the state machine's: the start timeout and deadline watchdog
(SageMaker's MaxRuntimeInSeconds still bounds it), capacity relaunches, the abort cleanup, result.json
in S3 and sweeps. Its result is computed here (job_result), the way the collect function computes a run's.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hetero.api import (
    ClientFacingError,
    InputRefused,
    Platform,
    SpecRefused,
    TransientError,
    call,
    check_name,
    default_run_name,
    pack_local_code,
    read_json,
    spec_folder,
    upload_code,
    with_uploaded_code,
)
from lambdas.core.job_spec import JobSpec, JobSpecError, SpecPolicy, split_s3_uri, validate_job_spec
from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.results import read_summary, result_document
from lambdas.core.service_limits import limit
from lambdas.core.training_request import (
    DIRECT_RUNS,
    RequestError,
    checkpoint_uri,
    create_training_job_request,
    settings_from_environment,
    token_uri,
)
from training.hyperparameters import TOKEN_FILE
from training.workload.code import PackedCode, stored_archive_problem

# The direct job's tag naming its run (a state-machine run's job carries its execution's instead).
RUN_TAG = "run_id"
# A direct run keeps its checkpoints and token under this (checkpoints/direct.runs/<run id>/, control/
# direct.runs/<run id>/): a state-machine run's id (an execution name, or a resume_from) is letters,
# digits, "-" and "_" (RUN_ID), never "direct.runs", so the two never share a prefix.
DIRECT = DIRECT_RUNS
SDK_INSTALL = "pip install -e '.[sdk]' in the repository"


@dataclass(frozen=True)
class DirectJob:
    """A job launched without the state machine: its run id, its name, what sent it and, when the SDK was
    passed over, why."""

    run_id: str
    job_name: str
    sent_by: str
    fallback: str | None = None
    request: Mapping[str, Any] = field(default_factory=dict, repr=False)
    # The spec as launched (a local code folder replaced by its uploaded archive).
    raw_spec: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Launch:
    """Everything a direct launch needs, checked offline: the request for any job name."""

    run_id: str
    spec: JobSpec
    prefix: str
    settings: Any
    raw: Mapping[str, Any] = field(default_factory=dict)  # the spec as launched
    archives: tuple[PackedCode, ...] = ()  # its packed code, to upload before the job is created
    code_bucket: str = ""

    @property
    def key(self) -> str:
        """Where the run's checkpoints and token lie, under checkpoints/ and control/."""
        return f"{DIRECT}/{self.run_id}"

    @property
    def base_job_name(self) -> str:
        """<prefix>-<run name>-<6 hex of the run id>: the SDK adds the time to the second, and two runs of
        one spec launched within a second (a notebook's loop) must not ask for one name. A run id is
        launched once (its token is written once), so its jobs' names are its own."""
        return f"{self.prefix}-{self.spec.run_name}-{hashlib.sha256(self.run_id.encode()).hexdigest()[:6]}"

    def request(self, name: str) -> dict[str, Any]:
        """The builder's request for job ``name``: <prefix>-<run name>-<suffix>, within SageMaker's rules for
        a job name (IAM holds the platform's SageMaker permissions to its prefix)."""
        problem = limit("TrainingJobName").problem(name)
        if problem or not name.startswith(f"{self.base_job_name}-"):
            raise ClientFacingError(f"{name!r} cannot be a job name of run {self.spec.run_name!r}: {problem or 'another prefix'}")
        try:
            return create_training_job_request(self.spec, self.settings, name=name, run_id=self.key, control_key=self.key)
        except RequestError as error:
            raise ClientFacingError(str(error)) from None


def default_direct_run_id(raw: Mapping[str, Any]) -> str:
    """<run_name>-<UTC time>-<4 hex>: a notebook's loop launches several in one second."""
    return f"{default_run_name(raw)}-{secrets.token_hex(2)}"


def prepare(source: str | Path | Mapping[str, Any], platform: Platform, name: str | None = None) -> Launch:
    """The spec checked with the deployment's policy and the run id with the platform's rules; no write."""
    label, raw = read_json(source)
    try:
        validate_job_spec(raw)  # offline first: a bad spec is told before any AWS call
        run = check_name(default_direct_run_id(raw) if name is None else name)
        packed = pack_local_code(label, raw, spec_folder(source))  # and its code packed: nothing uploaded yet
        environment = platform.launch_settings
        policy = SpecPolicy.from_environment(environment)
        if packed and not policy.code_bucket:
            raise ClientFacingError(f"stack {platform.stack!r}: its LaunchSettings output names no results bucket (redeploy with `cdk deploy`)")
        raw = with_uploaded_code(raw, spec_folder(source), policy.code_bucket or "", packed) if packed else raw
        spec = validate_job_spec(raw, policy)  # the deployment's allow-list, ceiling and code location
    except JobSpecError as error:
        raise SpecRefused(label, error.field, error.problem) from None
    if spec.resume_from:
        # Its job's session reaches only direct.runs/ prefixes, and a resumed run's checkpoints lie elsewhere:
        # the job would start, bill, and fail on its resume channel.
        raise SpecRefused(label, "resume_from", "a direct run cannot resume another run's checkpoints: resume it through the "
                                                "state machine (`hetero run` without --direct)")
    try:
        settings = settings_from_environment(environment)
        prefix = environment["JOB_NAME_PREFIX"]
    except (KeyError, ValueError) as error:
        raise ClientFacingError(f"stack {platform.stack!r}: its LaunchSettings output lacks {error} (redeploy with `cdk deploy`)") from None
    # Its artifacts apart too (artifacts/direct.runs/<job>/): the only prefixes its job's session reaches.
    settings = replace(settings, tags=dict(settings.tags) | {RUN_TAG: run}, output_s3_uri=f"{settings.output_s3_uri.rstrip('/')}/{DIRECT}/")
    archives = tuple({archive.sha256: archive for archive in packed.values()}.values())
    launch = Launch(run_id=run, spec=spec, prefix=prefix, settings=settings, raw=raw, archives=archives, code_bucket=policy.code_bucket or "")
    launch.request(boto3_job_name(launch))  # a request can be built, before anything is written
    return launch


def check_job_name(job: str) -> str:
    """A direct run's job name as SageMaker takes one (1–63 letters, digits and inner hyphens), else
    InputRefused: nothing of that name can exist."""
    problem = limit("TrainingJobName").problem(job)
    if problem:
        raise InputRefused(f"RUN {job!r} cannot be a training job's name (with --direct, RUN is the job's name): {problem}")
    return job


def boto3_job_name(launch: Launch, now: datetime | None = None) -> str:
    """The job's name when boto3 sends it: <base>-<UTC time> (the SDK puts its machine's local time there),
    within SageMaker's 63 characters (a 40-character run name leaves 8 digits of the time: the base is
    the run's own)."""
    return f"{launch.base_job_name}-{(now or datetime.now(UTC)):%Y%m%d%H%M%S}"[:63]


def launch_direct(source: str | Path | Mapping[str, Any], platform: Platform | None = None, name: str | None = None,
                  use_sdk: bool = True) -> DirectJob:
    """Check, then create one training job for the spec (see the module's docstring)."""
    from hetero import sdk

    platform = platform or Platform()
    launch = prepare(source, platform, name)
    through_sdk = use_sdk and sdk.available()  # known before anything is written
    _check_run_id(launch, platform)
    for archive in launch.archives:  # content-addressed: a second run of the same code uploads nothing
        upload_code(platform, launch.code_bucket, archive)
    if launch.spec.code is not None and not launch.archives:  # named in S3 already: it must be there, and be itself
        bucket_name, key = split_s3_uri(launch.spec.code.source)
        problem = call(stored_archive_problem, s3=platform.client("s3"), bucket=bucket_name, key=key, sha256=launch.spec.code.sha256)
        if problem is not None:
            raise ClientFacingError(f"the workload's code: {problem}: run from the code's folder, which packs and uploads it")
    bucket, prefix = split_s3_uri(token_uri(launch.settings, launch.key))
    token = f"{prefix}{TOKEN_FILE}"
    _write_token(platform, bucket, token, launch.run_id)
    try:
        job = _send(launch, platform, through_sdk)
    except ClientFacingError as error:
        # SageMaker refused the job: the token goes, so the id may be used again. Not after a dropped
        # connection or throttling past the retries (the job may exist, and reads its token at its start).
        if not isinstance(error, TransientError):
            _take_back(platform, bucket, token, error)
        raise
    except BaseException as error:
        may_exist = f"its job may exist (`aws sagemaker list-training-jobs --name-contains {launch.base_job_name}`)"
        if isinstance(error, Exception):  # the SDK's own failure once its request had left
            raise ClientFacingError(f"the launch of run {launch.run_id!r} failed, and {may_exist}: {error}") from error
        error.add_note(f"run {launch.run_id!r}: {may_exist}")  # Ctrl-C stays Ctrl-C (a notebook's loop must stop)
        raise
    job = replace(job, raw_spec=launch.raw)
    if use_sdk and not through_sdk:
        return replace(job, fallback=f"sagemaker-train is not installed ({SDK_INSTALL}): sent by boto3")
    return job


def _take_back(platform: Platform, bucket: str, key: str, cause: ClientFacingError) -> None:
    try:
        call(platform.client("s3").delete_object, Bucket=bucket, Key=key)
    except ClientFacingError as error:
        raise ClientFacingError(f"{cause}; and its token s3://{bucket}/{key} could not be deleted ({error}): "
                                "launch under another name") from None


def _send(launch: Launch, platform: Platform, through_sdk: bool) -> DirectJob:
    fallback = None
    if through_sdk:
        from hetero import sdk

        try:
            try:
                created = call(sdk.send, request_for=launch.request, boto_session=platform.session, base_job_name=launch.base_job_name)
            except sdk.NameInUse as taken:
                created = _ours(launch, platform, taken.name, str(taken))
            return DirectJob(launch.run_id, created, sdk.sdk_version(), None, launch.request(created))
        except (sdk.RequestMismatch, sdk.SdkRefused) as error:
            fallback = f"{error}: sent by boto3"
    name = boto3_job_name(launch)
    request = launch.request(name)
    try:
        call(platform.client("sagemaker").create_training_job, **request)
    except ClientFacingError as error:
        if not str(error).startswith("ResourceInUse"):
            raise
        _ours(launch, platform, name, str(error))
    return DirectJob(launch.run_id, name, "boto3", fallback, request)


def _ours(launch: Launch, platform: Platform, name: str, refusal: str) -> str:
    """After ResourceInUse: ``name`` if its job is this run's (a create retried after a lost answer, which
    botocore does on a timeout, meets the job it made), else the refusal."""
    if _run_of(name, platform) != launch.run_id:
        raise ClientFacingError(refusal)
    return name


def _run_of(job: str, platform: Platform) -> str | None:
    """The run id a job is tagged with, or None (no such job, or no tag)."""
    described = call(platform.client("sagemaker").describe_training_job, TrainingJobName=job, absent_ok=True)
    return None if described is None else _tags(described, platform).get(RUN_TAG)


def _check_run_id(launch: Launch, platform: Platform) -> None:
    """Refuse a run id that has checkpoints (a job of it would resume their last step and train nothing)."""
    s3 = platform.client("s3")

    def holds_objects(uri: str) -> bool:
        bucket, prefix = split_s3_uri(uri)
        return call(s3.list_objects_v2, Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0) > 0

    if holds_objects(checkpoint_uri(launch.settings, launch.key)):
        raise InputRefused(f"run id {launch.run_id!r} has checkpoints already (a job of it would resume their last step): "
                           "launch under another name")


def _write_token(platform: Platform, bucket: str, key: str, run: str) -> None:
    """The job's shutdown token, written once: an id whose token exists was launched before."""
    try:
        call(platform.client("s3").put_object, Bucket=bucket, Key=key, Body=secrets.token_urlsafe(32).encode(),
             ContentType="text/plain", IfNoneMatch="*")
    except ClientFacingError as error:
        if "PreconditionFailed" in str(error) or "ConditionalRequestConflict" in str(error):
            raise InputRefused(f"run id {run!r} was launched before: launch under another name") from None
        raise


def stop_job(job: str, platform: Platform | None = None) -> str:
    """Stop a direct job of this platform (tagged with its run id; any other job is refused); returns the
    status it had."""
    platform = platform or Platform()
    sagemaker = platform.client("sagemaker")
    described = _described(job, platform)
    if _tags(described, platform).get(RUN_TAG) is None or not job.startswith(f"{platform.launch_settings.get('JOB_NAME_PREFIX')}-"):
        raise InputRefused(f"job {job!r} is not a direct job of this platform (`hetero stop RUN` stops a run's)")
    if described["TrainingJobStatus"] == "InProgress":
        call(sagemaker.stop_training_job, TrainingJobName=job)
    return described["TrainingJobStatus"]


def job_result(job: str, platform: Platform | None = None, raw_spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A direct job's result, as result.json has a run's: status, step times, cost per 1k steps, start-up
    times; from its description and its summary in output.tar.gz (the fallback price table's prices)."""
    platform = platform or Platform()
    describe = _described(job, platform)
    ended = describe["TrainingJobStatus"] in ("Completed", "Failed", "Stopped")
    summary, problem = read_summary(describe, *_s3_readers(platform)) if ended else (None, None)
    resources = describe["ResourceConfig"]
    groups = ([(group["InstanceType"], group["InstanceCount"]) for group in resources["InstanceGroups"]] if resources.get("InstanceGroups")
              else [(resources["InstanceType"], resources["InstanceCount"])])
    return result_document(run_id=_tags(describe, platform).get(RUN_TAG, job), groups=groups, raw_spec=raw_spec, job_name=job,
                           describe=describe, summary=summary, summary_problem=problem, prices=FALLBACK_PRICES)


def _described(job: str, platform: Platform) -> dict[str, Any]:
    return call(platform.client("sagemaker").describe_training_job, TrainingJobName=job,
                missing=f"no training job {job!r} in this account and region")


def _tags(described: Mapping[str, Any], platform: Platform) -> dict[str, str]:
    tags = call(platform.client("sagemaker").list_tags, ResourceArn=described["TrainingJobArn"]).get("Tags", [])
    return {tag["Key"]: tag["Value"] for tag in tags}


def _s3_readers(platform: Platform) -> tuple[Any, Any]:
    """(size of, bytes of) an S3 object, None when there is none. Whether it exists is asked by a listing
    (S3 answers a read of a missing key with 403 to a caller without s3:ListBucket, which DirectLaunchPolicy
    grants on prefixes only); a refused read of one that exists is an error, not an absent summary."""
    s3 = platform.client("s3")

    def size_of(bucket: str, key: str) -> int | None:
        listed = call(s3.list_objects_v2, Bucket=bucket, Prefix=key, MaxKeys=1).get("Contents", [])
        return int(listed[0]["Size"]) if listed and listed[0]["Key"] == key else None

    def read(bucket: str, key: str) -> bytes | None:
        try:
            return call(s3.get_object, Bucket=bucket, Key=key)["Body"].read()
        except ClientFacingError as error:
            raise ClientFacingError(f"cannot read s3://{bucket}/{key} ({error})") from None

    return size_of, read
