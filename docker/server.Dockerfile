# The verify server (sled serve) and the lab runner (sled lab run --fleet compose): the server's
# dependencies image (deps.Dockerfile with server.txt) plus the project's wheel (the build
# context), installed without dependencies.
ARG DEPS_IMAGE=sled-lab-server-deps:latest
FROM ${DEPS_IMAGE}
COPY . /project
RUN /opt/sled/bin/pip install --quiet --no-index --no-deps /project/sled-*.whl && rm -rf /project
# OMP_WAIT_POLICY: see sled_cli/main.py (busy-waiting OpenMP threads starve the event loop).
ENV PATH=/opt/sled/bin:$PATH PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE SLED_CACHE=/root/.cache/sled
ENTRYPOINT ["sled"]
CMD ["serve", "--help"]
