"""The folder `llmserve up` works in: the model repository and Triton's log.

`--workdir` given: that folder, left as it is. Not given: a new temporary folder
(`llmserve-up-*` under the system's temporary folder), removed when the platform stops
(Ctrl-C, SIGTERM, or the gateway ending by itself). A platform that failed once Triton had
been started (Triton did not get ready, the gateway could not listen, the watchdog gave up)
keeps it and says so in the log: its triton.log says why. (A failure before, such as a bad
platform.yaml, has no log to keep.) A launcher killed outright (SIGKILL) cannot remove it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

logger = logging.getLogger("llmserve.up")

PREFIX = "llmserve-up-"


@contextlib.contextmanager
def platform_workdir(given: str | None) -> Iterator[str]:
    """The workdir for the platform's life (see the module's docstring)."""
    if given:
        yield given
        return
    path = tempfile.mkdtemp(prefix=PREFIX)
    failed = True
    try:
        yield path
        failed = False
    except SystemExit as exc:  # the signal handlers' exit (0), or a failure's (1)
        failed = exc.code not in (None, 0)
        raise
    except KeyboardInterrupt:
        failed = False
        raise
    finally:
        log = os.path.join(path, "triton.log")
        if failed and os.path.exists(log):
            logger.warning("the platform failed: its folder %s is kept for the Triton log (%s); remove it when done",
                           path, log)  # fmt: skip
        else:
            shutil.rmtree(path, ignore_errors=True)
