"""compose.yaml, Dockerfile and .dockerignore, checked by reading them (no Docker engine here).

The point is that the deployment files cannot drift from the application: every environment
variable compose sets must be one core/settings.py reads, commands must match the entry points
(``core.wsgi``, ``celery -A core``), and the start-up order must wait for what each process needs.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from django.test import Client

from stack.nginx import RENDERER, nginx_check, setting_names
from tests.helpers.web import collectstatic_step, dockerfile_instructions

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
SETTINGS = ROOT / "core" / "settings.py"

APP_SERVICES = ("web", "webhooks", "worker", "beat")
PASSWORDS = ("POSTGRES_PASSWORD", "REDIS_PASSWORD", "RABBITMQ_PASSWORD")
REQUIRED_APP_ENV = (
    "DATABASE_URL",
    "CELERY_BROKER_URL",
    "REDIS_URL",
    "STRIPE_WEBHOOK_SECRET",
    "EMAIL_HOST",
    "EMAIL_PORT",
    "DJANGO_SECRET_KEY",
    "DJANGO_DEBUG",
)
FALSE_VALUES = {"0", "false", "off", "no"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # safe_load resolves the `<<: *app` merge keys, so each service below carries its
    # merged-in build, image and environment.
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def command(service: dict[str, Any]) -> list[str]:
    """The service's command as a list ([] when it runs its image's default)."""
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(part) for part in cmd]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the `- NAME=value` form
        env = dict(item.split("=", 1) for item in env)
    return {name: str(value) for name, value in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Each dependency and its condition (the short list form means service_started)."""
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def one_shot_services(services: dict[str, dict[str, Any]]) -> set[str]:
    """Services others wait on to *finish*: everything else is long-running."""
    return {
        name
        for service in services.values()
        for name, condition in depends_on(service).items()
        if condition == "service_completed_successfully"
    }


def settings_env_names() -> set[str]:
    """The environment variable names core/settings.py reads (env.str("X"), _secret("X"),
    machinery("X"), ...)."""
    source = SETTINGS.read_text()
    return set(
        re.findall(r'\b(?:env(?:\.\w+)?|_secret|setting|machinery)\(\s*"([A-Z][A-Z0-9_]*)"', source)
    )


def mail_catcher(services: dict[str, dict[str, Any]]) -> str:
    names = [
        n for n, s in services.items() if str(s.get("image", "")).startswith("axllent/mailpit")
    ]
    assert len(names) == 1, f"expected one Mailpit service, found {names}"
    return names[0]


def test_services_exist(services: dict[str, dict[str, Any]]) -> None:
    for name in ("postgres", "redis", *APP_SERVICES):
        assert name in services, name
    mail_catcher(services)
    assert services["postgres"]["image"].startswith("postgres:16-alpine@")
    assert services["postgres"]["environment"]["POSTGRES_DB"] == "invoicing"


def test_settings_regex_finds_the_names_it_should() -> None:
    # Guards the test below: a regex that matched nothing would make it vacuous.
    names = settings_env_names()
    assert {"DATABASE_URL", "DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET", "EMAIL_PORT"} <= names


@pytest.mark.parametrize("name", ["web", "webhooks"])
def test_web_and_webhooks_run_gunicorn_on_all_interfaces(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    cmd = command(services[name])
    assert cmd[0] == "gunicorn"
    assert "core.wsgi" in cmd
    assert "0.0.0.0:8000" in cmd
    assert "--workers" in cmd or "-w" in cmd


def test_metrics_are_summed_across_processes(services: dict[str, dict[str, Any]]) -> None:
    """Several gunicorn processes and a prefork worker: each group needs prometheus-client's
    multiprocess directory, its own (each clears it at start-up), or /metrics shows one
    process's counts."""
    groups = ("web", "webhooks", "worker")
    for name in ("web", "webhooks"):
        cmd = command(services[name])
        assert cmd[cmd.index("-c") + 1] == "gunicorn.conf.py"  # clears and marks dead
    assert int(environment(services["worker"])["WORKER_METRICS_PORT"]) > 0
    directories = {environment(services[n])["PROMETHEUS_MULTIPROC_DIR"] for n in groups}
    assert len(directories) == len(groups)
    assert "PROMETHEUS_MULTIPROC_DIR" not in environment(services["beat"])


def test_worker_runs_celery_and_never_consumes_the_dlq(services: dict[str, dict[str, Any]]) -> None:
    cmd = command(services["worker"])
    assert cmd[:4] == ["celery", "-A", "core", "worker"]
    # Queues come from core/celery.py; a -Q would override them and could add dlq.
    assert not any(
        part in ("-Q", "--queues") or part.startswith(("-Q", "--queues=")) for part in cmd
    ), cmd
    assert not any("dlq" in part for part in cmd), cmd


def test_beat_runs_celery_beat_exactly_once(services: dict[str, dict[str, Any]]) -> None:
    beat = services["beat"]
    assert command(beat)[:4] == ["celery", "-A", "core", "beat"]
    assert beat.get("deploy", {}).get("replicas", 1) == 1
    assert beat.get("scale", 1) == 1
    beats = [n for n, s in services.items() if command(s)[:4] == ["celery", "-A", "core", "beat"]]
    assert beats == ["beat"]


def test_long_running_services_have_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    one_shot = one_shot_services(services)
    assert one_shot == {"migrate"}
    for name, service in services.items():
        if name in one_shot:
            continue
        healthcheck = service.get("healthcheck")
        assert healthcheck, f"{name} has no healthcheck"
        assert not healthcheck.get("disable"), name
        assert healthcheck.get("test"), name


def test_healthchecks_probe_the_right_things(services: dict[str, dict[str, Any]]) -> None:
    assert "pg_isready" in str(services["postgres"]["healthcheck"]["test"])
    assert "redis-cli" in str(services["redis"]["healthcheck"]["test"])
    worker_test = str(services["worker"]["healthcheck"]["test"])
    assert "inspect ping" in worker_test
    # $$ so that the container's $HOSTNAME, not the host's, names the node.
    assert "celery@$$HOSTNAME" in worker_test
    # Liveness, with no I/O: a database or Redis outage must not mark web or the edge
    # unhealthy (tests/asyncwork/test_health.py: /health/live answers with both down).
    for name in ("web", "webhooks"):
        web_test = " ".join(services[name]["healthcheck"]["test"])
        assert "http://127.0.0.1:8000/health/live'" in web_test, name
    edge_test = services["edge"]["healthcheck"]["test"]
    assert edge_test[-1] == "http://127.0.0.1:8080/health/live"
    assert services["edge"]["environment"]["EDGE_LISTEN"] == "8080"


def test_redis_persists_the_broker(services: dict[str, dict[str, Any]]) -> None:
    assert "--appendonly yes" in command(services["redis"])[-1]
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])


def test_app_environment(services: dict[str, dict[str, Any]]) -> None:
    for name in APP_SERVICES:
        env = environment(services[name])
        for var in REQUIRED_APP_ENV:
            assert var in env, f"{name} lacks {var}"
        assert env["DJANGO_DEBUG"].lower() in FALSE_VALUES, name
        # Secrets come from the caller's environment; Compose refuses to start without them.
        assert env["DJANGO_SECRET_KEY"].startswith("${DJANGO_SECRET_KEY:?"), name
        assert env["STRIPE_WEBHOOK_SECRET"].startswith("${STRIPE_WEBHOOK_SECRET:?"), name
        assert env["DJANGO_SECURE_SSL_REDIRECT"].lower() in FALSE_VALUES, name


# Read by prometheus-client itself (multiprocess mode), not by core/settings.py.
LIBRARY_ENV = {"PROMETHEUS_MULTIPROC_DIR"}


def test_worker_metrics_are_served_inside_the_network_only(
    services: dict[str, dict[str, Any]],
) -> None:
    """The app binds the worker's metrics port to loopback unless told otherwise; compose
    tells it all interfaces, for Prometheus in another container, and publishes nothing."""
    worker = services["worker"]
    assert environment(worker)["WORKER_METRICS_ADDR"] == "0.0.0.0"
    assert "ports" not in worker
    assert "WORKER_METRICS_ADDR" not in environment(services["web"])


# What a user puts in .env for the required values (passwords URL-safe, as compose.yaml says).
REQUIRED = {name: f"{name.lower()}-value" for name in PASSWORDS}


def interpolated(value: str, secrets: dict[str, str]) -> str:
    """``value`` as Compose substitutes it: ``${NAME:?...}`` (required) from ``secrets`` (the
    passwords from REQUIRED unless given), ``${NAME:-default}`` from its default, innermost
    first, ``$$`` as ``$``."""
    given = {**REQUIRED, **secrets}

    def substitute(match: re.Match[str]) -> str:
        name, operator, rest = match.groups()
        if operator == ":?":
            return given[name]
        assert operator == ":-", match.group(0)
        return rest

    pattern = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(:\?|:-)([^${}]*)\}")
    while (substituted := pattern.sub(substitute, value)) != value:
        value = substituted
    return value.replace("$$", "$")


def secret_key_as_documented() -> str:
    """A DJANGO_SECRET_KEY made by the command the top of compose.yaml tells the user to run."""
    match = re.search(r"DJANGO_SECRET_KEY=\.\.\.\s+(python3 -c '[^']+')", COMPOSE.read_text())
    assert match, "compose.yaml no longer says how to make DJANGO_SECRET_KEY"
    made = subprocess.run(
        ["sh", "-c", match.group(1)], capture_output=True, text=True, timeout=30, check=True
    )
    return made.stdout.strip()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
@pytest.mark.parametrize("service", [*APP_SERVICES, "migrate"])
@pytest.mark.slow
def test_check_deploy_passes_with_the_environment_compose_gives(
    services: dict[str, dict[str, Any]], service: str, broker: str, tmp_path: Path
) -> None:
    """``manage.py check --deploy --fail-level WARNING`` in exactly the environment Compose
    gives the service, secrets made as its comments say. The hosts in it (postgres, redis,
    mailpit) do not exist here: the check must not need them."""
    secrets = {
        "DJANGO_SECRET_KEY": secret_key_as_documented(),
        "STRIPE_WEBHOOK_SECRET": "whsec_" + os.urandom(24).hex(),
    }
    env = {
        name: interpolated(value, secrets) for name, value in environment(services[service]).items()
    }
    if broker == "rabbitmq":
        env["CELERY_BROKER_URL"] = rabbitmq_broker_url(REQUIRED["RABBITMQ_PASSWORD"])
    if "PROMETHEUS_MULTIPROC_DIR" in env:  # a path inside the container
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    shell = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        # The image sets DJANGO_SETTINGS_MODULE=core.settings; manage.py defaults to it too.
        env={**shell, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # What it reports: only compose's explicit choice of plain HTTP, as the one INFO.
    issues = [line for line in result.stderr.splitlines() if line.startswith("?: (")]
    assert len(issues) == 1, result.stderr
    assert issues[0].startswith("?: (core.I001) HTTPS-only settings are off"), result.stderr
    assert "System check identified 1 issue (4 silenced)." in result.stderr


def test_every_app_variable_is_read_by_settings(services: dict[str, dict[str, Any]]) -> None:
    # A setting renamed in core/settings.py but not here would be silently ignored.
    known = settings_env_names() | LIBRARY_ENV
    image = services["web"]["image"]
    app_services = [n for n, s in services.items() if s.get("image") == image]
    assert set(APP_SERVICES) | {"migrate"} <= set(app_services)
    for name in app_services:
        # ANYMAIL_<NAME> is read by pattern (core/settings.py anymail_from_environment).
        given = {v for v in environment(services[name]) if not v.startswith("ANYMAIL_")}
        unknown = given - known
        assert not unknown, f"{name} sets variables core/settings.py never reads: {unknown}"


def test_urls_point_at_their_services(services: dict[str, dict[str, Any]]) -> None:
    env = environment(services["web"])
    database = urlsplit(interpolated(env["DATABASE_URL"], {}))
    assert database.scheme in ("postgres", "postgresql", "pgsql")
    assert database.hostname == "postgres"
    assert database.path == "/" + services["postgres"]["environment"]["POSTGRES_DB"]
    assert database.username == services["postgres"]["environment"]["POSTGRES_USER"]
    assert database.password == interpolated(
        services["postgres"]["environment"]["POSTGRES_PASSWORD"], {}
    )
    redis_password = interpolated(environment(services["redis"])["REDIS_PASSWORD"], {})
    for var in ("CELERY_BROKER_URL", "REDIS_URL"):
        url = urlsplit(interpolated(env[var], {}))
        assert (url.scheme, url.hostname, url.port) == ("redis", "redis", 6379), var
        assert url.password == redis_password, var
    # The broker and the cache do not share a Redis database.
    assert (
        urlsplit(interpolated(env["CELERY_BROKER_URL"], {})).path
        != urlsplit(interpolated(env["REDIS_URL"], {})).path
    )


def test_every_password_is_required_and_redis_asks_for_one(
    services: dict[str, dict[str, Any]],
) -> None:
    """No password has a default a copy would run with: Compose refuses to start without each
    one (``${NAME:?...}``), and Redis refuses clients without its own."""
    text = COMPOSE.read_text()
    for name in PASSWORDS:
        uses = re.findall(r"\$\{" + name + r"(:[?-])?", text)
        assert uses, name
        assert set(uses) == {":?"}, f"{name} is used without :? somewhere"
    redis = services["redis"]
    assert '--requirepass "$$REDIS_PASSWORD"' in command(redis)[-1]
    assert environment(redis)["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    # The healthcheck's redis-cli authenticates from the environment (REDISCLI_AUTH).
    assert environment(redis)["REDISCLI_AUTH"] == environment(redis)["REDIS_PASSWORD"]


def test_every_image_is_pinned_by_digest_and_rabbitmq_is_supported(
    services: dict[str, dict[str, Any]],
) -> None:
    pinned = re.compile(r"[a-z0-9./-]+:[A-Za-z0-9.-]+@sha256:[0-9a-f]{64}")
    for name, service in services.items():
        if "build" in service:  # the application's image, built from the Dockerfile
            continue
        assert pinned.fullmatch(service["image"]), name
    base = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("FROM ")]
    assert base
    assert all(pinned.fullmatch(line.split()[1]) for line in base), base
    assert re.fullmatch(r"rabbitmq:4\.[\d.]+-management-alpine@.*", services["rabbitmq"]["image"])


def test_nothing_is_published_beyond_loopback(services: dict[str, dict[str, Any]]) -> None:
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert set(published) == {"edge", "rabbitmq", "mailpit", "prometheus", "grafana"}, published
    for name, ports in published.items():
        assert all(str(port).startswith("127.0.0.1:") for port in ports), (name, ports)


def rabbitmq_broker_url(password: str) -> str:
    """The broker URL compose.yaml's comment gives for the rabbitmq profile, with ``password``
    where it says $RABBITMQ_PASSWORD."""
    match = re.search(
        r"COMPOSE_PROFILES=rabbitmq CELERY_BROKER_URL=(\S+) docker compose up", COMPOSE.read_text()
    )
    assert match, "compose.yaml no longer says how to run on RabbitMQ"
    return match.group(1).replace("$RABBITMQ_PASSWORD", password)


def test_the_rabbitmq_profile_is_a_healthy_broker_the_app_can_be_pointed_at(
    services: dict[str, dict[str, Any]],
) -> None:
    rabbitmq = services["rabbitmq"]
    assert rabbitmq["profiles"] == ["rabbitmq"]  # not started unless asked for
    assert re.fullmatch(
        r"rabbitmq:[\d.]+-management(-alpine)?@sha256:[0-9a-f]{64}", rabbitmq["image"]
    )
    assert rabbitmq["healthcheck"]["test"] == ["CMD", "rabbitmq-diagnostics", "-q", "ping"]
    assert any(v.endswith(":/var/lib/rabbitmq") for v in rabbitmq["volumes"])
    assert rabbitmq["hostname"] == "rabbitmq"  # the node name, which its data is kept under
    env = environment(rabbitmq)
    url = urlsplit(rabbitmq_broker_url(REQUIRED["RABBITMQ_PASSWORD"]))
    assert (url.scheme, url.hostname, url.port) == ("amqp", "rabbitmq", 5672)
    assert (url.username, url.password) == (
        env["RABBITMQ_DEFAULT_USER"],
        interpolated(env["RABBITMQ_DEFAULT_PASS"], {}),
    )
    assert url.path == "/" + env["RABBITMQ_DEFAULT_VHOST"]
    # The app services wait for it when it runs, and start without it when it does not.
    for name in APP_SERVICES:
        spec = services[name]["depends_on"]["rabbitmq"]
        assert spec == {"condition": "service_healthy", "required": False}, name
    # The broker URL is the caller's to switch; Redis is the default.
    broker = environment(services["web"])["CELERY_BROKER_URL"]
    assert broker.startswith("${CELERY_BROKER_URL:-redis://")


def test_email_goes_to_the_mail_catcher(services: dict[str, dict[str, Any]]) -> None:
    catcher = mail_catcher(services)
    smtp_bind = environment(services[catcher]).get("MP_SMTP_BIND_ADDR", "0.0.0.0:1025")
    smtp_port = smtp_bind.rsplit(":", 1)[1]
    for name in APP_SERVICES:
        env = environment(services[name])
        assert env["EMAIL_HOST"] == catcher, name
        assert env["EMAIL_PORT"] == smtp_port, name


def test_start_up_order(services: dict[str, dict[str, Any]]) -> None:
    migrate = services["migrate"]
    migrate_cmd = " ".join(command(migrate))
    assert "manage.py migrate" in migrate_cmd
    assert "manage.py setup_periodic_tasks" in migrate_cmd
    assert "manage.py setup_groups" in migrate_cmd
    assert migrate.get("restart", "no") == "no"
    assert depends_on(migrate).get("postgres") == "service_healthy"
    for name in APP_SERVICES:
        deps = depends_on(services[name])
        assert deps.get("migrate") == "service_completed_successfully", name
        assert deps.get("postgres") == "service_healthy", name
        assert deps.get("redis") == "service_healthy", name
    assert depends_on(services["worker"]).get(mail_catcher(services)) == "service_healthy"


def test_dockerfile_installs_the_project_and_runs_unprivileged() -> None:
    text = DOCKERFILE.read_text()
    lines = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    ]
    assert lines[0].startswith("FROM python:3.11-slim")
    # The locked runtime set with its hashes, then the machinery and the project alone
    # (tests/test_lock.py).
    assert re.search(r"^RUN pip install --require-hashes -r requirements/base.txt$", text, re.M)
    pattern = r"^RUN pip install --no-deps --no-build-isolation \./packages/asyncwork \.(\s|$)"
    assert re.search(pattern, text, re.M)
    installs = [line for line in lines if "pip install" in line]
    assert installs, "nothing is installed"
    assert not any("[dev]" in line or "-e " in line for line in installs), installs
    users = [line.split(None, 1)[1] for line in lines if line.startswith("USER ")]
    assert users, "the Dockerfile never switches away from root"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert "EXPOSE 8000" in lines
    assert any(line.startswith("CMD") and "gunicorn" in line for line in lines)
    # Production mode: DEBUG is off unless DJANGO_DEBUG is set, and the image never sets it.
    assert "DJANGO_DEBUG" not in "\n".join(lines)
    # The CMD runs from WORKDIR, where COPY put ./gunicorn.conf.py: gunicorn's master reads it
    # and checks the settings before any worker starts.
    assert "WORKDIR /app" in lines
    assert (ROOT / "gunicorn.conf.py").is_file()
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    assert not ignored & {"gunicorn.conf.py", "*.conf.py", "/gunicorn.conf.py"}


def test_dockerfile_collects_the_static_files_at_build(
    services: dict[str, dict[str, Any]],
) -> None:
    """The image carries its static files, for the application to serve (WhiteNoise): collected
    after the install and before the switch to the unprivileged user (owned by root, like the
    code), with throw-away secrets given to that one command, never to the image's environment.
    tests/helpers/web.py runs this very command for the tests that serve the files."""
    instructions = dockerfile_instructions()
    step = collectstatic_step()
    at = instructions.index(("RUN", step))
    installed = next(
        i
        for i, (kw, args) in enumerate(instructions)
        if kw == "RUN"
        and "pip install --no-deps --no-build-isolation ./packages/asyncwork ." in args
    )
    unprivileged = [kw for kw, _ in instructions].index("USER")
    assert installed < at < unprivileged
    assert step.endswith("python manage.py collectstatic --noinput"), step
    # The settings module it loads is the image's (core.settings, set by ENV before it).
    assert any(
        "DJANGO_SETTINGS_MODULE=core.settings" in args
        for kw, args in instructions[:at]
        if kw == "ENV"
    )
    # The two secrets the settings need, as assignments on this command only.
    assigned = dict(re.findall(r"\b([A-Z][A-Z0-9_]*)=(\S+)", step.partition("python")[0]))
    assert set(assigned) == {"DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET"}, step
    for keyword, arguments in instructions:
        if keyword in ("ENV", "ARG"):
            assert not set(assigned) & set(re.findall(r"[A-Z][A-Z0-9_]*", arguments)), arguments
    # They are where the build put them (/app/staticfiles): nothing points STATIC_ROOT away.
    for name, service in services.items():
        assert "DJANGO_STATIC_ROOT" not in environment(service), name


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = {
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    # staticfiles: a collection made on the host must not stand in for the build's own.
    assert {".venv", ".git", "bench/results", ".env", "staticfiles"} <= patterns


def test_edge_fronts_both_gunicorns_with_the_shipped_nginx_configuration(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    """The published port is nginx's (admission control before gunicorn), configured by
    deploy/nginx/render.sh from the edge's environment, as stack/nginx.py and the tests do; nginx
    starts only once it rendered, and accepts what it renders from compose's values. Who may
    post webhooks has no default; the webhook has a gunicorn of its own."""
    edge = services["edge"]
    assert str(edge["image"]).startswith("nginx:")
    mount = next(v for v in edge["volumes"] if v.split(":")[1] == "/etc/nginx/edge")
    source = (ROOT / mount.split(":")[0]).resolve()
    assert source == RENDERER.parent
    assert {"render.sh", "default.conf.template"} <= {p.name for p in source.iterdir()}
    script = command(edge)[-1]
    assert script.startswith("sh /etc/nginx/edge/render.sh && ")
    assert script.endswith("exec nginx -g 'daemon off;'")
    env = environment(edge)
    # Every name is one render.sh reads: a misspelled setting would be silently ignored.
    assert set(env) <= set(setting_names()), set(env) - set(setting_names())
    assert env["WEBHOOK_ALLOWED_SOURCES"].startswith("${WEBHOOK_ALLOWED_SOURCES:?")
    # gunicorn binds 0.0.0.0:8000 in each
    assert (env["APP_UPSTREAM"], env["WEBHOOK_UPSTREAM"]) == ("web:8000", "webhooks:8000")
    settings = {
        name: interpolated(value, {"WEBHOOK_ALLOWED_SOURCES": "any"}) for name, value in env.items()
    }
    # "web" and "webhooks" resolve inside compose only
    nginx_check(
        {**settings, "APP_UPSTREAM": "127.0.0.1:8000", "WEBHOOK_UPSTREAM": "127.0.0.1:8001"}
    )
    assert edge["ports"] == [f"127.0.0.1:8000:{env['EDGE_LISTEN']}"]
    # The gunicorns trust forwarded headers from the edge's fixed address alone, and nothing
    # reaches them around it.
    address = edge["networks"]["default"]["ipv4_address"]
    subnet = compose["networks"]["default"]["ipam"]["config"][0]["subnet"]
    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet)
    for name in ("web", "webhooks"):
        assert "ports" not in services[name], name
        assert environment(services[name])["TRUSTED_PROXIES"] == address, name
        # The edge refuses larger webhooks than the application would, never smaller ones.
        assert (
            environment(services[name])["WEBHOOK_MAX_BODY_BYTES"] == env["WEBHOOK_MAX_BODY_BYTES"]
        )


# --- The observability profile: Prometheus with the alert rules, Grafana with their dashboard ----

PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
OBSERVABILITY = ("prometheus", "grafana")


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Each bind mount's container path and its source in the repository (named volumes left)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith("./"):
            mounts[target] = ROOT / source
    return mounts


def gunicorn_port(service: dict[str, Any]) -> int:
    cmd = command(service)
    return int(cmd[cmd.index("--bind") + 1].rsplit(":", 1)[1])


def test_the_observability_profile_mounts_what_the_repository_holds(
    services: dict[str, dict[str, Any]],
) -> None:
    """Prometheus and Grafana run with the profile only, each from its pinned image, and every
    file they are given is one in deploy/: the configuration with its rules, the data source
    pointing at the Prometheus service, the dashboard where the provider reads."""
    for name in OBSERVABILITY:
        assert services[name]["profiles"] == ["observability"], name
        assert bind_mounts(services[name]), name
        for target, source in bind_mounts(services[name]).items():
            assert source.exists(), f"{name} mounts {source} at {target}: not in the repository"
        # The application never waits on them.
        for other in APP_SERVICES:
            assert name not in depends_on(services[other]), (other, name)

    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:v3.")
    config_file = next(
        arg.split("=", 1)[1] for arg in command(prometheus) if arg.startswith("--config.file=")
    )
    mounts = bind_mounts(prometheus)
    assert mounts["/etc/prometheus"] == PROMETHEUS_CONFIG.parent
    assert config_file == "/etc/prometheus/" + PROMETHEUS_CONFIG.name
    assert yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"] == ["alerts.yml"]
    assert (PROMETHEUS_CONFIG.parent / "alerts.yml").is_file()

    grafana = services["grafana"]
    assert grafana["image"].startswith("grafana/grafana:")
    mounts = bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    url = urlsplit(source["url"])
    prometheus_port = int(str(prometheus["ports"][0]).rsplit(":", 1)[1])
    assert (source["type"], url.hostname, url.port) == ("prometheus", "prometheus", prometheus_port)
    [provider] = yaml.safe_load((provisioning / "dashboards" / "invoice-async.yml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    dashboards = {
        target: path for target, path in mounts.items() if target.startswith(folder + "/")
    }
    assert [path.name for path in dashboards.values()] == ["dashboard.json"]
    # No account and no default password: anonymous viewers only.
    env = environment(grafana)
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert not {name for name in env if "PASSWORD" in name}


def test_prometheus_scrapes_the_services_compose_runs_on_the_ports_they_serve(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    """Each target of deploy/prometheus/prometheus.yml is a service here, on the port it serves
    metrics on: a gunicorn's --bind (by a name Django accepts as Host, from Prometheus' fixed
    address, which /metrics lets in), each worker's WORKER_METRICS_PORT on all interfaces."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    address = ipaddress.ip_address(services["prometheus"]["networks"]["default"]["ipv4_address"])
    subnet = compose["networks"]["default"]["ipam"]["config"][0]["subnet"]
    assert address in ipaddress.ip_network(subnet)
    assert str(address) != services["edge"]["networks"]["default"]["ipv4_address"]
    scraped = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                service = services[host]
                assert command(service)[0] == "gunicorn", target
                assert int(port) == gunicorn_port(service), target
                env = environment(service)
                assert host in env["DJANGO_ALLOWED_HOSTS"].split(","), target
                allowed = env["METRICS_ALLOWED_NETWORKS"].split(",")
                assert any(address in ipaddress.ip_network(net) for net in allowed), target
                # Loopback, and Prometheus alone: never a range other containers are in.
                assert all(
                    ipaddress.ip_network(net).is_loopback or net == str(address) for net in allowed
                ), allowed
                scraped.add(host)
        for discovery in job.get("dns_sd_configs", []):
            assert discovery["type"] == "A"
            for host in discovery["names"]:
                env = environment(services[host])
                assert command(services[host])[:4] == ["celery", "-A", "core", "worker"], host
                assert discovery["port"] == int(env["WORKER_METRICS_PORT"]), host
                assert env["WORKER_METRICS_ADDR"] == "0.0.0.0", host
                scraped.add(host)
    # Every process that serves metrics: the webhook counters are counted in webhooks alone.
    assert scraped == {"web", "webhooks", "worker"}


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["web", "webhooks"])
def test_a_gunicorns_metrics_answer_prometheus_and_refuse_the_rest_of_the_network(
    services: dict[str, dict[str, Any]], settings: Any, name: str
) -> None:
    """The application's own /metrics view, with the Host and the networks compose gives the
    service: Prometheus' scrape is served; another container, or the host through Docker's
    gateway, is refused."""
    env = environment(services[name])
    settings.ALLOWED_HOSTS = env["DJANGO_ALLOWED_HOSTS"].split(",")
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "METRICS_ALLOWED_NETWORKS": env["METRICS_ALLOWED_NETWORKS"].split(","),
        "METRICS_TOKEN": "",
        "TRUSTED_PROXIES": [env["TRUSTED_PROXIES"]],
    }
    prometheus = services["prometheus"]["networks"]["default"]["ipv4_address"]
    client = Client(HTTP_HOST=f"{name}:{gunicorn_port(services[name])}")
    scraped = client.get("/metrics", REMOTE_ADDR=prometheus)
    assert scraped.status_code == 200
    assert b"invoicing_dlq_depth" in scraped.content
    for other in ("172.30.80.1", "172.30.80.3"):
        assert client.get("/metrics", REMOTE_ADDR=other).status_code == 403, other
    # Through the edge (the one trusted proxy), the client it names decides, not the edge.
    edge = services["edge"]["networks"]["default"]["ipv4_address"]
    relayed = client.get("/metrics", REMOTE_ADDR=edge, HTTP_X_FORWARDED_FOR="172.30.80.1")
    assert relayed.status_code == 403
