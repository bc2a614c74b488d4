"""Benchmarks, each run as ``python -m bench.<name>`` from the repository root, or all of them
in sequence with one summary table as ``python -m bench`` (``--quick`` for the short profile).

``bench.harness`` serves the application with gunicorn and loads it over HTTP (closed and open
loop); ``bench.stack`` sets up and checks what surrounds the server (a database of the
benchmark's own, Redis keys under a prefix of its own, CPU per process group);
``bench.fullstack`` adds the Celery workers and an SMTP sink for the end-to-end benchmarks;
``bench.report`` holds the goal rows every benchmark reports. Results go to ``bench/results/``
(ignored).
"""
