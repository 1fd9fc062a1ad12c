"""An emulated network under a device session: its streams, with a Link's delays.

    link = Link(link_profile("wifi"), seed=1)
    result = await generate(stub, drafter, prompt_ids, max_new_tokens=32,
                            transport=link_transport(link))

Each message the device sends waits out the uplink before it is written. Each message from the
server is read the moment it comes and stamped, then waits out the downlink from that moment, so
a stream of verdicts (server-side generation) is delayed by the link without being slowed to
one latency per message (see Link.downlink).
"""
from __future__ import annotations

import asyncio

from edge_client.transport import Stream, Transport
from lab.profiles import Link, link_profile
from sled import clock
from sled.v1 import verifier_pb2 as pb


class LinkStream:
    """A device's stream (edge_client.transport.Stream) over an emulated link."""

    def __init__(self, inner: Stream, link: Link) -> None:
        self.inner = inner
        self.link = link
        self._inbox: asyncio.Queue = asyncio.Queue()     # (clock.now() received, message or error)
        self._reader: asyncio.Task | None = None

    async def send(self, msg: pb.DeviceMessage) -> None:
        await self.link.uplink(msg.ByteSize())
        await self.inner.send(msg)

    async def accepted(self) -> None:
        await self.inner.accepted()

    async def receive(self) -> pb.ServerMessage:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        received_at, msg = await self._inbox.get()
        if isinstance(msg, BaseException):
            raise msg
        await self.link.downlink(msg.ByteSize(), received_at)
        return msg

    async def _read(self) -> None:
        """Read every server message the moment it arrives; an error ends the inbox too."""
        try:
            while True:
                msg = await self.inner.receive()
                self._inbox.put_nowait((clock.now(), msg))
                if msg.verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return
        except BaseException as exc:
            self._inbox.put_nowait((clock.now(), exc))

    async def done_writing(self) -> None:
        await self.inner.done_writing()

    def cancel(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.inner.cancel()


def link_transport(link: Link) -> Transport:
    """A transport whose streams all go over link (one Link per emulated device, so its
    messages keep their order across the device's sessions and resumes)."""
    def open_stream(stub, *, timeout: float | None = None, wait_for_ready: bool = False) -> LinkStream:
        return LinkStream(Stream.open(stub, timeout=timeout, wait_for_ready=wait_for_ready), link)
    return open_stream


def seeded_transport(spec: str, seed: int) -> Transport:
    """The transport of one emulated device's link SPEC with its jitter seeded (what the daemon's
    user-space link emulation opens its streams with: the `link` entry point of sled.emulation)."""
    return link_transport(Link(link_profile(spec), seed=seed))
