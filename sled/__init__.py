"""sled's shared runtime, imported by the device, the server, the lab and the commands: the wire
contract's generated stubs (sled.v1, from protos/sled/v1/verifier.proto) and what both sides must
agree on byte for byte (tokenizer fingerprints, sampling, trees, loose verification, endpoints,
MQTT topics), then the utilities they share (the model registry and its cache, settings files,
progress lines, chat templates, the GGUF reader, the llama.cpp build) and the built-in SAT
adapters (data/)."""
