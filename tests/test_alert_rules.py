"""deploy/prometheus (alert rules, their unit tests, the scrape configuration) and
deploy/grafana/dashboard.json, checked by Debian's promtool and against the application's real
GET /metrics.

* promtool accepts the rules and the configuration, and its unit tests pass; every alert is
  tested firing and not firing, and the tests are shown to catch a rule that never fires and one
  that always does;
* every metric the rules and the dashboard read is one /metrics serves, with the labels and the
  label values they match on, so a renamed metric, label or scheduled job fails here;
* the dashboard is a Grafana model with a Prometheus data-source variable and one panel per
  alert's figure, its queries valid PromQL;
* Debian's Prometheus, scraping a real gunicorn, evaluates every rule without error (slow);
* each alert's runbook is its section of docs/how-to/alerts.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from django.db import connection
from django.test import Client
from django.utils import timezone

from asyncwork.deadletters import record
from asyncwork.errors import PermanentError
from asyncwork.models import Job
from invoicing.tasks import EMAIL_QUEUE, send_invoice_email
from stack import launch, stripe_events
from stack.net import HOST, free_port, wait_until
from stack.process import Process
from tests.helpers.metrics import Samples, scrape
from tests.helpers.processes import worker_env
from tests.helpers.stripe import paid_event, post_event
from webhooks.models import EventsCursor
from webhooks.reconcile import JOB as RECONCILE_JOB

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
RULE_TESTS = PROMETHEUS / "alerts.test.yml"
CONFIG = PROMETHEUS / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboard.json"
OPERATIONS = ROOT / "docs" / "how-to" / "alerts.md"

# Labels Prometheus attaches to every scraped series (a series' own `job` becomes `exported_job`).
TARGET_LABELS = {"instance", "job"}
# Series Prometheus makes itself, not the application.
PROMETHEUS_SERIES = {"up": TARGET_LABELS}


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    """Debian's promtool, run on ``args``; fails the test, saying how to install it, without."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found: install Debian's prometheus package "
            "(apt-get install prometheus), as .ci/run does"
        )
    return subprocess.run(
        [path, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def rule_tests() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULE_TESTS.read_text())["tests"])


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def scrape_jobs() -> list[str]:
    return [job["job_name"] for job in yaml.safe_load(CONFIG.read_text())["scrape_configs"]]


# --- promtool ------------------------------------------------------------------------------------


def test_without_promtool_the_tests_fail_saying_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match=r"apt-get install prometheus"):
        promtool("--version")


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
    assert len(alerts()) == len(rules()) >= 12  # every rule an alert, each name once


def test_promtool_accepts_the_configuration_and_the_rule_files_it_loads() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    # Relative to the configuration's directory: the same files in the repository and where
    # compose mounts it (/etc/prometheus).
    assert config["rule_files"] == [RULES.name]
    checked = promtool("check", "config", CONFIG.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {CONFIG.name} is valid prometheus config file syntax" in checked.stdout
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_promtool_unit_tests_pass() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_is_tested_firing_and_not_firing_and_the_healthy_run_covers_all() -> None:
    assert yaml.safe_load(RULE_TESTS.read_text())["rule_files"] == [RULES.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for group in rule_tests():
        for case in group["alert_rule_test"]:
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    assert firing == set(alerts())
    assert quiet == set(alerts())
    [healthy] = [group for group in rule_tests() if group["name"] == "healthy"]
    assert {case["alertname"] for case in healthy["alert_rule_test"]} == set(alerts())
    assert all(case["exp_alerts"] == [] for case in healthy["alert_rule_test"])


def failed_alerts(output: str) -> set[str]:
    """The alert names of promtool's failed cases (``alertname: X, time: ...`` under FAILED)."""
    return set(re.findall(r"alertname: (\w+), time:", output))


def rules_with_every_expr(tmp_path: Path, expr: str) -> Path:
    """The rules and their tests in ``tmp_path``, every alert's expression replaced by ``expr``."""
    data = yaml.safe_load(RULES.read_text())
    for group in data["groups"]:
        for rule in group["rules"]:
            rule["expr"] = expr
    (tmp_path / RULES.name).write_text(yaml.safe_dump(data))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    return tmp_path


@pytest.mark.parametrize(
    ("expr", "which"),
    [("vector(1) < 0", "never fires"), ("vector(1)", "always fires")],
)
def test_the_unit_tests_catch_an_alert_that_never_fires_or_always_fires(
    tmp_path: Path, expr: str, which: str
) -> None:
    """Each alert's tests fail when it ``which``: none of them asserts nothing."""
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=rules_with_every_expr(tmp_path, expr))
    assert tested.returncode != 0, tested.stdout
    assert failed_alerts(tested.stdout + tested.stderr) == set(alerts()), tested.stdout


# --- The metrics the rules and the dashboard read -------------------------------------------------

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count"}
AGGREGATIONS |= {"count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"} | GROUPING
TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"'  # a string
    r"|\{[^}]*\}"  # label matchers
    r"|\[[^\]]*\]"  # a range or subquery
    r"|[A-Za-z_:][A-Za-z0-9_:]*"  # a name
    r"|[0-9][0-9.eE+-]*"  # a number
    r"|\S"
)
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def selectors(expr: str) -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    """Each series selector of PromQL ``expr``: its metric name and its label matchers. Names
    followed by ``(`` are functions and aggregations; names in grouping clauses are labels."""
    tokens = TOKEN.findall(expr)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in GROUPING and following == "(":
            i = tokens.index(")", i)  # the label list: names, not metrics
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token) and not (
            token in KEYWORDS or token in AGGREGATIONS or following == "("
        ):
            matchers: list[tuple[str, str, str]] = []
            if following.startswith("{"):
                body = following[1:-1]
                matchers = [(m[1], m[2], m[3]) for m in MATCHER.finditer(body)]
                assert "".join(m.group(0) for m in MATCHER.finditer(body)).strip() == body.strip()
            yield token, matchers
        i += 1


def grouping_labels(expr: str) -> set[str]:
    """The label names of ``expr``'s ``by``/``without``/``on``/``ignoring`` clauses."""
    lists = re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr)
    return {name.strip() for names in lists for name in names.split(",") if name.strip()}


Exported = dict[str, dict[str, set[str]]]


def exported(samples: Samples) -> Exported:
    """Each metric name /metrics served, and each of its labels with the values seen."""
    names: Exported = {}
    for (name, labels), _ in samples.items():
        seen = names.setdefault(name, {})
        for label, label_value in labels:
            seen.setdefault(label, set()).add(label_value)
    return names


def problems(expr: str, served: Exported) -> list[str]:
    """What in ``expr`` the application does not serve: a metric name, a label, or a label value
    an equality or a plain alternation matches on."""
    found = []
    labels_used: set[str] = set(TARGET_LABELS)
    for name, matchers in selectors(expr):
        if name in PROMETHEUS_SERIES:
            labels: dict[str, set[str]] = {label: set() for label in PROMETHEUS_SERIES[name]}
        elif name in served:
            # The series' own `job` is `exported_job` once scraped.
            labels = {("exported_job" if k == "job" else k): v for k, v in served[name].items()}
        else:
            found.append(f"metric {name} is not served")
            continue
        labels_used |= set(labels)
        for label, op, matched in matchers:
            if label not in labels and label not in TARGET_LABELS:
                found.append(f"{name} has no label {label}")
            elif label in labels and labels[label] and op in ("=", "=~"):
                wanted = matched.split("|") if op == "=~" else [matched]
                if all(re.fullmatch(r"[\w-]+", part) for part in wanted):
                    found += [
                        f'{name}{{{label}="{part}"}} is not served'
                        for part in wanted
                        if part not in labels[label]
                    ]
    found += [f"no metric here has label {label}" for label in grouping_labels(expr) - labels_used]
    return found


@pytest.fixture
def served(transactional_db: None, client: Client, settings: Any) -> Exported:
    """/metrics as Prometheus reads it, after the webhook outcomes the rules match on happened
    for real and with the Stripe reconcile on (its cursor walked ten minutes ago)."""
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "1"  # nothing listens there: the database refuses
    try:
        unavailable = post_event(client, stripe_events.encode(paid_event()))
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port
    # Backpressure at one job waiting to be published: an event type nothing handles is shed.
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_CHECK_SECONDS": 0,
        "BACKPRESSURE_SOFT_MARK": 1,
        "BACKPRESSURE_HARD_MARK": 1000,
    }
    Job.objects.create(task=send_invoice_email.module_path, args=[0], queue=EMAIL_QUEUE)
    ignored = stripe_events.event("customer.created", stripe_events.customer_object())
    shed = post_event(client, stripe_events.encode(ignored))
    rejected = post_event(client, stripe_events.encode(paid_event()), secret="whsec_wrong")
    assert [unavailable.status_code, shed.status_code, rejected.status_code] == [503, 503, 400]

    settings.STRIPE_API_KEY = "sk_test_alert_rules"
    EventsCursor.objects.create(
        name=RECONCILE_JOB, covered_until=timezone.now() - timedelta(minutes=10)
    )
    return exported(scrape(client))


def test_the_rules_and_the_dashboard_read_only_what_metrics_serves(served: Exported) -> None:
    # The check itself: a renamed metric, label or job would be found.
    assert problems("invoicing_dlq_depths > 0", served) == [
        "metric invoicing_dlq_depths is not served"
    ]
    assert problems('invoicing_breaker_state{circuit="email"}', served) == [
        "invoicing_breaker_state has no label circuit"
    ]
    stale = 'invoicing_scheduled_job_last_run_failed{exported_job="stripe-reconcile"}'
    assert problems(stale, served) == [f"{stale} is not served"]
    assert problems("sum by (kind) (invoicing_dlq_depth)", served) == [
        "no metric here has label kind"
    ]

    for name, rule in alerts().items():
        assert list(selectors(rule["expr"])), name  # reads something
        assert problems(rule["expr"], served) == [], name
    for expr in dashboard_queries():
        assert problems(expr, served) == [], expr


def test_the_target_alert_covers_every_scrape_job() -> None:
    [(name, matchers)] = list(selectors(alerts()["MetricsTargetDown"]["expr"]))
    assert name == "up"
    [(label, op, pattern)] = matchers
    assert (label, op) == ("job", "=~")
    jobs = scrape_jobs()
    assert len(jobs) == 3
    assert all(re.fullmatch(pattern, job) for job in jobs), jobs


# --- A real Prometheus on the real application ---------------------------------------------------


def prometheus_api(port: int, path: str) -> Any:
    answer = requests.get(f"http://{HOST}:{port}/api/v1/{path}", timeout=5)
    answer.raise_for_status()
    return answer.json()["data"]


@pytest.mark.slow
def test_prometheus_evaluates_every_rule_on_what_the_application_serves(
    transactional_db: None, tmp_path: Path
) -> None:
    """Debian's Prometheus scraping a real gunicorn's /metrics with this configuration's web job
    and the rules: every rule evaluates without error; a waiting dead letter, and neither a beat
    nor a worker running, make their alerts pending; the others stay quiet."""
    record(
        task=send_invoice_email.module_path,
        task_id="alert-rules-1",
        args=[1],
        kwargs={},
        queue=EMAIL_QUEUE,
        reason="permanent",
        exc=PermanentError("recipient refused"),
        traceback="",
        attempts=1,
    )
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: apt-get install prometheus"
    # Ready at Django's first answer, whatever it is (the probe is a POST): the app is loaded.
    with launch.gunicorn(
        worker_env(0), ready_path="/metrics", ready_status=None, log=tmp_path / "gunicorn.log"
    ) as web:
        config = yaml.safe_load(CONFIG.read_text())
        [job] = [job for job in config["scrape_configs"] if job["job_name"] == "invoicing-web"]
        job["static_configs"] = [{"targets": [f"{HOST}:{web.port}"]}]
        config["scrape_configs"] = [job]
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES)]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()

        def ready(_: Process) -> bool:
            try:
                return requests.get(f"http://{HOST}:{port}/-/ready", timeout=1).ok
            except requests.ConnectionError:
                return False

        prometheus = Process(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={HOST}:{port}",
            ],
            name="prometheus",
            env=dict(os.environ),
            log=tmp_path / "prometheus.log",
            ready=ready,
        )
        with prometheus:

            def pending() -> set[str]:
                return {
                    alert["labels"]["alertname"]
                    for alert in prometheus_api(port, "alerts")["alerts"]
                }

            expected = {"DeadLettersWaiting", "NoBeatLeader", "NoLiveWorkers"}
            assert wait_until(lambda: pending() == expected, timeout=30), pending()
            evaluated = [
                rule for group in prometheus_api(port, "rules")["groups"] for rule in group["rules"]
            ]
            states = {alert["state"] for alert in prometheus_api(port, "alerts")["alerts"]}
            [target] = prometheus_api(port, "targets")["activeTargets"]
            reconcile = prometheus_api(
                port,
                "query?query=invoicing_scheduled_job_last_run_failed"
                '{exported_job="stripe-events-reconcile"}',
            )["result"]

    assert (target["labels"]["job"], target["health"]) == ("invoicing-web", "up")
    assert {rule["name"] for rule in evaluated} == set(alerts())
    assert all(rule["health"] == "ok" for rule in evaluated), [
        (rule["name"], rule.get("lastError")) for rule in evaluated if rule["health"] != "ok"
    ]
    assert states == {"pending"}  # each waits out its `for:`
    [series] = reconcile  # the scheduled jobs' `job` label, as the rules read it
    assert series["metric"]["job"] == "invoicing-web"


# --- The dashboard --------------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_model_with_a_prometheus_data_source_variable() -> None:
    model = dashboard()
    assert model["uid"]
    assert model["title"]
    assert isinstance(model["schemaVersion"], int)
    [variable] = model["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    source = {"type": "prometheus", "uid": "${" + variable["name"] + "}"}
    panels = model["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] == "timeseries", panel["title"]
        assert panel["datasource"] == source, panel["title"]
        place = panel["gridPos"]
        assert place["x"] >= 0, panel["title"]
        assert place["x"] + place["w"] <= 24, panel["title"]
        covers = {
            (x, y)
            for x in range(place["x"], place["x"] + place["w"])
            for y in range(place["y"], place["y"] + place["h"])
        }
        assert not covers & cells, f"{panel['title']} overlaps another panel"
        cells |= covers
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids, panel["title"]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        assert all(target["datasource"] == source for target in panel["targets"])


def test_each_alert_has_a_panel_showing_what_it_alerts_on() -> None:
    panels = dashboard()["panels"]
    for name, rule in alerts().items():
        read = {metric for metric, _ in selectors(rule["expr"])}
        showing = [
            panel
            for panel in panels
            if name in panel["description"]
            and read & {m for t in panel["targets"] for m, _ in selectors(t["expr"])}
        ]
        assert showing, f"no panel names {name} and shows what it reads ({read})"


def test_the_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query, as a recording rule (it evaluates none without a server)."""
    recorded = [
        {"record": f"dashboard:query_{n}", "expr": expr}
        for n, expr in enumerate(dashboard_queries())
    ]
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]})
    )
    checked = promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(recorded)} rules found" in checked.stdout


# --- The runbook ----------------------------------------------------------------------------------


def test_each_alert_says_what_to_do_and_points_to_its_section_of_alerts_md() -> None:
    text = OPERATIONS.read_text()
    section = text.split("\n## Alert rules\n", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^### (\w+)$", section, re.M)
    assert headings == list(alerts())  # in the rules' order, each once
    for name, rule in alerts().items():
        annotations = rule["annotations"]
        assert annotations["summary"], name
        assert len(annotations["description"]) > 80, name
        assert annotations["runbook"] == f"docs/how-to/alerts.md#{name.lower()}", name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert re.fullmatch(r"\d+m", rule["for"]), name
