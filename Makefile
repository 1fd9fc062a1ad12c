# Everything runs from a local virtual environment that these targets create.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; the package range in pyproject.toml admits it.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# Every extra: the tests and the demo run both sides, every drafter and the benchmarks.
EXTRAS := server,gguf,onnx,hf,export,lab,models,dev

.PHONY: demo test install models mosquitto haproxy docker protos clean arm-root

install: $(STAMP)

# llama-cpp-python compiles llama.cpp; sled.llama_build names its flags for this CPU (its vector
# extensions, never AMX), keeps the wheel in sled's cache under those flags, and installs it before
# the extras would let pip build it with -march=native. The last step decodes a few tokens of the
# built-in GGUF in a child: a build that crashes is rebuilt once with the portable baseline.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e .
	$(BIN)/python -m sled.llama_build install
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/python -m sled.llama_build verify
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/sled demo

# The suite on both cores: whole test files to two workers (a file's fixtures stay in one process),
# then the tests marked serial (fleets with fault steps at set times) alone.
TEST_JOBS ?= 2
test: $(STAMP) mosquitto haproxy docker models
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not serial" --durations=15
	$(BIN)/python -m pytest -q -m serial --durations=5

# The built-in models the slow tests and the demo use, made once into the sled cache (each step
# is skipped when its result is there): assemble the GGUFs, convert them to transformers
# checkpoints, export the int4 ONNX drafters.
models: $(STAMP)
	$(BIN)/sled models prepare --onnx

# An aarch64 Debian Bookworm root (debootstrap, run by qemu-user) built once into the sled cache,
# then its python3 run through chroot. As root; it names the Debian packages it lacks.
arm-root: $(STAMP)
	$(BIN)/sled lab arm-root --check

# apt-get waits for another apt-get to finish (two `make test` side by side both install) instead
# of failing at once on the dpkg lock.
APT := apt-get -o DPkg::Lock::Timeout=600

# $(call debian_package,PACKAGE,NAME,WITHOUT_IT): install PACKAGE (its command has the same
# name) from the Debian packages when missing, as root, else through passwordless sudo; else say
# how, and WITHOUT_IT (what the suite does until then).
define debian_package
@if command -v $(1) >/dev/null 2>&1 || [ -x /usr/sbin/$(1) ]; then :; \
elif [ "$$(id -u)" = 0 ]; then \
	DEBIAN_FRONTEND=noninteractive $(APT) install -y -q $(1) || \
	{ $(APT) update -q && DEBIAN_FRONTEND=noninteractive $(APT) install -y -q $(1); }; \
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	sudo -n env DEBIAN_FRONTEND=noninteractive $(APT) install -y -q $(1) || \
	{ sudo -n $(APT) update -q && sudo -n env DEBIAN_FRONTEND=noninteractive $(APT) install -y -q $(1); }; \
else \
	echo "$(2) is missing and cannot be installed from here (not root, no passwordless sudo)."; \
	echo "Install it, then run make test again:  sudo apt-get install $(1)  (Debian/Ubuntu)"; \
	echo "$(3)"; \
fi
endef

# The MQTT tests start a real Mosquitto broker. The demo does not need it.
mosquitto:
	$(call debian_package,mosquitto,Mosquitto,The MQTT tests fail until it is installed.)

# The replicas tests put HAProxy in front of two servers. Without it they are skipped, saying so.
haproxy:
	$(call debian_package,haproxy,HAProxy,The replicas tests are skipped until it is installed.)

# The compose lab's test builds images and runs a fleet in Docker: install what is missing of the
# engine, Compose and debootstrap (the local base image) from the Debian packages, one package at
# a time (as root, else through passwordless sudo); `docker compose` v2 counts as Compose. Start
# dockerd in the background when it does not answer. Never fails: the test says what is missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] && echo root || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && echo "sudo -n"; })
docker:
	@missing=""; \
	command -v docker >/dev/null 2>&1 || missing="$$missing docker.io"; \
	command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing="$$missing debootstrap"; \
	run="$(SUDO)"; [ "$$run" = root ] && run=""; \
	if [ -z "$$missing" ]; then :; \
	elif [ -z "$(SUDO)" ]; then \
		echo "Missing:$$missing; cannot install from here (not root, no passwordless sudo)."; \
		echo "Install it, then run make test again:  sudo apt-get install$$missing  (Debian/Ubuntu)"; \
	else \
		updated=""; \
		for pkg in $$missing; do \
			$$run env DEBIAN_FRONTEND=noninteractive $(APT) install -y -q $$pkg >/dev/null 2>&1 || \
			{ [ -z "$$updated" ] && updated=1 && $$run $(APT) update -q >/dev/null 2>&1; \
			  $$run env DEBIAN_FRONTEND=noninteractive $(APT) install -y -q $$pkg >/dev/null 2>&1; } || \
			echo "$$pkg could not be installed from the Debian packages; the compose lab test fails until it is."; \
		done; \
	fi; \
	if command -v docker >/dev/null 2>&1 && ! $$run docker info >/dev/null 2>&1; then \
		if [ -n "$(SUDO)" ] && { command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ]; }; then \
			$$run nohup dockerd >/tmp/sled-dockerd.log 2>&1 & \
			for i in $$(seq 1 30); do docker info >/dev/null 2>&1 && break; sleep 1; done; \
			docker info >/dev/null 2>&1 || echo "dockerd did not start (see /tmp/sled-dockerd.log)."; \
		else \
			echo "The Docker engine does not answer and cannot be started from here (not root):"; \
			echo "start it (sudo systemctl start docker), then run make test again."; \
		fi; \
	fi; true

# Regenerate the committed gRPC stubs from protos/ (tests check they are current).
protos: $(STAMP)
	$(BIN)/python -m sled_cli.protos

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
