"""The documentation: the site builds strictly (a warning, a broken link or anchor fails), the generated
reference pages are what the code generates now, the README's links resolve, and the quick start's and
the workload guide's commands and the README's code run as a reader would run them (the guide's example
module: tests/training/test_workload.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import generate  # noqa: E402  (docs/generate.py)

from hetero.cli import app  # noqa: E402

# Commands of the guides that need a deployed stack and an AWS account: shown, not run here (the workflow
# tests run them against moto).
NEEDS_AWS = ("hetero run", "hetero sweep", "hetero follow", "make deploy")


def code_blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(encoding="utf-8"), re.S | re.M)


def commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("  #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    assert (tmp_path / "site" / "reference" / "cli.html").is_file()


def test_the_generated_reference_pages_are_the_codes(tmp_path: Path) -> None:
    assert generate.stale_pages() == [], "run `.venv/bin/python docs/generate.py`"
    # And the check can fail: a page edited by hand is stale.
    for name in generate.PAGES:
        shutil.copy(ROOT / "docs" / "reference" / name, tmp_path / name)
    (tmp_path / "cli.md").write_text((tmp_path / "cli.md").read_text() + "\nedited by hand\n")
    assert generate.stale_pages(tmp_path) == ["cli.md"]


def test_every_command_and_option_of_the_cli_is_in_its_reference() -> None:
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for name in ("validate", "run", "runs", "show", "follow", "stop", "logs", "sweep", "report", "prices", "local"):
        assert f"## `hetero {name}`" in page
    assert "`--channel`" in page and "`--json`" in page


def test_the_readmes_links_lead_to_pages_and_headings_that_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}, which does not exist"
        if anchor:
            headings = [re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                        for line in target.read_text().splitlines() if line.startswith("#")]
            assert anchor in headings, f"README links to {link}: no such heading in {path}"


# The guides' step counts are the reader's (enough steps for a steady figure); the test runs each command
# as written but for fewer steps: what it proves is that the commands, options, paths and files work.
TEST_STEPS = 12


def fewer_steps(words: list[str]) -> list[str]:
    """A command's words with every ``--steps N`` and ``--set steps=N`` at most TEST_STEPS. Pure."""
    out = list(words)
    for index, word in enumerate(out[:-1]):
        following = out[index + 1]
        if word == "--steps" and following.isdigit():
            out[index + 1] = str(min(int(following), TEST_STEPS))
        elif word == "--set" and following.startswith("steps=") and following[6:].isdigit():
            out[index + 1] = f"steps={min(int(following[6:]), TEST_STEPS)}"
    return out


def test_fewer_steps_cuts_only_step_counts() -> None:
    assert fewer_steps(["demo", "--steps", "40", "--set", "steps=30", "--set", "lr=3"]) == ["demo", "--steps", "12", "--set", "steps=12", "--set", "lr=3"]
    assert fewer_steps(["x", "--steps", "5"]) == ["x", "--steps", "5"]


def run_commands(block_commands: list[str], timeout_s: float, cwd: Path = ROOT) -> dict[str, str]:
    """Run a guide's commands in order from ``cwd`` (those needing AWS or make skipped); each must exit 0.
    Returns each command's stdout by the command as written."""
    environment = os.environ | {"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    outputs = {}
    for command in block_commands:
        if command.startswith(NEEDS_AWS) or command.startswith("make "):
            continue
        words = fewer_steps(shlex.split(command))
        if words[0].startswith(".venv/bin/") or words[0] == "hetero":  # the reader's .venv is this test's interpreter's
            words[0] = str(Path(sys.executable).parent / Path(words[0]).name)
        elif words[0] == "python":
            words[0] = sys.executable
        done = subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=environment)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs[command] = done.stdout
    return outputs


def a_readers_checkout(tmp_path: Path) -> Path:
    """A folder that reads as the repository's root to the guides' commands: its examples and the
    settings `hetero validate` finds above a spec (cdk.json), linked; its own build/. So
    two halves of one guide run at once, each writing only its own data and runs."""
    for name in ("examples", "cdk.json"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def quick_start_commands() -> list[str]:
    return [command for block in code_blocks(ROOT / "docs" / "guides" / "quickstart.md", "bash") for command in commands(block)]


# The quick start is two tests that run at once on the suite's two workers: its steps 2-3 (data, check,
# both runs) and its comparison (which makes its own data), each from a reader's checkout of its own.
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_the_quick_start_makes_its_data_validates_and_runs_both_jobs_as_written(tmp_path: Path) -> None:
    """The quick start's commands up to its comparison, in order, as a reader runs them from the
    repository's root (the data lands in build/quickstart/), for fewer steps."""
    before_demo = [command for command in quick_start_commands() if "hetero demo" not in command]
    assert any(command.startswith(".venv/bin/hetero validate") for command in before_demo)
    assert sum(command.startswith(".venv/bin/hetero local") for command in before_demo) == 2
    outputs = run_commands(before_demo, timeout_s=500, cwd=a_readers_checkout(tmp_path))
    assert (tmp_path / "build" / "quickstart" / "train").is_dir()
    (validated,) = [out for command, out in outputs.items() if command.startswith(".venv/bin/hetero validate")]
    assert "ok" in validated


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_the_quick_starts_comparison_runs_as_written(tmp_path: Path) -> None:
    """The quick start's comparison, `make demo`'s third part (the example workload's own specs): it
    compares both, and the heterogeneous run's model validates."""
    (demo_command,) = [command for command in quick_start_commands() if "hetero demo --workload" in command]
    demo = run_commands([demo_command], timeout_s=500, cwd=a_readers_checkout(tmp_path))[demo_command]
    assert "homogeneous: 1× ml.p3.2xlarge" in demo and "heterogeneous: 1× ml.c5.9xlarge + 1× ml.p3.2xlarge" in demo
    assert re.search(r"validation accuracy of the heterogeneous run's model: \d\.\d{3}", demo)
    report = re.search(r"report(?: \(not a recommendation\))?: (\S+/report\.md), chart: (\S+)", demo)
    assert report, demo[-2000:]
    report_path, chart_path = (Path(group) if Path(group).is_absolute() else tmp_path / group for group in report.groups())
    assert report_path.is_file() and chart_path.read_bytes().startswith(b"\x89PNG"), demo[-2000:]


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_the_workload_guides_commands_run_as_written() -> None:
    """The guide's first commands: make the example's data, validate it, run it on the emulated cluster."""
    (block,) = [block for block in code_blocks(ROOT / "docs" / "guides" / "workload.md", "bash") if "make_data.py" in block][:1]
    ran = commands(block)
    assert any(command.startswith("hetero local") for command in ran)
    run_commands(ran, timeout_s=600)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.local.images import write_dataset

    root = tmp_path_factory.mktemp("shapes")
    write_dataset(root / "train", per_class=8, size=48)
    return root


def test_the_readmes_example_module_is_a_working_workload(tmp_path: Path, images: Path) -> None:
    """The README's complete workload, as printed, passes `hetero validate` (its hooks run on a few images)."""
    (example,) = code_blocks(ROOT / "README.md", "python")
    code = tmp_path / "readme"
    code.mkdir()
    (code / "workload.py").write_text(example)
    spec = ROOT / "examples" / "workloads" / "augmented_cnn" / "homogeneous.json"
    own = tmp_path / "spec.json"
    parsed = json.loads(spec.read_text())
    parsed["hyperparameters"] = {key: value for key, value in parsed["hyperparameters"].items() if key in ("batch_size", "steps", "log_every")}
    parsed["inputs"].pop("validation", None)
    own.write_text(json.dumps(parsed))
    result = CliRunner().invoke(app, ["validate", str(own), "--code", str(code), "--channel", f"train={images / 'train'}"])
    assert result.exit_code == 0 and result.stdout.startswith("ok"), result.output


def test_every_test_the_docs_cite_exists() -> None:
    """A guarantee's row names the test that holds it: `file.py::test_name` (a path below tests/, or its
    file name alone) must be a test of that file."""
    tests = ROOT / "tests"
    cited = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        cited |= {(page.name, path, name) for path, name in re.findall(r"([\w/]+\.py)::(test_\w+)", page.read_text(encoding="utf-8"))}
    assert len(cited) > 50
    missing = []
    for page, path, name in sorted(cited):
        candidates = [file for file in tests.rglob(Path(path).name) if file.as_posix().endswith(path)]
        if not any(re.search(rf"^(?:async )?def {name}\(", file.read_text(encoding="utf-8"), re.M) for file in candidates):
            missing.append(f"{page}: {path}::{name}")
    assert missing == [], "\n".join(missing)
