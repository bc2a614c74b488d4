"""The machinery's relay (``asyncwork.backend.relay``, what every worker's poll runs each
second), run once with no grace period and frozen right after it has published its
``--freeze-after``-th job, so the orchestrator can SIGKILL it *between publishing and marking
published*.

The relay publishes a batch of rows inside one transaction, holding them ``FOR UPDATE``, and
marks them published at the end of it; this process reports each job published (once the
outbox's send of it returned: the broker took the message) on stdout and, at the chosen one,
stops where it is, the transaction still open, until it is killed. Nothing in the relay's code
is changed: the probe only observes each send and holds the process at the point where the
crash is injected.

Protocol on stdout: ``ready`` once Django is set up; then, after a line on stdin, one
``published job-<id>`` per job, then ``frozen`` (waiting to be killed) or ``finished`` (it ran
out of rows first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freeze-after", type=int, default=3, metavar="N")
    freeze_after = parser.parse_args().freeze_after

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
    import django

    django.setup()
    from asyncwork import backend

    published = 0
    send = backend._send

    def observed(job: Any, *, queue: str) -> Exception | None:
        nonlocal published
        error = send(job, queue=queue)
        if error is None:
            published += 1
            print(f"published {backend.message_id(job.pk)}", flush=True)
            if published >= freeze_after:
                print("frozen", flush=True)
                while True:  # the transaction stays open until SIGKILL
                    time.sleep(3600)
        return error

    backend._send = observed
    print("ready", flush=True)
    sys.stdin.readline()
    backend.relay(grace=timedelta(0))
    print("finished", flush=True)


if __name__ == "__main__":
    main()
