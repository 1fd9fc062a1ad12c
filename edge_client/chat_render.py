"""Chat templates rendered with jinja2 alone, the way transformers' apply_chat_template renders
them: a sandboxed environment that cannot be changed from inside a template, blocks trimmed
(trim_blocks, lstrip_blocks), {% break %}/{% continue %}, and the names templates rely on:
raise_exception(message), strftime_now(format), a JSON `tojson` that escapes no HTML, `dict`
and a `namespace` that refuses underscore names. What a template sees is rebuilt from plain
JSON-like values (messages, tools, documents and every extra variable).

A template that raises (raise_exception, an undefined name used wrongly, a sandbox refusal)
raises jinja2's TemplateError (or the error jinja2 met): the caller decides what a person reads.

A template may come from a server, so it is rendered only on a jinja2 whose sandbox has no known
escape (MIN_JINJA2 and later, else a RuntimeError of one line), and `*` and `**` in a template
refuse results over MAX_RESULT bytes (a string repeated a billion times, a number of a billion
digits) instead of taking the device's memory or CPU.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning may come under; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MIN_JINJA2 = (3, 1, 6)      # 3.1.5 and older: sandbox escapes through str.format and |attr
MAX_RESULT = 1 << 20        # bytes (or digits' bits / 8) one `*` or `**` may make in a template

# transformers' apply_chat_template keywords sled does not implement, each with the value that
# asks for nothing beyond what sled does (text, or a plain list of ids)
UNSUPPORTED = {"continue_final_message": False, "sanitize_control_tokens": False,
               "padding": False, "truncation": False, "max_length": None, "return_tensors": None,
               "return_dict": False, "return_assistant_tokens_mask": False,
               "tokenizer_kwargs": None}


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` bounded (MAX_RESULT)."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left, right):
        if _too_big(operator, left, right):
            raise jinja2.exceptions.SecurityError(
                f"a chat template's {operator!r} would make more than {MAX_RESULT} bytes")
        return super().call_binop(context, operator, left, right)


def _too_big(operator: str, left, right) -> bool:
    """Whether LEFT OPERATOR RIGHT would be over MAX_RESULT: a repeated sequence, or a power of
    an integer (its bits / 8)."""
    if operator == "*":
        sequence, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(times, int):
            return len(sequence) * times > MAX_RESULT
        return False
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return abs(left).bit_length() * right > 8 * MAX_RESULT
    return False


def check_jinja2(version: str | None = None) -> None:
    """A RuntimeError of one line when jinja2 (VERSION, else the installed one) is older than
    MIN_JINJA2: its sandbox can be escaped, so it must not render a template from a server."""
    version = version or jinja2.__version__
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:3])
    if found < MIN_JINJA2:
        need = ".".join(map(str, MIN_JINJA2))
        raise RuntimeError(f"jinja2 {version} is too old to render a chat template safely (its "
                           f"sandbox can be escaped): pip install \"jinja2>={need}\"")


def check_keywords(keywords: Mapping[str, Any]) -> None:
    """TypeError for a transformers apply_chat_template keyword sled does not implement (given a
    value that asks for something), rather than handing it to the template as a variable."""
    for name, value in keywords.items():
        if name in UNSUPPORTED and value != UNSUPPORTED[name]:
            raise TypeError(f"apply_chat_template: {name}={value!r} is not supported here "
                            f"(only {name}={UNSUPPORTED[name]!r})")


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks an assistant reply (for training masks);
    rendering writes its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` inside a template, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing attribute names that start with an underscore."""

    def __init__(*args, **kwargs):     # jinja2's own signature: `self` may be an attribute name
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the namespace attribute {name!r} (it starts with '_')")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    """The template compiled once (a chat template is rendered for every request)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(template)


def plain(value: Any) -> Any:
    """VALUE rebuilt from JSON-like types (str, int, float, bool, None, dict, list, tuple), so a
    template reaches no method of a richer object; anything else becomes "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, np.generic):
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def template_messages(conversation) -> list[dict]:
    """The messages a template sees: keys whose value is None dropped (an OpenAI-style
    content=None), plain values, and a message's reasoning under each name templates read."""
    messages = plain([{key: value for key, value in message.items() if value is not None}
                      for message in conversation])
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        reasoning = next((message[key] for key in REASONING_FIELDS
                          if message.get(key) is not None), None)
        if reasoning is not None:
            messages[i] = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return messages


def render(template: str, conversation, add_generation_prompt: bool = False, tools=None,
           documents=None, variables: Mapping[str, Any] | None = None) -> str:
    """The conversation written out by the template. `variables` (the tokenizer's special
    tokens as strings, then the caller's extra names) are visible to the template as well; a
    transformers keyword sled does not implement among them is a TypeError (check_keywords)."""
    check_jinja2()
    check_keywords(variables or {})
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise TypeError("documents must be dicts with 'title' and 'text' keys")
    return compiled(template).render(
        messages=template_messages(conversation), tools=plain(tools), documents=plain(documents),
        add_generation_prompt=add_generation_prompt, **plain(dict(variables or {})))
