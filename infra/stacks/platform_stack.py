"""The platform in one stack: storage, training images, the SageMaker role (and in VPC mode its network),
the policy for direct launches, the functions, the
training-run and benchmark-sweep state machines (with the sweep's schedule, dashboard and alarm), the
abort cleanup, and the key every log group is encrypted with. It only composes constructs and exports what users need."""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, Stack
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.config import PlatformConfig
from infra.constructs.abort_cleanup import AbortCleanup
from infra.constructs.alarm_topic import AlarmTopic
from infra.constructs.benchmark_sweep import BenchmarkSweep
from infra.constructs.buckets import Buckets
from infra.constructs.direct_launch import DirectLaunchPolicy
from infra.constructs.execution_role import ExecutionRole
from infra.constructs.functions import TrainingRunFunctions, training_jobs_resource
from infra.constructs.log_encryption import LogEncryption
from infra.constructs.training_images import TrainingImages
from infra.constructs.training_network import TrainingNetwork
from infra.constructs.training_workflow import TrainingWorkflow


class PlatformStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: PlatformConfig, **kwargs: Any) -> None:
        super().__init__(scope, construct_id, **kwargs)
        buckets = Buckets(self, "Buckets", checkpoint_retention_days=config.checkpoint_retention_days)
        images = TrainingImages(self, "TrainingImages", base_images={v: config.base_image(v) for v in config.base_images})
        inputs = [buckets.datasets, *(s3.Bucket.from_bucket_name(self, f"Input{index}", name) for index, name in enumerate(config.input_buckets))]
        script_repositories = [ecr.Repository.from_repository_name(self, f"ScriptImages{index}", name)
                               for index, name in enumerate(config.script_image_repositories)]
        role = ExecutionRole(self, "SageMakerExecution", inputs=inputs, results=buckets.results, images=images.images.values(),
                             script_repositories=script_repositories)
        network = TrainingNetwork(self, "TrainingNetwork", sagemaker_role=role.role, buckets=[buckets.results, *inputs],
                                  log_retention_days=config.log_retention_days) if config.vpc_mode else None
        vpc_config = {"SecurityGroupIds": [network.security_group.security_group_id], "Subnets": network.subnet_ids} if network else None
        functions = TrainingRunFunctions(
            self, "TrainingRunFunctions", prefix=config.prefix, sagemaker_role=role.role, results=buckets.results,
            image_uris=images.image_uris, log_retention_days=config.log_retention_days, deadline_grace_s=config.deadline_grace_s,
            poll_interval_s=config.poll_interval_s,
            policy_environment=config.policy_environment(self.to_json_string([bucket.bucket_name for bucket in inputs]),
                                                         self.to_json_string([repository.repository_uri for repository in script_repositories])),
            start_timeout_s=config.start_timeout_s, capacity_relaunches=config.capacity_relaunches, capacity_backoff_s=config.capacity_backoff_s,
            vpc_config=vpc_config,
        )
        workflow = TrainingWorkflow(
            self, "TrainingRun", prefix=config.prefix, functions=functions, poll_interval_s=config.poll_interval_s,
            start_timeout_s=config.start_timeout_s,
            timeout_s=config.run_timeout_s, log_retention_days=config.log_retention_days,
        )
        AbortCleanup(self, "AbortCleanup", state_machine=workflow.state_machine, stop=functions.stop, reconcile=functions.reconcile)
        sweep = BenchmarkSweep(
            self, "BenchmarkSweep", prefix=config.prefix, functions=functions, training_run=workflow.state_machine,
            max_concurrency=config.sweep_max_concurrency, timeout_h=config.sweep_timeout_h,
            log_retention_days=config.log_retention_days, schedule=config.sweep_schedule,
        )
        direct = DirectLaunchPolicy(self, "DirectLaunch", prefix=config.prefix, jobs_arn=training_jobs_resource(self, config.prefix),
                                    sagemaker_role=role.role, results=buckets.results, instance_types=config.priced_instance_types(), vpc_config=vpc_config)
        self.alarms = AlarmTopic(self, "Alarms", email=config.alarm_email)
        self.alarms.notify_from_every_alarm_in(self)
        self.log_encryption = LogEncryption(self, "LogEncryption")
        self.log_encryption.encrypt_every_log_group_in(self)
        self.buckets, self.functions, self.workflow, self.sweep = buckets, functions, workflow, sweep
        CfnOutput(self, "AlarmTopic", value=self.alarms.topic.topic_arn)
        CfnOutput(self, "DatasetsBucket", value=buckets.datasets.bucket_name)
        CfnOutput(self, "ResultsBucket", value=buckets.results.bucket_name)
        CfnOutput(self, "TrainingRunStateMachine", value=workflow.state_machine.state_machine_arn)
        CfnOutput(self, "BenchmarkSweepStateMachine", value=sweep.state_machine.state_machine_arn)
        CfnOutput(self, "BenchmarksDashboard", value=sweep.dashboard.dashboard_name)
        CfnOutput(self, "LaunchSettings", value=self.to_json_string(functions.launch_settings),
                  description="The launch function's settings: images, SageMaker role, locations, spec policy (hetero run --direct)")
        CfnOutput(self, "DirectLaunchPolicy", value=direct.policy.managed_policy_arn,
                  description="Attach to the role of whoever launches with `hetero run --direct`")
