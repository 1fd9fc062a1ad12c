"""What the device's chat template renderer (edge_client.chat_render) refuses: a jinja2 whose
sandbox can be escaped, transformers keywords sled does not implement, and a template that would
make a huge value. The same tokenizer is rendered as transformers renders it in
tests/test_device_tokenizer.py."""
from __future__ import annotations

import pytest

from edge_client.tokenizer import DeviceTokenizer


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    """The DeviceTokenizer of the tiny tokenizer's saved files."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save_pretrained(folder)
    return DeviceTokenizer.load(folder)

def test_a_jinja2_with_a_sandbox_escape_is_refused_in_one_line(tiny, monkeypatch):
    import jinja2

    device = tiny
    chat = [{"role": "user", "content": "q"}]
    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    with pytest.raises(RuntimeError, match=r'too old .* pip install "jinja2>=3.1.6"') as raised:
        device.apply_chat_template(chat, chat_template="{{ messages[0]['content'] }}",
                                   tokenize=False)
    assert "\n" not in str(raised.value)
    monkeypatch.setattr(jinja2, "__version__", "3.2.0")
    assert device.apply_chat_template(chat, chat_template="{{ messages[0]['content'] }}",
                                      tokenize=False) == "q"


@pytest.mark.parametrize("keyword", [
    {"continue_final_message": True}, {"return_dict": True}, {"return_tensors": "np"},
    {"padding": True}, {"truncation": True}, {"max_length": 8},
    {"return_assistant_tokens_mask": True}, {"tokenizer_kwargs": {"add_special_tokens": True}},
])
def test_transformers_keywords_sled_does_not_implement_are_refused(tiny, keyword):
    """Not handed to the template as a variable (which would quietly do nothing)."""
    device = tiny
    chat = [{"role": "user", "content": "q"}]
    with pytest.raises(TypeError, match=f"{next(iter(keyword))}=.* is not supported"):
        device.apply_chat_template(chat, chat_template="{{ messages[0]['content'] }}", **keyword)


def test_the_no_op_values_of_those_keywords_are_accepted(tiny):
    device = tiny
    chat = [{"role": "user", "content": "q"}]
    assert device.apply_chat_template(chat, chat_template="{{ messages[0]['content'] }}",
                                      tokenize=False, return_dict=False, padding=False,
                                      max_length=None, continue_final_message=False) == "q"


@pytest.mark.parametrize("template", ["{{ 'ab' * 1000000000 }}", "{{ 1000000000 * 'ab' }}",
                                      "{{ [0] * 10 ** 9 }}", "{{ 10 ** 100000000 }}"])
def test_a_template_cannot_make_a_huge_value(tiny, template):
    device = tiny
    with pytest.raises(Exception, match="more than 1048576 bytes"):
        device.apply_chat_template([{"role": "user", "content": "q"}], chat_template=template,
                                   tokenize=False)
    assert device.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                      chat_template="{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ 3 * 0.5 }}") == \
        "ababab10241.5"
