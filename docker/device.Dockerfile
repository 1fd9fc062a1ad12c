# The slim device: the project's wheel with the gguf and onnx drafter extras, no torch and no
# transformers. Its entrypoint (sled lab device) takes a slot of the scenario's fleet, sets up the
# link profile (tc netem when the kernel has it, else the daemon's user-space emulation) and runs
# sled device. Built from a wheelhouse like server.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# removed after the build (lab/images.py prunes images with this label)
LABEL sled.lab.stage=build
COPY . /wheels
RUN python3 -m venv /opt/sled \
 && /opt/sled/bin/pip install --quiet --no-index --find-links /wheels \
        "$(ls /wheels/sled-*.whl)[gguf,onnx]"

FROM ${BASE_IMAGE}
# tc (iproute2) for netem; the debootstrap base has it, a public slim image installs it here.
RUN command -v tc >/dev/null 2>&1 || { apt-get update -q \
    && apt-get install -y -q --no-install-recommends iproute2 libgomp1 \
    && rm -rf /var/lib/apt/lists/*; }
COPY --from=build /opt/sled /opt/sled
ENV PATH=/opt/sled/bin:$PATH PYTHONUNBUFFERED=1 SLED_CACHE=/root/.cache/sled
ENTRYPOINT ["sled", "lab", "device"]
