"""stack.machine: every result file names the machine it was made on, the servers' versions
read from the servers themselves when they answer, from their binaries when they do not."""

from __future__ import annotations

import os
import re
import subprocess

import psycopg
import redis

from stack import machine
from stack.net import HOST, free_port
from stack.process import ROOT

POSTGRES = "postgres://postgres@127.0.0.1:5432/a_database_that_need_not_exist"
REDIS = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
VERSION = re.compile(r"\d+\.\d+(\.\d+)?")


def test_the_servers_versions_are_what_the_servers_say() -> None:
    with psycopg.connect("postgres://postgres@127.0.0.1:5432/postgres") as connection:
        row = connection.execute("SHOW server_version").fetchone()
    assert row is not None
    assert machine.postgres_version(POSTGRES) == str(row[0]).split()[0]
    client = redis.Redis.from_url(REDIS)
    try:
        assert machine.redis_version(REDIS) == client.info("server")["redis_version"]
    finally:
        client.close()


def test_a_server_that_does_not_answer_is_described_by_its_binary() -> None:
    nowhere = free_port()
    postgres = machine.postgres_version(f"postgres://postgres@{HOST}:{nowhere}/x")
    assert VERSION.fullmatch(postgres)
    assert VERSION.fullmatch(machine.redis_version(f"redis://{HOST}:{nowhere}/0"))


def test_the_description_names_every_part_a_result_file_needs() -> None:
    described = machine.describe(postgres_url=POSTGRES, redis_url=REDIS)
    assert described["nproc"] >= 1
    assert described["cpu_model"] != machine.UNKNOWN
    assert described["memory_gib"] > 0
    assert VERSION.fullmatch(described["python"])
    assert VERSION.fullmatch(described["postgres"])
    assert VERSION.fullmatch(described["redis"])
    assert len(described["loadavg_at_start"]) == 3
    assert described["redis"] in machine.summary(described)


def test_the_revision_is_the_checked_out_commit() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert machine.revision() == head.stdout.strip()
