"""Loose verification: opt-in, greedy only, and marked everywhere as not lossless.

The rule is exact on hand-made logits; over gRPC a loose session departs from the target only at
the tokens its verdicts count, while strict sessions beside it stay token-identical to generate();
the Opened message, the verdicts, the metrics, the device's result, the OpenAI answer and
`sled generate` all say so; bad settings are refused with a precise status."""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch

from conftest import greedy_reference
from drafters.hf import HFDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from sled.wire.loose import MAX_ENTROPY, Loose
from sled.v1 import verifier_pb2 as pb
from tests.test_bad_input import open_msg
from tests.test_lossless import server_stub
from tests.test_openai_api import running_api
from tests.test_device import make_device
from tests.test_trees import refusal
from verify_server.acceptance import top3_entropy, verify_greedy

MAX_NEW = 24
Reason = pb.ErrorDetail.Reason


def logits_with(argmax: list[int], unsure: set[int], vocab: int = 16) -> torch.Tensor:
    """One row per position: a clear argmax, or (unsure) two runner-ups close behind it (top-3
    entropy 0.83 nats)."""
    logits = torch.full((len(argmax), vocab), -10.0)
    for j, token in enumerate(argmax):
        logits[j, token] = 5.0
        if j in unsure:
            logits[j, (token + 1) % vocab] = 4.0
            logits[j, (token + 2) % vocab] = 3.0
    return logits


def test_top3_entropy_is_ln3_for_three_equal_tokens_and_small_for_a_sure_one():
    assert top3_entropy(torch.tensor([1.0, 1.0, 1.0, -50.0])) == pytest.approx(math.log(3))
    assert top3_entropy(torch.tensor([20.0, 0.0, 0.0, 0.0])) < 1e-6


def test_a_mismatch_where_the_target_is_unsure_is_kept_when_the_window_agrees():
    # argmax p: 5 9 4 2; the target is unsure at position 1; the draft says 8 there
    logits = logits_with([5, 9, 4, 2], unsure={1})
    outcome = verify_greedy(logits, [5, 8, 4], Loose(window=2, entropy=0.5))
    assert (outcome.accepted, outcome.emitted, outcome.loose_at) == (3, [5, 8, 4, 2], (1,))
    strict = verify_greedy(logits, [5, 8, 4])
    assert (strict.accepted, strict.emitted, strict.loose_at) == (1, [5, 9], ())


@pytest.mark.parametrize("draft,loose,why", [
    ([5, 8, 7], Loose(2, 0.5), "the next draft token is not the target's"),
    ([5, 8], Loose(2, 0.5), "the draft ends inside the window"),
    ([5, 8, 4], Loose(2, 0.9), "the target is not unsure enough"),
])
def test_a_mismatch_is_rejected_as_strictly(draft, loose, why):
    outcome = verify_greedy(logits_with([5, 9, 4, 2], unsure={1}), draft, loose)
    assert outcome.accepted == 1 and outcome.loose_at == (), why


def test_a_sure_target_is_never_overruled():
    outcome = verify_greedy(logits_with([5, 9, 4, 2], unsure=set()), [5, 8, 4], Loose(1, 0.01))
    assert outcome.accepted == 1


@pytest.mark.parametrize("text,message", [
    ("0:0.5", "window must be 1 to 16"),
    ("2:1.2", "below ln 3"),
    ("2:0", "above 0"),
    ("2:nan", "above 0"),
    ("two", "use WINDOW:ENTROPY"),
])
def test_bad_loose_settings_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        Loose.parse(text)


def test_a_window_alone_takes_the_default_entropy():
    assert Loose.parse("3") == Loose(3, 0.5)


# --- over gRPC ----------------------------------------------------------------------------------

def departures(model, prompt: list[int], output: list[int]) -> int:
    """Positions where the output is not the target's own greedy token after what precedes it."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        argmax = model(ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    return sum(a != o for a, o in zip(argmax, output))


async def test_a_loose_session_departs_only_where_its_verdicts_say_and_strict_ones_stay_exact(
        serve, models, drafter_models, tokenizer, prompts):
    model = models["llama"]
    server = await serve(model)
    loose = Loose(window=1, entropy=0.05)      # the tiny target is unsure almost everywhere

    def session(prompt, loose=None):
        drafter = HFDrafter(drafter_models["llama"], tokenizer, name="hf:noisy")
        return generate(server_stub(server), drafter,
                        SessionRequest(prompt, max_new_tokens=MAX_NEW, loose=loose),
                        settings=RoundSettings(draft_len=4))

    strict_prompts, loose_prompts = prompts[:4], prompts[4:]
    results = await asyncio.gather(*(session(p) for p in strict_prompts),
                                   *(session(p, loose) for p in loose_prompts))
    for prompt, result in zip(strict_prompts, results):
        assert result.token_ids == greedy_reference(model, prompt, MAX_NEW)
        assert not result.loose and result.loose_accepted == 0
        assert result.summary()["verification"] == "lossless"
    loose_results = results[len(strict_prompts):]
    for prompt, result in zip(loose_prompts, loose_results):
        assert result.loose and result.summary()["verification"].startswith("loose")
        assert departures(model, prompt, result.token_ids) <= result.loose_accepted
    kept = sum(r.loose_accepted for r in loose_results)
    assert kept > 0
    assert server.metrics.value("sled_loose_accepted_tokens_total") == kept
    assert server.metrics.value("sled_loose_sessions_total") == len(loose_prompts)


async def test_the_opened_message_says_the_session_is_loose(serve, models, prompts):
    server = await serve(models["llama"])
    opening = open_msg(prompts[0])
    Loose(2, 0.5).to_proto(opening.open.loose)
    call = server_stub(server).Generate()
    await call.write(opening)
    opened = (await call.read()).opened
    await call.done_writing()
    assert opened.loose
    call.cancel()


def loose_open(prompt, window: int = 2, entropy: float = 0.5, **kw) -> pb.DeviceMessage:
    message = open_msg(prompt, **kw)
    message.open.loose.window, message.open.loose.entropy = window, entropy
    return message


@pytest.mark.parametrize("opening,fault", [
    (lambda p: loose_open(p, temperature=0.8), "greedy sessions"),
    (lambda p: loose_open(p, window=0), "window must be 1 to 16"),
    (lambda p: loose_open(p, window=17), "window must be 1 to 16"),
    (lambda p: loose_open(p, entropy=MAX_ENTROPY + 0.1), "below ln 3"),
    (lambda p: loose_open(p, entropy=-1.0), "above 0"),
])
async def test_bad_loose_opens_are_invalid_argument_and_others_go_on(serve, models, drafter_models,
                                                                     tokenizer, prompts, opening,
                                                                     fault):
    model = models["llama"]
    server = await serve(model)
    other = asyncio.create_task(generate(server_stub(server),
                                         HFDrafter(drafter_models["llama"], tokenizer,
                                                   name="hf:noisy"),
                                         SessionRequest(prompts[1], max_new_tokens=MAX_NEW)))
    code, detail, message = await refusal(server, [opening(prompts[0])])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and detail.reason == Reason.REASON_BAD_LOOSE
    assert fault in message and "bad loose verification" in message
    assert (await other).token_ids == greedy_reference(model, prompts[1], MAX_NEW)


async def test_a_loose_server_mode_session_is_refused(serve, models, prompts):
    server = await serve(models["llama"])
    opening = loose_open(prompts[0])
    opening.open.mode = pb.GENERATION_MODE_SERVER
    code, detail, message = await refusal(server, [opening])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "GENERATION_MODE_DEVICE_DRAFTS" in message


# --- the device's OpenAI API and sled generate ----------------------------------------------------

async def test_the_openai_answer_of_a_loose_request_is_marked_not_lossless(serve, models,
                                                                           drafter_models, tokenizer):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tokenizer)
    async with running_api(device) as (client, _):
        loose = await client.completions.create(
            model=device.model_id, prompt="def add(", max_tokens=8, temperature=0,
            extra_body={"loose": {"window": 1, "entropy": 0.05}, "ignore_eos": True})
        strict = await client.completions.create(model=device.model_id, prompt="def add(",
                                                 max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
        with pytest.raises(Exception) as refused:
            await client.completions.create(model=device.model_id, prompt="def add(", max_tokens=8,
                                            temperature=0.7, extra_body={"loose": {"window": 2}})
    assert loose.model_extra["sled"] == {"lossless": False, "verification": "loose"}
    assert "sled" not in (strict.model_extra or {})
    assert getattr(refused.value, "status_code", None) == 400 and "greedy" in str(refused.value)


def test_sled_generate_refuses_a_bad_loose_flag_with_exit_2(capsys):
    from sled_cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--server", "127.0.0.1:1", "--prompt", "x", "--loose", "0:0.5"])
    assert exit_.value.code == 2
    assert "window must be 1 to 16" in capsys.readouterr().err
