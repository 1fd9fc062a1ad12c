# HAProxy for the lab's replicas profile: several `sled serve` replicas behind one address. Its
# haproxy.cfg is not baked in: sled lab compose writes it for the run (lab/proxy.py) and mounts it
# at /usr/local/etc/haproxy.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
RUN command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || { apt-get update -q \
    && apt-get install -y -q --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*; }
EXPOSE 50051
ENTRYPOINT ["/usr/sbin/haproxy", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
