"""Sends a phase's workload to the fleet's devices and records every request.

    records = await drive(fleet, scenario, fleet.devices, prompts, references, progress)

Each device gets one loop: a closed loop (the next request when the previous one ends) or
Poisson arrivals (exponential gaps at arrivals.rate_per_s, seeded per device; requests overlap),
until `scenario.requests` requests per device or `scenario.duration_s` seconds. Prompts go round
robin, each device starting at its own offset.

Over MQTT (the default) one lab client publishes `<prefix>/devices/<id>/requests` and reads
`<prefix>/devices/+/responses/#` (edge_client/mqtt.py documents the messages); over "openai" the
official client streams completions from each device's API. A request cut by the broker going
away, answered "unavailable", or late (no first chunk, or no next chunk, in time) is sent again
with a new request id (at most ATTEMPTS times); its record keeps the last attempt. Over MQTT a
request waits until its device's retained status says online (lab.drive_mqtt). With greedy
sampling and references (the target's own outputs, lab.oracle) each record says whether it was
lossless (None for an answer cut short that was right as far as it went; `complete` and `error`
say what happened) and how many tokens were lost, duplicated or differing.
"""
from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field
from typing import Callable

from lab.oracle import compare, decode_text, target_tokenizer
from sled.wire.topics import DEFAULT_PREFIX

ATTEMPTS = 3                  # sends of one request at most
RETRY_PAUSE_S = 1.0           # before sending a failed request again
FIRST_CHUNK_TIMEOUT_S = 60.0  # from sent to the first chunk: longer, the request was lost
STALL_TIMEOUT_S = 60.0        # between two chunks: longer, the rest of the answer was lost
RETRYABLE = {"unavailable", "broker", "timeout"}   # failure kinds worth a second send


@dataclass
class RequestRecord:
    """One request of a phase; times are seconds from the phase start."""
    device: str
    profile: str
    link: str
    drafter: str
    system: str                       # "sled" or "centralized"
    fleet_size: int
    prompt_index: int
    sent_at: float
    first_token_at: float | None = None
    done_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    duplicated_chunks: list[int] = field(default_factory=list)
    missing_chunks: list[int] = field(default_factory=list)
    error: str | None = None
    attempts: int = 0
    complete: bool = False            # the answer ended with a finish reason
    lossless: bool | None = None      # None: not greedy, no reference, or cut short but right so far
    lost_tokens: int = 0              # reference tokens missing from what came
    duplicated_tokens: int = 0        # tokens that came the reference does not have
    differing_tokens: int = 0         # tokens that came in place of other reference tokens


@dataclass
class Attempt:
    """What one send of a request brought back."""
    first_token_at: float | None = None
    done_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    duplicated_chunks: list[int] = field(default_factory=list)
    missing_chunks: list[int] = field(default_factory=list)
    error: str | None = None
    kind: str | None = None           # the failure's kind ("unavailable", "broker", ...)
    complete: bool = False            # the last chunk (with a finish reason) came, none missing


@dataclass
class Phase:
    """What every device loop of one drive() shares."""
    scenario: object
    prompts: list[str]
    references: list[list[int]] | None
    sender: object                    # MqttSender or OpenAISender: send(handle, prompt) -> Attempt
    clock: Callable[[], float]
    progress: Callable
    system: str
    fleet_size: int
    records: list[RequestRecord] = field(default_factory=list)


async def drive(fleet, scenario, devices, prompts: list[str], references: list[list[int]] | None,
                progress: Callable[[RequestRecord], None], *, system: str = "sled",
                tokenizer=None) -> list[RequestRecord]:
    """Every device's loop until the scenario's requests or duration; the records in the order
    requests ended. TOKENIZER (openai only): text <-> ids (default: the target's)."""
    if not prompts:
        raise ValueError("the workload has no prompts")
    loop = asyncio.get_running_loop()
    started = loop.time()

    def clock() -> float:
        return round(loop.time() - started, 4)

    via = getattr(scenario, "via", "mqtt") or "mqtt"
    async with make_sender(via, fleet, scenario, references, clock, tokenizer) as sender:
        phase = Phase(scenario, list(prompts), references, sender, clock, progress, system,
                      len(devices))
        await all_or_none(*(device_loop(phase, handle, i) for i, handle in enumerate(devices)))
    return phase.records


async def all_or_none(*coroutines) -> list:
    """Run side by side; the first failure cancels the others and is raised (a TaskGroup's
    behaviour, on Python 3.10 too)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def make_sender(via: str, fleet, scenario, references, clock, tokenizer):
    from lab.drive_openai import OpenAISender   # a cycle: lab.drive_openai imports this module
    from lab.drive_mqtt import MqttSender   # a cycle: lab.drive_mqtt imports this module

    if via == "mqtt":
        return MqttSender(fleet.broker, topic_prefix(fleet), clock, sampling_fields(scenario),
                          first_chunk_s=FIRST_CHUNK_TIMEOUT_S, stall_s=STALL_TIMEOUT_S)
    if via == "openai":
        if tokenizer is None:              # the API sends text: ids come from the target's tokenizer
            tokenizer = target_tokenizer(scenario.served_target())
        return OpenAISender(clock, sampling_fields(scenario), tokenizer, timeout_s=STALL_TIMEOUT_S)
    raise ValueError(f"via must be mqtt or openai, got {via!r}")


def topic_prefix(fleet) -> str:
    return getattr(fleet, "topic_prefix", None) or getattr(fleet, "prefix", None) or DEFAULT_PREFIX


def sampling_fields(scenario) -> dict:
    """The request fields every request of the phase carries."""
    sampling = scenario.sampling
    return {"max_tokens": int(scenario.max_tokens), "temperature": float(sampling.temperature),
            "top_p": float(sampling.top_p), "top_k": int(sampling.top_k), "seed": sampling.seed}


# -- the loops ------------------------------------------------------------------------------
def more(phase: Phase, sent: int) -> bool:
    """Whether a device sends another request: under its count, or within the duration."""
    scenario = phase.scenario
    if getattr(scenario, "requests", None) is not None:
        return sent < int(scenario.requests)
    return phase.clock() < float(scenario.duration_s)


async def device_loop(phase: Phase, handle, position: int) -> None:
    arrivals = phase.scenario.arrivals
    if getattr(arrivals, "mode", "closed") == "poisson":
        await poisson_loop(phase, handle, position, float(arrivals.rate_per_s))
        return
    sent = 0
    while more(phase, sent):
        await request(phase, handle, prompt_index(phase, position, sent))
        sent += 1


async def poisson_loop(phase: Phase, handle, position: int, rate_per_s: float) -> None:
    """Arrivals at exponential gaps (seeded per device); requests run side by side."""
    if rate_per_s <= 0:
        raise ValueError(f"arrivals.rate_per_s must be above 0, got {rate_per_s}")
    seed = phase.scenario.sampling.seed
    gaps = random.Random(f"{seed}:{handle.slot.id}")
    running: list[asyncio.Task] = []
    sent = 0
    try:
        while True:
            await asyncio.sleep(gaps.expovariate(rate_per_s))
            if not more(phase, sent):
                break
            running.append(asyncio.create_task(request(phase, handle, prompt_index(phase, position, sent))))
            sent += 1
    except BaseException:            # this loop failed or was cancelled: its requests go too
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        raise
    await all_or_none(*running)


def prompt_index(phase: Phase, position: int, sent: int) -> int:
    """Round robin over the prompts, each device starting at its own offset."""
    return (position + sent) % len(phase.prompts)


async def request(phase: Phase, handle, index: int) -> RequestRecord:
    """One request, sent again while it fails for a retryable reason; recorded and reported."""
    slot = handle.slot
    record = RequestRecord(slot.id, slot.device, slot.link, slot.drafter, phase.system,
                           phase.fleet_size, index, sent_at=phase.clock())
    reference = phase.references[index] if phase.references is not None else None
    while True:
        record.attempts += 1
        attempt = await phase.sender.send(handle, phase.prompts[index], reference)
        if attempt.kind not in RETRYABLE or record.attempts >= ATTEMPTS:
            break
        await asyncio.sleep(RETRY_PAUSE_S)
    take_attempt(record, attempt)
    judge(record, reference, phase.scenario.sampling.greedy)
    phase.records.append(record)
    phase.progress(record)
    return record


def take_attempt(record: RequestRecord, attempt: Attempt) -> None:
    for name in ("first_token_at", "done_at", "token_ids", "text", "chunks", "duplicated_chunks",
                 "missing_chunks", "error", "complete"):
        setattr(record, name, getattr(attempt, name))


def judge(record: RequestRecord, reference: list[int] | None, greedy: bool) -> None:
    """Lossless and the lost/duplicated/differing counts against the target's greedy output. A
    complete answer must equal the reference; one cut short (an error, a timeout) is judged only
    on what came: not a prefix of the reference is a violation, a prefix is not judged (None)."""
    if reference is None or not greedy:
        return
    received, wanted = list(record.token_ids), list(reference)
    difference = compare(wanted, received, complete=record.complete)
    record.lost_tokens = difference.lost
    record.duplicated_tokens = difference.duplicated
    record.differing_tokens = difference.differing
    if record.complete:
        record.lossless = received == wanted
    else:
        record.lossless = None if received == wanted[:len(received)] else False


def new_request_id(device_id: str) -> str:
    return f"lab-{device_id}-{uuid.uuid4().hex[:12]}"


def reference_text(tokenizer, reference: list[int] | None) -> str | None:
    return None if reference is None or tokenizer is None else decode_text(tokenizer, reference)
