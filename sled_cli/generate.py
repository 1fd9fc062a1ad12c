"""`sled generate`: one generation from this device, streamed to the terminal or as JSON."""
from __future__ import annotations

import json
import sys

import grpc

from sled_cli.flags import (builtin_aliases, non_negative_float, non_negative_int, open_probability,
                            positive_int)


def add_arguments(parser) -> None:
    parser.add_argument("--server", required=True, help="HOST:PORT of a sled server")
    parser.add_argument("--drafter", default="ngram",
                        help="ngram, ngram:N, hf:PATH_OR_ID, gguf:ALIAS_OR_FILE, onnx:ALIAS_OR_DIR "
                             f"(built-in aliases: {builtin_aliases()}); "
                             "or server (no drafter: the server generates) or sat (the server "
                             "drafts with its semantic adaptive tokens)")
    parser.add_argument("--lookahead", type=non_negative_int, default=0,
                        help="ask for this many SAT hints per verdict to start the next draft with")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64,
                        help="stop after this many new tokens")
    # 0 passes the parser to get the round settings' own message (draft_len must be >= 1)
    parser.add_argument("--draft-len", type=non_negative_int, default=4,
                        help="tokens drafted per round")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="0 = greedy")
    parser.add_argument("--top-p", type=open_probability, default=1.0,
                        help="nucleus sampling: keep the smallest set of tokens with this mass")
    parser.add_argument("--top-k", type=non_negative_int, default=0,
                        help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help="sampling seed (none: a random one)")
    parser.add_argument("--stop-id", type=non_negative_int, action="append", default=[],
                        help="extra stop token id")
    parser.add_argument("--cache-salt", default="", metavar="TEXT",
                        help="share the server's cached prompt blocks only with sessions from "
                             "this host that send the same salt (default: empty)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of text")


async def run(args) -> int:
    from edge_client.connection import Connection
    from edge_client.server_side import generate_server_side
    from edge_client.session import generate
    from edge_client.text import OutputText
    from edge_client.transport import VerifyError
    from sled.cache import CacheError
    from sled.printable import printable
    from sled.v1 import verifier_pb2 as pb

    server_modes = {"server": pb.GENERATION_MODE_SERVER, "sat": pb.GENERATION_MODE_SERVER_SAT}
    try:
        sampling, settings, drafter = _round_inputs(args, server_modes)
    except (ValueError, OSError) as exc:
        print(f"sled generate: {exc}", file=sys.stderr)
        return 2
    async with Connection(args.server) as conn:
        try:
            info = await conn.model_info(timeout=15, wait_for_ready=False)
            tokenizer = await conn.tokenizer()
        except grpc.aio.AioRpcError as exc:
            print(f"sled generate: cannot reach a sled server at {args.server}: "
                  f"{exc.code().name}: {printable(exc.details() or '', 200)}", file=sys.stderr)
            return 3
        except CacheError as exc:  # the server's tokenizer was refused (or cannot be kept)
            print(f"sled generate: {exc}", file=sys.stderr)
            return 3
        prompt_ids = tokenizer(args.prompt).input_ids
        # the output as tokenizer.decode() writes it, each character once it is whole
        output = OutputText(tokenizer, skip_special_tokens=False, clean_up_tokenization_spaces=None)

        def stream(tokens: list[int]) -> None:
            output.add(tokens)
            if not args.json:
                sys.stdout.write(output.take())
                sys.stdout.flush()

        try:
            if drafter is None:   # a thin device: the server generates (and drafts with SATs)
                result = await generate_server_side(
                    conn.stub, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                    stop_ids=args.stop_id, on_tokens=stream, mode=server_modes[args.drafter],
                    cache_salt=args.cache_salt)
            else:
                result = await generate(conn.stub, drafter, prompt_ids,
                                        max_new_tokens=args.max_new_tokens,
                                        settings=settings,
                                        sampling=sampling, stop_ids=args.stop_id,
                                        target_fingerprint=info.tokenizer_fingerprint,
                                        on_tokens=stream, cache_salt=args.cache_salt)
        except VerifyError as exc:
            print(f"\nsled generate: server refused: {printable(str(exc), 200)}", file=sys.stderr)
            return 4
    result.text = tokenizer.decode(result.token_ids)
    _print_result(result, output, args.json)
    return 0


def _round_inputs(args, server_modes):
    """The sampling, the round settings and the drafter (None in a server mode) the flags ask
    for; ValueError or OSError says which flag is wrong."""
    from drafters import load_drafter
    from edge_client.session import RoundSettings
    from sled.sampling import Sampling

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    settings = RoundSettings(draft_len=args.draft_len, lookahead=args.lookahead)
    drafter = None if args.drafter in server_modes else load_drafter(args.drafter)
    return sampling, settings, drafter


def _print_result(result, output, as_json: bool) -> None:
    """One JSON object, or the rest of the text and a line of round statistics on stderr."""
    if as_json:
        print(json.dumps(result.summary()))
        return
    sys.stdout.write(output.take(final=True) + "\n")
    print(f"[{result.finish_reason}] {len(result.token_ids)} tokens in {result.rounds} rounds, "
          f"acceptance {result.acceptance_rate:.0%}, {result.tokens_per_round:.2f} tokens/round",
          file=sys.stderr)
