"""The house's layers (pyproject.toml's [tool.importlinter], docs/reference/architecture.md#layers): no
module imports from a layer above its own but for the debts named there, and each named debt is a real
import (removing the exceptions breaks the contract, naming them)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def lint(config: Path) -> subprocess.CompletedProcess:
    linter = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(linter), "--config", str(config), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_every_import_points_down_the_layers_but_the_named_debts() -> None:
    done = lint(ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def ini_section(name: str, values: dict[str, Any]) -> str:
    """One section of import-linter's INI form (lists one item a line). Pure."""
    lines = [f"[{name}]"]
    for key, value in values.items():
        lines.append(f"{key} =" + "".join(f"\n    {item}" for item in value) if isinstance(value, list) else f"{key} = {value}")
    return "\n".join(lines) + "\n"


def test_without_its_named_exceptions_the_contract_names_each_upward_import(tmp_path: Path) -> None:
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    sections = [ini_section("importlinter", {key: value for key, value in settings.items() if key != "contracts"})]
    sections += [ini_section(f"importlinter:contract:{contract['id']}", {key: value for key, value in contract.items()
                                                                         if key not in ("id", "ignore_imports")})
                 for contract in settings["contracts"]]
    config = tmp_path / ".importlinter"
    config.write_text("\n".join(sections))
    done = lint(config)
    assert done.returncode == 1, done.stdout[-4000:]
    for upward in ("training.workload.host -> training.trainers.config", "training.variants -> training.trainers.config",
                   "lambdas.launch_job.handler -> training.hyperparameters"):
        assert upward in done.stdout, done.stdout[-4000:]
