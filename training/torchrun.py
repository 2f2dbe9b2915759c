"""torchrun, recording which rank failed first and how, for the launcher's failure reason.

torchrun prints its "Root Cause" report to stderr and writes an error file only for a rank that wrote
one itself; a rank killed by a signal (the OOM killer's SIGKILL) writes nothing. This runs torchrun's own
``main`` and, when a rank fails, writes the first failure as JSON (rank, local rank, exit code, signal)
to the file the launcher names in ``TRAINING_RANK_FAILURE_FILE``, then fails as torchrun does.

    TRAINING_RANK_FAILURE_FILE=/tmp/rank-failure.json python -m training.torchrun --nproc-per-node=2 -m my.module
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from training.failure import RANK_FAILURE_ENV


def first_failure(error: ChildFailedError) -> dict[str, Any]:
    rank, failure = error.get_first_failure()
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "pid": failure.pid,
    }


def main(argv: list[str]) -> None:
    try:
        torchrun_main(argv)
    except ChildFailedError as error:
        path = os.environ.get(RANK_FAILURE_ENV)
        if path:
            with open(path, "w") as file:
                json.dump(first_failure(error), file)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
