# kxlb: run as root. `make setup` is idempotent and cached; every target runs it first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test bench lint clean help

help:
	@echo "make demo    - standalone demo: namespaces, real servers, traffic through a VIP"
	@echo "make test    - the test suite (root; needs BPF)"
	@echo "make bench   - datapath microbenchmark (BPF_PROG_TEST_RUN)"
	@echo "make setup   - install everything this project needs (idempotent)"

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kxlb demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) bench/prog_run.py

clean:
	rm -rf $(VENV) build *.egg-info
