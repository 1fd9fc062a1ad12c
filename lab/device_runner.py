"""One device working through a workload against a server, reporting progress as JSON lines on
stdout (`sled run-device`; the demo and the lab read them, a person can too)."""
from __future__ import annotations

import json
import time

from drafters import bind_target_tokenizer, load_drafter
from edge_client.connection import Connection
from edge_client.session import RoundSettings, SessionHooks, Target, generate
from edge_client.transport import VerifyError
from edge_client.wire import SessionRequest


async def run_workload(server: str, drafter_spec: str, prompts: list[str], *, name: str,
                       max_new_tokens: int, draft_len: int) -> int:
    """Every prompt in turn as device `name`; a line per progress callback, per prompt and at the
    end, each with the running totals. Exit code: 0, or 4 when the server refused a session."""
    drafter = load_drafter(drafter_spec)
    totals = {"device": name, "drafter": drafter_spec, "prompts": 0, "tokens": 0, "rounds": 0,
              "verified": 0, "accepted": 0, "seconds": 0.0, "outputs": []}

    def emit(**extra) -> None:
        print(json.dumps({**totals, **extra}), flush=True)

    async with Connection(server) as conn:
        info = await conn.model_info()
        tokenizer = await conn.tokenizer()
        bind_target_tokenizer(drafter, tokenizer)
        for prompt in prompts:
            started = time.perf_counter()

            def progress(tokens: list[int]) -> None:
                totals["tokens"] += len(tokens)
                emit(event="progress", seconds=totals["seconds"] + time.perf_counter() - started)

            try:
                result = await generate(conn.stub, drafter,
                                        SessionRequest(tokenizer(prompt).input_ids,
                                                       max_new_tokens=max_new_tokens),
                                        settings=RoundSettings(draft_len=draft_len),
                                        target=Target(fingerprint=info.tokenizer_fingerprint),
                                        hooks=SessionHooks(on_tokens=progress))
            except VerifyError as exc:
                emit(event="error", error=str(exc))
                return 4
            totals["prompts"] += 1
            totals["rounds"] += result.rounds
            totals["verified"] += result.draft_tokens
            totals["accepted"] += result.accepted_tokens
            totals["seconds"] += time.perf_counter() - started
            totals["outputs"].append(result.token_ids)
            emit(event="prompt")
    emit(event="done")
    return 0
