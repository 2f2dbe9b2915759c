"""A training job's output.tar.gz as SageMaker uploads it, the trainer's summary.json inside: shared by the
Lambda, workflow and SDK tests (standard library only: tests/sdk/ runs without the platform's packages)."""

from __future__ import annotations

import io
import json
import tarfile


def output_archive(summary: dict) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = json.dumps(summary).encode()
        info = tarfile.TarInfo("summary.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
