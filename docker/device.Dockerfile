# The slim device: the device's dependencies image (deps.Dockerfile with device.txt: the gguf and
# onnx drafter extras, no torch and no transformers) plus the project's wheel (the build
# context), installed without dependencies. Its entrypoint (sled lab device) takes a slot of the
# scenario's fleet, sets up the link profile (tc netem when the kernel has it, else the daemon's
# user-space emulation) and runs sled device.
ARG DEPS_IMAGE=sled-lab-device-deps:latest
FROM ${DEPS_IMAGE}
COPY . /project
RUN /opt/sled/bin/pip install --quiet --no-index --no-deps /project/sled-*.whl && rm -rf /project
ENV PATH=/opt/sled/bin:$PATH PYTHONUNBUFFERED=1 SLED_CACHE=/root/.cache/sled
ENTRYPOINT ["sled", "lab", "device"]
