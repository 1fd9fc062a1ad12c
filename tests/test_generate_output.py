"""`sled generate` prints its output once: a Ctrl-C that lands after the output has ended (while
the connection closes) neither prints it again nor changes the exit code or the finish reason."""
from __future__ import annotations

import argparse
import asyncio
import json
from types import SimpleNamespace

import pytest

from conftest import PROMPT_TEXTS, greedy_reference
from edge_client.connection import Connection
from edge_client.result import INTERRUPTED, SERVER_LOST, GenerationResult
from sled_cli import generate

MAX_NEW = 12


def flags(address: str, *more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(["--server", address, "--prompt", PROMPT_TEXTS[0], "--max-new-tokens",
                              str(MAX_NEW), *more])


@pytest.fixture
def slow_close(monkeypatch):
    """Connection.close that waits a while: `closing` is set once the generation is over and
    the connection is closing, so a Ctrl-C can land right there."""
    closing, close = asyncio.Event(), Connection.close

    async def slow(self) -> None:
        closing.set()
        try:
            await asyncio.sleep(30)
        finally:
            await close(self)

    monkeypatch.setattr(Connection, "close", slow)
    return closing


async def ctrl_c_while_closing(args, closing: asyncio.Event) -> int:
    """Run `sled generate` in-process and cancel it (what Ctrl-C does) as its connection closes."""
    running = asyncio.create_task(generate.run(args))
    await asyncio.wait_for(closing.wait(), 60)
    running.cancel()
    return await asyncio.wait_for(running, 30)


@pytest.mark.parametrize("drafter", ["ngram", "server"])
async def test_ctrl_c_after_the_end_prints_one_json_object(serve, models, tokenizer, slow_close,
                                                           tmp_path, monkeypatch, capsys, drafter):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    server = await serve(models["llama"])
    code = await ctrl_c_while_closing(flags(server.address, "--json", "--drafter", drafter), slow_close)
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out             # one object, not a second "interrupted" one
    body = json.loads(lines[0])
    assert body["finish_reason"] == "length"
    prompt = tokenizer(PROMPT_TEXTS[0]).input_ids
    assert body["token_ids"] == greedy_reference(models["llama"], prompt, MAX_NEW)
    assert "interrupted" not in err and "Traceback" not in err


async def test_ctrl_c_after_the_end_prints_the_text_once(serve, models, tokenizer, slow_close,
                                                         tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    server = await serve(models["llama"])
    code = await ctrl_c_while_closing(flags(server.address), slow_close)
    out, err = capsys.readouterr()
    prompt = tokenizer(PROMPT_TEXTS[0]).input_ids
    text = tokenizer.decode(greedy_reference(models["llama"], prompt, MAX_NEW))
    assert code == 0, err
    assert out == text + "\n"
    assert err.count("[length]") == 1 and "interrupted" not in err, err


class Session:
    """What Shown reads of a DeviceSession: its committed tokens, ended for a reason."""

    def __init__(self, token_ids: list[int]) -> None:
        self.result = GenerationResult(token_ids=token_ids)

    def partial(self, finish_reason: str) -> GenerationResult:
        self.result.finish_reason = finish_reason
        return self.result


@pytest.mark.parametrize("json_output", [True, False])
def test_an_interrupt_after_a_lost_server_keeps_exit_5_and_prints_nothing_more(tokenizer, capsys,
                                                                               json_output):
    args = SimpleNamespace(json=json_output, server="127.0.0.1:1", reconnect_s=2.0)
    shown = generate.Shown(args)
    shown.tokenizer, shown.session = tokenizer, Session([5, 6, 7])
    shown.stream([5, 6, 7])
    assert shown.end(SERVER_LOST, waited=True) == 5
    first = capsys.readouterr()
    assert shown.end(INTERRUPTED) == 5        # Ctrl-C while the connection closes
    assert capsys.readouterr() == ("", "")
    assert shown.session.result.finish_reason == SERVER_LOST
    if json_output:
        assert json.loads(first.out)["finish_reason"] == SERVER_LOST
    assert "3 tokens kept" in first.err and "interrupted" not in first.err


def test_an_interrupt_after_a_whole_generation_keeps_exit_0_and_its_finish_reason(tokenizer, capsys):
    shown = generate.Shown(SimpleNamespace(json=True, server="127.0.0.1:1", reconnect_s=2.0))
    shown.tokenizer = tokenizer
    shown.session = Session([5, 6])
    shown.session.result.finish_reason = "eos"
    assert shown.finish(shown.session.result) == 0
    first = capsys.readouterr().out
    assert shown.end(INTERRUPTED) == 0
    assert capsys.readouterr() == ("", "") and json.loads(first)["finish_reason"] == "eos"
