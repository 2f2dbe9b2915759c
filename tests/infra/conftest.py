"""One synthesis of the platform per test session (a first CDK synth costs seconds; later ones are
cheap), with cdk-nag's AwsSolutions pack attached: synthesis fails on any unacknowledged finding."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

from aws_cdk.assertions import Template  # noqa: E402

from app import build_app  # noqa: E402


@pytest.fixture(scope="session")
def synthesized() -> tuple[Any, Any]:
    app, stack = build_app()
    assembly = app.synth()  # raises ValidationFailed on an unacknowledged cdk-nag finding
    return assembly, stack


@pytest.fixture(scope="session")
def template(synthesized) -> Template:
    _, stack = synthesized
    return Template.from_stack(stack)


@pytest.fixture(scope="session")
def template_json(template: Template) -> dict[str, Any]:
    return template.to_json()


# The VPC-mode synthesis also allows an input bucket of the deployment's (cdk.json's input_buckets) and a
# repository of script images (script_image_repositories).
VPC_CONTEXT = {"platform": {"vpc_mode": True, "input_buckets": ["example-training-data"], "script_image_repositories": ["teams/train"]}}


@pytest.fixture(scope="session")
def in_vpc() -> dict[str, Any]:
    """The platform synthesized in VPC mode (cdk-nag runs as part of synthesis: it must be clean)."""
    app, stack = build_app(context=VPC_CONTEXT)
    app.synth()
    return Template.from_stack(stack).to_json()


def render(value: Any, references: dict[str, str] | None = None) -> Any:
    """Resolve the intrinsics a definition string is built from: Fn::Join, Ref, Fn::GetAtt. A reference
    not in ``references`` becomes a readable placeholder (<LogicalId> or <LogicalId.Attribute>)."""
    references = references or {}
    if isinstance(value, dict) and len(value) == 1:
        (key, argument), = value.items()
        if key == "Fn::Join":
            separator, parts = argument
            return separator.join(str(render(part, references)) for part in parts)
        if key == "Ref":
            return references.get(argument, f"<{argument}>")
        if key == "Fn::GetAtt":
            name = ".".join(argument)
            return references.get(name, f"<{name}>")
    if isinstance(value, dict):
        return {k: render(v, references) for k, v in value.items()}
    if isinstance(value, list):
        return [render(item, references) for item in value]
    return value


def state_machine_logical_id(template_json: dict[str, Any], construct: str = "TrainingRun") -> str:
    """The logical ID of the state machine in construct ``TrainingRun`` or ``BenchmarkSweep``."""
    (logical_id,) = [key for key, r in template_json["Resources"].items()
                     if r["Type"] == "AWS::StepFunctions::StateMachine" and key.startswith(f"{construct}StateMachine")]
    return logical_id


def state_machine_definition(
    template_json: dict[str, Any], references: dict[str, str] | None = None, construct: str = "TrainingRun"
) -> dict[str, Any]:
    resource = template_json["Resources"][state_machine_logical_id(template_json, construct)]
    return json.loads(render(resource["Properties"]["DefinitionString"], references))


ASSET_HASH = re.compile(r"[0-9a-f]{64}")
ACCOUNT, REGION = "123456789012", "us-east-1"
PSEUDO = {"AWS::Partition": "aws", "AWS::Region": REGION, "AWS::AccountId": ACCOUNT, "AWS::URLSuffix": "amazonaws.com"}


def deployed_references(template_json: dict[str, Any], function_names: dict[str, str] | None = None) -> dict[str, str]:
    """What CloudFormation would substitute: pseudo parameters, and each function's ARN (named after its
    logical ID, or as given in ``function_names``)."""
    references = dict(PSEUDO)
    for logical_id, resource in template_json["Resources"].items():
        if resource["Type"] == "AWS::Lambda::Function":
            name = (function_names or {}).get(logical_id, logical_id)
            references[f"{logical_id}.Arn"] = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{name}"
    return references
