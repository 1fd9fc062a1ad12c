"""SATs on the server: self-drafting (GENERATION_MODE_SERVER_SAT) and lookahead hints for drafting
devices are exactly the target's output, greedy and sampled, batched with other sessions."""
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
from lab.tiny import make_tokenizer
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from test_sampling_e2e import exact_distributions, total_variation, unseeded_tv_bound
from verify_server.sdsat import SatSpec, sat_inputs, slots_under_load
from verify_server.target import Target

Reason = pb.ErrorDetail.Reason
SLOTS = 3
TARGET_FP = fingerprint_tokenizer(make_tokenizer())    # the tiny target's tokenizer


def adapter_spec(model, seed: int = 0) -> SatSpec:
    """Untrained slot embeddings, the scale of the model's own."""
    weight = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(3, weight.shape[0], (SLOTS,), generator=generator)
    return SatSpec(slots=SLOTS, embeddings=model.get_input_embeddings()(rows[None])[0].detach())


async def serve_sat(serve, model, tokenizer, spec: SatSpec, **settings):
    return await serve(model, sat=spec, **settings)


async def server_sat(stub, prompt, max_new: int, stop_ids=(), sampling: Sampling = Sampling(),
                     mode=pb.GENERATION_MODE_SERVER_SAT):
    msg = pb.DeviceMessage(open=pb.Open(prompt_ids=prompt, max_new_tokens=max_new,
                                        stop_ids=list(stop_ids), ignore_eos=True, mode=mode,
                                        tokenizer_fingerprint=TARGET_FP))
    sampling.to_proto(msg.open.sampling)
    call = stub.Generate()
    await call.write(msg)
    await call.read()
    tokens, verdicts = [], []
    while (reply := await call.read()) is not grpc.aio.EOF:
        verdicts.append(reply.verdict)
        tokens.extend(reply.verdict.emitted_ids)
    return tokens, verdicts


async def lookahead_error(stub, prompt, lookahead: int) -> grpc.aio.AioRpcError:
    """Open a session, send one draft asking for `lookahead` SAT slots: the error it ends with."""
    call = stub.Generate()
    await call.write(pb.DeviceMessage(open=pb.Open(prompt_ids=prompt, max_new_tokens=4,
                                                   tokenizer_fingerprint=TARGET_FP)))
    await call.read()
    await call.write(pb.DeviceMessage(draft=pb.Draft(round=0, token_ids=[5], lookahead=lookahead)))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        while await call.read() is not grpc.aio.EOF:
            pass
    return caught.value


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["adapter", "token-ids"])
async def test_sat_self_drafting_matches_generate(serve, models, drafter_models, tokenizer, prompts,
                                                  arch, kind):
    model = models[arch]
    spec = adapter_spec(model) if kind == "adapter" else SatSpec(slots=SLOTS, token_ids=[7] * SLOTS)
    server = await serve_sat(serve, model, tokenizer, spec)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        runs = [server_sat(stub, p, 24) for p in prompts[:5]]
        device = generate(stub, HFDrafter(drafter_models[arch]),
                          SessionRequest(prompts[5], max_new_tokens=24, ignore_eos=True),
                          settings=RoundSettings(draft_len=3))
        *outs, device_result = await asyncio.gather(*runs, device)
    for prompt, (tokens, verdicts) in zip(prompts, outs):
        assert tokens == greedy_reference(model, prompt, 24)
        assert all(v.verified <= 24 for v in verdicts)
    assert device_result.token_ids == greedy_reference(model, prompts[5], 24)
    assert server.metrics.value("sled_draft_tokens_total") > 0   # SAT guesses were verified


async def test_sat_self_drafting_stops_inside_an_accepted_run(serve, models, tokenizer, prompts):
    """A stop id met inside a run of accepted SAT guesses ends the output exactly there."""
    model = models["llama"]
    server = await serve_sat(serve, model, tokenizer, SatSpec(slots=SLOTS, token_ids=[7] * SLOTS))
    want = greedy_reference(model, prompts[1], 30)
    stop = want[9]
    async with grpc.aio.insecure_channel(server.address) as channel:
        tokens, verdicts = await server_sat(VerifierStub(channel), prompts[1], 30, stop_ids=[stop])
    assert tokens == want[:want.index(stop) + 1]
    assert verdicts[-1].finish_reason == pb.FINISH_REASON_STOP


async def test_hints_are_the_targets_sat_guesses(serve, models, tokenizer, prompts):
    """A draft accepted whole returns, as hints, the argmax at the SAT slots of one full forward
    over prompt + accepted tokens followed by the slots (the bonus token's place is slot 1)."""
    model = models["gemma3"]
    spec = adapter_spec(model, seed=3)
    server = await serve_sat(serve, model, tokenizer, spec)
    prompt = prompts[2]
    want = greedy_reference(model, prompt, 8)
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = VerifierStub(channel).Generate()
        await call.write(pb.DeviceMessage(open=pb.Open(prompt_ids=prompt, max_new_tokens=8,
                                                       ignore_eos=True, tokenizer_fingerprint=TARGET_FP)))
        await call.read()
        await call.write(pb.DeviceMessage(draft=pb.Draft(round=0, token_ids=want[:3], lookahead=SLOTS)))
        verdict = (await call.read()).verdict
        await call.write(pb.DeviceMessage(draft=pb.Draft(round=1, token_ids=[0], lookahead=SLOTS)))
        rejected = (await call.read()).verdict
        call.cancel()
    assert list(verdict.emitted_ids) == want[:4]
    with torch.no_grad():
        real = torch.tensor([prompt + want[:3]])
        out = model(inputs_embeds=sat_inputs(model, spec, real, SLOTS)).logits[0]
    assert list(verdict.hint_ids) == out[real.shape[1]:].argmax(-1).tolist()
    assert rejected.accepted == 0 and not rejected.hint_ids   # guesses after a rejection: none


async def test_lookahead_devices_stay_lossless(serve, models, drafter_models, tokenizer, prompts):
    model = models["llama"]
    server = await serve_sat(serve, model, tokenizer, SatSpec(slots=SLOTS, token_ids=[7] * SLOTS))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        results = await asyncio.gather(*(
            generate(stub, HFDrafter(drafter_models["llama"]),
                     SessionRequest(p, max_new_tokens=20, ignore_eos=True),
                     settings=RoundSettings(draft_len=4, lookahead=SLOTS, hints="always"))
            for p in prompts[:4]))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(model, prompt, 20)
    assert sum(r.hint_tokens for r in results) > 0


async def test_measured_hints_worse_than_the_drafter_are_not_used(serve, models, prompts, tokenizer):
    """The drafter is the target itself (every draft accepted whole, so hints come every asked
    round) and the SATs are untrained: the hints lose every scoring and never start a draft,
    and the session asks for them only on probing rounds."""
    model = models["llama"]
    server = await serve_sat(serve, model, tokenizer, SatSpec(slots=SLOTS, token_ids=[7] * SLOTS))
    async with grpc.aio.insecure_channel(server.address) as channel:
        result = await generate(VerifierStub(channel), HFDrafter(model),
                                SessionRequest(prompts[0], max_new_tokens=40, ignore_eos=True),
                                settings=RoundSettings(draft_len=2, lookahead=SLOTS))
    assert result.token_ids == greedy_reference(model, prompts[0], 40)
    assert result.hint_tokens == 0 and result.rounds >= 13


def test_sat_slots_are_switched_off_above_the_load():
    assert slots_under_load(3, 40, 0) == 3           # 0: never off
    assert slots_under_load(3, 32, 32) == 3
    assert slots_under_load(3, 33, 32) == 0
    assert slots_under_load(0, 1, 32) == 0


async def test_self_drafting_decodes_plainly_above_sat_off_above(serve, models, tokenizer,
                                                                 prompts):
    """With another session open the server is past --sat-off-above 1: the SAT session's passes
    carry no draft; once that session is gone, a new one drafts again. Both are the target's
    greedy output."""
    model = models["llama"]
    server = await serve_sat(serve, model, tokenizer, SatSpec(slots=SLOTS, token_ids=[7] * SLOTS),
                             sat_off_above=1)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        other = stub.Generate()          # open, then idle: a second live session
        await other.write(pb.DeviceMessage(open=pb.Open(prompt_ids=prompts[1], max_new_tokens=4,
                                                        tokenizer_fingerprint=TARGET_FP)))
        await other.read()
        loaded, loaded_verdicts = await server_sat(stub, prompts[0], 16)
        assert server.metrics.value("sled_draft_tokens_total") == 0
        other.cancel()
        while server.service.core.sessions:
            await asyncio.sleep(0.01)
        alone, _ = await server_sat(stub, prompts[0], 16)
    assert loaded == alone == greedy_reference(model, prompts[0], 16)
    assert all(v.verified == 0 and len(v.emitted_ids) == 1 for v in loaded_verdicts)
    assert server.metrics.value("sled_draft_tokens_total") > 0


async def test_sat_modes_refused_without_sats(serve, models, prompts):
    server = await serve(models["llama"], max_draft_tokens=4)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await server_sat(stub, prompts[0], 4)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no semantic adaptive tokens" in caught.value.details()
        error = await lookahead_error(stub, prompts[0], 2)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "send lookahead 0" in error.details()


async def test_lookahead_beyond_the_slots_is_invalid(serve, models, tokenizer, prompts):
    server = await serve_sat(serve, models["llama"], tokenizer, SatSpec(slots=2, token_ids=[7, 7]))
    async with grpc.aio.insecure_channel(server.address) as channel:
        error = await lookahead_error(VerifierStub(channel), prompts[0], 3)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the target's 2 SAT slots" in error.details()


@pytest.mark.parametrize("seeded", [True, False])
async def test_sat_self_drafting_samples_the_target_distribution(serve, models, tokenizer, prompts,
                                                                 seeded):
    """Three tokens per request: the second is a verified SAT guess, or what replaces it (the
    keyed pick, seeded; a residual resample, unseeded).
    The SAT id is the target's likeliest first token, so the guess after it is often right and
    both the accept and the reject branch are exercised."""
    model = models["llama"]
    sampling = Sampling(temperature=1.0, top_k=12)
    p1, p2 = exact_distributions(model, prompts[0], sampling)
    spec = SatSpec(slots=1, token_ids=[int(p1.argmax())])
    server = await serve_sat(serve, model, tokenizer, spec, max_batch_sessions=64)
    n = 3200
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub, gate = VerifierStub(channel), asyncio.Semaphore(64)

        async def one(seed):
            async with gate:
                tokens, _ = await server_sat(stub, prompts[0], 3,
                                             sampling=Sampling(1.0, 12, seed=seed if seeded else None))
                return tokens

        samples = await asyncio.gather(*(one(seed) for seed in range(n)))
    accepted = server.metrics.value("sled_accepted_tokens_total")
    assert 0 < accepted < server.metrics.value("sled_draft_tokens_total")
    for position, p in ((0, p1), (1, p2)):
        support = int((p > 1e-4).sum())
        distance = total_variation([s[position] for s in samples], p)
        bound = 0.8 * math.sqrt(support / n) if seeded else unseeded_tv_bound(support + 1, n)
        assert distance < bound, (position, distance)


async def test_an_adapter_for_another_model_is_refused_at_start(models, tokenizer):
    from verify_server.settings import ServerSettings
    from verify_server.server import start_server

    model = models["llama"]
    target = Target.from_model(model, tokenizer, "tiny")
    target.sat = SatSpec(slots=2, embeddings=torch.zeros(2, 640), source="other.safetensors")
    with pytest.raises(ValueError, match="640-wide embeddings, the model's are 64"):
        await start_server(target, ServerSettings(kv_budget=1 << 20))


# --- a target that really has SATs: it counts, and its SATs guess the count ahead ---------------

def counting_sequences(n: int, generator: torch.Generator) -> list[list[int]]:
    rows = []
    for _ in range(n):
        start = int(torch.randint(10, 200, (1,), generator=generator))
        step = int(torch.randint(1, 3, (1,), generator=generator))
        rows.append([10 + (start - 10 + step * j) % 250 for j in range(40)])
    return rows


@pytest.fixture(scope="module")
def counting_target(tokenizer):
    """A tiny Llama taught to count (plain LM loss), then SAT-tuned in full mode with the KL
    term that keeps its real-token behaviour: (float64 model, SatSpec, sequences)."""
    from sdsat.train import SatTrainConfig, train_sat
    from lab.tiny import make_model

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = make_model("llama", len(tokenizer), dtype=torch.float32)
    sequences = counting_sequences(256, generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(300):
        picks = torch.randint(0, len(sequences), (16,), generator=generator)
        batch = torch.tensor([sequences[int(i)] for i in picks])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    spec, log = train_sat(model, sequences, SatTrainConfig(slots=3, mode="full", steps=300, batch=16,
                                                           eval_every=300, lr=3e-3))
    assert log[-1]["heldout"]["accepted_run"] > 1.0
    return model.to(torch.float64).eval(), spec, sequences


async def test_trained_sats_draft_for_the_target_and_stop_inside_an_accepted_run(
        serve, tokenizer, counting_target):
    model, spec, sequences = counting_target
    server = await serve_sat(serve, model, tokenizer, spec)
    prompt = sequences[0][:8]
    want = greedy_reference(model, prompt, 24)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        tokens, verdicts = await server_sat(stub, prompt, 24)
        assert tokens == want
        assert len(verdicts) < len(tokens) / 1.5           # well over one token per pass
        # A stop id that arrives as an accepted SAT guess, not as the pass's own token.
        run = next(v for v in verdicts[1:] if v.accepted >= 2)
        stop = run.emitted_ids[0]
        assert want.index(stop) == tokens.index(stop)
        cut, cut_verdicts = await server_sat(stub, prompt, 24, stop_ids=[stop])
    assert cut == want[:want.index(stop) + 1]
    last = cut_verdicts[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.accepted == len(last.emitted_ids)            # cut inside the accepted run


@pytest.mark.parametrize("pipeline", [False, True])
async def test_lookahead_hints_start_drafts_and_stay_lossless(serve, tokenizer, counting_target, pipeline):
    """With a drafter that is usually right, whole-draft acceptances bring SAT hints, the next
    drafts start with them (ahead of any tokens drafted while the verdict was in flight), and
    the output is still the target's."""
    from lab.tiny import perturbed

    model, spec, sequences = counting_target
    server = await serve_sat(serve, model, tokenizer, spec)
    drafter_model = perturbed(model, 0.02)
    prompts = [s[:8] for s in sequences[1:5]]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        results = await asyncio.gather(*(generate(stub, HFDrafter(drafter_model),
                                                  SessionRequest(p, max_new_tokens=24,
                                                                 ignore_eos=True),
                                                  settings=RoundSettings(draft_len=4, lookahead=3,
                                                                         pipeline=pipeline,
                                                                         hints="always"))
                                         for p in prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(model, prompt, 24)
    assert sum(r.hint_tokens for r in results) > 0
