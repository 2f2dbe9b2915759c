"""checkov and cfn-lint on the synthesized templates, default and VPC mode (the session's two syntheses):
no finding that is not acknowledged in the code with its reason. checkov's acknowledgments are skips in
each resource's metadata (infra/nag.py's skip_checkov), cfn-lint's the few rules of CFN_LINT_IGNORED.
The scanners live in their own environment, .venv-scan (requirements/scan.txt), which `make test` builds."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra.nag import CFN_LINT_IGNORED

REPO = Path(__file__).resolve().parents[2]
SCANNERS = REPO / ".venv-scan" / "bin"
pytestmark = pytest.mark.skipif(not (SCANNERS / "checkov").exists(), reason="make test installs the scanners (.venv-scan)")


@pytest.fixture(scope="module")
def templates(template_json, in_vpc, tmp_path_factory) -> dict[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("templates")
    written = {}
    for mode, template in (("default", template_json), ("vpc", in_vpc)):
        path = folder / f"{mode}.template.json"
        path.write_text(json.dumps(template, indent=1))
        written[str(path)] = template
    return written


@pytest.fixture(scope="module")
def scans(templates) -> dict[str, tuple[str, str]]:
    """Both scanners over both templates, run at once: (stdout, stderr) of each."""
    files = [argument for path in templates for argument in ("-f", path)]
    commands = {
        "checkov": ["checkov", *files, "--framework", "cloudformation", "--skip-download", "--output", "json"],
        "cfn-lint": ["cfn-lint", "--format", "json", "--ignore-checks", *CFN_LINT_IGNORED, "--", *templates],
    }
    # No network: checkov would fetch its guidelines and version news from Prisma Cloud without these.
    environment = os.environ | {"BC_SKIP_MAPPING": "TRUE", "CHECKOV_DISABLE_VERSION_CHECK": "true", "PYTHONWARNINGS": "ignore"}
    running = {name: subprocess.Popen([str(SCANNERS / command[0]), *command[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=environment)
               for name, command in commands.items()}
    return {name: process.communicate(timeout=300) for name, process in running.items()}


@pytest.fixture(scope="module")
def checkov(scans) -> dict[str, Any]:
    stdout, stderr = scans["checkov"]
    assert stdout, stderr
    report = json.loads(stdout)
    return report[0] if isinstance(report, list) else report


def test_checkov_finds_nothing_unacknowledged(checkov) -> None:
    assert checkov["summary"]["parsing_errors"] == 0 and checkov["summary"]["resource_count"] > 100
    failed = [f"{Path(c['file_path']).name}: {c['check_id']} {c['resource']} ({c['check_name']})" for c in checkov["results"]["failed_checks"]]
    assert not failed, "checkov findings to fix, or acknowledge with infra.nag.skip_checkov and the reason:\n" + "\n".join(failed)


def test_every_checkov_acknowledgment_is_read_and_says_why(checkov, templates) -> None:
    """Each skip in the templates' metadata is one checkov applied (a mistyped check ID, or a skip on a
    resource the check does not cover, shows here), and each gives its reason."""
    declared = {
        (Path(path).name, f"{resource['Type']}.{logical_id}", skip["id"]): skip["comment"]
        for path, template in templates.items()
        for logical_id, resource in template["Resources"].items()
        for skip in resource.get("Metadata", {}).get("checkov", {}).get("skip", [])
    }
    applied = {(Path(c["file_path"]).name, c["resource"], c["check_id"]): c["check_result"].get("suppress_comment", "")
               for c in checkov["results"]["skipped_checks"]}
    assert applied == declared
    assert all(len(reason) > 40 for reason in declared.values()), declared


def test_cfn_lint_finds_nothing_unacknowledged(scans) -> None:
    stdout, stderr = scans["cfn-lint"]
    findings = [f"{Path(m['Filename']).name}: {m['Rule']['Id']} {m['Message']} ({'/'.join(map(str, m['Location']['Path']))})"
                for m in json.loads(stdout or "[]")]
    assert not findings, "cfn-lint findings to fix, or ignore in infra.nag.CFN_LINT_IGNORED with the reason:\n" + "\n".join(findings)
    assert stdout.strip() == "[]", stderr
