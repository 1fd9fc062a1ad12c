"""A chat template is bounded in all it holds at once, not only value by value: it renders in a
process of its own whose address space is bounded (RENDER_MEMORY), so a template that keeps
many 1 MiB values alive (a list grown in a loop, a dict, a filter's list, a macro's or a block
set's text: most took the serving process to 1.5 or 2 GiB when it rendered them itself) is
refused within its budget while the serving process grows by at most 64 MiB, and the local API
answers 400. A step that runs long is cut when its process is killed, and /health answers
meanwhile. Templates within the budget render exactly as in this process. The local API renders
on threads of its own, so renderings that run long or wait for a process leave the default
executor, where drafts are made, free; it renders a template's turn end once per tokenizer."""
from __future__ import annotations

import asyncio
import copy
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import aiohttp
import jinja2
import pytest

from edge_client import chat_render, openai_api
from edge_client.chat_render import HARD_SECONDS, RENDER_MEMORY, RENDERERS, TemplateBudgetError
from edge_client.tokenizer import DeviceTokenizer
from sled.chat_templates import GEMMA3, turn_end_ids
from tests.conftest import status_kib
from tests.test_device import make_device
from tests.test_openai_api import CHAT_TEMPLATE, running_api

CHAT = [{"role": "user", "content": "q"}]
GROWTH_MIB = 64          # what the serving process may gain while a hostile template renders
KEPT = ("{% set ns = namespace(a=[]) %}{% for i in range(2000) %}{% set ns.a = ns.a + [VALUE] %}"
        "{% endfor %}{{ ns.a|length }}")
HOSTILE = {
    "a list appended to": ('{% set ns = namespace(a=[]) %}{% for i in range(2000) %}'
                           '{% set _ = ns.a.append("x" * 1048576) %}{% endfor %}'),
    "a list grown by +": KEPT.replace("VALUE", "'x' * 1048576"),
    "strings joined by ~": KEPT.replace("VALUE", "('x' * 524288) ~ ('y' * 524288)"),
    "strings joined by +": KEPT.replace("VALUE", "('x' * 524288) + ('y' * 524288)"),
    "strings joined by |join": KEPT.replace("VALUE", "(['x' * 1024] * 1024)|join"),
    "lists multiplied": KEPT.replace("VALUE", "[i] * 1048576"),
    "a dict built": ("{% set ns = namespace(d={}) %}{% for i in range(2000) %}"
                     "{% set ns.d = dict(ns.d, **{('k' ~ i): 'x' * 1048576}) %}{% endfor %}"),
    "a filter's list": "{{ range(2000)|map('center', 1048576)|list|length }}",
    "a macro's text": ("{% macro m(x) %}{% for i in range(1500) %}{{ x }}{% endfor %}{% endmacro %}"
                       "{{ m('x' * 1048576)|length }}"),
    "a block set": ("{% set s = 'x' * 1048576 %}{% set y %}{% for i in range(1500) %}{{ s }}"
                    "{% endfor %}{% endset %}{{ y|length }}"),
}
# One step that runs long: sum() of lists copies all it has summed at every turn (minutes).
LONG_STEP = "{{ ([[1]] * 200000)|sum(start=[])|length }}"
# A template whose turn end (two messages) runs long; a one-message chat prompt renders at once.
LONG_TURN_END = "{% if messages|length > 1 %}" + LONG_STEP + "{% endif %}" + CHAT_TEMPLATE
# A template that ends a turn with a special token (</s>).
SPECIAL_TURN_END = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")


@contextmanager
def serving_growth():
    """{"mib": what this process's peak resident memory grew to above its resident memory at
    the start}, filled in at the end (the peak is reset first: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pytest.skip("this kernel cannot reset a process's peak resident memory")
    before, grown = status_kib("VmRSS"), {}
    yield grown
    grown["mib"] = (status_kib("VmHWM") - before) / 1024


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save_pretrained(folder)
    return DeviceTokenizer.load(folder)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_template_that_keeps_too_much_alive_is_refused_and_the_daemon_does_not_grow(name):
    with serving_growth() as grown:
        started = time.perf_counter()
        with pytest.raises(jinja2.exceptions.SecurityError) as refused:
            chat_render.render(HOSTILE[name], CHAT)
        took = time.perf_counter() - started
    message = str(refused.value)
    assert len(message) < 200 and "\n" not in message
    assert took < HARD_SECONDS + 3, f"{name}: {took:.1f} s"
    assert grown["mib"] < GROWTH_MIB, f"{name}: {grown['mib']:.0f} MiB"
    if name != "a list appended to":                     # the sandbox refuses list.append
        assert isinstance(refused.value, TemplateBudgetError), message


def test_memory_is_what_stops_them():
    with pytest.raises(TemplateBudgetError, match=f"more than {RENDER_MEMORY >> 20} MiB at once"):
        chat_render.render(HOSTILE["a macro's text"], CHAT)
    with pytest.raises(TemplateBudgetError, match=f"more than {RENDER_MEMORY >> 20} MiB at once"):
        chat_render.render(HOSTILE["lists multiplied"], CHAT)


def test_a_step_that_runs_long_is_cut_when_its_process_is_killed():
    started = time.perf_counter()
    with pytest.raises(TemplateBudgetError, match="takes more than 1 s to render"):
        chat_render.render(LONG_STEP, CHAT)
    took = time.perf_counter() - started
    assert HARD_SECONDS - 0.5 < took < HARD_SECONDS + 3, took
    assert chat_render.render("{{ 6 * 7 }}", CHAT) == "42"


@pytest.mark.parametrize("template", [GEMMA3, CHAT_TEMPLATE, (
    "{% for m in messages %}{{ '<' ~ m.role ~ '>' }}{{ m.content|trim }}{{ m.get('n', 0) }}"
    "{{ '{}|{}'.format(m.role, m.content|length) }}{% endfor %}{{ messages|tojson }}{{ pair }}"
    "{{ keyed }}{{ tools|tojson }}{{ documents }}{{ add_generation_prompt }}")])
def test_templates_within_the_budget_render_as_in_this_process(template):
    chat = [{"role": "system", "content": "Be brief. ünïcødé 🙂 \ud800"},
            {"role": "user", "content": "  Hi  ", "n": 1.5},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "x" * 100_000}]
    variables = {"bos_token": "<bos>", "pair": ("a", 1), "keyed": {1: None, "b": [True, 2.0]}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "<b>&"}}}]
    documents = [{"title": "t", "text": "d"}]
    for prompt in (True, False):
        got = chat_render.render(template, chat, prompt, tools, documents, variables)
        values = dict(messages=chat_render.template_messages(chat), tools=tools,
                      documents=documents, add_generation_prompt=prompt, **variables)
        assert got == chat_render.render_in_process(template, values)
    assert chat_render.render(GEMMA3, chat[1:3], True, variables=variables) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>model\n")


def test_a_templates_own_errors_come_back_by_name():
    with pytest.raises(jinja2.exceptions.TemplateError, match="^roles must alternate$"):
        chat_render.render("{{ raise_exception('roles must alternate') }}", CHAT)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="has no attribute"):
        chat_render.render("{{ messages.nothing.deeper }}", CHAT)
    with pytest.raises(jinja2.exceptions.TemplateError, match="^ZeroDivisionError: division by zero$"):
        chat_render.render("{{ 1 / 0 }}", CHAT)
    with pytest.raises(jinja2.exceptions.TemplateError) as long:
        chat_render.render("{{ raise_exception('x' * 1000000) }}", CHAT)
    assert len(str(long.value)) == chat_render.MAX_MESSAGE


async def test_the_api_answers_400_to_each_and_the_daemon_does_not_grow(serve, models,
                                                                         drafter_models, tiny):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tiny)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with running_api(device) as (_, url), aiohttp.ClientSession() as http:
        tiny.chat_template = CHAT_TEMPLATE                # workers started, the API warmed
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
        answers = {}
        with serving_growth() as grown:
            for name, template in HOSTILE.items():
                tiny.chat_template = template
                async with http.post(url + "/v1/chat/completions", json=body) as response:
                    answers[name] = response.status, (await response.json())["error"]
        tiny.chat_template = LONG_STEP                    # the GIL held for minutes in one process
        started = time.perf_counter()
        chat = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body))
        await asyncio.sleep(0.2)
        async with http.get(url + "/health") as health:
            health_took = time.perf_counter() - started - 0.2     # counts a rendering the loop ran
            assert health.status == 200
        async with await chat as response:
            answers["one long step"] = response.status, (await response.json())["error"]
        took = time.perf_counter() - started
        tiny.chat_template = CHAT_TEMPLATE
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
    # had /health waited for the rendering (HARD_SECONDS), it would have taken 1.8 s and more
    assert health_took < 1.5 and took < HARD_SECONDS + 3, (health_took, took)
    for name, (status, error) in answers.items():
        assert status == 400 and error["param"] == "messages", (name, error)
        assert error["message"].startswith("the chat template cannot format these messages: ")
    assert grown["mib"] < GROWTH_MIB, f"{grown['mib']:.0f} MiB"


@pytest.mark.parametrize("template, status", [(LONG_STEP, 400), (LONG_TURN_END, 200)],
                         ids=["chat prompt", "turn end"])
async def test_renderings_leave_the_default_executor_to_drafting(template, status, serve, models,
                                                                 drafter_models, tiny, monkeypatch):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tiny)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # a default executor of as many threads as chats: renderings there would take all of it (set
    # where asyncio keeps it, so that the suite's own comes back after)
    with ThreadPoolExecutor(RENDERERS) as drafting, monkeypatch.context() as patch:
        patch.setattr(asyncio.get_running_loop(), "_default_executor", drafting)
        async with running_api(device) as (_, url), aiohttp.ClientSession() as http:
            tiny.chat_template = template                 # its long renderings killed at HARD_SECONDS
            chats = [asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body))
                     for _ in range(RENDERERS)]
            await asyncio.sleep(0.3)
            started = time.perf_counter()
            await asyncio.to_thread(time.sleep, 0)        # as a drafting call does
            drafting_waited = time.perf_counter() - started
            statuses = []
            for chat in chats:
                async with await chat as response:
                    statuses.append(response.status)
            tiny.chat_template = CHAT_TEMPLATE
    # on the default executor, the call would have waited for a rendering: 1.7 s and more
    assert drafting_waited < 1.0 and statuses == [status] * RENDERERS, (drafting_waited, statuses)


async def test_a_templates_turn_end_is_rendered_once_per_tokenizer(serve, models, drafter_models,
                                                                   tiny, monkeypatch):
    asked = []

    def counted(tokenizer, template):
        asked.append(template)
        return turn_end_ids(tokenizer, template)

    monkeypatch.setattr(openai_api, "turn_end_ids", counted)
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tiny)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with running_api(device) as (_, url), aiohttp.ClientSession() as http:
        for template in (SPECIAL_TURN_END, SPECIAL_TURN_END, CHAT_TEMPLATE, CHAT_TEMPLATE,
                         SPECIAL_TURN_END):
            tiny.chat_template = template
            async with http.post(url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
        tiny.chat_template = CHAT_TEMPLATE
    other = copy.copy(tiny)                               # the same files, another tokenizer
    assert await openai_api.chat_turn_end(other, SPECIAL_TURN_END) == [tiny.eos_token_id]
    # CHAT_TEMPLATE writes no special token there: no ids, asked each time
    assert asked == [SPECIAL_TURN_END, CHAT_TEMPLATE, CHAT_TEMPLATE, SPECIAL_TURN_END]
