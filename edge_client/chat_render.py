"""Chat templates rendered with jinja2 alone, the way transformers' apply_chat_template renders
them: a sandboxed environment that cannot be changed from inside a template, blocks trimmed
(trim_blocks, lstrip_blocks), {% break %}/{% continue %}, and the names templates rely on:
raise_exception(message), strftime_now(format), a JSON `tojson` that escapes no HTML, `dict`
and a `namespace` that refuses underscore names. What a template sees is rebuilt from plain
JSON-like values (messages, tools, documents and every extra variable).

A template that raises (raise_exception, an undefined name used wrongly, a sandbox refusal)
raises jinja2's TemplateError (or the error jinja2 met): the caller decides what a person reads.
"""
from __future__ import annotations

import dataclasses
import json
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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
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
    tokens as strings, then the caller's extra names) are visible to the template as well."""
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise TypeError("documents must be dicts with 'title' and 'text' keys")
    return compiled(template).render(
        messages=template_messages(conversation), tools=plain(tools), documents=plain(documents),
        add_generation_prompt=add_generation_prompt, **plain(dict(variables or {})))
