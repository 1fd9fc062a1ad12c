"""Real models, offline: the gemma3-270m target (registry GGUF, dequantized into transformers)
with each real edge drafter. Greedy output must equal the target's own generate()."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from conftest import cached_reference
from drafters import load_drafter, resolve_spec
from edge_client.session import RoundSettings, Target as ServedTarget, generate
from edge_client.wire import SessionRequest
from edge_client.transport import VerifyError
from sled.v1 import verifier_pb2_grpc as pb_grpc
from sled.models import hf_checkpoint
from lab.workload import load_workload
from verify_server.server import start_server
from verify_server.target import Target

pytestmark = pytest.mark.slow
TARGET = "gemma3-270m"
PROMPTS = 8        # 2 per device: each drafter meets rejections on every prompt
MAX_NEW = 64


@pytest.fixture(scope="module")
def target() -> Target:
    torch.set_num_threads(2)
    return Target.load(str(hf_checkpoint(TARGET)))


@pytest.fixture(scope="module")
def prompt_ids(target) -> list[list[int]]:
    return [target.tokenizer(p).input_ids for p in load_workload(f"humaneval:{PROMPTS}")]


@pytest.fixture(scope="module")
def references(target, prompt_ids) -> list[list[int]]:
    """generate(do_sample=False) of the target, one prompt at a time (kept on disk by content)."""
    return [cached_reference(target.model, ids, MAX_NEW) for ids in prompt_ids]


@pytest.fixture(scope="module")
async def server(target):
    running = await start_server(target)
    yield running
    await running.stop(grace=0)


@pytest.mark.parametrize("spec", [f"gguf:{TARGET}", f"onnx:{TARGET}", "ngram"])
async def test_real_drafter_output_is_identical_to_generate(server, target, prompt_ids, references, spec):
    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
    drafters = [load_drafter(spec) for _ in range(4)]  # 4 devices at a time
    results = [None] * len(prompt_ids)

    async def device(slot: int) -> None:
        for i in range(slot, len(prompt_ids), len(drafters)):
            results[i] = await generate(stub, drafters[slot],
                                        SessionRequest(prompt_ids[i], max_new_tokens=MAX_NEW),
                                        settings=RoundSettings(draft_len=4),
                                        target=ServedTarget(fingerprint=target.fingerprint))

    await asyncio.gather(*(device(slot) for slot in range(len(drafters))))
    mismatched = [i for i, (r, ref) in enumerate(zip(results, references)) if r.token_ids != ref]
    assert not mismatched, f"{spec}: prompts {mismatched} differ from generate()"
    accepted = sum(r.accepted_tokens for r in results) / sum(r.draft_tokens for r in results)
    assert accepted > 0.05, f"{spec} acceptance {accepted:.2f}: drafts are not being accepted"


async def test_smollm2_drafter_is_refused_by_a_gemma3_target(server, target, prompt_ids):
    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
    drafter = load_drafter("gguf:smollm2-135m")
    # Sent as is (no client-side check), the server refuses it and names both models.
    with pytest.raises(VerifyError) as refused:
        await generate(stub, drafter, SessionRequest(prompt_ids[0], max_new_tokens=8))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # the drafter as the user named it (its alias), not the file behind it
    assert "gguf:smollm2-135m" in refused.value.message and TARGET in refused.value.message
    # The device-side check refuses it before anything is sent, with the same precision.
    with pytest.raises(VerifyError) as early:
        await generate(stub, drafter, SessionRequest(prompt_ids[0], max_new_tokens=8),
                       target=ServedTarget(fingerprint=target.fingerprint, model=target.model_id))
    assert early.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert early.value.message.startswith(
        f"the drafter gguf:smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf) does not share a "
        f"tokenizer with the served model {target.model_id}"), early.value.message
    assert TARGET in target.model_id and "site-packages" not in early.value.message
