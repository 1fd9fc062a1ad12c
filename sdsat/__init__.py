"""Training the SAT adapters the verify server serves (verify_server.sdsat): `sled sdsat train`
fits the SAT embeddings on a corpus (train.py, over corpus.py's documents), `sled sdsat train
--mode lora` self-distils a LoRA on the target's own greedy continuations (lora.py, over
distill.py's set). Nothing here runs when serving."""
