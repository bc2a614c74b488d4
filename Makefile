# The two set-up commands of the README, and the install they share: the exact versions and
# hashes of requirements/dev.txt (a file pip refuses to install from if any download differs),
# then the machinery's distribution (packages/asyncwork) and the project itself, without touching
# their dependencies.
PYTHON ?= python3
# A pipe fails when any of its commands fails (pip piped through sed, below: pip's failure is make's).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV := .venv
STAMP := $(VENV)/.installed
# How requirements/*.txt are made from pyproject.toml (`make lock`): every package pinned with
# the hashes of its files, build dependencies included, for Python 3.11.
COMPILE := $(VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--all-build-deps --no-emit-index-url --no-emit-find-links

.PHONY: demo lint check test bench lock

# Three test processes (pytest-xdist), each module's tests in one of them, the modules handed out
# in the order tests/conftest.py gives them (the slow ones first), not by their count of tests: most
# tests wait on real timeouts, so three processes keep two cores busy.
PYTEST_PROCESSES := -n 3 --dist loadfile --no-loadscope-reorder
# Python keeps the modules it compiled (__pycache__, ignored by git and Docker): a test run starts
# a hundred processes (manage.py, workers, gunicorn) and three test processes whose assertion
# rewriting takes seconds, each compiling the same modules again if a shell's
# PYTHONDONTWRITEBYTECODE forbids it.
unexport PYTHONDONTWRITEBYTECODE
NOT_HERE := --ignore=tests/bench/test_peers.py

# The first install takes a minute or two: each step says what it does, and pip names each
# package as it takes it.
$(STAMP): pyproject.toml packages/asyncwork/pyproject.toml requirements/dev.txt
	@echo "make: creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "make: installing requirements/dev.txt ($$(grep -c '^[a-z]' requirements/dev.txt) pinned packages)"
	$(VENV)/bin/pip install --progress-bar off --disable-pip-version-check --require-hashes \
		-r requirements/dev.txt | sed -u -n -E '/^(Collecting|Successfully installed)/p'
	@echo "make: installing the machinery's distribution (packages/asyncwork), then the project"
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
		-e packages/asyncwork -e .
	touch $(STAMP)
	@echo "make: $(VENV) is ready"

demo: $(STAMP)
	$(VENV)/bin/python scripts/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The fast tier, about two minutes here: lint and the application's tests not marked slow
# (pyproject.toml), which prove each guarantee at least once; the tools' own tests (tests/stack,
# tests/bench) and the API's schemathesis run (slow, its cases built as its module is collected)
# are left to `make test`, which runs everything. Four test processes: the fast tests wait more
# than they compute.
check: lint
	$(VENV)/bin/pytest -n 4 --dist loadfile -m "not slow" --ignore=tests/stack --ignore=tests/bench \
		--ignore=tests/asyncwork/test_api_fuzz.py

test: lint
	# Each test process is a run of its own (tests/settings.py). The peers benchmark's own run
	# (five minutes: six backends' workers) is `make bench`'s first step.
	$(VENV)/bin/pytest $(PYTEST_PROCESSES) -m "not alone" $(NOT_HERE)
	# The tests that time what the cores do under a load they make themselves, one at a time.
	$(VENV)/bin/pytest -m alone $(NOT_HERE)
	# The machinery's own tests, on a small project of their own (packages/asyncwork/tests).
	cd packages/asyncwork && ../../$(VENV)/bin/pytest
	# The tests that prove the pipeline through the broker, again on RabbitMQ
	# (tests/helpers/broker.py BOTH_BROKERS), in a virtual host each process creates and deletes.
	TESTS_BROKER=rabbitmq $(VENV)/bin/pytest $(PYTEST_PROCESSES) $(NOT_HERE)

bench: $(STAMP)
	$(VENV)/bin/pytest -p no:xdist tests/bench/test_peers.py
	$(VENV)/bin/python -m bench

# After changing a dependency in pyproject.toml: pin it (and what it needs) with hashes. The
# runtime set is what the Docker image installs; the dev set adds the tools and tests.
lock: $(STAMP)
	$(COMPILE) --output-file requirements/base.txt pyproject.toml
	$(COMPILE) --extra dev --output-file requirements/dev.txt pyproject.toml
