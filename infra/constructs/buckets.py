"""The platform's S3 buckets: datasets (read by training; versioned), results (artifacts, checkpoints,
results, reports; versioned), and the access-log bucket both log to. All encrypted, SSL-only, private."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.nag import acknowledge, skip_checkov


def _bucket(scope: Construct, construct_id: str, **overrides: object) -> s3.Bucket:
    return s3.Bucket(
        scope,
        construct_id,
        encryption=s3.BucketEncryption.S3_MANAGED,
        enforce_ssl=True,
        block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
        object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
        removal_policy=RemovalPolicy.RETAIN,
        **overrides,
    )


class Buckets(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, checkpoint_retention_days: int) -> None:
        super().__init__(scope, construct_id)
        self.access_logs = _bucket(self, "AccessLogs", lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(365))])
        acknowledge(self.access_logs, "This is the access-log bucket; logging it into itself would loop.", "S1")
        skip_checkov(self.access_logs, "This is the access-log bucket; logging it into itself would loop.", "CKV_AWS_18")
        skip_checkov(self.access_logs, "S3 log delivery writes each log object once and never overwrites it; they expire after a year, "
                                       "and versioning would only keep deleted logs longer.", "CKV_AWS_21")
        # Versioned: a dataset object overwritten or deleted by mistake can be restored for 90 days (a run's
        # result names the dataset's URI, not a copy).
        self.datasets = _bucket(
            self, "Datasets", versioned=True, server_access_logs_bucket=self.access_logs, server_access_logs_prefix="datasets/",
            lifecycle_rules=[s3.LifecycleRule(noncurrent_version_expiration=Duration.days(90),
                                              abort_incomplete_multipart_upload_after=Duration.days(7))],
        )
        self.results = _bucket(
            self,
            "Results",
            versioned=True,
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="results/",
            lifecycle_rules=[
                s3.LifecycleRule(prefix="checkpoints/", expiration=Duration.days(checkpoint_retention_days),
                                 noncurrent_version_expiration=Duration.days(7), abort_incomplete_multipart_upload_after=Duration.days(7)),
                # Each job's shutdown token (control/<job>/): read once, when the job starts (≤ 5 days + start).
                s3.LifecycleRule(prefix="control/", expiration=Duration.days(7), noncurrent_version_expiration=Duration.days(1)),
                # Results and reports keep every version: they are never overwritten, nor expire.
                *(s3.LifecycleRule(prefix=prefix, noncurrent_version_expiration=Duration.days(90),
                                   abort_incomplete_multipart_upload_after=Duration.days(7))
                  for prefix in ("artifacts/", "prices/", "neuron-cache/")),
            ],
        )
        # "Never overwritten" held by S3 itself, not only by our code: a write to results/ or benchmarks/
        # must be conditional on no object being there (If-None-Match: *), whoever makes it; and so must a
        # write to code/: a workload's archive is named by its SHA-256, and a run's hosts refuse one whose
        # bytes are not it, so an overwrite could only break the runs that use it.
        # Nothing else under code/ may share an archive's key as its prefix: a channel of S3Prefix type downloads
        # every object whose key starts with the archive's (sourcedir.tar.gz.x.tar.gz, sourcedir.tar.gz/x), and
        # such an object, planted by anyone who may write code/, would break every run of that archive.
        self.results.add_to_resource_policy(
            iam.PolicyStatement(
                sid="OnlyArchivesUnderCode", effect=iam.Effect.DENY, principals=[iam.AnyPrincipal()], actions=["s3:PutObject"],
                resources=[self.results.arn_for_objects("code/*/sourcedir.tar.gz?*")],
            )
        )
        for prefix in ("results/", "benchmarks/", "code/"):
            self.results.add_to_resource_policy(
                iam.PolicyStatement(
                    sid=f"WriteOnce{prefix.strip('/').capitalize()}",
                    effect=iam.Effect.DENY,
                    principals=[iam.AnyPrincipal()],
                    actions=["s3:PutObject"],
                    resources=[self.results.arn_for_objects(f"{prefix}*")],
                    conditions={"Null": {"s3:if-none-match": "true"}},
                )
            )
