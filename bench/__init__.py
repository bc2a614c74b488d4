"""Benchmarks, each run as ``python -m bench.<name>`` from the repository root.

``bench.harness`` serves the application with gunicorn and loads it over HTTP; ``bench.stack``
sets up and checks what surrounds the server (a database of the benchmark's own, Redis keys
under a prefix of its own, CPU per process group). Results go to ``bench/results/`` (ignored).
"""
