# kxlb: run as root (or as a user with sudo). `make setup` is idempotent and cached; every target runs it first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Everything runs as root (BPF, namespaces, apt): as a user, the root parts go through sudo.
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo)
PYTEST_ARGS ?=

.PHONY: setup demo standalone-demo test fuzz bench bench-scale bench-e2e e2e image kind kind-down vagrant-setup vagrant-box vagrant-test vagrant-up vagrant-down lint clean help

help:
	@echo "make demo    - the Kubernetes lab (real control plane, 2 netns nodes, kxlb controller) and traffic"
	@echo "make standalone-demo - the datapath alone: namespaces, real servers, traffic through a VIP"
	@echo "make test    - the test suite (root; needs BPF)"
	@echo "make fuzz    - the datapath fuzzer, a million frames through tc and XDP (FUZZ_FRAMES, FUZZ_SEED)"
	@echo "make bench   - datapath microbenchmark (BPF_PROG_TEST_RUN), controller benchmarks, Maglev vs hash % N, the CLI at 70k services, an upgrade under 10k connections, a TCP stream through hooked veths"
	@echo "make bench-scale - the controller with 20k Services and EndpointSlice churn (about 10 min)"
	@echo "make bench-e2e - kxlb against kube-proxy iptables and nftables on the lab: latency, sync, throughput, memory"
	@echo "make e2e     - the upstream Kubernetes e2e Services tests, kube-proxy then kxlb, on real-kubelet nodes (E2E_SUITE)"
	@echo "make image   - kxlb's image from deploy/Dockerfile (buildah, local Debian bases; cached): name and size"
	@echo "make kind    - a kind cluster here (control plane + 2 workers, no kube-proxy) with kxlb from deploy/kxlb.yaml; make kind-down removes it"
	@echo "make vagrant-test - the Vagrant lab VM (box built here, libvirt): the datapath tests and the demo inside it"
	@echo "make setup   - install everything this project needs (idempotent)"

setup:
	@bash scripts/setup.sh

demo: setup
	$(SUDO) $(VENV)/bin/kxlb lab demo

standalone-demo: setup
	$(SUDO) $(VENV)/bin/kxlb demo

test: setup
	$(SUDO) $(PY) -m pytest $(PYTEST_ARGS)

# The fuzzer of the test suite (100k frames there), longer: counts printed, no time limit.
FUZZ_FRAMES ?= 1000000
fuzz: setup
	$(SUDO) FUZZ_FRAMES=$(FUZZ_FRAMES) $(PY) -m pytest tests/test_fuzz.py tests/test_fuzz6.py -s -q -o timeout=0 $(PYTEST_ARGS)

# BENCH_VETH_ARGS="--rounds 20 --release" for README's veth table (more rounds, kxlb 0.1.0 itself too).
BENCH_VETH_ARGS ?=
bench: setup
	$(SUDO) $(PY) bench/prog_run.py
	$(SUDO) $(PY) bench/controller.py
	$(SUDO) $(PY) bench/maglev.py
	$(SUDO) $(PY) bench/cli.py
	$(SUDO) $(PY) bench/upgrade.py
	$(SUDO) $(PY) bench/veth.py $(BENCH_VETH_ARGS)

bench-scale: setup
	$(SUDO) $(PY) bench/churn.py

# BENCH_E2E_ARGS="--sizes 1,1000,10000,30000" for the full series (longer: creating 30k Services);
# "--sizes 10000,30000 --merge" adds sizes to a saved run.
BENCH_E2E_ARGS ?=
bench-e2e: setup
	$(SUDO) $(PY) bench/e2e.py $(BENCH_E2E_ARGS)

# The upstream e2e binary against both proxies' DaemonSets on one real-kubelet lab; the
# table goes to docs/e2e.md (between the suite's markers). E2E_SUITE=conformance is the
# subset CI runs.
# E2E_CLUSTER=kind runs the suite against kxlb on the kind cluster of `make kind` instead.
E2E_SUITE ?= services
E2E_CLUSTER ?= lab
E2E_ARGS ?=
e2e: setup
	$(SUDO) $(PY) -m kxlb.lab.e2e --suite $(E2E_SUITE) --cluster $(E2E_CLUSTER) --markdown docs/e2e.md $(E2E_ARGS)

# kxlb's image: deploy/Dockerfile built by buildah on Debian bases that mmdebstrap makes
# here (nothing is pulled), tagged localhost/kxlb:dev and exported for containerd; the lab
# runs the same image. Cached by its inputs: about 6 minutes the first time, a second when
# nothing changed, one to two after a change to the sources (lab/imagebuild.py).
image: setup
	$(SUDO) $(PY) -m kxlb.lab.imagebuild

# kind on this machine (lab/kind.py, docs/kind.md): Debian's docker.io run as a dockerd of its
# own (no firewall rule, no forwarding), a node image made here, deploy/kind-config.yaml, kxlb's
# image and deploy/kxlb.yaml unchanged. Cold about 3 minutes after `make setup`, 1.5 with its images
# cached, seconds when it is up.
kind: setup
	$(SUDO) $(PY) -m kxlb.lab.kind up

kind-down:
	$(SUDO) $(PY) -m kxlb.lab.kind down

# The Vagrant lab VM (lab/vagrant.py, docs/vagrant.md): a Debian 12 box built here from
# Debian's packages (cached), libvirt with KVM where the CPU has it and QEMU's TCG otherwise,
# an isolated network (no NAT, no firewall change on the host). vagrant-test runs the
# datapath tests and the standalone demo inside the VM, then destroys it.
vagrant-setup: setup
	@$(SUDO) bash scripts/setup-vagrant.sh

vagrant-box: vagrant-setup
	$(SUDO) $(PY) -m kxlb.lab.vagrant box

vagrant-test: vagrant-setup
	$(SUDO) $(PY) -m kxlb.lab.vagrant test

vagrant-up: vagrant-setup
	$(SUDO) $(PY) -m kxlb.lab.vagrant up

vagrant-down:
	$(SUDO) $(PY) -m kxlb.lab.vagrant down

clean:
	rm -rf $(VENV) build *.egg-info loader/*.so
