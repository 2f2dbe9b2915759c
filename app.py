"""The CDK app: `cdk synth` / `cdk deploy` (see `make deploy`), or `python app.py` to synthesise into
cdk.out. Settings come from the "platform" context (cdk.json; override with -c platform='{...}')."""

from __future__ import annotations

import json
import os

from aws_cdk import App, Environment, Validations
from cdk_nag import AwsSolutionsChecks

from infra.config import CONTEXT_KEY, PlatformConfig
from infra.stacks.platform_stack import PlatformStack

# Feature flags new projects get from `cdk init`; the access-log bucket then takes logs through a bucket
# policy instead of the legacy LogDeliveryWrite ACL.
FEATURE_FLAGS = {"@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy": True}


def build_app(context: dict | None = None, outdir: str | None = None) -> tuple[App, PlatformStack]:
    app = App(context=FEATURE_FLAGS | (context or {}), outdir=outdir)
    raw = app.node.try_get_context(CONTEXT_KEY)
    config = PlatformConfig.from_context(json.loads(raw) if isinstance(raw, str) else raw)
    stack = PlatformStack(
        app,
        f"{config.prefix.capitalize()}TrainingPlatform",
        config=config,
        env=Environment(account=os.environ.get("CDK_DEFAULT_ACCOUNT"), region=config.region),
        description="Heterogeneous-cluster training on SageMaker: buckets, images, roles, training-run state machine",
    )
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app, stack


if __name__ == "__main__":
    # The CLI passes its output folder in CDK_OUTDIR; run directly, synthesise into ./cdk.out.
    build_app(outdir=os.environ.get("CDK_OUTDIR", "cdk.out"))[0].synth()
