"""The platform's client: the `hetero` command (hetero/cli.py) and the Python API under it (hetero/api.py)."""

from hetero.api import ClientFacingError, Platform, Run, follow, launch, launch_sweep, result, runs, stop, validate

__all__ = ["ClientFacingError", "Platform", "Run", "follow", "launch", "launch_sweep", "result", "runs", "stop", "validate"]
