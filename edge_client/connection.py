"""A device's connection to one verify server: model info, tokenizer bootstrap, the stub."""
from __future__ import annotations

from pathlib import Path

import grpc

from sled.cache import tokenizer_dir
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
]


class Connection:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self._info: pb.ModelInfo | None = None

    async def model_info(self, timeout: float = 30.0, wait_for_ready: bool = True,
                         refresh: bool = False) -> pb.ModelInfo:
        """wait_for_ready=False fails at once (UNAVAILABLE) when nothing listens at the address;
        refresh=True asks again instead of answering from the first reply."""
        if self._info is None or refresh:
            self._info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                                      wait_for_ready=wait_for_ready)
        return self._info

    async def tokenizer(self, timeout: float = 60.0):
        """The target's tokenizer, fetched once per fingerprint and cached on disk."""
        from transformers import AutoTokenizer

        info = await self.model_info()
        folder = tokenizer_dir(info.tokenizer_fingerprint)
        if not (folder / ".complete").exists():
            files = await self.stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=timeout)
            folder.mkdir(parents=True, exist_ok=True)
            for item in files.files:
                (folder / Path(item.name).name).write_bytes(item.content)
            (folder / ".complete").touch()
        return AutoTokenizer.from_pretrained(str(folder))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
