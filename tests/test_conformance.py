"""A third-party client of the sled wire protocol, written from docs/protocol.md alone, against
`sled serve`, checked against `sled generate`.

The client (tests/conformance_client.py) runs as a process of its own, `python -I`, so nothing
of the project can reach it (pytest's conftest imports the project into this process): the
messages come from the server's own reflection descriptors, the tokenizer from the files
GetTokenizer streams, the drafter is a few lines of prompt lookup; it asserts at its end that
no project module was loaded, and prints what it got as JSON. The server and `sled generate`
(the reference) run as child processes, as a person runs them. Greedy output must equal
`sled generate`'s, token for token, for every prompt and draft length; what the protocol refuses
must be refused with the documented status and reason.
"""
from __future__ import annotations

import ast
import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

pytestmark = pytest.mark.slow

SLED = [sys.executable, "-m", "sled_cli.main"]
CLIENT = Path(__file__).with_name("conformance_client.py")
PROJECT = ("sled", "edge_client", "verify_server", "drafters", "lab", "sled_cli")
MODEL = "gemma3-270m"
PROMPTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4, 5,"]
DRAFT_LENS = (1, 3, 6)
MAX_NEW = 12
CLIENT_S = 600                 # the whole client run: a hang fails the test


# --- the server, the client and the reference, as child processes ---------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def address():
    port = free_port()
    server = subprocess.Popen([*SLED, "serve", "--model", MODEL, "--port", str(port),
                               "--kv-budget", "256MiB", "--max-draft-len", "8"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:   # ready once it answers
            grpc.channel_ready_future(channel).result(timeout=300)
        yield address
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


def sled_generate(address: str, prompt: str, draft_len: int) -> subprocess.Popen:
    """`sled generate --json`, started: the reference output (see reference_of)."""
    return subprocess.Popen([*SLED, "generate", "--server", address, "--prompt", prompt,
                             "--max-new-tokens", str(MAX_NEW), "--draft-len", str(draft_len),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reference_of(generating: subprocess.Popen) -> dict:
    """The JSON object `sled generate --json` printed."""
    out, err = generating.communicate(timeout=180)
    assert generating.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(address) -> tuple[dict, dict[str, dict]]:
    """(what the client got, speaking the protocol by itself; `sled generate --json` for each
    prompt at one draft length, by prompt), all run at once; the tests below read them.
    The client runs with `-I`: neither this directory, PYTHONPATH nor the user's site is on its
    path."""
    config = {"prompts": PROMPTS, "draft_lens": list(DRAFT_LENS), "max_new_tokens": MAX_NEW}
    client = subprocess.Popen([sys.executable, "-I", str(CLIENT), address, json.dumps(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    generating = {prompt: sled_generate(address, prompt, DRAFT_LENS[i])
                  for i, prompt in enumerate(PROMPTS)}
    try:
        out, err = client.communicate(timeout=CLIENT_S)
        assert client.returncode == 0, err[-4000:]
        references = {prompt: reference_of(process) for prompt, process in generating.items()}
    finally:
        for process in (client, *generating.values()):
            process.kill()
    return json.loads(out.strip().splitlines()[-1]), references


@pytest.fixture(scope="module")
def client(runs) -> dict:
    return runs[0]


@pytest.fixture(scope="module")
def references(runs) -> dict[str, dict]:
    return runs[1]


# --- the checks -----------------------------------------------------------------------------------

def test_fingerprint_example():
    """The worked example of the fingerprint in docs/protocol.md."""
    text = "0\ta\n1\tb\n"
    assert "sha256:" + hashlib.sha256(text.encode()).hexdigest() == \
        "sha256:a2b804b1740ccd2fc6e05d726ef2753cc62bc024e643716f632d0d01a2736de6"


def test_the_client_loads_no_project_code(client):
    assert client["project_modules"] == []


def test_the_client_checks_for_every_project_package():
    """Its list of the project's top-level names holds every package in the tree."""
    tree = ast.parse(CLIENT.read_text())
    listed = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and [getattr(t, "id", None) for t in node.targets] == ["PROJECT"])
    root = CLIENT.parent.parent
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert set(PROJECT) <= set(listed) and packages - {"tests"} <= set(listed), packages


def test_model_info_and_tokenizer(client):
    info, tokenizer = client["model_info"], client["tokenizer"]
    assert info["model_id"] == MODEL
    assert info["fingerprint"].startswith("sha256:") and len(info["fingerprint"]) == 71
    assert tokenizer["fingerprint"] == info["fingerprint"]      # computed by the client
    assert "tokenizer.json" in tokenizer["files"]
    assert tokenizer["vocab_size"] <= info["vocab_size"]
    assert info["max_draft_tokens"] == 8 and info["eos_token_ids"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_equals_sled_generate(client, references, prompt):
    """prompt_ids as tokenizer.encode(prompt) gives them, special tokens (BOS) included."""
    reference = references[prompt]
    outputs = [output for output in client["greedy"] if output["prompt"] == prompt]
    assert sorted(output["draft_len"] for output in outputs) == sorted(DRAFT_LENS)
    finish = "FINISH_REASON_" + reference["finish_reason"].upper()
    for output in outputs:
        assert output["prompt_ids"][0] == client["tokenizer"]["bos_id"]
        assert (output["token_ids"], output["finish_reason"]) == \
            (reference["token_ids"], finish), f"draft_len {output['draft_len']}"


def test_server_mode_streams_to_its_end(client):
    """GENERATION_MODE_SERVER: no drafts and no fingerprint needed; a verdict per step, rounds
    counted from 0; the server ends the stream with OK after the finishing verdict. A device
    that writes a draft ahead of its verdict gets the same output."""
    served = client["server_mode"]
    assert served["first"] == "opened" and served["code"] == "OK"
    assert served["rounds"] == list(range(len(served["rounds"])))
    assert served["finish_reason"] == "FINISH_REASON_LENGTH"
    assert served["token_ids"] == client["written_ahead"]


def test_refusals(client):
    assert client["refusals"] == {
        "wrong_fingerprint": ["FAILED_PRECONDITION", "REASON_TOKENIZER_MISMATCH"],
        "empty_fingerprint": ["INVALID_ARGUMENT", "REASON_TOKENIZER_MISMATCH"],
        "draft_before_open": ["FAILED_PRECONDITION", "REASON_NO_SESSION"],
        "wrong_round": ["FAILED_PRECONDITION", "REASON_WRONG_ROUND"],
        "draft_too_long": ["INVALID_ARGUMENT", "REASON_DRAFT_TOO_LONG"],
        "token_out_of_range": ["INVALID_ARGUMENT", "REASON_TOKEN_OUT_OF_RANGE"],
        "draft_after_finish": ["FAILED_PRECONDITION", "REASON_SESSION_FINISHED"],
        "empty_prompt": ["INVALID_ARGUMENT", "REASON_PROTOCOL"],
    }


def test_close_ends_the_stream(client):
    """Close (or a half-close) ends a session at any point; the call ends with OK."""
    assert client["close"] == {"first": "opened", "ended": True, "code": "OK"}
