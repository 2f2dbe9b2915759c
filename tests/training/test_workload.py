"""The workload contract's checks (training/workload/): each refusal names the hook, the file, the key, the
sample; code packs reproducibly and unpacks only as itself. Real modules written to a temporary folder and
imported, real preprocessing, real pip for the requirements refusal."""

from __future__ import annotations

import importlib
import io
import json
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from training.hyperparameters import HyperparameterError, is_relative_path
from training.workload import code as workload_code
from training.workload.contexts import ChannelContext, ChannelNotRoutedError, Samples
from training.workload.contract import (
    HookSignatureError,
    MissingHookError,
    NotImportableByNameError,
    PlatformImportError,
    WorkloadError,
    WorkloadImportError,
    load_workload,
    resolve_hyperparameters,
)
from training.workload.host import split_settings
from training.workload.samples import (
    AllSkippedError,
    BatchRecipe,
    BatchTrace,
    FeatureMismatchError,
    HookError,
    PreprocessOutputError,
    SamplesError,
    list_channel,
    make_batch,
    preprocess_one,
    probe_features,
    sample_rng,
)

GOOD = '''
import numpy as np

HYPERPARAMETERS = {"scale": 2.0, "width": 4}

def list_samples(ctx):
    return list(range(10))

def preprocess(sample, ctx):
    if sample == 3 and ctx.training:
        raise ctx.Skip("three")
    return {"x": np.full(4, sample * ctx.hyperparameters["scale"], dtype=np.float32) + ctx.rng.random(), "label": sample % 2}

def build_model(ctx):
    import torch
    return torch.nn.Linear(4, 2)

def train_step(model, batch, ctx):
    return model(batch["x"]).sum()
'''


def module_dir(tmp_path: Path, source: str, name: str = "workload") -> Path:
    """A fresh folder holding ``name``.py; the module is forgotten first so each test imports its own."""
    folder = tmp_path / f"code-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return folder


@pytest.fixture
def good(tmp_path):
    yield load_workload(module_dir(tmp_path, GOOD), "workload")
    sys.modules.pop("workload", None)


def test_a_good_module_loads_with_its_hooks_and_hyperparameters(good):
    assert set(good.hooks) == {"list_samples", "preprocess", "build_model", "train_step"}
    assert dict(resolve_hyperparameters(good, {"scale": "0.5"})) == {"scale": 0.5, "width": 4}
    with pytest.raises(HyperparameterError, match="width.*not a valid int.*declares width=4"):
        resolve_hyperparameters(good, {"width": "wide"})


@pytest.mark.parametrize(("source", "error", "words"), [
    (GOOD.replace("def train_step", "def train_stepp"), MissingHookError, r"defines no train_step\(\) \(it defines train_stepp\(\): rename it train_step\)"),
    (GOOD + "\ndef build_optimiser(model, ctx):\n    return None\n", MissingHookError, r"defines build_optimiser\(\), not build_optimizer\(\)"),
    (GOOD.replace("def preprocess(sample, ctx)", "def preprocess(sample)"), HookSignatureError, r"preprocess in .* takes \(sample\), but the platform calls preprocess\(sample, ctx\)"),
    (GOOD + "\ntrain_step = lambda model, batch, ctx: 0\n", NotImportableByNameError, "<lambda>.*define it with def at the top level"),
    (GOOD + "\ndef _make():\n    def build_model(ctx):\n        return None\n    return build_model\nbuild_model = _make()\n", NotImportableByNameError, "<locals>"),
    ("from training.workload.contexts import Samples\n" + GOOD, PlatformImportError, "line 1 imports training.workload.contexts at module scope"),
    ("import not_a_package_anyone_has\n" + GOOD, WorkloadImportError, "imports 'not_a_package_anyone_has', which is not installed: add it to the workload's requirements"),
    ("raise RuntimeError('boom')\n", WorkloadImportError, "raised RuntimeError: boom"),
    ("def list_samples(ctx:\n", WorkloadImportError, "line 1"),
])
def test_a_module_off_the_contract_is_refused_naming_the_hook_and_the_file(tmp_path, source, error, words):
    folder = module_dir(tmp_path, source)
    with pytest.raises(error, match=words) as raised:
        load_workload(folder, "workload")
    if error not in (WorkloadImportError,):
        assert str(folder / "workload.py") in str(raised.value)
    sys.modules.pop("workload", None)


def test_a_hook_defined_in_main_is_refused(tmp_path):
    folder = module_dir(tmp_path, GOOD)
    loaded = load_workload(folder, "workload")
    loaded.module.train_step.__module__ = "__main__"
    from training.workload.contract import check_module

    with pytest.raises(NotImportableByNameError, match="'__main__'"):
        check_module(loaded.module, "workload", folder)
    sys.modules.pop("workload", None)


def test_a_missing_module_is_named_with_the_folder_and_the_nearest_one(tmp_path):
    with pytest.raises(WorkloadImportError, match=r"no module 'nothing_here' in the code folder"):
        load_workload(tmp_path, "nothing_here")
    folder = module_dir(tmp_path, GOOD, name="regressor")
    with pytest.raises(WorkloadImportError, match=r"no module 'regresor' .*did you mean 'regressor'\?"):
        load_workload(folder, "regresor")
    with pytest.raises(WorkloadImportError, match=r"is a file name: name the module \(regressor\)"):
        load_workload(folder, "regressor.py")


def test_a_hook_imported_from_another_module_of_the_code_is_taken(tmp_path):
    folder = module_dir(tmp_path, GOOD.replace("def preprocess(sample, ctx):", "from helpers import preprocess\ndef _unused(sample, ctx):"))
    (folder / "helpers.py").write_text("import numpy as np\ndef preprocess(sample, ctx):\n    return {'x': np.zeros(2)}\n")
    sys.modules.pop("helpers", None)
    assert load_workload(folder, "workload").preprocess.__module__ == "helpers"
    sys.modules.pop("workload", None)
    sys.modules.pop("helpers", None)


def test_samples_are_listed_checked_and_preprocessed_with_the_seeded_generator(good, tmp_path):
    ctx = ChannelContext("train", tmp_path, True, {"scale": 2.0})
    samples = list_channel(good, ctx)
    first = preprocess_one(good, samples, 5, seed=7, epoch=1, training=True, hyperparameters={"scale": 2.0})
    again = preprocess_one(good, samples, 5, seed=7, epoch=1, training=True, hyperparameters={"scale": 2.0})
    other_epoch = preprocess_one(good, samples, 5, seed=7, epoch=2, training=True, hyperparameters={"scale": 2.0})
    assert np.array_equal(first["x"], again["x"]) and not np.array_equal(first["x"], other_epoch["x"])
    assert first["x"][0] == pytest.approx(10.0 + sample_rng(7, 1, 5).random())
    assert first["label"].dtype == np.int64 and first["label"].shape == ()
    assert preprocess_one(good, samples, 3, seed=7, epoch=0, training=True, hyperparameters={"scale": 2.0}) is None  # ctx.Skip


def test_a_batch_replaces_skipped_samples_by_spares_and_records_where_each_went(good):
    samples = list(range(10))
    features = probe_features(good, samples, seed=0, hyperparameters={"scale": 1.0})
    recipe = BatchRecipe(good.code_dir, "workload", None, samples, {"scale": 1.0}, 0, features)
    trace = BatchTrace()
    batch, skipped = make_batch(good, recipe, [2, 3, 4], [3, 9], [0, 0, 0], trace)
    assert skipped == 2 and trace.failed == [1, 3] and trace.slots == [0, 2, 4]  # the spare 3 is skipped too
    assert batch["x"].shape == (3, 4) and batch["label"].tolist() == [0, 0, 1]
    with pytest.raises(AllSkippedError, match="skipped 2 of the 2 samples a data host had for one batch of 1"):
        make_batch(good, recipe, [3], [3], [0], BatchTrace())


@pytest.mark.parametrize(("body", "error", "words"), [
    ('return [1, 2]', PreprocessOutputError, r"returned a list: return a dict of NumPy arrays"),
    ('return {"x": "text"}', PreprocessOutputError, r"'x' is a builtins.str, not a NumPy array"),
    ('return {"x": np.array(["a"])}', PreprocessOutputError, r"'x' has dtype str32"),
    ('return {"bad key": np.zeros(2)}', PreprocessOutputError, r"key 'bad key' is not"),
    ('return {"x": np.zeros(sample + 1, dtype=np.float32)}', FeatureMismatchError, r"'x' is float32 \[2\], expected float32 \[1\] \(the first sample's\)"),
    ('return {"x": np.zeros(1, dtype=np.float32 if sample == 0 else np.float64)}', FeatureMismatchError, r"'x' is float64 \[1\], expected float32 \[1\]"),
    ('return {"x": np.zeros(1)} if sample == 0 else {"y": np.zeros(1)}', FeatureMismatchError, r"returned keys \['y'\], expected \['x'\].*missing \['x'\]; extra \['y'\]"),
    ('raise KeyError("caption")', HookError, r"preprocess raised KeyError at workload.py:\d+ on sample 0 \(0\): 'caption'"),
    ('return {"boxes": np.zeros((0, 4))}', PreprocessOutputError, r"'boxes' has shape \[0, 4\], with no elements"),
])
def test_preprocess_output_that_cannot_be_batched_is_refused_naming_key_and_sample(tmp_path, body, error, words):
    source = GOOD.replace('''    if sample == 3 and ctx.training:
        raise ctx.Skip("three")
    return {"x": np.full(4, sample * ctx.hyperparameters["scale"], dtype=np.float32) + ctx.rng.random(), "label": sample % 2}''',
                          f"    {body}")
    workload = load_workload(module_dir(tmp_path, source), "workload")
    samples = [0, 1]
    with pytest.raises(error, match=words):
        features = probe_features(workload, samples, seed=0, hyperparameters={})
        make_batch(workload, BatchRecipe(workload.code_dir, "workload", None, samples, {}, 0, features), [0, 1], [], [0, 0])
    sys.modules.pop("workload", None)


@pytest.mark.parametrize(("body", "words"), [
    ("return []", "found no samples"),
    ('return "abc"', "returned a str"),
    ("return [lambda: 0]", "cannot be sent to worker processes"),
    ('return [b"x" * 100_000]', "pickles to 100"),
    ("return [ctx.channel_path('labels')]", r"raised ChannelNotRoutedError.*'labels'.*it has \['train'\]"),
])
def test_a_listing_that_cannot_be_served_is_refused(tmp_path, body, words):
    source = GOOD.replace("    return list(range(10))", f"    {body}")
    workload = load_workload(module_dir(tmp_path, source), "workload")
    with pytest.raises((SamplesError, HookError), match=words):
        list_channel(workload, ChannelContext("train", tmp_path, True, {}, channels={"train": tmp_path}))
    sys.modules.pop("workload", None)


def test_a_channel_not_routed_to_the_group_lists_those_it_has(tmp_path):
    ctx = ChannelContext("train", tmp_path, True, {}, channels={"train": tmp_path, "validation": tmp_path})
    with pytest.raises(ChannelNotRoutedError, match=r"'labels'.*it has \['train', 'validation'\]"):
        ctx.channel_path("labels")


def test_the_readers_list_an_image_folder_with_its_classes_and_jsonl_rows(tmp_path):
    from training.local.images import write_dataset
    from training.workload.contexts import READERS

    folder = write_dataset(tmp_path / "images", classes=3, per_class=2, size=32)
    listed = READERS.image_folder(folder)
    assert isinstance(listed, Samples) and len(listed) == 6 and len(listed.classes) == 3
    assert READERS.decode_image(listed[0][0]).shape == (32, 32, 3)
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "b.jsonl").write_text('{"a": 2}\n')
    (tmp_path / "rows" / "a.jsonl").write_text('{"a": 1}\n\n')
    assert READERS.jsonl(tmp_path / "rows") == [{"a": 1}, {"a": 2}]


def test_hyperparameters_split_between_platform_loop_and_workload_and_typos_are_named(good):
    raw = {"role_map": '{"homogeneousCluster": "dnn"}', "steps": "12", "scale": "3", "workload_module": "workload",
           "workload_sha256": "0" * 64}
    platform, config, workload = split_settings(raw, good, "t" * 24)
    assert config.steps == 12 and workload["scale"] == 3.0 and platform.workload_module == "workload"
    with pytest.raises(HyperparameterError, match=r"unknown hyperparameter 'scal' \(did you mean 'scale'\?\)"):
        split_settings(raw | {"scal": "3"}, good, "t" * 24)


def test_a_workload_hyperparameter_the_loop_also_has_is_refused(tmp_path):
    workload = load_workload(module_dir(tmp_path, GOOD.replace('"width": 4', '"steps": 4')), "workload")
    with pytest.raises(HyperparameterError, match=r"declares \['steps'\].*which the platform's loop or launcher sets"):
        split_settings({"role_map": '{"homogeneousCluster": "dnn"}'}, workload, "t" * 24)
    sys.modules.pop("workload", None)


def test_a_modules_loop_defaults_apply_under_the_jobs_own_values(tmp_path):
    workload = load_workload(module_dir(tmp_path, GOOD + '\nLOOP_DEFAULTS = {"grad_clip_norm": 1, "batch_size": 8, "compile": True}\n'),
                             "workload")
    raw = {"role_map": '{"homogeneousCluster": "dnn"}'}
    _, config, _ = split_settings(raw, workload, "t" * 24)
    assert (config.grad_clip_norm, config.batch_size, config.compile) == (1.0, 8, True)  # an int is a fine float
    _, config, _ = split_settings(raw | {"batch_size": "16", "compile": "false"}, workload, "t" * 24)
    assert (config.batch_size, config.compile) == (16, False)  # the job's word wins
    sys.modules.pop("workload", None)


@pytest.mark.parametrize(("defaults", "words"), [
    ('{"grad_clip": 1.0}', r"LOOP_DEFAULTS in .*workload.py names 'grad_clip', which is not a setting of the platform's loop "
                           r"\(did you mean 'grad_clip_norm'\?\)"),
    ('{"batch_size": "8"}', r"LOOP_DEFAULTS in .*: batch_size='8' is not an integer, as the setting is \(default 32\)"),
    ('{"compile": 1}', r"LOOP_DEFAULTS in .*: compile=1 is not a bool"),
    ('{"steps": True}', r"LOOP_DEFAULTS in .*: steps=True is not an integer"),
    ('[("steps", 4)]', r"LOOP_DEFAULTS in .* must be a dict"),
])
def test_loop_defaults_off_the_loops_settings_are_refused_by_name(tmp_path, defaults, words):
    with pytest.raises(WorkloadError, match=words):
        load_workload(module_dir(tmp_path, GOOD + f"\nLOOP_DEFAULTS = {defaults}\n"), "workload")
    sys.modules.pop("workload", None)


# Code: packing, unpacking, requirements ------------------------------------------------------------


def test_code_packs_reproducibly_without_caches_and_a_change_changes_its_hash(tmp_path):
    folder = module_dir(tmp_path, GOOD)
    for ignored in (".git/HEAD", "__pycache__/workload.cpython-311.pyc", ".venv/bin/python", "notes.txt~"):
        (folder / ignored).parent.mkdir(parents=True, exist_ok=True)
        (folder / ignored).write_text("x")
    (folder / "pkg").mkdir()
    (folder / "pkg" / "util.py").write_text("A = 1\n")
    first, second = workload_code.pack_code(folder), workload_code.pack_code(folder)
    assert first.archive == second.archive and first.files == ("pkg/util.py", "workload.py")
    assert first.key == f"code/{first.sha256}/sourcedir.tar.gz"
    (folder / "pkg" / "util.py").write_text("A = 2\n")
    assert workload_code.pack_code(folder).sha256 != first.sha256


def test_code_unpacks_only_as_the_archive_the_run_was_started_with(tmp_path):
    packed = workload_code.pack_code(module_dir(tmp_path, GOOD))
    archive = tmp_path / "sourcedir.tar.gz"
    archive.write_bytes(packed.archive)
    with pytest.raises(workload_code.CodeMismatchError, match="not the 0000"):
        workload_code.unpack_code(archive, tmp_path / "a", "0" * 64)
    unpacked = workload_code.unpack_code(archive, tmp_path / "b", packed.sha256)
    assert (unpacked / "workload.py").read_text() == textwrap.dedent(GOOD)


def test_an_archive_with_a_member_outside_its_folder_or_a_link_is_refused(tmp_path):
    for name, kind in (("../escape.py", tarfile.REGTYPE), ("link", tarfile.SYMTYPE)):
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w:gz") as archive:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
            archive.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
        path = tmp_path / f"{kind!r}.tar.gz"
        path.write_bytes(raw.getvalue())
        with pytest.raises((workload_code.CodeError, tarfile.TarError)):
            workload_code.unpack_code(path, tmp_path / f"out-{kind!r}", workload_code.file_sha256(path))
        assert not (tmp_path / "escape.py").exists()


def test_a_link_in_the_code_folder_is_refused_when_packing(tmp_path):
    folder = module_dir(tmp_path, GOOD)
    (folder / "secret").symlink_to("/etc/hostname")
    with pytest.raises(workload_code.CodeError, match="symbolic link"):
        workload_code.pack_code(folder)


def test_requirements_that_cannot_install_are_refused_with_pips_words(tmp_path):
    folder = module_dir(tmp_path, GOOD)
    (folder / "wheels").mkdir()  # offline: only the shipped wheels, of which there are none
    (folder / "requirements.txt").write_text("# a comment\nsurely-no-such-package-exists==9.9\n")
    with pytest.raises(workload_code.CodeError, match=r"cannot be installed from the wheels shipped in wheels/"):
        workload_code.install_requirements(folder, "requirements.txt", tmp_path / "environment")
    (folder / "empty.txt").write_text("# nothing\n")
    assert workload_code.install_requirements(folder, "empty.txt") is None
    with pytest.raises(workload_code.CodeError, match="not in the code folder"):
        workload_code.install_requirements(folder, "missing.txt")


def test_requirements_install_beside_the_images_packages_without_shadowing_them(tmp_path):
    """A shipped wheel that depends on numpy installs offline: the image's numpy satisfies it (pip's
    --target would have refused, needing numpy's wheel too), and its environment goes after the image's
    packages on the path."""
    import zipfile

    folder = module_dir(tmp_path, GOOD.replace("import numpy as np", "import numpy as np\nimport leafpkg"))
    (folder / "wheels").mkdir()
    with zipfile.ZipFile(folder / "wheels" / "leafpkg-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("leafpkg/__init__.py", "VALUE = 7\n")
        wheel.writestr("leafpkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: leafpkg\nVersion: 1.0\nRequires-Dist: numpy\n")
        wheel.writestr("leafpkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("leafpkg-1.0.dist-info/RECORD", "")
    (folder / "requirements.txt").write_text("leafpkg\n")
    packages = workload_code.install_requirements(folder, "requirements.txt")
    assert (packages / "leafpkg" / "__init__.py").exists() and not list(packages.glob("numpy*"))
    loaded = load_workload(folder, "workload", packages)
    assert loaded.module.leafpkg.VALUE == 7 and sys.path.index(str(packages)) > sys.path.index(str(Path(np.__file__).parents[1]))
    sys.path.remove(str(packages))
    sys.modules.pop("workload", None)
    sys.modules.pop("leafpkg", None)


def test_requirements_paths_stay_inside_the_folder():
    assert is_relative_path("requirements/train.txt")
    assert not any(is_relative_path(path) for path in ("/etc/x", "../x", "a//b", "a\\b", ""))


def test_the_workload_guides_complete_workload_passes_the_dry_run_hetero_validate_runs(tmp_path):
    """The workload guide's example file, as printed, on a small dataset: imported, listed, preprocessed, one step."""
    import importlib.util
    import re

    from lambdas.core.job_spec import validate_job_spec
    from training.workload.dry_run import dry_run

    repo = Path(__file__).resolve().parents[2]
    guide = (repo / "docs" / "guides" / "workload.md").read_text()
    block = re.search(r"A complete workload.*?```python\n(.*?)```", guide, re.S).group(1)
    folder = tmp_path / "readme-workload"
    folder.mkdir()
    (folder / "workload.py").write_text(block)
    make = importlib.util.spec_from_file_location("make_reviews", repo / "examples/workloads/text_classifier/make_data.py")
    module = importlib.util.module_from_spec(make)
    make.loader.exec_module(module)
    data = module.write(tmp_path / "reviews", train=32, validation=8)
    spec = validate_job_spec({"run_name": "readme", "variant": "pytorch", "workload": {"code": str(folder)},
                              "instance_groups": [{"name": "dnn", "role": "dnn", "instance_type": "ml.p3.2xlarge", "count": 1}],
                              "hyperparameters": {"eval_channel": "validation"},
                              "inputs": {"train": {"s3_uri": "s3://bucket/t/"}, "validation": {"s3_uri": "s3://bucket/v/"}}})
    report = dry_run(spec, folder, {"train": data / "train", "validation": data / "validation"})
    assert report["features"] == {"input_ids": "int32 [32]", "label": "int64 []"} and report["classes"] == ["negative", "positive"]
    assert np.isfinite(report["trial_loss"]) and set(report["trial_eval"]) == {"accuracy"}


def test_the_client_reads_the_hooks_from_the_source_without_importing_it():
    """What `hetero run` refuses before anything is uploaded or launched, from the module's text alone."""
    from training.workload.contract import source_problem

    assert source_problem(textwrap.dedent(GOOD), "workload.py") is None
    assert source_problem(GOOD.replace("def train_step", "def train_stepp"), "w.py") == "w.py defines no train_step() (it defines train_stepp(): rename it train_step)"
    assert "takes 1 arguments, but the platform calls preprocess(sample, ctx)" in source_problem(
        GOOD.replace("def preprocess(sample, ctx)", "def preprocess(sample)"), "w.py")
    assert source_problem("def list_samples(ctx:\n", "w.py") == "w.py line 1: '(' was never closed"
    assert source_problem("from helpers import *\n", "w.py") is None  # left to the hosts' full check


def test_hetero_validate_runs_a_builtins_hooks_on_local_folders(images, tmp_path):
    """`hetero validate SPEC --channel train=DIR` on a built-in PyTorch workload: its hyperparameters split
    as the hosts split them, its listing, preprocessing and one step on the folder; a folder that is no
    dataset is refused under the field ``workload`` before anything is billed."""
    from typer.testing import CliRunner

    from hetero.cli import app

    repo = Path(__file__).resolve().parents[2]
    raw = json.loads((repo / "examples" / "pytorch-heterogeneous.json").read_text())
    raw["hyperparameters"] |= {"model": "cnn", "image_size": 32}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(raw))
    checked = CliRunner().invoke(app, ["validate", str(spec), "--channel", f"train={images}", "--json"])
    verdict = json.loads(checked.stdout)[0]
    assert checked.exit_code == 0 and verdict["ok"], checked.stdout
    assert verdict["workload"]["builtin"] and verdict["workload"]["module"] == "vision"
    assert verdict["workload"]["features"] == {"image": "uint8 [3, 32, 32]", "label": "int64 []"}
    assert verdict["workload"]["samples"] == 96 and np.isfinite(verdict["workload"]["trial_loss"])
    (tmp_path / "empty" / "class_00").mkdir(parents=True)
    refused = CliRunner().invoke(app, ["validate", str(spec), "--channel", f"train={tmp_path / 'empty'}", "--json"])
    verdict = json.loads(refused.stdout)[0]
    assert refused.exit_code == 2 and verdict["field"] == "workload" and "holds no images" in verdict["error"]
