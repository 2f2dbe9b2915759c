"""The platform from Python: start a run, follow it, read its result. The `hetero` command is a thin
layer over these functions, and a notebook can call them as they are:

    from hetero import Platform, launch, follow, result
    platform = Platform(region="us-east-1")           # the deployed stack's outputs find everything
    run = launch("examples/pytorch-heterogeneous.json", platform=platform)
    for event in follow(run, platform):                 # status changes, job transitions, step metrics
        print(event)
    print(result(run, platform)["cost_per_1k_steps_usd"])

Everything here speaks to AWS through boto3 with the caller's credentials (the AWS CLI's profiles,
environment and SSO): Step Functions starts, lists and stops runs, S3 holds their results and sweep
reports, SageMaker and CloudWatch Logs tell how a running job is doing. A spec is validated offline first,
with the platform's own rules (lambdas/core/job_spec.py), so a bad one is refused before anything starts.
Errors a user can fix are ClientFacingError, one line each.

A spec whose workload is code of the user's own in a local folder (``"workload": {"code": "my_workload/"}``,
relative to the spec file's folder as docker-compose's build contexts are) is packed here
(training/workload/code.py: reproducible, named by its SHA-256), uploaded once to the results bucket's
code/<sha256>/sourcedir.tar.gz (a second run of unchanged code uploads nothing), and the run starts with
the spec naming that archive and its hash: the state machine cannot read the user's disk. A sweep packs
each distinct folder of its configurations once.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError, ProfileNotFound

from lambdas.core.job_spec import (
    DEFAULT_MODULE,
    NO_POLICY,
    RUN_ID,
    JobSpecError,
    SpecPolicy,
    WorkloadCode,
    code_key,
    cost_ceiling_usd,
    is_script_workload,
    validate_job_spec,
    worst_case_cost_usd,
)
from lambdas.core.sweep import SweepSpecError, plan_sweep, sweep_ceiling_usd
from training.metrics import parse_metric_line
from training.variants import VARIANTS
from training.workload.code import CodeError, PackedCode, pack_code, stored_archive_problem
from training.workload.contract import CONTRACTS, source_problem

DEFAULT_STACK = "HeteroTrainingPlatform"
# SageMaker's log group for training jobs; each host writes the stream <job>/<host>-<epoch seconds>.
TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
# The launcher's line that names a host's instance group (training/launcher.py): how logs are grouped.
GROUP_LINE = re.compile(r"host (algo-\d+) is in instance group (\S+)")
STEP = re.compile(r"(?:^|\s)step=(\d+)/(\d+)")


# Every call retries throttling and dropped connections itself, backing off (several people following
# runs share the account's Step Functions and Logs quotas).
RETRIES = Config(retries={"mode": "adaptive", "max_attempts": 10})
# Execution names Step Functions and the platform both accept (results/<name>/, job names); a sweep's
# configurations are named <sweep id>-<index>, within Step Functions' 80 characters.
SWEEP_ID_LENGTH = 77


class ClientFacingError(RuntimeError):
    """Something the user can fix; the message says what, in one line."""


class TransientError(ClientFacingError):
    """Throttling past the retries, a dropped connection, a service hiccup: trying again later may work."""


class InputRefused(ClientFacingError):
    """The user's input (a file, a spec, a name) is refused before anything starts."""


class SpecRefused(InputRefused):
    def __init__(self, source: str, field_path: str, problem: str) -> None:
        super().__init__(f"{source}: {field_path}: {problem}")
        self.field = field_path


@dataclass
class Platform:
    """A deployed platform, found by its CloudFormation stack's outputs."""

    stack: str = DEFAULT_STACK
    region: str | None = None
    profile: str | None = None
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    @cached_property
    def session(self) -> boto3.Session:
        try:
            return boto3.Session(region_name=self.region, profile_name=self.profile)
        except ProfileNotFound as error:
            raise ClientFacingError(f"{error}: pass an existing --profile or configure it with `aws configure`") from None

    def client(self, service: str) -> Any:
        if service not in self._clients:
            try:
                self._clients[service] = self.session.client(service, config=RETRIES)
            except NoRegionError:
                raise ClientFacingError("no AWS region: pass --region or set AWS_REGION (the stack's region)") from None
        return self._clients[service]

    @cached_property
    def outputs(self) -> dict[str, str]:
        """The stack's outputs: TrainingRunStateMachine, BenchmarkSweepStateMachine, ResultsBucket, ..."""
        stacks = call(self.client("cloudformation").describe_stacks, StackName=self.stack, stack=self.stack)
        return {output["OutputKey"]: output["OutputValue"] for output in stacks["Stacks"][0].get("Outputs", [])}

    def output(self, key: str) -> str:
        try:
            return self.outputs[key]
        except KeyError:
            raise ClientFacingError(f"stack {self.stack!r} has no output {key!r}: is it this platform's stack? (redeploy with `cdk deploy`)") from None

    @property
    def training_run_machine(self) -> str:
        return self.output("TrainingRunStateMachine")

    @property
    def sweep_machine(self) -> str:
        return self.output("BenchmarkSweepStateMachine")

    @property
    def results_bucket(self) -> str:
        return self.output("ResultsBucket")

    @property
    def launch_settings(self) -> dict[str, str]:
        """The launch function's settings as the stack exports them (images, SageMaker role, locations,
        the deployment's spec policy), for launches without the state machine (hetero/direct.py)."""
        try:
            settings = json.loads(self.output("LaunchSettings"))
        except json.JSONDecodeError:
            settings = None
        if not isinstance(settings, dict):
            raise ClientFacingError(f"stack {self.stack!r}: its LaunchSettings output is not a JSON object (redeploy with `cdk deploy`)")
        return settings


NOT_FOUND = ("ExecutionDoesNotExist", "NoSuchKey", "404", "ResourceNotFoundException", "ResourceNotFound")
# S3 answers a missing key with 403 to a caller without s3:ListBucket: for reads that may find nothing yet.
HIDDEN = ("AccessDenied", "403")
TRANSIENT = ("ThrottlingException", "Throttling", "TooManyRequestsException", "RequestLimitExceeded", "SlowDown",
             "ServiceUnavailable", "InternalServerError", "InternalFailure", "RequestTimeout")


def _missing_by_validation(code: str, message: str) -> bool:
    """SageMaker answers a Describe of a job that does not exist with ValidationException ("Requested
    resource not found.", moto: "Could not find training job ...")."""
    lowered = message.lower()
    return code == "ValidationException" and ("not found" in lowered or "could not find" in lowered)


def call(method: Callable[..., Any], *, stack: str | None = None, missing: str | None = None, absent_ok: bool = False, **params: Any) -> Any:
    """``method(**params)``, an AWS call, its errors turned into one line a user can act on: ``stack``
    names the stack a ValidationError is about, ``missing`` what to say when the thing does not exist
    (``absent_ok``: return None instead)."""
    try:
        return method(**params)
    except NoCredentialsError:
        raise ClientFacingError("no AWS credentials: run `aws configure` or `aws sso login`, or pass --profile") from None
    except NoRegionError:
        raise ClientFacingError("no AWS region: pass --region or set AWS_REGION (the stack's region)") from None
    except ClientError as error:
        code, message = error.response["Error"].get("Code", ""), error.response["Error"].get("Message", "")
        if stack and code == "ValidationError" and "does not exist" in message:
            raise ClientFacingError(f"stack {stack!r} not found: deploy the platform (`cdk deploy`) or pass --stack/--region") from None
        if absent_ok and (code in NOT_FOUND or code in HIDDEN):
            return None
        if missing and (code in NOT_FOUND or _missing_by_validation(code, message)):
            raise ClientFacingError(missing) from None
        raise (TransientError if code in TRANSIENT else ClientFacingError)(f"{code}: {message}") from None
    except BotoCoreError as error:  # connection errors and the like (credentials and region are above)
        raise TransientError(str(error)) from None


# Specs ----------------------------------------------------------------------------------------------


def read_json(source: str | Path | Mapping[str, Any]) -> tuple[str, Any]:
    """(what to call it in errors, the parsed JSON) of a path or an already parsed spec."""
    if isinstance(source, Mapping):
        return "spec", dict(source)
    path = Path(source)
    try:
        return str(path), json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputRefused(f"{path}: no such file") from None
    except OSError as error:
        raise InputRefused(f"{path}: cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise InputRefused(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise InputRefused(f"{path}: not JSON (line {error.lineno}: {error.msg})") from None


def validate(source: str | Path | Mapping[str, Any], policy: SpecPolicy = NO_POLICY) -> dict[str, Any]:
    """The spec, checked with the platform's own rules and ``policy`` (deployment_policy(): a checkout's
    cost ceilings; the bucket allow-list and the ceilings are checked again when the run starts). Raises
    SpecRefused naming the field."""
    return _checked(*read_json(source), sweep=False, policy=policy)


def validate_sweep(source: str | Path | Mapping[str, Any], policy: SpecPolicy = NO_POLICY) -> dict[str, Any]:
    """A sweep's input, checked as the plan step checks it (every configuration as a run)."""
    return _checked(*read_json(source), sweep=True, policy=policy)


def validate_any(source: str | Path | Mapping[str, Any], policy: SpecPolicy = NO_POLICY) -> dict[str, Any]:
    """A run's spec, or a sweep's input when it has a sweep_name: the file read once."""
    name, raw = read_json(source)
    return _checked(name, raw, sweep=is_sweep(raw), policy=policy)


def is_sweep(raw: Any) -> bool:
    return isinstance(raw, dict) and "sweep_name" in raw


def _checked(name: str, raw: Any, sweep: bool, policy: SpecPolicy = NO_POLICY) -> Any:
    try:
        plan_sweep(raw, policy) if sweep else validate_job_spec(raw, policy)
    except (JobSpecError, SweepSpecError) as error:
        raise SpecRefused(name, error.field, error.problem) from None
    return raw


# Cost before deploying ------------------------------------------------------------------------------


def deployment_policy(start: Path | None = None) -> tuple[SpecPolicy, Path | None]:
    """The spec policy a deployment of the checkout around ``start`` (default: the working directory)
    applies, and the cdk.json it comes from: the nearest cdk.json in ``start`` or above it with the
    platform's context, read as the CDK app reads it (infra/config.py, defaults included), so an offline
    check refuses what the deployed launch function would. Its bucket allow-list is left out (the datasets
    bucket is named at deployment), as is anything given with ``cdk deploy -c``. No such cdk.json:
    NO_POLICY (no ceiling), and None."""
    folder = (start or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        path = candidate / "cdk.json"
        if path.is_file():
            policy = settings_policy(path)
            if policy is not None:
                return policy, path
    return NO_POLICY, None


def settings_policy(path: Path) -> SpecPolicy | None:
    """The spec policy of one CDK settings file (a cdk.json); None when it holds no platform context
    (another CDK app's). A file that is unreadable or whose settings cannot be deployed is refused."""
    from infra.config import CONTEXT_KEY, PlatformConfig, PlatformConfigError

    try:
        context = json.loads(path.read_text(encoding="utf-8")).get("context") or {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise InputRefused(f"{path}: not a readable cdk.json ({error})") from None
    if not isinstance(context, dict) or CONTEXT_KEY not in context:
        return None
    raw = context[CONTEXT_KEY]
    try:
        config = PlatformConfig.from_context(json.loads(raw) if isinstance(raw, str) else raw)
    except (PlatformConfigError, SweepSpecError, TypeError, ValueError) as error:
        raise InputRefused(f"{path}: its {CONTEXT_KEY!r} settings cannot be deployed: {error}") from None
    return config.policy_for_synthesis()


@dataclass(frozen=True)
class CostEstimate:
    """A spec's (or a sweep's) worst case: every instance billed for the whole max_runtime_s."""

    worst_case_usd: float | None  # None: a type has no price to compute it with
    ceiling_usd: float | None  # the ceiling that applies (the deployment's, lowered by the spec's own); None: none
    unpriced: tuple[str, ...] = ()  # the types without a price (fallback table, cdk.json's ceiling prices)
    runs: int = 1


def estimate_cost(raw: Any, policy: SpecPolicy = NO_POLICY) -> CostEstimate:
    """The worst case of an already valid spec or sweep input under ``policy``, with the same functions
    the validator's ceiling check uses (lambdas/core/job_spec.py, lambdas/core/sweep.py). Pure."""
    specs = [validate_job_spec(spec, policy) for spec in plan_sweep(raw, policy).configurations] if is_sweep(raw) else [validate_job_spec(raw, policy)]
    unpriced = tuple(sorted({group.instance_type for spec in specs for group in spec.instance_groups if policy.price(group.instance_type) is None}))
    total = None if unpriced else sum(worst_case_cost_usd(spec, policy) for spec in specs)
    if is_sweep(raw):
        ceiling = sweep_ceiling_usd(raw.get("max_cost_usd"), policy)
    else:
        ceiling = cost_ceiling_usd(specs[0], policy)
    return CostEstimate(total, ceiling, unpriced, len(specs))


# A user workload's code ----------------------------------------------------------------------------


def spec_folder(source: str | Path | Mapping[str, Any]) -> Path:
    """The folder a spec's relative code folders are relative to: its file's, or for a spec given as a
    mapping (a notebook's), the working directory."""
    return Path.cwd() if isinstance(source, Mapping) else Path(source).parent


def code_folder(source: str, base: Path) -> Path:
    """A spec's local code folder as a path: relative to ``base`` (the spec file's folder), an absolute
    one as it is. Pure."""
    folder = Path(source).expanduser()
    return folder if folder.is_absolute() else base / folder


def _specs_in(raw: Any, sweep: bool) -> list[tuple[str, Any]]:
    """(where, spec) of a run's spec, or of each spec a sweep's input holds (its configurations, its base,
    its extra ones), as the sweep's checks name them. Pure."""
    if not sweep:
        return [("", raw)]
    if not isinstance(raw, Mapping):
        return []
    found = [(f"configurations[{index}].", spec) for index, spec in enumerate(raw.get("configurations") or [])]
    found += [("base.", raw["base"])] if "base" in raw else []
    return found + [(f"extra[{index}].", spec) for index, spec in enumerate(raw.get("extra") or [])]


def _local_code(spec: Any) -> WorkloadCode | None:
    """The spec's workload code when it is a local folder (the spec already passed validation)."""
    workload = spec.get("workload") if isinstance(spec, Mapping) else None
    if not isinstance(workload, Mapping) or not isinstance(workload.get("code"), str):
        return None
    script = is_script_workload(workload)
    code = WorkloadCode(workload["code"], "" if script else workload.get("module", DEFAULT_MODULE), workload.get("requirements", ""),
                        entry_point=workload.get("entry_point", ""), command=workload.get("command", ""))
    return code if code.is_local else None


def module_files(module: str) -> tuple[str, str]:
    """The files a dotted module name is imported from inside the folder: a module or a package. Pure."""
    path = module.replace(".", "/")
    return f"{path}.py", f"{path}/__init__.py"


def _check_packed(label: str, where: str, code: WorkloadCode, packed: PackedCode, folder: Path, variant: str = "pytorch") -> None:
    """The module and the requirements file must be among what was packed: else every host would fail
    at its start, billed, on what the client can see now. A script's entry point likewise."""
    if code.is_script:
        if code.entry_point and code.entry_point not in packed.files:
            raise SpecRefused(label, f"{where}workload.entry_point", f"{code.entry_point!r} is not among the files of {folder} as it is packed "
                                                                     "(folders like .venv, build and __pycache__ are not packed)")
        if code.requirements and code.requirements not in packed.files:
            raise SpecRefused(label, f"{where}workload.requirements", f"{code.requirements!r} is not a file of {folder}")
        return
    if not set(module_files(code.module)) & set(packed.files):
        raise SpecRefused(label, f"{where}workload.module", f"{code.module!r} is not in {folder}: no {' or '.join(module_files(code.module))} "
                                                            "among its files (folders like .venv, build and __pycache__ are not packed)")
    if code.requirements and code.requirements not in packed.files:
        raise SpecRefused(label, f"{where}workload.requirements", f"{code.requirements!r} is not a file of {folder}")
    module_file = next(folder / name for name in module_files(code.module) if name in packed.files)
    framework = VARIANTS[variant].contract if variant in VARIANTS else "pytorch"
    problem = source_problem(module_file.read_text(errors="replace"), str(module_file), CONTRACTS[framework])
    if problem is not None:  # what the source alone shows (`hetero validate` runs the hooks themselves)
        raise SpecRefused(label, f"{where}workload.module", problem)


def pack_local_code(label: str, raw: Any, base: Path, sweep: bool = False) -> dict[Path, PackedCode]:
    """Each distinct local folder the spec (or the sweep's specs) names, packed once, by its resolved
    path; nothing is uploaded. Raises SpecRefused naming the field."""
    packed: dict[Path, PackedCode] = {}
    for where, spec in _specs_in(raw, sweep):
        code = _local_code(spec)
        if code is None:
            continue
        folder = code_folder(code.source, base).resolve()
        if folder not in packed:
            try:
                packed[folder] = pack_code(folder)
            except CodeError as error:
                raise SpecRefused(label, f"{where}workload.code", str(error)) from None
        _check_packed(label, where, code, packed[folder], folder, str(spec.get("variant", "pytorch")))
    return packed


def code_uri(bucket: str, packed: PackedCode) -> str:
    return f"s3://{bucket}/{code_key(packed.sha256)}"


def with_uploaded_code(raw: Any, base: Path, bucket: str, packed: Mapping[Path, PackedCode], sweep: bool = False) -> Any:
    """A copy of the spec (or sweep) whose every local code names its archive in ``bucket`` and its hash,
    as the platform launches it. Pure."""
    rewritten = copy.deepcopy(raw)
    for _, spec in _specs_in(rewritten, sweep):
        code = _local_code(spec)
        if code is None:
            continue
        archive = packed[code_folder(code.source, base).resolve()]
        if code.is_script:  # every field of the script's as the user wrote it, the code now its archive
            spec["workload"] = dict(spec["workload"]) | {"code": code_uri(bucket, archive), "sha256": archive.sha256}
            continue
        spec["workload"] = {"code": code_uri(bucket, archive), "sha256": archive.sha256, "module": code.module,
                            **({"requirements": code.requirements} if code.requirements else {})}
    return rewritten


def upload_code(platform: Platform, bucket: str, packed: PackedCode) -> bool:
    """Put the archive at code/<sha256>/sourcedir.tar.gz unless it is there already; True when it was
    uploaded. An object there is taken only when its bytes are the archive (S3's SHA-256 of it, or its
    bytes hashed): every host checks the archive against its run's hash, so other bytes would fail the run
    after it started billing. Written once (If-None-Match; the bucket's policy denies any other write to
    code/): a client that meets another's upload of the same archive (412, or 409 while it lands) checks
    what is there and goes on. S3 checks the bytes it receives against their SHA-256 (ChecksumSHA256)."""
    s3 = platform.client("s3")
    if call(s3.head_object, Bucket=bucket, Key=packed.key, absent_ok=True) is not None:
        _check_stored(s3, bucket, packed)
        return False
    digest = base64.b64encode(bytes.fromhex(packed.sha256)).decode()
    try:
        # The bucket encrypts every object (S3-managed keys, its default): no header to add, as for the other uploads.
        call(s3.put_object, Bucket=bucket, Key=packed.key, Body=packed.archive, ChecksumSHA256=digest, ContentType="application/gzip",
             IfNoneMatch="*")
    except ClientFacingError as error:
        if not str(error).startswith(WRITTEN_MEANWHILE):
            raise
        _check_stored(s3, bucket, packed)  # another client's upload of it landed first
        return False
    return True


# What S3 answers a conditional write when an object came meanwhile (412), or while another lands (409).
WRITTEN_MEANWHILE = ("PreconditionFailed:", "ConditionalRequestConflict:")


def _check_stored(s3: Any, bucket: str, packed: PackedCode) -> None:
    problem = call(stored_archive_problem, s3=s3, bucket=bucket, key=packed.key, sha256=packed.sha256)
    if problem is not None:
        raise ClientFacingError(f"{problem}: ask the platform's operator to remove it, then run again")


def upload_local_code(platform: Platform, bucket: str, raw: Any, base: Path, packed: Mapping[Path, PackedCode], sweep: bool = False) -> Any:
    """Upload each packed folder (once), and the spec as the platform launches it."""
    for archive in {archive.sha256: archive for archive in packed.values()}.values():
        upload_code(platform, bucket, archive)
    return with_uploaded_code(raw, base, bucket, packed, sweep)


# Runs -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A training run: its execution of the training-run state machine; its id is the execution's name."""

    name: str
    execution_arn: str


def execution_arn(machine_arn: str, name: str) -> str:
    """arn:aws:states:<region>:<account>:stateMachine:<machine> → ...:execution:<machine>:<name>. Pure."""
    return machine_arn.replace(":stateMachine:", ":execution:", 1) + f":{name}"


def run_of(name: str, platform: Platform, machine: str | None = None) -> Run:
    return Run(name, execution_arn(machine or platform.training_run_machine, name))


def default_run_name(spec: Mapping[str, Any], now: datetime | None = None) -> str:
    """<run_name>-<UTC time>: unique per second, within Step Functions' 80 characters. Pure."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    return f"{str(spec.get('run_name', 'run'))[:64]}-{stamp}"


def check_name(name: str, limit: int = 80, what: str = "--name") -> str:
    """A run's or sweep's id: what Step Functions (1–80 characters, none of whitespace, brackets,
    wildcards, ``"#%\\^|~`$&,;:/`` or control characters), the results' keys and the job names all
    accept. ``what`` is how the caller took it, for the refusal."""
    if not RUN_ID.fullmatch(name) or len(name) > limit:
        raise InputRefused(f"{what} {name!r}: 1–{limit} letters, digits, hyphens or underscores")
    return name


def launch(spec: str | Path | Mapping[str, Any], platform: Platform | None = None, name: str | None = None) -> Run:
    """Validate the spec (and pack its local code), then upload the code and start a training-run
    execution named ``name`` (default: the spec's run_name and the time)."""
    platform = platform or Platform()
    label, raw = read_json(spec)
    _checked(label, raw, sweep=False)
    run_name = check_name(default_run_name(raw) if name is None else name)
    packed = pack_local_code(label, raw, spec_folder(spec))  # before any AWS call
    if packed:
        raw = upload_local_code(platform, platform.results_bucket, raw, spec_folder(spec), packed)
    return _start(platform, platform.training_run_machine, raw, run_name)


def launch_sweep(sweep: str | Path | Mapping[str, Any], platform: Platform | None = None, name: str | None = None) -> Run:
    platform = platform or Platform()
    label, raw = read_json(sweep)
    _checked(label, raw, sweep=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    sweep_id = check_name(f"{raw['sweep_name']}-{stamp}" if name is None else name, SWEEP_ID_LENGTH)
    packed = pack_local_code(label, raw, spec_folder(sweep), sweep=True)
    if packed:
        raw = upload_local_code(platform, platform.results_bucket, raw, spec_folder(sweep), packed, sweep=True)
    return _start(platform, platform.sweep_machine, raw, sweep_id)


def _start(platform: Platform, machine: str, raw: Mapping[str, Any], name: str) -> Run:
    started = call(platform.client("stepfunctions").start_execution, stateMachineArn=machine, name=name, input=json.dumps(raw))
    return Run(name, started["executionArn"])


def describe(run: Run, platform: Platform) -> dict[str, Any]:
    return call(platform.client("stepfunctions").describe_execution, executionArn=run.execution_arn,
                missing=f"no run {run.name!r} on this platform (see `hetero runs`)")


def result(run: Run | str, platform: Platform | None = None) -> dict[str, Any] | None:
    """The run's result.json, or None while there is none yet."""
    platform = platform or Platform()
    name = run.name if isinstance(run, Run) else run
    found = call(platform.client("s3").get_object, Bucket=platform.results_bucket, Key=f"results/{name}/result.json", absent_ok=True)
    return None if found is None else json.loads(found["Body"].read())


def job_name(run: Run, platform: Platform) -> str | None:
    """The training job the run launched last (a capacity relaunch launches another): the newest launch
    output in the execution's history, read newest first (a long run's history has thousands of polls)."""
    sfn = platform.client("stepfunctions")
    token = None
    while True:
        page = call(sfn.get_execution_history, executionArn=run.execution_arn, maxResults=200, reverseOrder=True,
                    **({"nextToken": token} if token else {}))
        for event in page["events"]:
            details = event.get("lambdaFunctionSucceededEventDetails") or event.get("taskSucceededEventDetails") or {}
            try:
                output = json.loads(details.get("output") or "{}")
            except json.JSONDecodeError:
                continue
            payload = output.get("Payload", output) if isinstance(output, dict) else {}
            if isinstance(payload, dict) and isinstance(payload.get("job_name"), str):
                return payload["job_name"]
        token = page.get("nextToken")
        if not token:
            return None


@dataclass(frozen=True)
class Event:
    """What `follow` reports: kind is "execution" (the run's status), "job" (the training job's status
    or secondary status), "progress" (step, steps and the last metric line's values) or "done"."""

    kind: str
    status: str = ""
    message: str = ""
    step: int = 0
    steps: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)


def follow(run: Run, platform: Platform | None = None, poll_s: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> Iterator[Event]:
    """Events of a run until it ends: its status, its job's transitions, its step metrics (from the
    job's log lines: SageMaker's metrics lag a minute). The last event is "done" with the run's status
    and, for a failed run, its error and cause. A failing look (throttling past the retries, a dropped
    connection) is reported as a "warning" event and the next poll tries again."""
    platform = platform or Platform()
    last: dict[str, Any] = {}
    log_token: dict[str, str] = {}
    job: str | None = None
    while True:
        try:
            described = describe(run, platform)
            status = described["status"]
            if last.get("execution") != status:
                last["execution"] = status
                yield Event("execution", status=status)
            if job is None or last.get("job_status") == "Failed":  # none yet, or a capacity relaunch may follow
                job = job_name(run, platform) or job
            if job:
                yield from job_events(platform, job, last, log_token)
        except TransientError as error:
            yield Event("warning", message=str(error))
            sleep(poll_s)
            continue
        if status != "RUNNING":
            reason = ": ".join(part for part in (described.get("error"), described.get("cause")) if part)
            yield Event("done", status=status, message=reason)
            return
        sleep(poll_s)


def job_events(platform: Platform, job: str, last: dict[str, Any], log_token: dict[str, str]) -> Iterator[Event]:
    """One look at a training job: an event for its status if it changed, and one for its progress if its
    hosts logged a newer step (``last`` and ``log_token`` carry what the previous look saw)."""
    training = call(platform.client("sagemaker").describe_training_job, TrainingJobName=job,
                    missing=f"no training job {job!r} in this account and region")
    state = f"{job}/{training['TrainingJobStatus']}/{training.get('SecondaryStatus', '')}"
    last["job_status"] = training["TrainingJobStatus"]
    last["failure_reason"] = training.get("FailureReason", "")
    if last.get("job") != state:
        last["job"] = state
        yield Event("job", status=training["TrainingJobStatus"], message=f"{job}: {training.get('SecondaryStatus', '')}")
    progress = latest_progress(platform, job, log_token)
    if progress and progress != last.get("progress"):
        last["progress"] = progress
        yield Event("progress", step=progress[0], steps=progress[1], metrics=progress[2])


# SageMaker's statuses of a job that has ended.
JOB_ENDED = ("Completed", "Failed", "Stopped")


def follow_job(job: str, platform: Platform | None = None, poll_s: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> Iterator[Event]:
    """Events of one training job until it ends (a job launched without the state machine: hetero/direct.py):
    its status transitions and step metrics, then "done" with its status and failure reason."""
    platform = platform or Platform()
    last: dict[str, Any] = {}
    log_token: dict[str, str] = {}
    while True:
        try:
            yield from job_events(platform, job, last, log_token)
        except TransientError as error:
            yield Event("warning", message=str(error))
            sleep(poll_s)
            continue
        if last["job_status"] in JOB_ENDED:
            yield Event("done", status=last["job_status"], message=last["failure_reason"])
            return
        sleep(poll_s)


def latest_progress(platform: Platform, job: str, tokens: dict[str, str]) -> tuple[int, int, dict[str, float]] | None:
    """The last metric line any host of the job logged since the previous call: (step, steps, values)."""
    logs = platform.client("logs")
    found = None
    kwargs: dict[str, Any] = {"logGroupName": TRAINING_LOG_GROUP, "logStreamNamePrefix": f"{job}/", "filterPattern": '"step="'}
    if job in tokens:
        kwargs["startTime"] = int(tokens[job])
    while True:
        page = call(logs.filter_log_events, absent_ok=True, **kwargs)  # None: no log group yet, no line written
        if page is None:
            return found
        for event in page.get("events", []):
            match = STEP.search(event["message"])
            if match:
                found = (int(match.group(1)), int(match.group(2)), parse_metric_line(event["message"]))
                tokens[job] = str(event["timestamp"])
        if not page.get("nextToken"):
            return found
        kwargs["nextToken"] = page["nextToken"]


def runs(platform: Platform | None = None, limit: int = 20) -> list[dict[str, Any]]:
    """The most recent runs, newest first, with their step time and cost where their result says."""
    platform = platform or Platform()
    sfn = platform.client("stepfunctions")
    listed: list[dict[str, Any]] = []
    token = None
    while len(listed) < limit:  # a page may hold fewer than asked, with a token for more
        page = call(sfn.list_executions, stateMachineArn=platform.training_run_machine, maxResults=min(limit, 1000),
                    **({"nextToken": token} if token else {}))
        listed += page["executions"]
        token = page.get("nextToken")
        if not token:
            break
    rows = []
    for execution in sorted(listed, key=lambda item: item["startDate"], reverse=True)[:limit]:
        outcome = result(execution["name"], platform) or {}
        rows.append({
            "run": execution["name"],
            "status": execution["status"],
            "started": execution["startDate"].isoformat(timespec="seconds"),
            "job_status": outcome.get("job_status"),
            "step_time_ms": (outcome.get("step_time_ms") or {}).get("p50"),
            "billed_ms_per_step": outcome.get("billed_ms_per_step"),
            "cost_per_1k_steps_usd": outcome.get("cost_per_1k_steps_usd"),
        })
    return rows


def stop(run: Run, platform: Platform | None = None) -> str:
    """Stop a run's execution; the platform's abort cleanup then stops its training job. Returns the
    status the run had."""
    platform = platform or Platform()
    status = describe(run, platform)["status"]
    if status == "RUNNING":
        call(platform.client("stepfunctions").stop_execution, executionArn=run.execution_arn, cause="stopped with `hetero stop`")
    return status


def seconds(duration: str) -> float:
    """30s, 10m, 2h, 1d → seconds. Pure."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", duration.strip())
    if not match:
        raise ValueError(f"--since {duration!r}: a number and s, m, h or d (30s, 10m, 2h, 1d)")
    return float(match.group(1)) * units[match.group(2)]


def log_lines(run: Run, platform: Platform | None = None, hosts: set[str] | None = None, groups: set[str] | None = None,
              limit: int = 10_000, since: float | None = None) -> list[tuple[str, str]]:
    """(host, line) of the run's job, oldest first, for the given hosts and/or instance groups (a host's
    group is what its launcher logged: SageMaker names streams by host only), at most ``limit`` lines
    from ``since`` (epoch seconds) on. With ``since`` and groups, a host whose launcher line is older
    than ``since`` is not known to be in the group."""
    platform = platform or Platform()
    job = job_name(run, platform)
    if job is None:
        raise ClientFacingError(f"run {run.name!r} has not launched a job yet")
    return job_log_lines(job, platform, hosts, groups, limit, since)


def job_log_lines(job: str, platform: Platform, hosts: set[str] | None = None, groups: set[str] | None = None,
                  limit: int = 10_000, since: float | None = None) -> list[tuple[str, str]]:
    """log_lines of a training job by its name."""
    logs = platform.client("logs")
    events: list[dict[str, Any]] = []
    # One host: CloudWatch filters by its streams' prefix (<job>/<host>-); the group's hosts are read
    # from their launchers' lines, so a group filter reads every stream.
    for prefix in ([f"{job}/{host}-" for host in sorted(hosts)] if hosts and not groups else [f"{job}/"]):
        kwargs: dict[str, Any] = {"logGroupName": TRAINING_LOG_GROUP, "logStreamNamePrefix": prefix}
        if since is not None:
            kwargs["startTime"] = int(since * 1000)
        while len(events) < limit:
            page = call(logs.filter_log_events, missing=f"no logs for job {job} yet", **kwargs)
            events += page.get("events", [])
            if not page.get("nextToken"):
                break
            kwargs["nextToken"] = page["nextToken"]
    host_of_stream = {event["logStreamName"]: event["logStreamName"].split("/", 1)[1].rsplit("-", 1)[0] for event in events}
    group_of_host = {match.group(1): match.group(2) for event in events if (match := GROUP_LINE.search(event["message"]))}
    chosen = []
    for event in sorted(events, key=lambda item: item["timestamp"]):
        host = host_of_stream[event["logStreamName"]]
        if hosts and host not in hosts:
            continue
        if groups and group_of_host.get(host) not in groups:
            continue
        chosen.append((host, event["message"].rstrip("\n")))
    return chosen[:limit]


def sweep_report(sweep_id: str, platform: Platform | None = None) -> tuple[str, dict[str, Any], bytes | None]:
    """(report.md, report.json, chart.png or None) of a finished sweep."""
    platform = platform or Platform()
    s3 = platform.client("s3")

    def read(key: str, absent_ok: bool = False) -> bytes | None:
        found = call(s3.get_object, Bucket=platform.results_bucket, Key=f"benchmarks/{sweep_id}/{key}", absent_ok=absent_ok,
                     missing=f"no report for sweep {sweep_id!r} (yet): it is written when the sweep ends")
        return None if found is None else found["Body"].read()

    markdown, report = (read("report.md") or b"").decode(), json.loads(read("report.json") or b"{}")
    return markdown, report, read("chart.png", absent_ok=True)
