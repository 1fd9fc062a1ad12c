"""The sled wire contract: generated stubs (sled.v1) and the few definitions both sides must share
byte for byte: how a tokenizer is fingerprinted and what the sampling parameters mean."""
