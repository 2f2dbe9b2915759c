"""Cost before deploying: `hetero prices` offline and live, `hetero validate`'s worst case and the
deployment's ceilings read from cdk.json. No stack and no moto: only the live prices need credentials,
and their one AWS call is replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetero import cli
from hetero.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# No credentials anywhere botocore looks (files, environment, instance metadata).
NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None, "AWS_PROFILE": None,
                  "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials", "AWS_CONFIG_FILE": "/nonexistent/config",
                  "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONTAINER_CREDENTIALS_FULL_URI": None,
                  "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": None, "AWS_WEB_IDENTITY_TOKEN_FILE": None}


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=NO_CREDENTIALS | (env or {}))


def spec(tmp_path: Path, name: str = "tensorflow-homogeneous.json", **changes) -> Path:
    raw = json.loads((EXAMPLES / name).read_text()) | changes
    path = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    path.write_text(json.dumps(raw))
    return path


def checkout(folder: Path, platform: dict | None = None) -> Path:
    """A folder with the platform's cdk.json, as the repository has it."""
    folder.mkdir(parents=True, exist_ok=True)
    context = {"platform": platform} if platform is not None else {}
    (folder / "cdk.json").write_text(json.dumps({"app": ".venv/bin/python app.py", "context": context}))
    return folder


def expensive(tmp_path: Path) -> Path:
    """20 ml.p4d.24xlarge for 120 hours: 20 × $37.688 × 120 = $90,451.20 in the worst case."""
    groups = [{"name": "dnn_group", "role": "dnn", "instance_type": "ml.p4d.24xlarge", "count": 20}]
    return spec(tmp_path, instance_groups=groups, max_runtime_s=120 * 3600)


def g5_with_c6i_data_hosts(tmp_path: Path) -> Path:
    groups = [{"name": "data_group", "role": "data", "instance_type": "ml.c6i.8xlarge", "count": 2},
              {"name": "dnn_group", "role": "dnn", "instance_type": "ml.g5.2xlarge", "count": 1}]
    return spec(tmp_path, "pytorch-heterogeneous.json", instance_groups=groups)


# hetero prices ------------------------------------------------------------------------------------


def test_prices_offline_list_hardware_and_the_dated_fallback_price_by_family_or_type(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = invoke("prices", "g5", "ml.c5.xlarge", "trn2", "--json")
    assert shown.exit_code == 0, shown.output
    listed = json.loads(shown.stdout)
    assert listed["date"] == "2022-07-01" and listed["source"].startswith("fallback table") and listed["hardware"]["date"]
    rows = {row["instance_type"]: row for row in listed["instance_types"]}
    assert len(rows) == 10 and list(rows)[0] == "ml.c5.xlarge"
    assert rows["ml.c5.xlarge"]["usd_per_hour"] == 0.204 and rows["ml.c5.xlarge"]["accelerator_kind"] == "cpu"
    assert rows["ml.g5.48xlarge"] | {"usd_per_hour": None} == rows["ml.g5.48xlarge"]  # live prices only
    assert (rows["ml.g5.48xlarge"]["accelerators"], rows["ml.g5.48xlarge"]["accelerator_memory_gb"], rows["ml.g5.48xlarge"]["memory_gib"]) == (8, 24, 768)
    assert rows["ml.trn2.48xlarge"]["neuron_cores"] == 64 and rows["ml.trn2.48xlarge"]["accelerator_kind"] == "trainium"
    assert listed["usd_per_hour"]["ml.c5.xlarge"] == 0.204
    # A wide terminal. Rich fixes a console's width from COLUMNS when it is made (at import): pytest-xdist's
    # workers set COLUMNS=80, so the CLI's console is widened itself.
    monkeypatch.setattr(cli.out, "_width", 250)
    monkeypatch.setattr(cli.out, "_force_terminal", True)
    table = invoke("prices", "ml.p4d.24xlarge")
    assert table.exit_code == 0 and "37.688" in table.stdout and "2022-07-01" in table.stdout and "8× NVIDIA A100 40 GB" in table.stdout
    assert "┃" in table.stdout


def test_prices_into_a_pipe_are_plain_columns_with_whole_names() -> None:
    piped = subprocess.run([sys.executable, "-m", "hetero.cli", "prices", "g5", "p4d"], capture_output=True, text=True, timeout=60,
                           env=os.environ | {"COLUMNS": "40"})
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.splitlines()
    assert lines[0].split() == ["instance", "type", "vCPUs", "memory", "GiB", "accelerators", "NeuronCores", "$/hour"]
    assert not any(box in piped.stdout for box in "┃│━─┏") and "…" not in piped.stdout  # no box drawn, no name cut
    p4d = next(line for line in lines if line.startswith("ml.p4d.24xlarge "))
    assert p4d.split()[:3] == ["ml.p4d.24xlarge", "96", "1152"] and p4d.endswith("37.688")
    assert lines[-1].startswith("$/hour: fallback table")


def test_prices_of_every_type_need_no_stack_and_no_credentials() -> None:
    listed = json.loads(invoke("prices", "--json").stdout)
    assert len(listed["instance_types"]) > 200


def test_an_unknown_family_is_refused_in_one_line() -> None:
    refused = invoke("prices", "g99")
    assert refused.exit_code == 2 and "'g99' is neither an instance type nor a family" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_live_prices_of_every_type_are_refused_before_any_call() -> None:
    refused = invoke("prices", "--live")
    assert refused.exit_code == 2 and "name the types or families to price" in refused.stderr


def test_live_prices_without_credentials_are_one_line_not_a_traceback() -> None:
    refused = invoke("prices", "g5", "--live")
    assert refused.exit_code == 1 and "live prices need AWS credentials" in refused.stderr
    assert "Traceback" not in refused.output and len(refused.stderr.strip().splitlines()) == 1


def test_live_prices_come_from_the_price_list_api_with_the_fallback_for_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = {}

    def live_prices(pricing, region, instance_types):
        asked.update(service=pricing.meta.service_model.service_name, region=region, types=list(instance_types))
        return {"ml.g5.xlarge": 1.408}

    monkeypatch.setattr("lambdas.core.pricing.live_prices", live_prices)
    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    shown = invoke("prices", "ml.g5.xlarge", "ml.c5.xlarge", "--live", "--region", "eu-west-1", "--json", env=credentials)
    assert shown.exit_code == 0, shown.output
    listed = json.loads(shown.stdout)
    assert asked == {"service": "pricing", "region": "eu-west-1", "types": ["ml.c5.xlarge", "ml.g5.xlarge"]}
    assert listed["usd_per_hour"] == {"ml.c5.xlarge": 0.204, "ml.g5.xlarge": 1.408}
    assert listed["source"].startswith("AWS Price List API") and "fallback table" in listed["source"] and "for ml.c5.xlarge" in listed["source"]
    assert listed["date"] == datetime.now(UTC).strftime("%Y-%m-%d")


# hetero validate's cost --------------------------------------------------------------------------


def test_validate_prints_the_worst_case_outside_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    checked = invoke("validate", str(expensive(tmp_path)), "--json")
    assert checked.exit_code == 0, checked.output
    (verdict,) = json.loads(checked.stdout)
    assert verdict["ok"] and verdict["worst_case_usd"] == pytest.approx(90451.20) and verdict["ceiling_usd"] is None
    text = invoke("validate", str(expensive(tmp_path)))
    assert "worst case $90,451.20" in text.stdout and "no ceiling" in text.stdout


def test_a_spec_in_a_checkout_is_refused_what_the_deployment_would_wherever_validate_runs(tmp_path: Path,
                                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """cdk.json sets no ceiling: the CDK app's default ($1,000 a run, infra/config.py) applies, as the
    launch function would apply it, to a spec in a folder below the checkout's root; the verdict is the
    spec's and its settings' alone: the same from inside the checkout and from outside it."""
    below = checkout(tmp_path / "repo", {"prefix": "hetero"}) / "examples"
    below.mkdir()
    inside = expensive(below)
    for where in (below, tmp_path, Path("/")):
        monkeypatch.chdir(where)
        refused = invoke("validate", str(inside))
        assert refused.exit_code == 2, (where, refused.output)
        assert "refused" in refused.stdout and "$90,451.20" in refused.stdout and "ceiling of $1,000.00" in refused.stdout
        assert "max_runtime_s" in refused.stdout and f"policy of {tmp_path / 'repo' / 'cdk.json'}" in refused.stderr
    # A spec outside any checkout is checked without a policy, even when validate runs inside one, and says so.
    monkeypatch.chdir(below)
    outside = invoke("validate", str(expensive(tmp_path)))
    assert outside.exit_code == 0 and "policy: none" in outside.stderr, outside.output
    settings = tmp_path / "repo" / "cdk.json"
    cheap = invoke("validate", str(EXAMPLES / "tensorflow-homogeneous.json"), "--settings", str(settings), "--json")
    assert cheap.exit_code == 0 and json.loads(cheap.stdout)[0]["ceiling_usd"] == 1000.0
    assert json.loads(cheap.stdout)[0]["settings"] == str(settings)
    refused_json = json.loads(invoke("validate", str(inside), "--json").stdout)[0]
    assert not refused_json["ok"] and refused_json["settings"] == str(settings)  # a refusal names its settings too
    named = invoke("validate", str(expensive(tmp_path)), "--settings", str(settings))  # the named settings, for a spec anywhere
    assert named.exit_code == 2 and "ceiling of $1,000.00" in named.stdout
    assert invoke("validate", str(inside), "--no-deployment").exit_code == 0
    missing = invoke("validate", str(inside), "--settings", str(tmp_path / "nope.json"))
    assert missing.exit_code == 2 and "no such file" in missing.stderr


def test_cdk_jsons_own_ceiling_and_prices_are_the_ones_applied(tmp_path: Path) -> None:
    generous = checkout(tmp_path / "repo", {"run_cost_ceiling_usd": 100000}) / "cdk.json"
    assert invoke("validate", str(expensive(tmp_path)), "--settings", str(generous)).exit_code == 0
    unpriced = invoke("validate", str(g5_with_c6i_data_hosts(tmp_path)), "--settings", str(generous))
    assert unpriced.exit_code == 2 and "no price known for ml.c6i.8xlarge" in unpriced.stdout and "ceiling_prices_usd_per_hour" in unpriced.stdout
    priced = checkout(tmp_path / "priced", {"ceiling_prices_usd_per_hour": {"ml.c6i.8xlarge": 1.5, "ml.g5.2xlarge": 1.6}}) / "cdk.json"
    checked = invoke("validate", str(g5_with_c6i_data_hosts(tmp_path)), "--settings", str(priced), "--json")
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.stdout)[0]["worst_case_usd"] == pytest.approx(2 * 1.5 + 1.6)  # its 3,600 s


def test_a_sweeps_worst_case_is_its_runs_together_under_the_sweep_ceiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = json.loads((EXAMPLES / "tensorflow-homogeneous.json").read_text()) | {"max_runtime_s": 10 * 3600}
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"sweep_name": "p4d", "configurations": [base | {"run_name": f"p4d-{index}"} for index in range(3)]}))
    monkeypatch.chdir(tmp_path)
    (verdict,) = json.loads(invoke("validate", str(sweep), "--json").stdout)
    assert verdict["runs"] == 3 and verdict["worst_case_usd"] == pytest.approx(3 * 376.88)
    ceiling = checkout(tmp_path / "repo", {"sweep_cost_ceiling_usd": 1000}) / "cdk.json"
    refused = invoke("validate", str(sweep), "--settings", str(ceiling))
    assert refused.exit_code == 2 and "above the sweep ceiling of $1,000.00" in refused.stdout


def test_another_apps_cdk_json_sets_no_policy_and_a_broken_one_is_one_line(tmp_path: Path) -> None:
    other = checkout(tmp_path / "other")  # no "platform" context: some other CDK app's
    assert invoke("validate", str(expensive(other))).exit_code == 0
    named = invoke("validate", str(expensive(other)), "--settings", str(other / "cdk.json"))
    assert named.exit_code == 2 and "holds no platform settings" in named.stderr
    broken = checkout(tmp_path / "broken", {"run_cost_ceiling_usd": -1})
    refused = invoke("validate", str(spec(broken)))
    assert refused.exit_code == 2 and "run_cost_ceiling_usd must be a positive number" in refused.stderr and "Traceback" not in refused.output


def test_a_users_own_prices_replace_the_tables_in_prices_validate_and_the_emulated_cost(tmp_path: Path) -> None:
    from lambdas.core.job_spec import validate_job_spec
    from lambdas.core.price_performance import FALLBACK_PRICES, given_price, with_given
    from training.local.__main__ import emulated_cost_per_1k_steps

    assert given_price("ml.g5.2xlarge=1.515") == ("ml.g5.2xlarge", 1.515)
    for bad, words in (("ml.g5.2xlarge", "takes TYPE=USD_PER_HOUR"), ("ml.g9.xlarge=1", "not in the catalog"),
                       ("ml.g5.2xlarge=-1", "positive number"), ("ml.g5.2xlarge=nan", "positive number")):
        with pytest.raises(ValueError, match=words):
            given_price(bad)
    mine = with_given(FALLBACK_PRICES, {"ml.c5.xlarge": 0.1})
    assert mine.usd_per_hour["ml.c5.xlarge"] == 0.1 and "given with --price for ml.c5.xlarge" in mine.source
    shown = json.loads(invoke("prices", "ml.g5.2xlarge", "ml.c5.xlarge", "--price", "ml.g5.2xlarge=1.515", "--json").stdout)
    assert shown["usd_per_hour"] == {"ml.c5.xlarge": 0.204, "ml.g5.2xlarge": 1.515} and "--price" in shown["source"]
    refused = invoke("prices", "g5", "--price", "g5=1")
    assert refused.exit_code == 2 and "--price g5=1" in refused.stderr
    # validate: the worst case priced with them (a type the table has no price for, priced by the user).
    checked = invoke("validate", str(g5_with_c6i_data_hosts(tmp_path)), "--no-deployment", "--price", "ml.c6i.8xlarge=1.5",
                     "--price", "ml.g5.2xlarge=1.6", "--json")
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.stdout)[0]["worst_case_usd"] == pytest.approx(2 * 1.5 + 1.6)
    # Under a deployment's ceiling the verdict stays the deployment's: a price of yours does not let through
    # what its launch would refuse (it prices p4d with its own settings).
    ceiling = checkout(tmp_path / "repo", {"prefix": "hetero"}) / "cdk.json"
    cheap_claim = invoke("validate", str(expensive(tmp_path)), "--settings", str(ceiling), "--price", "ml.p4d.24xlarge=0.01")
    assert cheap_claim.exit_code == 2 and "ceiling of $1,000.00" in cheap_claim.stdout
    # hetero local's emulated cost: the user's $/hour where given, the table's for the rest, and it says which.
    spec = validate_job_spec(json.loads(g5_with_c6i_data_hosts(tmp_path).read_text()))
    summary = {"wall_ms_per_step": 100.0, "step_time_ms": {"p50": 90.0}}
    assert emulated_cost_per_1k_steps(spec, summary)[0] is None  # no table price for either type
    cost, basis = emulated_cost_per_1k_steps(spec, summary, {"ml.c6i.8xlarge": 1.5, "ml.g5.2xlarge": 1.6})
    assert cost == pytest.approx((2 * 1.5 + 1.6) * 0.1 / 3.6) and "your --price for ml.c6i.8xlarge, ml.g5.2xlarge" in basis
