"""Whether the AWS calls our handlers make are allowed by their synthesized roles: moto enforces no IAM, so a
grant the stack forgot (a compare that reads back benchmarks/ with only PutObject there) passed every workflow
test and failed on AWS. The harness records each call a handler makes (its service, operation and S3 bucket,
key or prefix) and checks it against the statements of the role the template gives that function, and of the
roles it may assume (the launch creates jobs as the job launcher role).

A small model of IAM, enough for the statements this stack writes: Allow statements, actions with wildcards,
S3 resources rendered from the template (the results bucket by its logical id), StringLike on s3:prefix.
Other services' calls are checked by action alone (their resources are job ARNs the infra tests check).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

# S3 operations → the action IAM checks for them.
S3_ACTIONS = {"GetObject": "s3:GetObject", "HeadObject": "s3:GetObject", "PutObject": "s3:PutObject", "DeleteObject": "s3:DeleteObject",
              "ListObjectsV2": "s3:ListBucket", "ListObjects": "s3:ListBucket", "ListObjectVersions": "s3:ListBucketVersions"}
# Operations whose IAM action is not "<prefix>:<Operation>".
OTHER_ACTIONS = {("monitoring", "PutMetricData"): "cloudwatch:PutMetricData"}


@dataclass(frozen=True)
class Call:
    function: str  # the Lambda function (the harness's name for it)
    service: str  # the service's signing name: s3, sagemaker, sts, states, monitoring, ...
    operation: str
    bucket: str = ""
    key: str | None = None  # an object's key, or a listing's prefix
    listing: bool = False

    @property
    def action(self) -> str:
        if self.service == "s3":
            return S3_ACTIONS.get(self.operation, f"s3:{self.operation}")
        return OTHER_ACTIONS.get((self.service, self.operation), f"{self.service}:{self.operation}")


def call_of(function: str, service: str, operation: str, params: dict[str, Any]) -> Call:
    if service != "s3":
        return Call(function, service, operation)
    listing = operation.startswith("List")
    return Call(function, service, operation, params.get("Bucket", ""), params.get("Prefix", "") if listing else params.get("Key"), listing)


def function_roles(template: dict[str, Any]) -> dict[str, list[str]]:
    """Function name (the harness's, from its logical id) → its role and the roles it may assume."""
    resources = template["Resources"]
    roles: dict[str, list[str]] = {}
    for logical_id, resource in resources.items():
        if resource["Type"] != "AWS::Lambda::Function":
            continue
        role = resource["Properties"]["Role"]["Fn::GetAtt"][0]
        assumed = [statement["Resource"]["Fn::GetAtt"][0] for statement in role_statements(template, role)
                   if "sts:AssumeRole" in _as_list(statement["Action"]) and isinstance(statement.get("Resource"), dict)]
        roles[logical_id] = [role, *assumed]
    return roles


def role_statements(template: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [statement for resource in template["Resources"].values() if resource["Type"] == "AWS::IAM::Policy"
            and {"Ref": role} in resource["Properties"]["Roles"] for statement in resource["Properties"]["PolicyDocument"]["Statement"]]


def allowed(call: Call, statements: list[dict[str, Any]], results_bucket: str) -> bool:
    for statement in statements:
        if statement.get("Effect") != "Allow" or not any(fnmatch.fnmatchcase(call.action, action) for action in _as_list(statement["Action"])):
            continue
        if call.service != "s3":
            return True
        arns = [_render(resource, results_bucket) for resource in _as_list(statement["Resource"])]
        target = f"arn:aws:s3:::{call.bucket}" if call.listing else f"arn:aws:s3:::{call.bucket}/{call.key}"
        if not any(fnmatch.fnmatchcase(target, arn) for arn in arns):
            continue
        prefixes = statement.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
        if call.listing and prefixes is not None and not any(fnmatch.fnmatchcase(call.key or "", prefix) for prefix in _as_list(prefixes)):
            continue
        return True
    return False


def _render(resource: Any, results_bucket: str) -> str:
    """An S3 resource of the template as an ARN pattern: the results bucket by its name, any other bucket
    as one no call names."""
    if resource == "*":
        return "*"
    if isinstance(resource, dict) and "Fn::GetAtt" in resource:
        logical_id = resource["Fn::GetAtt"][0]
        return f"arn:aws:s3:::{results_bucket}" if logical_id.startswith("BucketsResults") else f"arn:aws:s3:::<{logical_id}>"
    if isinstance(resource, dict) and "Fn::Join" in resource:
        return "".join(_render(part, results_bucket) if isinstance(part, dict) else part for part in resource["Fn::Join"][1])
    return str(resource)


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
