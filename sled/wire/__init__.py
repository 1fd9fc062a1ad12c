"""The wire contract beside the generated stubs (sled.v1, from protos/sled/v1/verifier.proto):
what a device and a server must agree on byte for byte. Tokenizer fingerprints (fingerprint),
sampling parameters and the sparse q (sampling), token trees (tree), loose verification (loose),
server endpoints (endpoint), the bearer-token header (auth) and the MQTT topics and payloads
(topics). It imports nothing of sled's but the stubs, so a third party can read it alone."""
