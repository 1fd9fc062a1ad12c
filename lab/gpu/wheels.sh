#!/usr/bin/env bash
# Downloads, on this machine, the wheels lab/gpu/check.sh installs on a GPU machine whose Python
# (3.12) has torch, transformers, grpcio, protobuf, pytest and the rest of sled's heavy
# dependencies but not these (the server's settings and MQTT plane, the health and reflection
# services, the simulator's clock, the tests' asyncio and timeout plugins; pydantic, grpcio and
# protobuf pinned, as sled's generated stubs and settings need them); and packs the built-in
# Gemma 3 tokenizer and config (no weights) that synthetic:gemma3-4b needs. Versions: those
# sled's .venv runs. Everything lands in .whl/
# (git ignores it: a device run carries it). No weights travel (the built-in gemma3-270m is
# 253 MB as GGUF, 1.1 GB converted): check.sh's targets are synthetic, made on the GPU, and its
# SAT part gives one a random adapter of its shape, written there (lab/bench/random_sat.py).
#
#   bash lab/gpu/wheels.sh && bash lab/gpu/check.sh OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=(
    pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
    pydantic-settings==2.16.3 python-dotenv==1.2.4
    aiomqtt==2.5.1 paho-mqtt==2.2.0
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
    grpcio==1.85.3 protobuf==7.36.2      # sled's stubs need these or newer
    looptime==0.9
    pytest-asyncio==1.5.0 pytest-timeout==2.4.0
)
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"

# the tokenizer and config of the built-in gemma3-270m (its transformers copy, converted once)
tokenizer=$(.venv/bin/python -c \
    'from sled.models import hf_checkpoint; print(hf_checkpoint("gemma3-270m"))')
tar czf .whl/gemma3-270m-tokenizer.tar.gz -C "$tokenizer" config.json generation_config.json \
    tokenizer.json tokenizer_config.json chat_template.jinja
ls -l .whl
du -sh .whl
