"""One Docker image asset per training variant, built by `cdk deploy` from the repository root with the
shared training/images/Dockerfile: the variant's Deep Learning Container for the region, plus
training/images/<variant>/requirements.txt and the project's runtime."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from aws_cdk import aws_ecr_assets as ecr_assets
from constructs import Construct

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = Path("training") / "images" / "Dockerfile"


class TrainingImages(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, base_images: Mapping[str, str]) -> None:
        super().__init__(scope, construct_id)
        self.images: dict[str, ecr_assets.DockerImageAsset] = {}
        for variant, base_image in sorted(base_images.items()):
            requirements = Path("training") / "images" / variant / "requirements.txt"
            if not (REPO_ROOT / requirements).exists():
                raise FileNotFoundError(f"variant {variant!r} has no {requirements}")
            self.images[variant] = ecr_assets.DockerImageAsset(
                self,
                f"{variant.capitalize()}Image",
                directory=str(REPO_ROOT),
                file=str(DOCKERFILE),
                build_args={"BASE_IMAGE": base_image, "VARIANT": variant},
                platform=ecr_assets.Platform.LINUX_AMD64,
            )

    @property
    def image_uris(self) -> dict[str, str]:
        return {variant: asset.image_uri for variant, asset in self.images.items()}
