"""A chat template from a server renders within a budget: no value over MAX_RESULT characters
(a string doubled in a loop took a device to 1,000 MiB), at most MAX_OUTPUT characters in all,
and at most MAX_STEPS steps and RENDER_SECONDS; past it a TemplateBudgetError says so, quickly
and in bounded memory, and the local API answers 400 with that message while /health answers.

Each budget is checked where render_in_process renders, in a process bounded far below
RENDER_MEMORY and killed far later than HARD_SECONDS: what stops a hostile template there is its
own budget, never those two bounds that render() adds."""
from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time

import aiohttp
import pytest

from edge_client import chat_render
from edge_client.bounded_workers import BoundedWorkers, WorkerOverBudget
from edge_client.chat_render import MAX_OUTPUT, MAX_RESULT, TemplateBudgetError
from edge_client.tokenizer import DeviceTokenizer
from tests.test_device import make_device
from tests.test_openai_api import running_api

CHAT = [{"role": "user", "content": "q"}]
VALUES = dict(messages=chat_render.template_messages(CHAT), tools=None, documents=None,
              add_generation_prompt=False)
HELD = 16 * MAX_RESULT + MAX_OUTPUT       # what rendering a hostile template may hold at once
DOUBLING = ("{% set s = namespace(v='x') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}"
            "{% endfor %}{{ s.v }}")
HOSTILE = {
    "doubling with ~": DOUBLING,
    "doubling with +": ("{% set s = namespace(v='x') %}{% for i in range(40) %}{% set s.v = s.v + s.v %}"
                        "{% endfor %}{{ s.v }}"),
    "doubling with join": ("{% set s = namespace(v='x') %}{% for i in range(40) %}"
                           "{% set s.v = [s.v, s.v]|join %}{% endfor %}{{ s.v }}"),
    "doubling with str.join": ("{% set s = namespace(v='x') %}{% for i in range(40) %}"
                               "{% set s.v = ''.join([s.v, s.v]) %}{% endfor %}{{ s.v }}"),
    "doubling with format": ("{% set s = namespace(v='x') %}{% for i in range(40) %}"
                             "{% set s.v = '{0}{0}'.format(s.v) %}{% endfor %}{{ s.v }}"),
    "doubling with %": ("{% set s = namespace(v='x') %}{% for i in range(40) %}"
                        "{% set s.v = '%s%s' % (s.v, s.v) %}{% endfor %}{{ s.v }}"),
    "growing with replace": ("{% set s = namespace(v='xx') %}{% for i in range(40) %}"
                             "{% set s.v = s.v.replace('x', 'xx') %}{% endfor %}{{ s.v }}"),
    "growing with |replace": ("{% set s = namespace(v='xx') %}{% for i in range(40) %}"
                              "{% set s.v = s.v|replace('x', 'xx') %}{% endfor %}{{ s.v }}"),
    "growing with |indent": ("{% set s = namespace(v='x\\n' * 1000) %}{{ s.v|indent(999999) }}"),
    "a wide *": "{{ 'x' * 1000000000 }}",
    "a wide **": "{{ 10 ** 100000000 }}",
    "a wide ljust": "{{ 'x'.ljust(1000000000) }}",
    "a wide center": "{{ 'x'|center(1000000000) }}",
    "a wide %": "{{ '%01000000000d' % 1 }}",
    "a wide format": "{{ '{:>1000000000}'.format(1) }}",
    "one string many times in a list": ("{% set s = 'x' * 1000000 %}{{ [s, s, s, s, s, s, s, s]|join }}"),
    "one string many times, printed": ("{% set s = 'x' * 1000000 %}{{ [s, s, s, s, s, s, s, s] }}"),
    "a namespace printed many times": ("{% set n = namespace(v='x' * 1000000) %}{{ [n, n, n, n] }}"),
    "tojson with a wide indent": "{{ [[1, [2, [3]]]]|tojson(indent=900000) }}",
    "more text than the budget": "{% for i in range(10) %}{{ 'x' * 1000000 }}{% endfor %}",
    "loops without end": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loops over a long string": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}"
                                 "{% endfor %}{% endfor %}"),
}


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save_pretrained(folder)
    return DeviceTokenizer.load(folder)


@pytest.fixture(scope="module")
def small_renderer():
    """A rendering process that may hold HELD bytes at once and is killed at 10 s."""
    renderer = BoundedWorkers("edge_client.chat_render:render_request", memory=HELD, seconds=10.0,
                              size=1, max_reply=4 * MAX_OUTPUT + 1)
    yield renderer
    renderer.close()


def refusal(renderer: BoundedWorkers, template: str) -> dict:
    """The error render_in_process(TEMPLATE) ends with in RENDERER: {"name", "message"}."""
    try:
        reply = renderer.run(pickle.dumps((template, VALUES)))
    except WorkerOverBudget as over:
        pytest.fail(f"the rendering process's {over.bound} bound stopped it, not its budget")
    assert reply[:1] == chat_render.ERROR, f"it rendered {len(reply)} bytes"
    return json.loads(reply[1:])


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_stops_at_its_budget_quickly_in_bounded_memory(name, small_renderer):
    started = time.perf_counter()
    error = refusal(small_renderer, HOSTILE[name])
    took = time.perf_counter() - started
    assert error["name"] == "TemplateBudgetError", error
    assert "chat template" in error["message"] and len(error["message"]) < 200
    assert "\n" not in error["message"] and took < 3.0, f"{name}: {took:.1f} s"


def test_a_hostile_template_is_refused_through_render_too():
    with pytest.raises(TemplateBudgetError, match=f"more than {MAX_RESULT} bytes"):
        chat_render.render(DOUBLING, CHAT)


def test_templates_within_the_budget_render_as_before():
    big = "y" * (MAX_RESULT // 2)
    chat = [{"role": "user", "content": big}, {"role": "assistant", "content": "a\tb"}]
    template = ("{% for m in messages %}{{ '<' ~ m.role ~ '>' }}{{ m.content|trim }}"
                "{{ '{}|{}'.format(m.role, m.content|length) }}{{ '%s!' % m.role }}"
                "{{ m.content.replace('y', 'z')|length }}{{ [m.role, m.role]|join('+') }}"
                "{{ m.content.expandtabs(4)|length }}{% endfor %}{{ messages|tojson|length > 0 }}")
    text = chat_render.render(template, chat)
    assert text.startswith("<user>" + big) and text.endswith("<assistant>a\tbassistant|3assistant!3"
                                                             "assistant+assistant5True")
    most = "v" * MAX_RESULT
    assert chat_render.render("{% for i in range(4) %}{{ x }}{% endfor %}", CHAT,
                              variables={"x": most}) == most * 4 == "v" * MAX_OUTPUT


def test_the_budget_holds_in_every_thread_and_ends_with_its_rendering():
    seen = {}

    def render_twice():
        try:
            chat_render.render_in_process("{% for i in range(2000) %}{% for j in range(1000) %}"
                                          "{% endfor %}{% endfor %}", VALUES)      # 2,000,000 steps
        except TemplateBudgetError as refused:
            seen["refused"] = str(refused)
        seen["left"] = chat_render._BUDGET.get()                   # nothing left behind
        seen["next"] = chat_render.render_in_process("{% for i in range(5) %}{{ i }}{% endfor %}",
                                                     VALUES)

    thread = threading.Thread(target=render_twice)
    thread.start()
    thread.join()
    assert "to render (its budget)" in seen.get("refused", ""), seen
    assert seen["left"] is None and seen["next"] == "01234"


async def test_the_api_refuses_a_hostile_template_with_a_400_and_health_answers_meanwhile(
        serve, models, drafter_models, tiny):
    server = await serve(models["llama"])
    device = make_device([server.address], drafter_models["llama"], tiny)
    async with running_api(device) as (client, url):
        for template, says in ((DOUBLING, f"more than {MAX_RESULT} bytes"),
                               (HOSTILE["loops without end"], "to render (its budget)")):
            tiny.chat_template = template
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2})
            async with aiohttp.ClientSession() as http:
                started = time.perf_counter()
                chat = asyncio.ensure_future(http.post(url + "/v1/chat/completions", data=body,
                                                       headers={"Content-Type": "application/json"}))
                await asyncio.sleep(0.05)
                health_started = time.perf_counter()
                async with http.get(url + "/health") as health:
                    assert health.status == 200
                health_took = time.perf_counter() - health_started
                async with await chat as response:
                    answer = await response.json()
                took = time.perf_counter() - started
            assert response.status == 400, answer
            assert says in answer["error"]["message"] and answer["error"]["param"] == "messages"
            assert took < 3.0 and health_took < 0.5, (took, health_took)
