"""`sled generate`: one generation from this device, streamed to the terminal or as JSON."""
from __future__ import annotations

import json
import sys

import grpc


async def run_generate(args) -> int:
    from drafters import load_drafter
    from edge_client.connection import Connection
    from edge_client.session import VerifyError, generate, generate_server_side
    from sled.sampling import Sampling
    from sled.v1 import verifier_pb2 as pb

    server_modes = {"server": pb.GENERATION_MODE_SERVER, "sat": pb.GENERATION_MODE_SERVER_SAT}
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed)
        drafter = None if args.drafter in server_modes else load_drafter(args.drafter)
    except (ValueError, OSError) as exc:
        print(f"sled generate: {exc}", file=sys.stderr)
        return 2
    async with Connection(args.server) as conn:
        try:
            info = await conn.model_info(timeout=15, wait_for_ready=False)
            tokenizer = await conn.tokenizer()
        except grpc.aio.AioRpcError as exc:
            print(f"sled generate: cannot reach a sled server at {args.server}: "
                  f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            return 3
        prompt_ids = tokenizer(args.prompt).input_ids
        shown = ""
        generated: list[int] = []

        def stream(tokens: list[int]) -> None:
            nonlocal shown
            generated.extend(tokens)
            text = tokenizer.decode(generated)
            if not args.json and not text.endswith("\ufffd"):  # wait for whole UTF-8 characters
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text

        try:
            if drafter is None:   # a thin device: the server generates (and drafts with SATs)
                result = await generate_server_side(
                    conn.stub, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                    stop_ids=args.stop_id, on_tokens=stream, mode=server_modes[args.drafter])
            else:
                result = await generate(conn.stub, drafter, prompt_ids,
                                        max_new_tokens=args.max_new_tokens, draft_len=args.draft_len,
                                        sampling=sampling, stop_ids=args.stop_id,
                                        target_fingerprint=info.tokenizer_fingerprint,
                                        on_tokens=stream, lookahead=args.lookahead)
        except VerifyError as exc:
            print(f"\nsled generate: server refused: {exc}", file=sys.stderr)
            return 4
    result.text = tokenizer.decode(result.token_ids)
    if args.json:
        print(json.dumps(result.summary()))
    else:
        sys.stdout.write(result.text[len(shown):] + "\n")
        print(f"[{result.finish_reason}] {len(result.token_ids)} tokens in {result.rounds} rounds, "
              f"acceptance {result.acceptance_rate:.0%}, {result.tokens_per_round:.2f} tokens/round",
              file=sys.stderr)
    return 0
