"""sled's shared runtime, imported by the device, the server, the lab and the commands. The wire
contract: the generated stubs (sled.v1, from protos/sled/v1/verifier.proto) and what both sides
must agree on byte for byte (sled.wire: tokenizer fingerprints, sampling, trees, loose
verification, endpoints, the bearer-token header, MQTT topics). Then the utilities they share:
the model registry and its cache, MQTT connections, settings files, flag types, progress lines,
chat templates, the GGUF reader, the llama.cpp build, the development PKI, and the built-in SAT
adapters (data/)."""
