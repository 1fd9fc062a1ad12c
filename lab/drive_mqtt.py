"""The lab's requests over MQTT: one client, subscribed to every device's responses and status,
that stays connected through broker restarts.

    async with MqttSender(broker, "sled", clock, fields) as sender:
        attempt = await sender.send(handle, "def add(a, b):", reference)

A request is published only once its device says it is online: the device's retained
`status` ({"online": true}) is published after it has subscribed to its requests, on every
(re)connect, so a request is never sent into a broker that has no subscriber for it. After a
lost broker connection every device counts as offline until its status comes again.

A request whose last chunk has not come when the broker connection drops fails with kind
"broker" (the device cancels it too, edge_client/mqtt.py); one with no first chunk within
FIRST_CHUNK_TIMEOUT_S, or no next chunk within STALL_TIMEOUT_S, fails with kind "timeout". Its
asker may send it again (with a new request id, so nothing is counted twice).
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import aiomqtt

from lab.drive import FIRST_CHUNK_TIMEOUT_S, STALL_TIMEOUT_S, Attempt, new_request_id
from sled.wire.topics import decode, device_topic, encode

log = logging.getLogger("sled.lab.drive")

RECONNECT_S = 0.5             # between attempts to reach the broker again
ONLINE_TIMEOUT_S = 120.0      # a device not online this long: the request fails ("offline")


class Pending:
    """One request in flight: its chunks by index as they arrive, until the last one or an error."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.attempt = Attempt()
        self.chunks: dict[int, dict] = {}
        self.last_index: int | None = None
        self.progressed = asyncio.Event()      # set by every message; cleared by the waiter
        self.done = asyncio.get_running_loop().create_future()

    def take(self, message: dict) -> None:
        if self.done.done():
            return
        self.progressed.set()
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
            self.attempt.complete = True
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
                 first_chunk_s: float = FIRST_CHUNK_TIMEOUT_S, stall_s: float = STALL_TIMEOUT_S,
                 online_s: float = ONLINE_TIMEOUT_S) -> None:
        self.broker, self.prefix, self.clock, self.fields = broker, prefix, clock, fields
        self.first_chunk_s, self.stall_s, self.online_s = first_chunk_s, stall_s, online_s
        self.client: aiomqtt.Client | None = None
        self.connected = asyncio.Event()
        self.pending: dict[str, Pending] = {}
        self.online: set[str] = set()                 # device ids whose status says online
        self.status_changed = asyncio.Condition()
        self.identifier = f"sled-lab-{uuid.uuid4().hex[:8]}"
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "MqttSender":
        self._task = asyncio.create_task(self._stay_connected())
        try:
            await asyncio.wait_for(self.connected.wait(), 30)
        except asyncio.TimeoutError:
            await self._stop()
            raise RuntimeError(f"the lab could not reach the MQTT broker {self.broker.address}") from None
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stop()

    async def _stop(self) -> None:
        """Cancel the listener; an error it died of (not a cancel) is raised here."""
        task, self._task = self._task, None
        if task is None:
            return
        died = task.done() and not task.cancelled()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if died and task.exception() is not None:
            raise RuntimeError(f"the lab's MQTT listener stopped: {task.exception()}") from task.exception()

    async def _stay_connected(self) -> None:
        while True:
            try:
                await self._listen()
            except aiomqtt.MqttError as error:
                log.info("the lab's MQTT connection ended: %s", error)
            except Exception as error:              # a bug or surprise: say so, keep listening
                log.warning("the lab's MQTT listener failed, reconnecting: %r", error)
            finally:
                self.client = None
                self.connected.clear()
                self.online.clear()                 # statuses come again after the reconnect
                self._fail_all("the MQTT broker went away before the last chunk")
            await asyncio.sleep(RECONNECT_S)

    async def _listen(self) -> None:
        async with self.broker.client(self.identifier) as client:
            await client.subscribe([(device_topic(self.prefix, "+", "responses/#"), 1),
                                    (device_topic(self.prefix, "+", "status"), 1)])
            self.client = client
            self.connected.set()
            async for message in client.messages:
                await self._route(message.topic.value, message.payload)

    async def _route(self, topic: str, payload) -> None:
        """A response chunk to its request, a status to the online set; a malformed one is
        logged and dropped."""
        try:
            message = decode(payload)
            if topic.endswith("/status"):
                await self._take_status(topic, message)
                return
            request_id = message.get("request_id") or topic.rsplit("/", 1)[-1]
            pending = self.pending.get(request_id) if isinstance(request_id, str) else None
            if pending is not None:
                pending.take(message)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            log.warning("dropped a malformed MQTT message on %s: %s", topic, error)

    async def _take_status(self, topic: str, message: dict) -> None:
        device_id = topic.rsplit("/", 2)[-2]
        if message.get("online") is True:
            self.online.add(device_id)
        else:
            self.online.discard(device_id)
        async with self.status_changed:
            self.status_changed.notify_all()

    def _fail_all(self, why: str) -> None:
        for pending in list(self.pending.values()):
            pending.fail("broker", why)

    async def wait_online(self, device_id: str) -> bool:
        """Until the broker is reached and the device's status says online; False after online_s."""
        async def online() -> None:
            await self.connected.wait()
            async with self.status_changed:
                await self.status_changed.wait_for(lambda: device_id in self.online and self.connected.is_set())
        try:
            await asyncio.wait_for(online(), self.online_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def send(self, handle, prompt: str, reference=None) -> Attempt:
        """One attempt: wait until the device is online, publish, wait for the last chunk, an
        error, a lost broker, or no progress in time."""
        device_id = handle.slot.id
        pending = Pending(self.clock)
        if not await self.wait_online(device_id):
            pending.fail("offline", f"{device_id} was not online on MQTT within {self.online_s:g} s")
            return pending.attempt
        request_id = new_request_id(device_id)
        self.pending[request_id] = pending
        try:
            body = {"request_id": request_id, "prompt": prompt, **self.fields}
            client = self.client
            if client is None:
                raise aiomqtt.MqttError("the broker connection was lost")
            await client.publish(device_topic(self.prefix, device_id, "requests"), encode(body), qos=1)
            return await self._answer(pending)
        except aiomqtt.MqttError as error:
            pending.fail("broker", f"could not publish the request: {error}")
        finally:
            self.pending.pop(request_id, None)
        return pending.attempt

    async def _answer(self, pending: Pending) -> Attempt:
        """The attempt once done; a timeout when the first chunk, or the next one, is late."""
        while not pending.done.done():
            quiet_s = self.stall_s if pending.chunks else self.first_chunk_s
            pending.progressed.clear()
            progressed = asyncio.ensure_future(pending.progressed.wait())
            try:
                await asyncio.wait({pending.done, progressed}, timeout=quiet_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                progressed.cancel()
            if not pending.done.done() and not pending.progressed.is_set():
                what = "next chunk" if pending.chunks else "first chunk"
                pending.fail("timeout", f"no {what} within {quiet_s:g} s")
        return pending.attempt
