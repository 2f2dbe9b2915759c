"""The platform's Lambda functions: validate, launch, collect, stop (the training run) and plan, compare
(the benchmark sweep). One code asset holds the handlers and the pure modules they share with the
training image (job spec, container contract, metric names); Powertools comes from its public layer. Each
function has its own role: its log group, and the few SageMaker/S3/pricing actions it needs, scoped to the
platform's job-name prefix and bucket prefixes."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import ArnFormat, Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra.nag import (
    S3_READ_ACTIONS,
    acknowledge,
    arn_token,
    skip_checkov,
    training_jobs_arn,
    wildcard_actions,
    wildcard_resources,
)
from lambdas.core.sweep import METRIC_NAMESPACE
from lambdas.core.training_request import RUN_KEY_TAG, SESSION_TAG_KEYS

REPO_ROOT = Path(__file__).resolve().parents[2]
# What the handlers import, and nothing else (no torch, no grpc: these modules are standard library).
LAMBDA_SOURCES = (
    "lambdas/*.py",
    "lambdas/core/*.py",
    "lambdas/*/handler.py",
    "lambdas/*/__init__.py",
    "training/__init__.py",
    "training/cluster.py",
    "training/hyperparameters.py",
    "training/metrics.py",
    "training/variants.py",
    "training/trainers/__init__.py",
    "training/trainers/config.py",
    "training/data_service/__init__.py",
    "training/data_service/augmentation.py",
    "training/workload/__init__.py",
    "training/workload/code.py",
)
RUNTIME = lambda_.Runtime.PYTHON_3_14
# Why checkov's Lambda checks do not apply to these functions (acknowledged on each; the stop and reconcile
# functions' dead-letter check is acknowledged where their asynchronous invocation is set up,
# infra/constructs/abort_cleanup.py).
UNRESERVED_CONCURRENCY = (
    "No reserved concurrency: it is taken from the account's unreserved pool, which must keep its minimum (100, or all of a new "
    "account's limit of 10, where any reservation fails the deploy), and these functions run a few times per run, one call at a "
    "time per execution (a sweep runs at most max_concurrency at once): there is nothing to cap.")
OUTSIDE_THE_VPC = (
    "The functions call AWS APIs only (SageMaker, Step Functions, S3, Pricing, CloudWatch, X-Ray) and reach nothing inside a VPC; "
    "the training VPC (VPC mode) has no route out, so they would need an interface endpoint per API there, billed per AZ and "
    "hour, to reach what they reach now; without VPC mode there is no VPC.")
PLAIN_ENVIRONMENT = (
    "The environment holds names, ARNs, S3 prefixes, timings and cost ceilings, no secret (job tokens go to S3, never here); "
    "Lambda encrypts it at rest with its AWS-managed key, and a key of ours would protect nothing secret.")
SYNCHRONOUS_ONLY = (
    "Invoked synchronously, by the state machines only (their Retry and Catch handle its errors); a dead-letter queue "
    "receives failed asynchronous invocations alone.")
POWERTOOLS_LAYER_PARAMETER = "/aws/service/powertools/python/x86_64/python3.14/latest"


def training_jobs_resource(stack: Stack, prefix: str) -> str:
    """The ARN pattern of the platform's own training jobs, which every SageMaker permission is held to."""
    return stack.format_arn(service="sagemaker", resource="training-job", resource_name=f"{prefix}-*")


def stage_lambda_code(target: Path) -> Path:
    """Copy the handlers' sources into ``target`` (replacing it), so the asset is exactly those files."""
    shutil.rmtree(target, ignore_errors=True)
    for pattern in LAMBDA_SOURCES:
        for source in sorted(REPO_ROOT.glob(pattern)):
            destination = target / source.relative_to(REPO_ROOT)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
    return target


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    handler_package: str
    description: str
    timeout_s: int = 30


class TrainingRunFunctions(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        prefix: str,
        sagemaker_role: iam.IRole,
        results: s3.IBucket,
        image_uris: dict[str, str],
        log_retention_days: int,
        deadline_grace_s: int,
        poll_interval_s: int,
        policy_environment: dict[str, str],
        start_timeout_s: int,
        capacity_relaunches: int,
        capacity_backoff_s: int,
        vpc_config: dict | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        code = lambda_.Code.from_asset(str(stage_lambda_code(REPO_ROOT / "build" / "lambda-code")))
        layer = lambda_.LayerVersion.from_layer_version_arn(
            self, "Powertools", ssm.StringParameter.value_for_string_parameter(self, POWERTOOLS_LAYER_PARAMETER)
        )
        jobs_arn = training_jobs_resource(stack, prefix)
        environment = {
            "JOB_NAME_PREFIX": prefix,
            "RESULTS_BUCKET": results.bucket_name,
            "POWERTOOLS_LOG_LEVEL": "INFO",
            # Launch attempts one execution may make (the stop function looks for each of their jobs).
            "CAPACITY_RELAUNCHES": str(capacity_relaunches),
        } | policy_environment  # the spec policy: allowed input buckets, cost ceilings (infra/config.py)

        def function(spec: FunctionSpec, extra_environment: dict[str, str] | None = None) -> lambda_.Function:
            log_group = logs.LogGroup(
                self, f"{spec.name}Logs", retention=retention(log_retention_days), removal_policy=RemovalPolicy.DESTROY
            )
            role = iam.Role(self, f"{spec.name}Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))
            log_group.grant_write(role)
            fn = lambda_.Function(
                self,
                spec.name,
                runtime=RUNTIME,
                handler=f"lambdas.{spec.handler_package}.handler.handler",
                code=code,
                layers=[layer],
                role=role,
                log_group=log_group,
                timeout=Duration.seconds(spec.timeout_s),
                memory_size=256,
                tracing=lambda_.Tracing.ACTIVE,
                description=spec.description,
                environment=environment | {"POWERTOOLS_SERVICE_NAME": spec.handler_package} | (extra_environment or {}),
            )
            acknowledge(
                role, "X-Ray's PutTraceSegments and PutTelemetryRecords take no resource ARN.", *wildcard_resources("*")
            )
            skip_checkov(fn, UNRESERVED_CONCURRENCY, "CKV_AWS_115")
            skip_checkov(fn, OUTSIDE_THE_VPC, "CKV_AWS_117")
            skip_checkov(fn, PLAIN_ENVIRONMENT, "CKV_AWS_173")
            return fn

        self.validate = function(FunctionSpec("ValidateSpec", "validate_spec", "Validate a training run's job spec"))
        launch_settings = {
            "IMAGE_URIS": stack.to_json_string(image_uris),
            "SAGEMAKER_ROLE_ARN": sagemaker_role.role_arn,
            "OUTPUT_S3_URI": results.s3_url_for_object("artifacts/"),
            "CHECKPOINT_S3_URI": results.s3_url_for_object("checkpoints/"),
            "CONTROL_S3_URI": results.s3_url_for_object("control/"),
            "NEURON_CACHE_S3_URI": results.s3_url_for_object("neuron-cache/"),
            "JOB_TAGS": stack.to_json_string({"platform": prefix}),
        } | ({"VPC_CONFIG": stack.to_json_string(vpc_config)} if vpc_config else {})
        # What a launch needs besides the spec, as the launch function reads it; the stack exports the same
        # (its LaunchSettings output) for launching one job without the state machine (`hetero run --direct`).
        self.launch_settings = {"JOB_NAME_PREFIX": prefix} | policy_environment | launch_settings
        self.launch = function(
            FunctionSpec("LaunchJob", "launch_job", "CreateTrainingJob with instance groups for a job spec"),
            launch_settings | {
                "DEADLINE_GRACE_S": str(deadline_grace_s),
                "POLL_INTERVAL_S": str(poll_interval_s),
                "START_TIMEOUT_S": str(start_timeout_s),
                "RELAUNCH_BACKOFF_S": str(capacity_backoff_s),
            },
        )
        self.collect = function(FunctionSpec("CollectResults", "collect_results", "Write results/<run id>/result.json", 60))
        self.stop = function(FunctionSpec("StopJob", "stop_job", "Stop a run's training job after a failure or an abort"))
        self.reconcile = function(FunctionSpec("ReconcileJobs", "reconcile_jobs", "Stop running jobs whose execution no longer runs", 120))

        # ListTags: a job of the launch's name is adopted only if its execution_arn tag is the launch's own.
        self.launch.add_to_role_policy(
            iam.PolicyStatement(actions=["sagemaker:DescribeTrainingJob", "sagemaker:ListTags"], resources=[jobs_arn])
        )
        # ListTrainingJobs takes no resource ARN: to refuse a run name whose job is running already.
        self.launch.add_to_role_policy(iam.PolicyStatement(actions=["sagemaker:ListTrainingJobs"], resources=["*"]))
        self.job_launcher = job_launcher_role(self, prefix=prefix, launch_role=self.launch.role, sagemaker_role=sagemaker_role, jobs_arn=jobs_arn)
        self.launch.add_environment("JOB_LAUNCHER_ROLE_ARN", self.job_launcher.role_arn)
        self.launch.add_to_role_policy(iam.PolicyStatement(actions=["sts:AssumeRole", "sts:TagSession"], resources=[self.job_launcher.role_arn]))
        for fn in (self.collect, self.stop):
            fn.add_to_role_policy(iam.PolicyStatement(actions=["sagemaker:DescribeTrainingJob"], resources=[jobs_arn]))
        self.reconcile.add_to_role_policy(iam.PolicyStatement(actions=["sagemaker:ListTrainingJobs"], resources=["*"]))
        self.reconcile.add_to_role_policy(iam.PolicyStatement(actions=["sagemaker:ListTags", "sagemaker:StopTrainingJob"], resources=[jobs_arn]))
        self.launch.add_to_role_policy(iam.PolicyStatement(actions=["sagemaker:StopTrainingJob"], resources=[jobs_arn]))
        executions = stack.format_arn(service="states", resource="execution", resource_name=f"{prefix}-training-run:*",
                                      arn_format=ArnFormat.COLON_RESOURCE_NAME)
        for fn in (self.reconcile, self.launch):  # the launch checks that its own execution still runs
            fn.add_to_role_policy(iam.PolicyStatement(actions=["states:DescribeExecution"], resources=[executions]))
        # ListTags: after an abort it stops only a job tagged with the aborted execution.
        self.stop.add_to_role_policy(iam.PolicyStatement(actions=["sagemaker:StopTrainingJob", "sagemaker:ListTags"], resources=[jobs_arn]))
        results.grant_read(self.collect, "artifacts/*")
        results.grant_put(self.collect, "results/*")
        results.grant_read(self.collect, "results/*")  # a retried collect reads the result it wrote
        # A run id whose result exists is refused before launch: HeadObject on results/ (ListBucket on that
        # prefix, so that a missing result answers 404, not 403).
        self.launch.add_to_role_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[results.arn_for_objects("results/*")]))
        # Whether a user workload's archive is there (HeadObject), before a job that would fail to download it is billed.
        self.launch.add_to_role_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[results.arn_for_objects("code/*")]))
        # ... and whether the run a spec resumes left checkpoints (ListBucket on checkpoints/).
        self.launch.add_to_role_policy(iam.PolicyStatement(actions=["s3:ListBucket"], resources=[results.bucket_arn],
                                                           conditions={"StringLike": {"s3:prefix": ["results/*", "checkpoints/*", "code/*"]}}))
        # Each job's shutdown token, written once under control/<job name>/ (the job reads it as a channel).
        self.launch.add_to_role_policy(iam.PolicyStatement(actions=["s3:PutObject"], resources=[results.arn_for_objects("control/*")]))
        acknowledge(self.launch.role, "Reads whether a run's result or its workload's code exists, under results/ and code/ only; writes "
                                      "each job's token under control/ only.",
                    *wildcard_resources(f"{arn_token(results)}/results/*", f"{arn_token(results)}/control/*", f"{arn_token(results)}/code/*"))
        jobs = training_jobs_arn(stack, prefix)
        for fn in (self.launch, self.collect, self.stop, self.reconcile):
            acknowledge(fn.role, "Training jobs are held to the platform's job-name prefix.", *wildcard_resources(jobs))
        for fn in (self.launch, self.reconcile):
            acknowledge(fn.role, "sagemaker:ListTrainingJobs has no resource-level permissions (it lists, reading no job's data).",
                        *wildcard_resources("*"))
        for fn in (self.reconcile, self.launch):
            acknowledge(fn.role, "DescribeExecution is held to the executions of the platform's training-run state machine.",
                        *wildcard_resources(f"arn:<AWS::Partition>:states:{stack.region}:<AWS::AccountId>:execution:{prefix}-training-run:*"))
        acknowledge(
            self.collect.role,
            "Reads job outputs under artifacts/ and writes results under results/ of the results bucket only.",
            *wildcard_actions(*S3_READ_ACTIONS, "s3:Abort*"),
            *wildcard_resources(f"{arn_token(results)}/artifacts/*", f"{arn_token(results)}/results/*"),
        )
        self.training_run = (self.validate, self.launch, self.collect, self.stop)  # what the state machine invokes
        for fn in (self.validate, self.launch, self.collect):
            skip_checkov(fn, SYNCHRONOUS_ONLY, "CKV_AWS_116")

        # The benchmark sweep's two steps (infra/constructs/benchmark_sweep.py).
        self.plan_sweep = function(FunctionSpec("PlanSweep", "plan_sweep", "Validate a benchmark sweep and expand it into job specs"))
        self.compare_sweep = function(
            FunctionSpec("CompareSweep", "compare_sweep", "Write a sweep's report, chart and metrics, and recommend a configuration", 120),
            {"PRICING_REGION_CODE": stack.region},
        )
        results.grant_read(self.compare_sweep, "results/*")
        results.grant_read(self.compare_sweep, "prices/*")
        results.grant_put(self.compare_sweep, "prices/*")
        results.grant_put(self.compare_sweep, "benchmarks/*")
        # A retried compare reads back the report an earlier attempt wrote (a missing key must answer 404, not 403).
        results.grant_read(self.compare_sweep, "benchmarks/*")
        self.compare_sweep.add_to_role_policy(iam.PolicyStatement(actions=["pricing:GetProducts"], resources=["*"]))
        self.compare_sweep.add_to_role_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"], resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": METRIC_NAMESPACE}},
            )
        )
        acknowledge(
            self.compare_sweep.role,
            "Reads run results and the day's price cache, writes the price cache and sweep reports, each under its own "
            "prefix of the results bucket; the Price List API and PutMetricData take no resource ARN (metrics are held "
            "to the platform's namespace by condition).",
            *wildcard_actions(*S3_READ_ACTIONS, "s3:Abort*"),
            *wildcard_resources(
                "*", f"{arn_token(results)}/results/*", f"{arn_token(results)}/prices/*", f"{arn_token(results)}/benchmarks/*"
            ),
        )
        for fn in (self.plan_sweep, self.compare_sweep):
            skip_checkov(fn, SYNCHRONOUS_ONLY, "CKV_AWS_116")
        self.sweep = (self.plan_sweep, self.compare_sweep)


def job_launcher_role(scope: Construct, *, prefix: str, launch_role: iam.IRole, sagemaker_role: iam.IRole, jobs_arn: str) -> iam.Role:
    """The role a state-machine launch creates its job as, on a session tagged with the job's own keys
    (lambdas/core/training_request.py SESSION_TAG_KEYS) that SageMaker chains into the job's session of the
    execution role. Only the launch function assumes it, only with those tag keys, and with run_key set: a
    job created here is always held to its own prefixes (infra/constructs/execution_role.py)."""
    role = iam.Role(
        scope, "JobLauncherRole",
        description="Creates the platform's training jobs on sessions tagged with each job's own S3 prefixes",
        assumed_by=iam.SessionTagsPrincipal(iam.ArnPrincipal(launch_role.role_arn)).with_conditions({
            "ForAllValues:StringEquals": {"aws:TagKeys": list(SESSION_TAG_KEYS)},
            "Null": {f"aws:RequestTag/{RUN_KEY_TAG}": "false"},
        }),
        max_session_duration=Duration.hours(1),
    )
    role.add_to_policy(iam.PolicyStatement(actions=["sagemaker:CreateTrainingJob", "sagemaker:AddTags"], resources=[jobs_arn]))
    role.add_to_policy(
        iam.PolicyStatement(
            actions=["iam:PassRole"],
            resources=[sagemaker_role.role_arn],
            conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
        )
    )
    acknowledge(role, "Training jobs are held to the platform's job-name prefix.", *wildcard_resources(training_jobs_arn(Stack.of(scope), prefix)))
    return role


RETENTION = {30: logs.RetentionDays.ONE_MONTH, 90: logs.RetentionDays.THREE_MONTHS, 180: logs.RetentionDays.SIX_MONTHS,
             365: logs.RetentionDays.ONE_YEAR}


def retention(days: int) -> logs.RetentionDays:
    return RETENTION[days]
