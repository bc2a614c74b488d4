# The two set-up commands of the README, and the install they share: the exact versions and
# hashes of requirements/dev.txt (a file pip refuses to install from if any download differs),
# then the project itself, without touching its dependencies.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# How requirements/*.txt are made from pyproject.toml (`make lock`): every package pinned with
# the hashes of its files, build dependencies included, for Python 3.11.
COMPILE := $(VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--all-build-deps --no-emit-index-url --no-emit-find-links

.PHONY: demo test bench lock

PYTEST_PROCESSES := -n 2 --dist loadfile

$(STAMP): pyproject.toml requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --require-hashes -r requirements/dev.txt
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python scripts/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	# Two test processes (pytest-xdist), each module's tests in one of them: most tests wait on
	# real timeouts, and each process is a run of its own (tests/settings.py).
	$(VENV)/bin/pytest $(PYTEST_PROCESSES)
	# The tests that prove the pipeline through the broker, again on RabbitMQ
	# (tests/helpers/broker.py BOTH_BROKERS), in a virtual host each process creates and deletes.
	TESTS_BROKER=rabbitmq $(VENV)/bin/pytest $(PYTEST_PROCESSES)

bench: $(STAMP)
	$(VENV)/bin/python -m bench

# After changing a dependency in pyproject.toml: pin it (and what it needs) with hashes. The
# runtime set is what the Docker image installs; the dev set adds the tools and tests.
lock: $(STAMP)
	$(COMPILE) --output-file requirements/base.txt pyproject.toml
	$(COMPILE) --extra dev --output-file requirements/dev.txt pyproject.toml
