"""Benchmarks, each run as ``python -m bench.<name>`` from the repository root, or all of them
in sequence with one summary table as ``python -m bench`` (``--quick`` for the short profile).

They start the application's processes through the kit (``stack``). Here is only what is
theirs: ``bench.harness`` loads the application over HTTP (closed and open loop) with Stripe
deliveries; ``bench.run`` is what a run owns (a database of its own, Redis keys under a prefix of
its own), the environment its processes get, and CPU per process group; ``bench.fullstack`` adds
the SMTP server and the Celery workers for the end-to-end benchmarks, and checks what they
stored and sent; ``bench.report`` holds the goal rows every benchmark reports. Each benchmark
writes its result file, ``bench/results/<name>.json`` (date, machine, figures, goal verdicts),
kept in the repository: docs/explanation/performance.md's tables are generated from it.
"""
