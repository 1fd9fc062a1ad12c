"""The lab's requests over MQTT: one client, subscribed to every device's responses, that stays
connected through broker restarts.

    async with MqttSender(broker, "sled", clock, fields) as sender:
        attempt = await sender.send(handle, "def add(a, b):", reference)

A request whose last chunk has not come when the broker connection drops fails with kind
"broker" (the device cancels it too, edge_client/mqtt.py); its asker may send it again.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import aiomqtt

from lab.drive import REQUEST_TIMEOUT_S, Attempt, new_request_id
from sled.mqtt import decode, device_topic, encode

log = logging.getLogger("sled.lab.drive")

RECONNECT_S = 0.5             # between attempts to reach the broker again


class Pending:
    """One request in flight: its chunks by index as they arrive, until the last one or an error."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.attempt = Attempt()
        self.chunks: dict[int, dict] = {}
        self.last_index: int | None = None
        self.done = asyncio.get_running_loop().create_future()

    def take(self, message: dict) -> None:
        if self.done.done():
            return
        if "error" in message:
            self.fail(str(message.get("kind") or "error"), str(message["error"]))
            return
        index = int(message.get("index", len(self.chunks)))
        if index in self.chunks:
            self.attempt.duplicated_chunks.append(index)
            return
        self.chunks[index] = message
        if message.get("token_ids") and self.attempt.first_token_at is None:
            self.attempt.first_token_at = self.clock()
        if "finish_reason" in message:
            self.last_index = index
        if self.last_index is not None and len(self.chunks) == self.last_index + 1:
            self.finish()

    def finish(self) -> None:
        """The tokens in chunk order; chunks the last index says should be there but are not."""
        attempt = self.attempt
        attempt.done_at = self.clock()
        ordered = [self.chunks[i] for i in sorted(self.chunks)]
        attempt.token_ids = [int(t) for m in ordered for t in m.get("token_ids") or []]
        attempt.text = "".join(str(m.get("text") or "") for m in ordered)
        attempt.chunks = len(ordered)
        last = self.last_index if self.last_index is not None else max(self.chunks, default=-1)
        attempt.missing_chunks = [i for i in range(last + 1) if i not in self.chunks]
        if not self.done.done():
            self.done.set_result(attempt)

    def fail(self, kind: str, error: str) -> None:
        if self.done.done():
            return
        self.attempt.kind, self.attempt.error = kind, error
        self.finish()


class MqttSender:
    def __init__(self, broker, prefix: str, clock, fields: dict,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.broker, self.prefix, self.clock, self.fields = broker, prefix, clock, fields
        self.timeout_s = timeout_s
        self.client: aiomqtt.Client | None = None
        self.connected = asyncio.Event()
        self.pending: dict[str, Pending] = {}
        self.identifier = f"sled-lab-{uuid.uuid4().hex[:8]}"
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "MqttSender":
        self._task = asyncio.create_task(self._stay_connected())
        try:
            await asyncio.wait_for(self.connected.wait(), 30)
        except TimeoutError:
            await self.__aexit__()
            raise RuntimeError(f"the lab could not reach the MQTT broker {self.broker.address}") from None
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _stay_connected(self) -> None:
        while True:
            try:
                await self._listen()
            except aiomqtt.MqttError as error:
                log.info("the lab's MQTT connection ended: %s", error)
            finally:
                self.client = None
                self.connected.clear()
                self._fail_all("the MQTT broker went away before the last chunk")
            await asyncio.sleep(RECONNECT_S)

    async def _listen(self) -> None:
        async with self.broker.client(self.identifier) as client:
            await client.subscribe(device_topic(self.prefix, "+", "responses/#"), qos=1)
            self.client = client
            self.connected.set()
            async for message in client.messages:
                self._route(message.topic.value, message.payload)

    def _route(self, topic: str, payload) -> None:
        try:
            message = decode(payload)
        except ValueError:
            return
        request_id = message.get("request_id") or topic.rsplit("/", 1)[-1]
        pending = self.pending.get(request_id) if isinstance(request_id, str) else None
        if pending is not None:
            pending.take(message)

    def _fail_all(self, why: str) -> None:
        for pending in list(self.pending.values()):
            pending.fail("broker", why)

    async def send(self, handle, prompt: str, reference=None) -> Attempt:
        """One attempt: publish, wait for the last chunk, an error, a lost broker or the timeout."""
        pending = Pending(self.clock)
        request_id = new_request_id(handle.slot.id)
        self.pending[request_id] = pending
        try:
            await asyncio.wait_for(self.connected.wait(), self.timeout_s)
            body = {"request_id": request_id, "prompt": prompt, **self.fields}
            client = self.client
            if client is None:
                raise aiomqtt.MqttError("the broker connection was lost")
            await client.publish(device_topic(self.prefix, handle.slot.id, "requests"),
                                      encode(body), qos=1)
            return await asyncio.wait_for(asyncio.shield(pending.done), self.timeout_s)
        except aiomqtt.MqttError as error:
            pending.fail("broker", f"could not publish the request: {error}")
        except TimeoutError:
            pending.fail("timeout", f"no last chunk within {self.timeout_s:g} s")
        finally:
            self.pending.pop(request_id, None)
        return pending.attempt
