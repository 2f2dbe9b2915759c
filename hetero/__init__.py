"""The platform's client: the `hetero` command (hetero/cli.py), the Python API under it (hetero/api.py),
and one job without the state machine, through the SageMaker SDK when installed (hetero/direct.py, sdk.py)."""

from hetero.api import ClientFacingError, Platform, Run, follow, follow_job, launch, launch_sweep, result, runs, stop, validate
from hetero.direct import job_result, launch_direct, stop_job

__all__ = ["ClientFacingError", "Platform", "Run", "follow", "follow_job", "job_result", "launch", "launch_direct", "launch_sweep",
           "result", "runs", "stop", "stop_job", "validate"]
