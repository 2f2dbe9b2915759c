"""The hosts' environment is read at each process's door (training/host_environment.py,
docs/reference/architecture.md#the-hosts-environment): no module of the hosts' code reads ``os.environ``
(or ``os.getenv``) or names ``/opt/ml`` outside the doors listed here, and each module still doing so
that a later step of issue 45 moves is a named debt. A new reader fails this test, naming the line; so
does an entry here that no longer reads anything (its exception must go)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ROOT / "training"

# Where reading the process's environment belongs, and why.
DOORS = {
    "training/host_environment.py": "the door itself: HostEnvironment and TrainerEnvironment read once per process",
    "training/cluster.py": "resourceconfig.json and the emulated addresses, which HostEnvironment.read composes",
    "training/hyperparameters.py": "hyperparameters.json and the token file, which HostEnvironment.read composes",
    "training/launcher.py": "the launcher's door: it stamps the container's start and sets the host's cache folder for its children",
    "training/dnn_host.py": "its trainers' environment, written from its own (the progress folder, the rank failure file, the workload)",
    "training/supervisor.py": "the container's first process: the heartbeat pipe it hands its launcher, and the frozen note's folder",
    "training/trainers/keras_runtime.py": "TensorFlow's log level, set before TensorFlow is imported (no fact of the host)",
}
# Modules that still read the environment themselves: each is a step of issue 45 still to take.
DEBTS = {
    "training/failure.py": "write_failure finds output/failure from the environment at each call (step 4: the roles hand it their paths)",
    "training/script_env.py": "script mode's SM_* view takes the process environment by default (step 4)",
    "training/script_mode.py": "reads the script's own failure file from the environment (step 4)",
    "training/torchrun.py": "a rank's failure file named by a variable torchrun passes (step 4)",
    "training/data_service/dataset.py": "channel_dir/channel_is_sharded and the shard-index cache from the environment (step 3)",
    "training/data_service/tf_service.py": "its child reads the job's hyperparameters and token itself, and its TensorFlow log level (step 3)",
    "training/workloads/text.py": "the tokenised-channel cache folder from the environment (step 3: the context carries it)",
}


def is_docstring(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """A string that is a module's, class's or function's docstring (words for readers, not a path used)."""
    statement = parents.get(node)
    owner = parents.get(statement) if isinstance(statement, ast.Expr) else None
    return isinstance(owner, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and owner.body[0] is statement


def readings(source: str) -> list[tuple[int, str]]:
    """(line, what) for each read of the environment in a module's source: ``os.environ``, ``os.getenv``,
    and a string (not a docstring) naming /opt/ml. Pure."""
    tree = ast.parse(source)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr in ("environ", "getenv"):
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "/opt/ml" in node.value and not is_docstring(node, parents):
            found.append((node.lineno, repr(node.value)))
    return found


def hosts_modules() -> dict[str, str]:
    """The hosts' code: training/ but the emulated cluster (a shell on the user's machine) and generated stubs."""
    return {str(path.relative_to(ROOT)): path.read_text() for path in sorted(TRAINING.rglob("*.py"))
            if "local" not in path.relative_to(TRAINING).parts[:1] and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))}


def test_the_readings_scan_finds_each_kind_of_read_and_ignores_docstrings() -> None:
    source = '"""Reads /opt/ml."""\nimport os\n\ndef f(environ=os.environ):\n    """Under /opt/ml."""\n    return os.getenv("X"), "/opt/ml/model"\n'
    assert sorted(readings(source)) == [(4, "os.environ"), (6, "'/opt/ml/model'"), (6, "os.getenv")]


def test_no_module_of_the_hosts_code_reads_the_environment_outside_its_doors_and_named_debts() -> None:
    read = {name: found for name, source in hosts_modules().items() if (found := readings(source))}
    allowed = DOORS.keys() | DEBTS.keys()
    strays = {name: found for name, found in read.items() if name not in allowed}
    assert not strays, f"read the environment or /opt/ml outside the doors (take a HostEnvironment or TrainerEnvironment instead): {strays}"
    stale = sorted(allowed - read.keys())
    assert not stale, f"listed as doors or debts but read nothing: remove them from this test: {stale}"
