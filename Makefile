# kxlb: run as root. `make setup` is idempotent and cached; every target runs it first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo standalone-demo test bench bench-scale lint clean help

help:
	@echo "make demo    - the Kubernetes lab (real control plane, 2 netns nodes, kxlb controller) and traffic"
	@echo "make standalone-demo - the datapath alone: namespaces, real servers, traffic through a VIP"
	@echo "make test    - the test suite (root; needs BPF)"
	@echo "make bench   - datapath microbenchmark (BPF_PROG_TEST_RUN) and controller benchmarks"
	@echo "make bench-scale - the controller with 20k Services and EndpointSlice churn (about 10 min)"
	@echo "make setup   - install everything this project needs (idempotent)"

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kxlb lab demo

standalone-demo: setup
	$(VENV)/bin/kxlb demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) bench/prog_run.py
	$(PY) bench/controller.py

bench-scale: setup
	$(PY) bench/churn.py

clean:
	rm -rf $(VENV) build *.egg-info
