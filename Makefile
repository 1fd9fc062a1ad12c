# Everything runs from a local virtual environment that these targets create.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; the package range in pyproject.toml admits it.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test install protos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[gguf,onnx,models,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/sled demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Regenerate the committed gRPC stubs from protos/ (tests check they are current).
protos: $(STAMP)
	$(BIN)/python -m sled_cli.protos

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
