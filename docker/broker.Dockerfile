# Mosquitto for the lab. Its conf, password file and ACL are not baked in: sled lab compose
# writes them for the fleet (lab/broker.py) and mounts them at /mosquitto/config.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
RUN command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || { apt-get update -q \
    && apt-get install -y -q --no-install-recommends mosquitto \
    && rm -rf /var/lib/apt/lists/*; }
EXPOSE 1883
ENTRYPOINT ["/usr/sbin/mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]
