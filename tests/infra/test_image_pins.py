"""The training images and the tests run the same framework releases: the DLC tags in infra/config.py and
the framework pins the tests install (requirements/) are held together here, so that bumping one without
the other fails CI instead of shipping an image that runs code its tests never ran."""

from __future__ import annotations

import re
from pathlib import Path

from infra.config import PlatformConfig

REPO = Path(__file__).resolve().parents[2]


def pin(path: str, package: str) -> str:
    text = (REPO / path).read_text()
    match = re.search(rf"^{re.escape(package)}(?:\[[^\]]*\])?==(\S+)$", text, re.MULTILINE)
    assert match, f"{path} pins no {package}"
    return match.group(1)


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def tag_version(variant: str) -> str:
    """The framework release a DLC tag names (``pytorch-training:2.9.0-gpu-...`` → 2.9.0)."""
    tag = PlatformConfig().base_images[variant].rsplit(":", 1)[1]
    return tag.split("-", 1)[0]


def local(version: str) -> str:
    """A wheel's version without its local build label (2.9.1+cu126 → 2.9.1)."""
    return version.split("+", 1)[0]


def test_the_pytorch_image_runs_the_tests_torch_release_with_kernels_for_v100() -> None:
    assert minor(tag_version("pytorch")) == minor(pin("requirements/dlc-pytorch.txt", "torch"))
    # The DLC is a CUDA 13 build (no Volta): the image installs the tests' exact torch in its CUDA 12.6 build.
    framework = "training/images/pytorch/framework.txt"
    for package in ("torch", "torchvision"):
        assert local(pin(framework, package)) == pin("requirements/dlc-pytorch.txt", package)
        assert pin(framework, package).endswith("+cu126")


def test_the_neuron_image_runs_the_tests_torch_xla_release() -> None:
    assert minor(tag_version("neuron")) == minor(pin("requirements/xla.txt", "torch-xla"))
    assert minor(tag_version("neuron")) == minor(pin("requirements/dlc-pytorch.txt", "torch"))


def test_the_tensorflow_image_installs_the_tests_tensorflow_release() -> None:
    # No TensorFlow DLC carries the tests' release: the image installs it (framework.txt) over the DLC.
    assert pin("training/images/tensorflow/framework.txt", "tensorflow") == pin("requirements/dlc-tensorflow.txt", "tensorflow-cpu")
    assert "framework.txt" in (REPO / "training" / "images" / "Dockerfile").read_text()


def test_the_pytorch_image_checks_it_has_the_opencv_release_the_tests_run() -> None:
    # The DLC carries opencv-python; the tests install the headless build of the same release.
    release = pin("requirements/dlc-pytorch.txt", "opencv-python-headless").rsplit(".", 1)[0]  # 4.11.0.86 → 4.11.0
    dockerfile = (REPO / "training" / "images" / "Dockerfile").read_text()
    assert f"cv2.__version__ != '{release}'" in dockerfile
