"""The store's own threads run below the serving loop's priority.

A read ahead (file read, checksum, decode) and a save compete for the same cores as the
steps of running requests; on a host with few cores the step waits for them (a decode
step beside a long entry's read can take much longer). Lowered, they take
what the steps leave: the read-ahead's request waits somewhat longer in the queue instead
of every running request decoding slower.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

# nice increment of the store's threads (Linux schedules each thread by its own niceness)
NICENESS = 10


def lower_thread_priority(increment: int = NICENESS) -> bool:
    """Make the calling thread `increment` nicer (Linux: niceness is per thread); whether it
    could. Nowhere else is anything changed."""
    setpriority = getattr(os, "setpriority", None)
    if setpriority is None or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as e:  # a sandbox may refuse it: the thread runs as it was
        log.debug("could not lower the priority of %s: %s", threading.current_thread().name, e)
        return False
    return True
