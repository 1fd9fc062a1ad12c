"""`sled generate`: one generation from this device, streamed to the terminal or as JSON."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys

import grpc

from drafters import bind_target_tokenizer, load_drafter
from edge_client.connection import Connection
from edge_client.result import (INTERRUPTED, LOST, SERVER_FAILED, SERVER_LOST, SERVER_SILENT,
                                GenerationResult)
from edge_client.security import ChannelSecurity
from edge_client.server_side import generate_server_side
from edge_client.session import (OPEN_TIMEOUT_S, VERDICT_TIMEOUT_S, RoundSettings, SessionHooks,
                                  Target, device_session)
from edge_client.strikes import SILENT_RETRIES
from edge_client.text import OutputText
from edge_client.transport import ServerGivenUp, ServerLost, ServerSilent, VerifyError, lost_server
from edge_client.verdict_check import BrokenVerdict
from edge_client.wire import SessionRequest
from sled.cache import CacheError
from sled.flags import (builtin_aliases, loose_flag, non_negative_float, non_negative_int,
                            open_probability, positive_float, positive_int)
from sled.printable import counted, printable
from sled.v1 import verifier_pb2 as pb
from sled.wire.sampling import Sampling


def add_arguments(parser) -> None:
    parser.add_argument("--server", required=True, help="HOST:PORT of a sled server")
    parser.add_argument("--drafter", default="ngram",
                        help="ngram, ngram:N, cacheback[:NAME=N...], hier:CHEAP>MODEL, hf:PATH_OR_ID, "
                             "gguf:ALIAS_OR_FILE, onnx:ALIAS_OR_DIR "
                             f"(built-in aliases: {builtin_aliases()}); "
                             "or server (no drafter: the server generates) or sat (the server "
                             "drafts with its semantic adaptive tokens)")
    parser.add_argument("--lookahead", type=non_negative_int, default=0,
                        help="ask for this many SAT hints per verdict to start the next draft with")
    parser.add_argument("--hints", choices=["measured", "always"], default="measured",
                        help="measured: start a draft with the hints only while they beat the "
                             "drafter (this session's rounds); always: whenever they come")
    parser.add_argument("--tree", type=positive_int, default=1,
                        help="candidates per draft position: above 1 a greedy session sends its "
                             "drafts as trees (cacheback and the model drafters branch)")
    parser.add_argument("--loose", type=loose_flag, default=None, metavar="WINDOW:ENTROPY",
                        help="opt-in loose verification, NOT lossless (greedy only): keep a draft "
                             "token the target disagrees with where the target's top-3 entropy "
                             "is above ENTROPY nats and the next WINDOW-1 draft tokens are its "
                             "own, e.g. 2:0.5")
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
    _waiting_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of text")
    access = parser.add_argument_group("access", "a server started with --tls-cert, "
                                       "--tls-client-ca or --auth-tokens (see sled certs)")
    access.add_argument("--server-ca", metavar="FILE",
                        help="TLS: the CA that signed the server's certificate")
    access.add_argument("--client-cert", metavar="FILE",
                        help="mutual TLS: this device's certificate (with --client-key)")
    access.add_argument("--client-key", metavar="FILE", help="the client certificate's key")
    access.add_argument("--server-name", metavar="NAME", default="",
                        help="the name the server's certificate carries, when not the host "
                             "dialed")
    access.add_argument("--token", metavar="TEXT", default=os.environ.get("SLED_DEVICE_TOKEN", ""),
                        help="this device's token (default: $SLED_DEVICE_TOKEN, which keeps "
                             "it out of the process list)")


def _waiting_arguments(parser) -> None:
    """How long the server is waited for: lost, slow to answer, silent."""
    waiting = parser.add_argument_group("waiting", "how long a server that is lost or silent is "
                                        "waited for")
    waiting.add_argument("--reconnect-s", type=non_negative_float, default=30.0, metavar="S",
                         help="how long a lost server (or another) is waited for to resume the "
                              "session before giving up with the partial output (0: at once)")
    waiting.add_argument("--open-timeout-s", type=positive_float, default=OPEN_TIMEOUT_S, metavar="S",
                         help="how long the server may take to answer the open (its prefill); "
                              "silent longer, it is treated as lost")
    waiting.add_argument("--verdict-timeout-s", type=positive_float, default=VERDICT_TIMEOUT_S,
                         metavar="S", help="how long the server may take to answer each draft; "
                                           "silent longer, it is treated as lost")
    waiting.add_argument("--silent-retries", type=non_negative_int, default=SILENT_RETRIES,
                         metavar="N", help="how many times the session reopens on a server that "
                                           "went silent, or dropped it without a verdict; the "
                                           "next time ends it (exit 4, the partial output kept)")


async def run(args) -> int:
    """Connect, generate, print. Ctrl-C (the cancelled task), a server that does not come back
    and one given up (silent, or dropping the session, past --silent-retries) still print the
    committed tokens, then one line: exit 130, 5 and 4. A Ctrl-C after the output has ended
    (while the connection closes) prints nothing more: the exit code stays."""
    shown = Shown(args)
    try:
        return await _generate(args, shown)
    except asyncio.CancelledError:
        return shown.end(INTERRUPTED)


async def _generate(args, shown: "Shown") -> int:
    server_modes = {"server": pb.GENERATION_MODE_SERVER, "sat": pb.GENERATION_MODE_SERVER_SAT}
    try:
        security = _security(args)
        sampling, settings, drafter = await asyncio.to_thread(_round_inputs, args, server_modes)
    except (ValueError, OSError) as exc:
        return shown.fail(str(exc), 2)
    # the drafter loads before the target's tokenizer, not beside it: both may import
    # transformers, whose lazy imports are not safe from two threads at once
    async with Connection(args.server, security, args.server_name) as conn:
        try:
            info = await conn.model_info(timeout=15, wait_for_ready=False)
            shown.tokenizer = await conn.tokenizer()
        except grpc.aio.AioRpcError as exc:
            return shown.fail(await conn.explain(exc), 3)
        except CacheError as exc:  # the server's tokenizer was refused (or cannot be kept)
            return shown.fail(str(exc), 3)
        prompt_ids = shown.tokenizer(args.prompt).input_ids
        bind_target_tokenizer(drafter, shown.tokenizer)   # an xtok: drafter drafts in its ids
        mode = server_modes.get(args.drafter)
        if info.limits.max_draft_tokens:      # a tree draft stays within what the server takes
            settings = dataclasses.replace(settings, max_draft_tokens=info.limits.max_draft_tokens)
        return await _session(conn.stub, info, prompt_ids, sampling, settings, drafter, mode, shown)


async def _session(stub, info, prompt_ids, sampling, settings, drafter, mode, shown: "Shown") -> int:
    """Run the session to its end and print it: 0; a refusal, a broken verdict or a server given
    up past its retries: 4 (that last with the partial output); a lost server: 5 (the same)."""
    args = shown.args
    try:
        if drafter is None:   # a thin device: the server generates (and drafts with SATs)
            result = await generate_server_side(
                stub,
                SessionRequest(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                               stop_ids=args.stop_id, mode=mode, cache_salt=args.cache_salt),
                hooks=SessionHooks(on_tokens=shown.stream, on_server=shown.server_event),
                reconnect_s=args.reconnect_s, vocab_size=info.vocab_size,
                open_timeout_s=settings.open_timeout_s, verdict_timeout_s=settings.verdict_timeout_s,
                silent_retries=settings.silent_retries)
        else:
            shown.session = device_session(
                stub, drafter,
                SessionRequest(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                               stop_ids=args.stop_id, cache_salt=args.cache_salt, loose=args.loose),
                settings=settings,
                target=Target(fingerprint=info.tokenizer_fingerprint, model=info.model_id,
                              vocab_size=info.vocab_size),
                hooks=SessionHooks(on_tokens=shown.stream, on_server=shown.server_event))
            result = await shown.session.run()
    except (VerifyError, grpc.aio.AioRpcError) as exc:
        if isinstance(exc, ServerGivenUp):
            return shown.given_up(exc)
        if isinstance(exc, ServerLost) or lost_server(exc):
            return shown.end(SERVER_LOST, waited=isinstance(exc, ServerLost))
        if isinstance(exc, VerifyError) and exc.reason == "REASON_TOKENIZER_MISMATCH":
            return shown.fail(printable(str(exc), 400), 4)   # found here, before anything was sent
        if isinstance(exc, BrokenVerdict):
            return shown.fail(f"the verify server {printable(args.server, 200)} sent a verdict "
                              f"that breaks the protocol, so nothing of it was kept: "
                              f"{printable(exc.problem, 300)}", 4)
        detail = str(exc) if isinstance(exc, VerifyError) else f"{exc.code().name}: {exc.details()}"
        return shown.fail(f"server refused: {printable(detail, 200)}", 4)
    return shown.finish(result)


def _security(args):
    """TLS and the token, as the access flags ask (ValueError names a file that cannot be read)."""
    return ChannelSecurity.from_files(args.server_ca, args.client_cert, args.client_key,
                                      args.token, [args.server_name] if args.server_name else [])


def _round_inputs(args, server_modes):
    """The sampling, the round settings and the drafter (None in a server mode) the flags ask
    for; ValueError or OSError says which flag is wrong."""
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    if args.loose is not None and (not sampling.greedy or args.drafter in server_modes):
        raise ValueError("--loose checks a drafter's greedy drafts: use it with --temperature 0 "
                         "and a drafter (not server or sat)")
    settings = RoundSettings(draft_len=args.draft_len, lookahead=args.lookahead, hints=args.hints,
                             tree=args.tree, reconnect_s=args.reconnect_s,
                             open_timeout_s=args.open_timeout_s,
                             verdict_timeout_s=args.verdict_timeout_s,
                             silent_retries=args.silent_retries)
    drafter = None if args.drafter in server_modes else load_drafter(args.drafter)
    return sampling, settings, drafter


class Shown:
    """What one `sled generate` shows: the text streamed so far, the session behind it, and one
    line on stderr for each thing a person should know (a lost server, a resumed one, the end).
    It ends once (finish, end, given_up or fail decide the exit code); after that it prints
    nothing more."""

    def __init__(self, args) -> None:
        self.args = args
        self.tokenizer = None      # the target's, once fetched
        self.output = None         # OutputText of the committed tokens, once there is a tokenizer
        self.session = None        # the DeviceSession, when this device drafts
        self.committed: list[int] = []
        self.mid_line = False      # text was printed that does not end its line
        self.code: int | None = None   # the exit code, once the output has ended

    def stream(self, tokens: list[int]) -> None:
        """A verdict's committed tokens: printed as text as soon as each character is whole."""
        if self.output is None:
            # the output as tokenizer.decode() writes it
            self.output = OutputText(self.tokenizer, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=None)
        self.committed.extend(tokens)
        self.output.add(tokens)
        if not self.args.json:
            self._write(self.output.take())

    def server_event(self, event) -> None:
        """The session lost its server, or got one back: say so at once."""
        if event.kind == LOST:
            how = " (it went silent)" if event.silent else ""
            self.say(f"lost the server at {self.args.server}{how} after "
                     f"{counted(event.committed, 'token')}; waiting up to {event.wait_s:g} s for it "
                     "(or another) to resume")
        else:
            self.say(f"the server is back: resumed after {counted(event.committed, 'token')} "
                     f"({event.detail})")

    def say(self, line: str) -> None:
        """One line on stderr, on a line of its own."""
        sys.stdout.flush()
        print(("\n" if self.mid_line else "") + f"sled generate: {line}", file=sys.stderr, flush=True)
        self.mid_line = False

    def finish(self, result) -> int:
        """A whole generation: the rest of the text (or one JSON object) and its statistics; 0."""
        self.code = 0
        self._print(result, whole=True)
        if not self.args.json:
            print(f"[{result.finish_reason}] {counted(len(result.token_ids), 'token')} in "
                  f"{counted(result.rounds, 'round')}, acceptance {result.acceptance_rate:.0%}, "
                  f"{result.tokens_per_round:.2f} tokens/round", file=sys.stderr)
            if result.loose:
                print(f"loose verification, NOT lossless: {counted(result.loose_accepted, 'draft token')} "
                      "kept where the target's own token was another", file=sys.stderr)
            if result.moves:
                where = ", ".join(f"{tokens} {placement}" for placement, tokens
                                  in result.placements.items())
                print(f"the server moved the session {counted(result.moves, 'time')}: tokens "
                      f"by where they came from: {where}", file=sys.stderr)
        return self.code

    def fail(self, line: str, code: int) -> int:
        """No generation (a wrong flag, no server, a refusal): one line; its exit code."""
        self.code = code
        self.say(line)
        return code

    def end(self, finish_reason: str, waited: bool = False) -> int:
        """A generation cut short: the committed tokens as output, then why it ended (waited:
        the session waited for a lost server in vain); 130 interrupted, 5 server lost. Once the
        output has ended, nothing is printed: the exit code already decided."""
        if self.code is not None:
            return self.code
        kept = self._cut_short(finish_reason, 130 if finish_reason == INTERRUPTED else 5)
        if finish_reason == INTERRUPTED:
            self.say(f"interrupted after {kept}")
        elif waited:
            self.say(f"the server at {self.args.server} did not come back within "
                     f"{self.args.reconnect_s:g} s; {kept} kept")
        else:
            self.say(f"lost the server at {self.args.server}; {kept} kept")
        return self.code

    def given_up(self, error: ServerGivenUp) -> int:
        """The session gave its server up (silent, or dropping it, past its retries): the
        committed tokens as output (server_silent or server_failed), then the line naming the
        server; 4."""
        if self.code is not None:
            return self.code
        self._cut_short(SERVER_SILENT if isinstance(error, ServerSilent) else SERVER_FAILED, 4)
        self.say(error.naming(self.args.server))
        return self.code

    def _cut_short(self, finish_reason: str, code: int) -> str:
        """The output ends early with `code`: the committed tokens printed, ended for
        finish_reason; how many, in words ("3 tokens")."""
        self.code = code
        if self.session is not None:
            result = self.session.partial(finish_reason)
        else:
            result = GenerationResult(token_ids=list(self.committed), finish_reason=finish_reason)
        self._print(result)
        return counted(len(result.token_ids), "token")

    def _print(self, result, whole: bool = False) -> None:
        """The result as one JSON object, or the rest of its text and the newline that ends it
        (a generation cut short before any text ends nothing)."""
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(result.token_ids)
        if self.args.json:
            print(json.dumps(result.summary()), flush=True)
            return
        rest = self.output.take(final=True) if self.output is not None else ""
        if whole or rest or self.mid_line:
            self._write(rest + "\n")

    def _write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.mid_line = not text.endswith("\n")
