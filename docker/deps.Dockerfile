# The dependencies of one lab image (REQUIREMENTS: server.txt or device.txt), from a wheelhouse
# (the build context) of every dependency, so the build never needs a package registry.
# lab/images.py tags it by the wheelhouse, the base and this file, so a change to the project's
# code reuses it: server.Dockerfile and device.Dockerfile add only the project's wheel.
# BASE_IMAGE: any Debian-like image with python3 and venv (a local debootstrap import, see
# lab/images.py, or the public default below).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# removed after the build (lab/images.py prunes images with this label)
LABEL sled.lab.stage=build
ARG REQUIREMENTS
COPY . /wheels
RUN python3 -m venv /opt/sled \
 && /opt/sled/bin/pip install --quiet --no-index --find-links /wheels -r "/wheels/${REQUIREMENTS}"

FROM ${BASE_IMAGE}
# tc (iproute2) for the devices' netem and libgomp for the runtimes: the debootstrap base has
# them, a public slim image installs them here.
RUN command -v tc >/dev/null 2>&1 || { apt-get update -q \
    && apt-get install -y -q --no-install-recommends iproute2 libgomp1 \
    && rm -rf /var/lib/apt/lists/*; }
COPY --from=build /opt/sled /opt/sled
