"""Stop strings are bounded as OpenAI bounds them (at most 4, each at most 256 characters: a 400 KB
one took 11.5 s of the device's event loop for 8 tokens) and are matched in time linear in their
length, cutting the output at the first one even across token boundaries."""
from __future__ import annotations

import json
import random
import time

import pytest

from edge_client.stop_strings import MAX_STOP_CHARS, MAX_STOPS, StopStrings, check_stops
from edge_client.text import OutputText
from tests.conftest import PROMPT_TEXTS
from tests.test_openai_api import NO_EOS, api, post  # noqa: F401 (api: a fixture)

COMPLETION = {"model": "tiny", "prompt": PROMPT_TEXTS[0], "max_tokens": 8, "temperature": 0, **NO_EOS}


class PieceTokenizer:
    """Token id i is the text PIECES[i]; decoding re-joins the pieces (cached for a growing list,
    as a real decode costs the output's length)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.ids: list[int] = []
        self.text = ""

    def decode(self, ids: list[int], **_) -> str:
        if ids[:len(self.ids)] != self.ids or len(ids) != len(self.ids) + 1:
            self.ids, self.text = [], "".join(self.pieces[i] for i in ids[:-1])
        self.ids, self.text = list(ids), self.text + self.pieces[ids[-1]]
        return self.text


def run(pieces: list[str], stops: list[str]) -> tuple[list[str], OutputText]:
    """Each piece one token: what take() handed out after each, and the output."""
    output = OutputText(PieceTokenizer(pieces), stops)
    sent = []
    for token in range(len(pieces)):
        output.add([token])
        sent.append(output.take())
        if output.stopped:
            break
    sent.append(output.take(final=True))
    return sent, output


# -- matching -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pieces, stops, want", [
    (["ab", "c\n", "\nd"], ["\n\n"], "abc"),                 # across two tokens
    (["x", "EN", "", "D", "y"], ["END"], "x"),                # across three, an empty one between
    (["ab", "ab", "ab", "c"], ["ababc"], "a" "b"),            # a stop that overlaps itself
    (["he", "llo w", "orld"], ["o w", "hello"], ""),          # the earliest one wins
    (["abc", "def"], ["cd", "abcdefg"], "ab"),
    (["aa", "ab"], ["b"], "aaa"),
])
def test_the_output_is_cut_at_the_first_stop_across_tokens(pieces, stops, want):
    sent, output = run(pieces, stops)
    assert "".join(sent) == want and output.text == want and output.stopped
    for handed in sent:                       # nothing of a stop was handed out before its end
        assert not any(stop and stop in handed for stop in stops)


def test_text_that_may_begin_a_stop_waits_and_goes_out_when_it_does_not():
    sent, output = run(["a", "E", "N", "x", "b"], ["END"])
    assert sent == ["a", "", "", "ENx", "b", ""] and not output.stopped
    sent, output = run(["a", "b"], ["", ""])        # empty stops are no stops
    assert sent == ["a", "b", ""] and not output.stopped


def reference_first(text: str, stops: list[str], start: int) -> int:
    found = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(found, default=-1)


def reference_held(text: str, stops: list[str]) -> int:
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_first_and_held_agree_with_the_plain_definitions():
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 8)))
                 for _ in range(rng.randrange(1, 4))]
        start = rng.randrange(0, len(text) + 1)
        matcher = StopStrings(stops)
        assert matcher.first(text, start) == reference_first(text, stops, start), (text, stops, start)
        assert matcher.held(text) == reference_held(text, stops), (text, stops)


def test_a_long_stop_costs_its_length_per_token_not_its_square():
    """A 40,000-character stop that the text keeps almost completing: the plain check (every
    prefix of the stop against the text's end) takes seconds for 120 tokens; this does not."""
    stop = "a" * 40_000 + "b"
    pieces = ["a" * 400] * 120 + ["b", "tail"]
    started = time.perf_counter()
    sent, output = run(pieces, [stop])
    took = time.perf_counter() - started
    assert output.stopped and output.text == "a" * (400 * 120 - 40_000)
    assert "".join(sent) == output.text
    assert took < 2.0, f"{took:.2f} s"


def test_a_long_output_with_the_most_stops_allowed_is_quick():
    stops = [("xyz" * 100)[:MAX_STOP_CHARS - i] for i in range(MAX_STOPS)]
    pieces = ["xy"] * 5000 + ["z" + "xyz" * 90, stops[3][-30:]]
    started = time.perf_counter()
    _, output = run(pieces, stops)
    assert time.perf_counter() - started < 2.0
    assert output.stopped and output.text == "xy" * 4999    # the last "xy" begins stops[3]


# -- bounds -------------------------------------------------------------------------------------
def test_check_stops_names_the_bound_passed():
    check_stops(["x" * MAX_STOP_CHARS] * MAX_STOPS)
    with pytest.raises(ValueError, match=f"at most {MAX_STOPS} stop strings"):
        check_stops(["a"] * (MAX_STOPS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        check_stops(["x" * (MAX_STOP_CHARS + 1)])


async def test_the_api_refuses_a_huge_stop_string_and_too_many_at_once(api):
    client, url, _ = api
    for stop, says in (("x" * 400_000, "at most 256 characters"), (["x" * 257], "at most 256 characters"),
                       (["a", "b", "c", "d", "e"], "at most 4 stop strings")):
        started = time.perf_counter()
        status, _, answer = await post(url, "/v1/completions", json.dumps({**COMPLETION, "stop": stop}))
        assert status == 400 and answer["error"]["param"] == "stop", answer
        assert says in answer["error"]["message"] and len(answer["error"]["message"]) < 200
        assert time.perf_counter() - started < 1.0
    done = await client.completions.create(**{k: v for k, v in COMPLETION.items() if k not in NO_EOS},
                                           stop=["z" * 256, "never", "neither", "nor"], extra_body=NO_EOS)
    assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
    status, _, answer = await post(url, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["s"] * 5}))
    assert status == 400 and "at most 4 stop strings" in answer["error"]["message"]
