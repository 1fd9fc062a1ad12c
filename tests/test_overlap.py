"""The overlapped scheduler (verify_server.scheduler: `overlap`): step t+1 launched before step t
is decided gives every session the verdicts the serial order gives, greedy (the target's own
generate()) and sampled (the same draws from each session's seed), on the paged and the flex
engine; a step with sampling rows is decided before the next is launched; a failed step reaches
its own sessions only."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from sled import clock
from sled.v1 import verifier_pb2 as pb
from tests.conftest import greedy_reference
from tests.test_core import make_core  # noqa: F401  (the fixture)
from verify_server import scheduler as scheduler_module
from verify_server.auth import Identity
from verify_server.core import VerifierCore
from verify_server.engines import make_engine
from verify_server.engines.base import StepLogits
from verify_server.metrics import Metrics
from verify_server.scheduler import Scheduler, Verify

MAX_NEW = 10
DEVICES = [Identity(device=f"dev-{i}", authenticated=True, key=f"dev-{i}") for i in range(4)]
GREEDY = pb.SamplingParams(temperature=0.0)
SAMPLED = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1234)


def open_request(core: VerifierCore, prompt: list[int], sampling: pb.SamplingParams,
                 mode: int = pb.GENERATION_MODE_DEVICE_DRAFTS) -> pb.Open:
    return pb.Open(prompt_ids=prompt, max_new_tokens=MAX_NEW, sampling=sampling, mode=mode,
                   tokenizer_fingerprint=core.target.fingerprint)


async def device_session(core: VerifierCore, prompt: list[int], identity: Identity,
                         guesses: list[int], sampling: pb.SamplingParams,
                         pace: float = 0.0) -> list[tuple]:
    """A device that drafts the next three of `guesses` each round (a deterministic drafter),
    `pace` seconds after each verdict (its drafts arrive while other sessions' steps run): every
    verdict as (accepted, emitted)."""
    session = await core.open(None, open_request(core, prompt, sampling), identity)
    await core.prefill(session, deadline=None)
    session.wait_for_device()
    verdicts, emitted = [], []
    while not session.finished:
        await asyncio.sleep(pace)
        draft = (guesses[len(emitted):len(emitted) + 3] or [1, 2, 3])
        verdict = await core.verify(session, pb.Draft(round=session.round, token_ids=draft), None)
        verdicts.append((verdict.accepted, tuple(verdict.emitted_ids)))
        emitted += verdict.emitted_ids
    core.close(session)
    return verdicts


async def server_session(core: VerifierCore, prompt: list[int], identity: Identity,
                         sampling: pb.SamplingParams) -> list[tuple]:
    """A session the server decodes alone: its verdicts' tokens."""
    request = open_request(core, prompt, sampling, pb.GENERATION_MODE_SERVER)
    session = await core.open(None, request, identity)
    await core.prefill(session, deadline=None)
    verdicts = [tuple(v.emitted_ids) async for v in core.decode(session, clock.now() + 120)]
    core.close(session)
    return verdicts


async def fleet(core: VerifierCore, prompts, guesses, sampling) -> list[list[tuple]]:
    """Two device sessions and two the server decodes, all at once."""
    return await asyncio.gather(
        device_session(core, prompts[0], DEVICES[0], guesses[0], sampling, 0.001),
        device_session(core, prompts[1], DEVICES[1], guesses[1], sampling, 0.003),
        server_session(core, prompts[2], DEVICES[2], sampling),
        server_session(core, prompts[3], DEVICES[3], sampling))


@pytest.fixture(scope="module")
def references(models, prompts):
    return [greedy_reference(models["llama"], prompt, MAX_NEW) for prompt in prompts[:4]]


def guesses_of(references: list[list[int]]) -> list[list[int]]:
    """A drafter that is right at first and wrong every fourth token."""
    return [[t if i % 4 != 3 else (t + 1) % 50 for i, t in enumerate(ref)] for ref in references]


@pytest.mark.parametrize("kind", ["paged", "flex"])
async def test_overlapped_steps_give_the_targets_greedy_output(make_core, prompts, references,
                                                                kind):
    serial = await make_core(kind=kind, overlap=False)
    overlapped = await make_core(kind=kind, overlap=True)
    alone = await fleet(serial, prompts, guesses_of(references), GREEDY)
    together = await fleet(overlapped, prompts, guesses_of(references), GREEDY)
    assert together == alone
    for verdicts, reference in zip(together[:2], references):
        assert [t for _, emitted in verdicts for t in emitted] == reference
    for verdicts, reference in zip(together[2:], references[2:]):
        assert [t for emitted in verdicts for t in emitted] == reference
    # the overlap happened, and only where it was asked for
    assert overlapped.metrics.value("sled_overlapped_steps_total") > 0
    assert serial.metrics.value("sled_overlapped_steps_total") == 0
    assert overlapped.pool.committed_blocks == 0 and overlapped.pool.held_tokens == 0


@pytest.mark.parametrize("kind", ["paged", "flex"])
async def test_overlapped_steps_draw_what_the_serial_steps_draw(make_core, prompts, references,
                                                                kind):
    serial = await make_core(kind=kind, overlap=False)
    overlapped = await make_core(kind=kind, overlap=True)
    alone = await fleet(serial, prompts, guesses_of(references), SAMPLED)
    together = await fleet(overlapped, prompts, guesses_of(references), SAMPLED)
    assert together == alone
    # sampled, not greedy: some session's tokens left the greedy reference
    assert any([t for _, e in v for t in e] != r for v, r in zip(together[:2], references))


async def test_a_sampled_step_is_decided_before_the_next_launch(make_core, prompts, references,
                                                                monkeypatch):
    """The engine thread's order: a greedy step is decided after the next step's launch, a step
    with sampling rows before it."""
    order: list[tuple[str, int, bool]] = []
    launch, decide = scheduler_module.launch_step, scheduler_module.decide_step

    def logged_launch(engine, plan):
        launched = launch(engine, plan)
        order.append(("launch", id(launched), launched.argmax_decides))
        return launched

    def logged_decide(launched):
        order.append(("decide", id(launched), launched.argmax_decides))
        return decide(launched)

    monkeypatch.setattr(scheduler_module, "launch_step", logged_launch)
    monkeypatch.setattr(scheduler_module, "decide_step", logged_decide)
    core = await make_core(kind="paged", overlap=True)
    await asyncio.gather(
        device_session(core, prompts[0], DEVICES[0], guesses_of(references)[0], GREEDY, 0.001),
        device_session(core, prompts[1], DEVICES[1], guesses_of(references)[1], SAMPLED, 0.003),
        server_session(core, prompts[2], DEVICES[2], GREEDY),
        server_session(core, prompts[3], DEVICES[3], GREEDY))
    launched_at: dict[int, int] = {}
    ahead = sampled = 0
    for i, (what, step, argmax_decides) in enumerate(order):
        if what == "launch":
            launched_at[step] = i
            continue
        launches_between = sum(1 for w, *_ in order[launched_at[step] + 1:i] if w == "launch")
        if argmax_decides:
            ahead += launches_between > 0
        else:
            sampled += 1
            assert launches_between == 0
    assert ahead > 0 and sampled > 0


@dataclass(slots=True, eq=False)
class Marked(Verify):
    """A one-token verify whose row is its name (the engine below reads nothing else), with
    nothing to decide or keep."""
    name: str = ""

    @property
    def tokens_wanted(self) -> int:
        return 1

    def row(self, budget: int):
        return self.name

    def proposal(self) -> None:
        return None

    def keep(self, row, outcome) -> None:
        pass


class Failing:
    """An engine that launches ahead, and whose launch of a row named "doomed" fails."""
    launches_ahead = True

    def launch(self, rows, send_argmax=False) -> StepLogits:
        if "doomed" in rows:
            raise RuntimeError("the device fell over")
        return StepLogits(torch.zeros(len(rows), 3), [None] * len(rows))


async def test_a_failed_overlapped_step_reaches_its_own_sessions_only():
    """One work a step: the step after a pending one fails at launch; the pending one is still
    decided and answered, the failed one's work hears why, the next step goes on."""
    scheduler = Scheduler(Failing(), Metrics(), max_batch_sessions=1)
    scheduler.start()
    try:
        works = [Marked(object(), None, name=name) for name in ("before", "doomed", "after")]
        futures = [scheduler.enqueue(work) for work in works]
        before, doomed, after = await asyncio.gather(*futures, return_exceptions=True)
    finally:
        await scheduler.stop()
    assert before[0] is None and after[0] is None        # decided: nothing to decide, answered
    assert isinstance(doomed, RuntimeError) and "fell over" in str(doomed)
    assert scheduler.metrics.value("sled_overlapped_steps_total") == 2
    assert scheduler._in_flight == {}


def test_the_flex_engine_launches_ahead_only_on_cuda(models):
    engine = make_engine(models["llama"], kv_budget_bytes=1 << 20, kind="flex")
    assert engine.launches_ahead is False
    assert Scheduler(engine, Metrics()).overlap is False
    assert Scheduler(engine, Metrics(), overlap=True).overlap is True


def test_a_launched_steps_argmax_is_on_the_host_before_its_decision(models):
    """send_argmax: the step's argmax copied at launch, read from that copy (a replay's static
    buffers are the next step's)."""
    packed = torch.randn(5, 7)
    logits = StepLogits(packed, [slice(0, 5)])
    logits.send_argmax()
    expected = packed.argmax(-1).tolist()
    packed.zero_()                 # the next step overwrites the buffers
    assert logits.targets() == expected
