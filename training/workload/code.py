"""A user workload's code on its way to the hosts: packed once on the client, unpacked on every host.

As SageMaker's own script mode ships a ``source_dir``, the client packs the folder into
``sourcedir.tar.gz`` and the job receives it as a channel routed to every instance group
(``hyperparameters.CODE_CHANNEL``). What differs, and why:

* the archive is reproducible (sorted members, zeroed times and owners, a fixed gzip header): the same
  folder always packs to the same bytes, so its SHA-256 names it (``code/<sha256>/sourcedir.tar.gz``),
  a second run of unchanged code uploads nothing, and a host refuses an archive that is not the one the
  run was started with (``CodeMismatchError``);
* ``.git``, virtual environments, caches, build outputs and editor files stay behind (``IGNORED``): they
  are large and never what a trainer imports;
* the launcher unpacks into a fresh folder of its own, not ``/opt/ml/code`` (the training toolkit skips
  unpacking into a folder that is not empty, and the platform's image has its code there), refusing any
  member that would land outside it, a link, or a device file;
* requirements install into a virtual environment in that folder's ``.packages`` that sees the image's
  packages (what the image has satisfies a requirement; nothing of it is installed again or shadowed: the
  environment's site-packages go on the path after the image's), from the package index, or only from
  the wheels shipped in the folder's ``wheels/`` when it has one (a job in a VPC without internet reaches
  no index).

    python -m training.workload.code pack FOLDER      # prints the SHA-256 and the size
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.hyperparameters import CODE_ARCHIVE

ARCHIVE_NAME = CODE_ARCHIVE
# Folders and files never packed, at any depth: version control, environments, caches, editor state, and
# credentials (a key or a cloud profile must not travel to every host, nor be copied beside the model).
IGNORED_DIRS = frozenset({".git", ".hg", ".svn", ".venv", "venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
                          ".ipynb_checkpoints", "node_modules", ".idea", ".vscode", ".tox", ".eggs", ".packages", "cdk.out",
                          ".aws", ".ssh", ".gnupg", ".docker", ".kube"})
IGNORED_FILES = frozenset({".env", ".envrc", ".netrc", ".pgpass", ".npmrc", ".pypirc", "credentials"})
IGNORED_SUFFIXES = (".pyc", ".pyo", ".egg-info", ".swp", "~", ".pem", ".key", ".p12", ".pfx")
# Build outputs, only at the folder's top (a package may well have a module folder named build or env).
IGNORED_TOP = frozenset({"build", "dist", "env"})
# Shipped wheels live here; with any, requirements install from them alone.
WHEELS_DIR = "wheels"
PACKAGES_DIR = ".packages"
# A workload's code is source, not data: past this the folder holds what belongs in a channel.
MAX_ARCHIVE_BYTES = 256 << 20


class CodeError(ValueError):
    """The workload's code folder cannot be packed, unpacked or installed."""


class CodeMismatchError(CodeError):
    """The code a host received is not the code the run was started with."""


@dataclass(frozen=True)
class PackedCode:
    archive: bytes  # sourcedir.tar.gz
    sha256: str
    files: tuple[str, ...]  # the packed paths, relative to the folder

    @property
    def key(self) -> str:
        """Its S3 key below the results bucket: content-addressed, shared by every run of this code."""
        return f"code/{self.sha256}/{ARCHIVE_NAME}"


def is_ignored(relative: Path) -> bool:
    """Whether a path of the folder stays behind. Pure."""
    parts = relative.parts
    return (bool(parts) and parts[0] in IGNORED_TOP) or relative.name in IGNORED_FILES or any(
        part in IGNORED_DIRS or part.endswith(IGNORED_SUFFIXES) for part in parts)


def code_files(folder: Path) -> Iterator[Path]:
    """The files to pack, sorted, relative to ``folder``; links are refused (they would point anywhere)."""
    for root, dirs, names in os.walk(folder):
        base = Path(root)
        dirs[:] = sorted(name for name in dirs if not is_ignored((base / name).relative_to(folder)))
        for name in sorted(names):
            path = base / name
            relative = path.relative_to(folder)
            if is_ignored(relative):
                continue
            if path.is_symlink():
                raise CodeError(f"{path} is a symbolic link: pack the file it points to instead (a link may lead outside the folder)")
            if path.is_file():
                yield relative
        for name in dirs:
            if (base / name).is_symlink():  # os.walk does not follow it: refused, not silently left behind
                raise CodeError(f"{base / name} is a symbolic link to a folder: pack the folder itself")


def pack_code(folder: Path) -> PackedCode:
    """The folder as a reproducible sourcedir.tar.gz and its SHA-256."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CodeError(f"the workload's code folder {folder} does not exist")
    files = tuple(sorted(path.as_posix() for path in code_files(folder)))  # tar names are POSIX paths, whatever the client
    if not files:
        raise CodeError(f"the workload's code folder {folder} holds no files to pack")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in files:
            data = (folder / name).read_bytes()
            info = tarfile.TarInfo(name)
            # Only the execute bit is kept of a file's mode (a shipped script stays runnable); times and owners not at all.
            info.size, info.mode, info.mtime = len(data), 0o755 if os.access(folder / name, os.X_OK) else 0o644, 0
            archive.addfile(info, io.BytesIO(data))
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, filename="") as compressed:
        compressed.write(raw.getvalue())
    data = packed.getvalue()
    if len(data) > MAX_ARCHIVE_BYTES:
        raise CodeError(f"{folder} packs to {len(data) >> 20} MiB, more than {MAX_ARCHIVE_BYTES >> 20} MiB of code: data belongs in a channel")
    return PackedCode(data, hashlib.sha256(data).hexdigest(), files)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_archive(channel: Path) -> Path:
    """The archive in a host's code channel: exactly its name (other objects that share the key's prefix,
    which an S3Prefix channel downloads too, are not it)."""
    archive = channel / ARCHIVE_NAME
    if not archive.is_file():
        found = sorted(path.name for path in channel.iterdir()) if channel.is_dir() else []
        raise CodeError(f"the code channel {channel} holds no {ARCHIVE_NAME} (it holds {found})")
    return archive


def stored_archive_problem(s3: Any, bucket: str, key: str, sha256: str) -> str | None:
    """None when s3://bucket/key is the archive whose SHA-256 is ``sha256``; else what is wrong with it
    (absent, too large, other bytes). S3's own SHA-256 of the object where it has one (an upload with
    ChecksumSHA256), else the bytes read and hashed: the size is bounded by MAX_ARCHIVE_BYTES."""
    import base64

    from botocore.exceptions import ClientError

    try:
        head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except ClientError as error:
        if error.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
            return f"s3://{bucket}/{key} does not exist"
        raise
    size = int(head.get("ContentLength", 0))
    if size > MAX_ARCHIVE_BYTES:
        return f"s3://{bucket}/{key} holds {size >> 20} MiB, more than any packed code ({MAX_ARCHIVE_BYTES >> 20} MiB)"
    if head.get("ChecksumSHA256") and "-" not in head["ChecksumSHA256"]:
        seen = base64.b64decode(head["ChecksumSHA256"]).hex()
    else:
        digest = hashlib.sha256()
        for block in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 20):
            digest.update(block)
        seen = digest.hexdigest()
    return None if seen == sha256 else f"s3://{bucket}/{key} holds other bytes than its name says (SHA-256 {seen})"


def unpack_code(archive: Path, destination: Path, sha256: str) -> Path:
    """Check the archive's SHA-256, then unpack it into ``destination`` (which must not exist yet)."""
    seen = file_sha256(archive)
    if seen != sha256:
        raise CodeMismatchError(f"the code channel's archive has SHA-256 {seen}, not the {sha256} this run was started with")
    destination.mkdir(parents=True)
    with tarfile.open(archive, mode="r:gz") as packed:
        for member in packed.getmembers():
            if not (member.isfile() or member.isdir()):
                raise CodeError(f"{archive} holds {member.name!r}, which is neither a file nor a folder")
        # The "data" filter refuses absolute names, '..' and anything that would land outside the folder.
        packed.extractall(destination, filter="data")
    return destination


def install_command(folder: Path, requirements: str, environment: Path) -> list[str]:
    """pip's command that installs the folder's requirements into ``environment`` (a virtual environment
    that sees the image's packages): from the index, or from the shipped wheels alone when the folder has
    a wheels/ folder. What the image has already satisfies a requirement: pip's --target would ignore it
    and install torch again, gigabytes on every host, shadowing the image's CUDA or Neuron build. Pure."""
    command = [str(environment / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
               "-r", str(folder / requirements)]
    wheels = folder / WHEELS_DIR
    if wheels.is_dir():
        command += ["--no-index", "--find-links", str(wheels)]
    return command


def site_packages(environment: Path) -> Path:
    return environment / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def install_requirements(folder: Path, requirements: str, environment: Path | None = None) -> Path | None:
    """Install the requirements into a virtual environment (``environment``, default the folder's
    .packages) that sees this interpreter's packages; its site-packages, to put on the path after them,
    or None when there is nothing to install. CodeError with pip's own words on failure."""
    if not requirements:
        return None
    path = folder / requirements
    if not path.is_file():
        raise CodeError(f"the requirements file {requirements!r} is not in the code folder {folder}")
    if not [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]:
        return None
    environment = environment or folder / PACKAGES_DIR
    # --without-pip: the environment runs the image's own pip, which it sees with the image's packages.
    created = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(environment)],
                             capture_output=True, text=True, check=False)
    if created.returncode != 0:
        raise CodeError(f"could not make an environment for the requirements: {created.stderr.strip()}")
    result = subprocess.run(install_command(folder, requirements, environment), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        where = "the wheels shipped in wheels/" if (folder / WHEELS_DIR).is_dir() else "the package index"
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise CodeError(f"the requirements in {requirements} cannot be installed from {where}: {' '.join(detail)}")
    return site_packages(environment)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "pack":
        print("usage: python -m training.workload.code pack FOLDER", file=sys.stderr)
        return 2
    try:
        packed = pack_code(Path(args[1]))
    except CodeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{packed.sha256}  {len(packed.archive)} bytes, {len(packed.files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
