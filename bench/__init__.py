"""Benchmarks run against the application served by gunicorn, never against the dev data.

``python -m bench.webhook_ingest`` measures webhook ingest; ``bench.harness`` holds the server
and load-generator pieces later benchmarks reuse, ``bench.stack`` the database, broker and CPU
bookkeeping around them.
"""
