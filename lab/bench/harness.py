"""What every benchmark shares: its common flags, a `sled serve` child on loopback with a checked
connection, a console for wide tables, the JSON + plot it writes, the lossless check against the
target's greedy output, and the exit codes.

A benchmark module exposes add_arguments(parser) (its own flags plus the shared ones below) and
run(args), which is run_bench(NAME, its coroutine or function, args). Exit codes: 0 done; 1 an
output differs from the target's greedy output; 2 bad flags, or a target that cannot run the
benchmark; 3 the server did not start, or refused the work (also a gRPC error status the
benchmark did not expect).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import shlex
import sys
from collections.abc import Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from rich.console import Console

from edge_client.connection import Connection
from edge_client.transport import VerifyError
from lab.bench.report import write_json
from lab.traces.record import traces_for
from sled.cache import CacheError
from sled.flags import positive_int
from sled.models import resolve_model
from sled.printable import printable

T = TypeVar("T")

DONE, LOSSY, BAD_FLAGS, SERVER_FAILED = 0, 1, 2, 3
FORWARD_PASSES = "sled_forward_passes_total"
BENCH_CONNECTION_STREAMS = "100000"    # calls the benchmark's one connection may hold at once


class Stop(Exception):
    """Ends a benchmark early: its message goes to stderr, its code is the exit code."""

    def __init__(self, message: str, code: int = BAD_FLAGS) -> None:
        super().__init__(message)
        self.code = code


def run_bench(name: str, bench, args, group: str = "bench") -> int:
    """`sled GROUP NAME` (`sled bench NAME` by default): bench(args), a coroutine function or a
    plain one, to its exit code. A call the server ends with an error status the benchmark did
    not expect is one line and exit 3 (its traceback goes to the debug log)."""
    command = f"sled {group} {name}"
    try:
        result = bench(args)
        return asyncio.run(result) if inspect.iscoroutine(result) else result
    except Stop as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return exc.code
    except grpc.aio.AioRpcError as exc:
        logging.getLogger(__name__).debug("%s: unexpected gRPC error", command, exc_info=True)
        print(f"{command}: the server answered {exc.code().name}: "
              f"{printable(exc.details() or 'no details', 1000)}", file=sys.stderr)
        return SERVER_FAILED


@contextmanager
def flag_errors():
    """Bad flags or inputs (ValueError, OSError) stop the benchmark with exit code 2."""
    try:
        yield
    except (ValueError, OSError) as exc:
        raise Stop(str(exc), BAD_FLAGS) from None


@contextmanager
def server_errors():
    """A refused session or an inconsistent server (VerifyError, ValueError) stops the
    benchmark with exit code 3."""
    try:
        yield
    except (VerifyError, ValueError) as exc:
        raise Stop(str(exc), SERVER_FAILED) from None


# --- the flags benchmarks share -----------------------------------------------------------------

def add_target_flags(parser, *, model_default: str | None = None, model_help: str,
                     dtype_help: str | None = "the target's dtype") -> None:
    """--model (the target), and --dtype unless dtype_help is None."""
    parser.add_argument("--model", default=model_default, help=model_help)
    if dtype_help is not None:
        parser.add_argument("--dtype", default="float32", help=dtype_help)


def add_server_flags(parser, *, model_default: str | None = None, model_help: str,
                     dtype_help: str = "the target's dtype on the server") -> None:
    """--model, --dtype and --server-args: what the `sled serve` child runs."""
    add_target_flags(parser, model_default=model_default, model_help=model_help,
                     dtype_help=dtype_help)
    parser.add_argument("--server-args", default="",
                        help='extra `sled serve` flags, e.g. "--device cuda"')


def add_replay_flags(parser) -> None:
    """The flags of benchmarks whose devices replay traces: the server's target and the traces."""
    add_server_flags(parser, model_help="target alias or path (default: the traces' target, "
                     "else a tiny random one)", dtype_help="the target's dtype, recording and serving")
    add_trace_flags(parser, max_new_tokens=48)


def add_trace_flags(parser, *, max_new_tokens: int = 48) -> None:
    """Where emulated devices' drafter traces come from: a `sled trace record` file, or
    recorded now (--drafter against --model over --workload)."""
    parser.add_argument("--traces", default=None,
                        help="a `sled trace record` file, or calibrated:NAME (a shipped pair's "
                             "acceptance drawn along the target's greedy output); default: "
                             "record now")
    add_recording_flags(parser, max_new_tokens=max_new_tokens)


def add_recording_flags(parser, *, max_new_tokens: int = 48) -> None:
    """What to record: --drafter along --model's greedy output over --workload (--model itself
    is the caller's: a benchmark's also names the server's target)."""
    parser.add_argument("--drafter", default=None, help="ngram, hf:PATH, gguf:ALIAS, onnx:ALIAS "
                        "(default: the tiny pair's drafter, or ngram with --model)")
    add_workload_flags(parser, default="humaneval:8", max_new_tokens=max_new_tokens)
    parser.add_argument("--prompts", type=positive_int, default=None,
                        help="use at most this many prompts")
    add_max_draft_len_flag(parser)


def add_workload_flags(parser, *, default: str, max_new_tokens: int) -> None:
    parser.add_argument("--workload", default=default,
                        help="humaneval[:N], a prompt file or tiny")
    parser.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                        help="new tokens per prompt")


def add_draft_len_flag(parser, *, default: int = 4, help: str = "draft length (tokens per "
                       "draft)", old: str = "--k") -> None:
    """--draft-len; OLD, its name before, still read but no longer shown."""
    parser.add_argument("--draft-len", dest="draft_len", type=positive_int, default=default,
                        help=help)
    parser.add_argument(old, dest="draft_len", type=positive_int, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def add_draft_lens_flag(parser, *, default: str, help: str) -> None:
    """--draft-lens, comma-separated draft lengths; --k, its name before, still read."""
    parser.add_argument("--draft-lens", dest="draft_lens", default=default,
                        type=listed(positive_int), help=help)
    parser.add_argument("--k", dest="draft_lens", default=argparse.SUPPRESS,
                        type=listed(positive_int), help=argparse.SUPPRESS)


def add_max_draft_len_flag(parser, *, default: int = 8,
                           help: str = "tokens proposed per position") -> None:
    """--max-draft-len: how long the drafts a trace records are; --max-k, its name before, still
    read."""
    parser.add_argument("--max-draft-len", dest="max_draft_len", type=positive_int,
                        default=default, help=help)
    parser.add_argument("--max-k", dest="max_draft_len", type=positive_int,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_out_flag(parser, name: str) -> None:
    parser.add_argument("--out", default=f"bench-results/{name}.json", help="results file")


def server_flags(args) -> list[str]:
    """The `sled serve` flags from --dtype and --server-args."""
    return ["--dtype", args.dtype, *shlex.split(args.server_args)]


def listed(item, *words: str):
    """A type= for a comma-separated flag: every item passes ITEM (a sled.flags type) or is
    one of WORDS, or the parser stops with one line (exit 2); the text is kept as given."""
    def parse(text: str) -> str:
        for part in text.split(","):
            if part.strip() not in words:
                try:
                    item(part.strip())
                except argparse.ArgumentTypeError as exc:
                    raise argparse.ArgumentTypeError(f"{exc} (in {text!r})") from None
        return text
    parse.__name__ = "list"
    return parse


def one_of(item, *words: str):
    """A type= for a flag that is one value passing ITEM or one of WORDS (e.g. 4 or auto);
    the text is kept as given."""
    def parse(text: str) -> str:
        if text not in words:
            try:
                item(text)
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{exc} or {' or '.join(words)}") from None
        return text
    parse.__name__ = "value"
    return parse


def rotated(items: Sequence[T], index: int) -> list[T]:
    """The order the configurations of a bench run in for its index-th prompt (or group, or
    fleet size): each goes first in turn and the direction alternates, so on a noisy machine no
    configuration always runs first or after the same one. [a, b, c] for 0, 1, 2, 3:
    [a, b, c], [b, a, c], [c, a, b], [a, c, b]."""
    n, step = len(items), -1 if index % 2 else 1
    return [items[(index + step * i) % n] for i in range(n)]


def split_list(text: str, kind=str) -> list:
    """A comma-separated flag value: split_list("1,4", int) == [1, 4]."""
    return [kind(item) for item in text.split(",")]


# --- the server child and the connection to it ---------------------------------------------------

@dataclass(slots=True)
class Served:
    """A running `sled serve` child and one connection to it, with the server's ModelInfo."""
    server: object          # lab.server_process.ServerProcess
    conn: object            # edge_client.connection.Connection
    info: object            # sled.v1 ModelInfo

    @property
    def stub(self):
        return self.conn.stub

    @property
    def fingerprint(self) -> str:
        return self.info.tokenizer_fingerprint

    def forward_passes(self) -> float:
        """The server's target forward passes so far (its Prometheus counter)."""
        return self.server.metric(FORWARD_PASSES)

    def check_traces(self, traces) -> None:
        """Traces recorded for another tokenizer cannot be replayed against this server."""
        if traces.tokenizer_fingerprint not in (None, self.fingerprint):
            raise ValueError(f"the traces were recorded for another tokenizer than the server's "
                             f"({traces.target} vs {self.info.model_id})")

    async def prompt_ids(self, texts: list[str]) -> list[list[int]]:
        """Prompts in the target's tokens (the tokenizer comes from the server); a tokenizer
        that is refused (or cannot be kept) stops the benchmark with exit code 3."""
        try:
            tokenizer = await self.conn.tokenizer()
        except CacheError as exc:
            raise Stop(str(exc), SERVER_FAILED) from None
        return [tokenizer(text).input_ids for text in texts]


@asynccontextmanager
async def serving(model: str, server_args: list[str] = (), console=None,
                  status: str = "starting the verify server", security=None):
    """`sled serve --model MODEL SERVER_ARGS` on a free loopback port, connected (through
    `security`, an edge_client.security.ChannelSecurity, for a server with TLS or tokens), as
    Served. A server that does not start stops the benchmark (exit 3) with its own message."""
    # not at the top: lab.bench.engine imports this module on a GPU box without pydantic and
    # aiomqtt, which lab.server_process needs
    from lab.server_process import ServerProcess

    # one connection carries every emulated device's calls, which N devices' own would carry
    server = ServerProcess(model, "--max-streams-per-connection", BENCH_CONNECTION_STREAMS,
                           *server_args, security=security)
    try:
        with console.status(status) if console is not None else _quiet():
            await server.__aenter__()
    except RuntimeError as exc:
        raise Stop(str(exc), SERVER_FAILED) from None
    except BaseException:   # Ctrl-C (a cancelled task) while it starts: it must not outlive us
        await _stop(server)
        raise
    try:
        async with Connection(server.address, security) as conn:
            yield Served(server, conn, await conn.model_info())
    finally:
        await _stop(server)


async def _stop(server) -> None:
    """End the server child, also when this task is being cancelled (Ctrl-C): terminate it
    before the first await, so a second cancellation cannot leave it running."""
    if server.proc is not None and server.proc.poll() is None:
        server.proc.terminate()
    await asyncio.shield(server.__aexit__(None, None, None))


def replay_inputs(args, console, parse) -> tuple:
    """For benchmarks of devices that replay traces: (parse(args), target, TraceSet), the traces
    from --traces or recorded now; bad flags or files stop the benchmark (exit 2)."""
    with flag_errors():
        settings = parse(args)
        return (settings, *traces_for(args, console))


def serving_target(model: str, args, console):
    """serving() for a target alias or path with the --dtype and --server-args flags."""
    return serving(resolve_model(model), server_flags(args), console)


@contextmanager
def _quiet():
    yield


# --- what a benchmark prints and writes ----------------------------------------------------------

def bench_console(width: int = 120):
    """A rich console; written to a file or a pipe it gets `width` columns, so a log holds
    whole tables."""
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, width)
    return console


def write_results(console, out: str | Path, data: dict, plot=None) -> Path:
    """The results as JSON at `out` and, when given, plot(png_path) draws its figure beside it."""
    path = write_json(out, data)
    if plot is None:
        console.print(f"wrote {path}")
        return path
    png = path.with_suffix(".png")
    plot(png)
    console.print(f"wrote {path} and {png}")
    return path


def lossless_exit(console, differences: list[str],
                  reference: str = "the target's greedy output") -> int:
    """The exit code of the lossless check: 1 after a red line per difference ("WHERE: N
    output(s)"), 0 when every output equals the reference."""
    for where in differences:
        console.print(f"[red]{where} differ from {reference}[/]")
    return LOSSY if differences else DONE
