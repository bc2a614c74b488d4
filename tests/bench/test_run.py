"""What a benchmark run measures of its processes (``bench/run.py``)."""

from __future__ import annotations

import subprocess
import sys

from bench.run import cpu_metered

# Burns 0.5 s of CPU, then idles before it exits.
_BURN = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
_BURN += "time.sleep(0.5)\n"


def test_a_process_that_ends_within_the_block_counts_until_its_last_reading() -> None:
    # As a PostgreSQL backend does whose connection Django replaces during an arm.
    child = subprocess.Popen([sys.executable, "-c", _BURN])
    try:
        with cpu_metered(
            lambda: {"child": [child.pid] if child.poll() is None else []}, every=0.1
        ) as spent:
            child.wait(timeout=30)
    finally:
        child.kill()
        child.wait()
    assert spent["child"] >= 0.4
