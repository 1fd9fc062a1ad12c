"""Chat templates rendered with jinja2 alone, the way transformers' apply_chat_template renders
them: a sandboxed environment that cannot be changed from inside a template, blocks trimmed
(trim_blocks, lstrip_blocks), {% break %}/{% continue %}, and the names templates rely on:
raise_exception(message), strftime_now(format), a JSON `tojson` that escapes no HTML, `dict`
and a `namespace` that refuses underscore names. What a template sees is rebuilt from plain
JSON-like values (messages, tools, documents and every extra variable).

A template that raises (raise_exception, an undefined name used wrongly, a sandbox refusal)
raises jinja2's TemplateError (a TypeError or ValueError it met as itself, any other error as a
TemplateError that names it): the caller decides what a person reads.

A template may come from a server, so it is rendered only on a jinja2 whose sandbox has no known
escape (MIN_JINJA2 and later, else a RuntimeError of one line), and within a budget instead of
taking the device's memory or CPU (TemplateBudgetError, a SecurityError, past any of these):
- no value a template makes is over MAX_RESULT characters: `*`, `**`, `~`, `+`, `%`, string
  methods (replace, join, format, ljust, ...) and filters (join, replace, indent, format,
  tojson, ...) are checked before they build a value where they can grow one (a string doubled
  forty times, repeated a billion times, a number of a billion digits), the rest after;
- the whole text is at most MAX_OUTPUT characters;
- one rendering takes at most MAX_STEPS steps (loop turns, calls, lookups, operations) and
  RENDER_SECONDS of wall time, checked at every step;
- all it holds at once (its values, however built: a list grown in a loop, a macro's text, a
  block set, a filter's list; the conversation it is given; its text) is at most RENDER_MEMORY
  bytes: render() renders in a process of its own (edge_client.bounded_workers, up to RENDERERS
  at once) whose address space is bounded, killed at HARD_SECONDS when one step runs long, so
  that neither reaches the daemon; what comes back is the text, or an error's name and message.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import pickle
import re
import string
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge_client.bounded_workers import BoundedWorkers, WorkerOverBudget

# The names a message's reasoning may come under; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MIN_JINJA2 = (3, 1, 6)      # 3.1.5 and older: sandbox escapes through str.format and |attr
MAX_RESULT = 1 << 20        # characters (or digits' bits / 8) one value a template makes may have
MAX_OUTPUT = 4 << 20        # characters one rendering may write
MAX_STEPS = 1_000_000       # loop turns, calls, lookups and operations of one rendering
RENDER_SECONDS = 1.0        # wall time of one rendering
RENDER_MEMORY = 128 << 20   # bytes one rendering may hold at once, beyond its process's start
HARD_SECONDS = RENDER_SECONDS + 1.0   # then its process is killed (one step that runs long)
RENDERERS = 2               # rendering processes: renderings at once
MAX_MESSAGE = 4096          # characters of a template's error that come back

# transformers' apply_chat_template keywords sled does not implement, each with the value that
# asks for nothing beyond what sled does (text, or a plain list of ids)
UNSUPPORTED = {"continue_final_message": False, "sanitize_control_tokens": False,
               "padding": False, "truncation": False, "max_length": None, "return_tensors": None,
               "return_dict": False, "return_assistant_tokens_mask": False,
               "tokenizer_kwargs": None}


class TemplateBudgetError(jinja2.exceptions.SecurityError):
    """A template past its budget: a value too large, too much text, too many steps or seconds."""


class _Budget:
    """What is left of one rendering's steps and time."""
    __slots__ = ("steps", "deadline")

    def __init__(self) -> None:
        self.steps = MAX_STEPS
        self.deadline = time.monotonic() + RENDER_SECONDS

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateBudgetError(f"the chat template takes more than {MAX_STEPS} steps to render "
                                      f"(its budget): it loops without end or is hostile")
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the chat template takes more than {RENDER_SECONDS:g} s to "
                                      f"render (its budget): it loops without end or is hostile")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget",
                                                                         default=None)


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_RESULT:
        raise TemplateBudgetError(f"a chat template's {what} would make more than {MAX_RESULT} bytes")


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox within a budget: every value bounded (MAX_RESULT), every step counted."""
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator: str, left, right):
        _step()
        if _too_big(operator, left, right):
            raise TemplateBudgetError(
                f"a chat template's {operator!r} would make more than {MAX_RESULT} bytes")
        if operator == "%" and isinstance(left, str):
            _refuse_over(_formatted_size(left, right), "'%'")
        return _checked_result(super().call_binop(context, operator, left, right), repr(operator))

    def getattr(self, obj, attribute):
        _step()
        return _checked_method(obj, attribute, super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        _step()
        return _checked_method(obj, argument, super().getitem(obj, argument))

    def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 (jinja2's own signature)
        _step()
        _refuse_wide(args, kwargs, "call")
        return _checked_result(ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs),
                               "call")


def _too_big(operator: str, left, right) -> bool:
    """Whether LEFT OPERATOR RIGHT would be over MAX_RESULT: a repeated or joined sequence, or a
    power of an integer (its bits / 8)."""
    if operator == "+":
        sized = (str, bytes, list, tuple)
        return isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > MAX_RESULT
    if operator == "%":
        return False
    if operator == "*":
        sequence, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(times, int):
            return len(sequence) * times > MAX_RESULT
        return False
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return abs(left).bit_length() * right > 8 * MAX_RESULT
    return False


def _text_size(value, indent: int = 0) -> int:
    """About how many characters str(VALUE) has (its JSON with INDENT, when given): counting
    stops past MAX_RESULT."""
    size, stack = 0, [(value, 1)]
    while stack and size <= MAX_RESULT:
        item, depth = stack.pop()
        if isinstance(item, jinja2.utils.Namespace):
            item = item._Namespace__attrs                     # noqa: SLF001 (its repr shows them)
        if isinstance(item, (str, bytes)):
            size += len(item) + (2 if depth > 1 else 0)     # quoted inside a container
        elif isinstance(item, int):
            size += item.bit_length() // 3 + 2
        elif isinstance(item, Mapping):
            size += 2 + len(item) * (indent * depth + 4)
            stack.extend((part, depth + 1) for pair in item.items() for part in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            size += 2 + len(item) * (indent * depth + 2)
            stack.extend((part, depth + 1) for part in item)
        else:
            size += 32
    return size


def _formatted_size(template: str, args, kwargs: Mapping | None = None) -> int:
    """At most how long TEMPLATE % ARGS or TEMPLATE.format(*ARGS, **KWARGS) is: its text, every
    width or precision it names, and each value as often as a field can take it."""
    widths = sum(int(digits) for digits in re.findall(r"\d+", template))
    if kwargs is None:                                   # printf-style: one value per field
        values = args if isinstance(args, tuple) else (args,)
        if isinstance(args, Mapping):
            largest = max((_text_size(v) for v in args.values()), default=0)
            return len(template) + widths + template.count("%(") * largest
        return len(template) + widths + sum(_text_size(v) for v in values)
    sizes = [_text_size(v) for v in args]
    named = {key: _text_size(v) for key, v in kwargs.items()}
    largest = max([*sizes, *named.values()], default=0)
    size, auto = len(template) + widths, 0
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError:
        return size                                      # format() refuses it anyway
    for field in fields:
        base = re.split(r"[.\[]", field, maxsplit=1)[0]
        if base == "":
            base, auto = str(auto), auto + 1
        size += sizes[int(base)] if base.isdigit() and int(base) < len(sizes) else named.get(base, largest)
    return size


def _refuse_wide(args, kwargs, what: str) -> None:
    """A number over MAX_RESULT given to a call or filter (a width, a count) is refused."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RESULT:
            raise TemplateBudgetError(f"a chat template's {what} was given {value}: more than "
                                      f"{MAX_RESULT}")


def _checked_result(value, what: str):
    if isinstance(value, (str, bytes, list, tuple, dict)):
        _refuse_over(len(value), what)
    return value


def _checked_method(obj, name, value):
    """A string's method, checked before it grows the string (others as they are)."""
    if isinstance(obj, str) and callable(value):
        return functools.partial(_string_method, obj, name, value)
    return value


def _string_method(text: str, name, method, *args, **kwargs):
    _refuse_over(_method_size(text, name, args, kwargs), f"str.{name}")
    return method(*args, **kwargs)


def _method_size(text: str, name, args: tuple, kwargs: dict) -> int:
    """At most how long text.NAME(*ARGS, **KWARGS) is, for the methods that grow a string."""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return _replaced_size(text, args[0], args[1])
    if name == "join" and args:
        return _joined_size(text, args[0])
    if name in ("format", "format_map"):
        return _formatted_size(text, args if name == "format" else (),
                               kwargs if name == "format" else (args[0] if args else {}))
    if name == "expandtabs":
        width = (args or (kwargs.get("tabsize", 8),))[0]
        return len(text) + text.count("\t") * (width if isinstance(width, int) else 8)
    if name == "translate" and args and isinstance(args[0], Mapping):
        return len(text) * (1 + max((_text_size(v) for v in args[0].values()), default=0))
    return len(text) + sum(_text_size(a) for a in (*args, *kwargs.values()))


def _replaced_size(text: str, old: str, new: str) -> int:
    found = text.count(old) if old else len(text) + 1
    return len(text) + found * max(0, len(new) - len(old))


def _joined_size(separator: str, items) -> int:
    items = items if isinstance(items, (list, tuple, str)) else []
    return sum(_text_size(item) for item in items) + len(separator) * len(items)


# Filters that can make a value far larger than what they are given: how large, at most.
def _filter_size(name: str, args: tuple, kwargs: dict) -> int:
    value = args[0] if args else ""
    if name == "join":
        separator = args[1] if len(args) > 1 else kwargs.get("d", "")
        return _joined_size(str(separator), list(value) if isinstance(value, Iterable) else [])
    if name == "replace" and len(args) >= 3:
        return _replaced_size(str(value), str(args[1]), str(args[2]))
    if name == "format":
        return _formatted_size(str(value), args[1:] or kwargs)
    if name == "indent":
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(str(value)) + (str(value).count("\n") + 1) * pad
    if name == "wordwrap":
        width = args[1] if len(args) > 1 else kwargs.get("width", 79)
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring") or "\n"
        return len(str(value)) * (1 + len(str(wrap)) // max(1, width if isinstance(width, int) else 1))
    if name == "tojson":
        indent = args[1] if len(args) > 1 else kwargs.get("indent")
        return _text_size(value, indent if isinstance(indent, int) else 0)
    if name in ("string", "pprint", "center", "urlize", "xmlattr"):
        return _text_size(value)
    return 0


def _checked_filter(name: str, function):
    """FILTER within the budget: a step, its growth checked before, its result after."""
    @functools.wraps(function)
    def checked(*args, **kwargs):
        _step()
        given = args[1:] if hasattr(function, "jinja_pass_arg") else args
        _refuse_wide(given, kwargs, f"|{name}")
        if name == "join" and given and not isinstance(given[0], (list, tuple, str)):
            given = (list(given[0]), *given[1:])       # an iterator is read once: keep the list
            args = (*args[:len(args) - len(given)], *given)
        _refuse_over(_filter_size(name, given, kwargs), f"|{name}")
        return _checked_result(function(*args, **kwargs), f"|{name}")
    return checked


class _BudgetTags(jinja2.ext.Extension):
    """What the template's loops and `~` are rewritten to call (_within_budget): each loop turn
    is a step, and a `~` is checked before it joins its parts."""

    def turns(self, iterable):
        for item in iterable:
            _step()
            yield item

    def concat(self, *parts) -> str:
        _refuse_over(sum(_text_size(part) for part in parts), "'~'")
        return "".join(map(str, parts))


class _WithinBudget(jinja2.visitor.NodeTransformer):
    """Every `for` iterates through _BudgetTags.turns, every `~` is _BudgetTags.concat."""

    def __init__(self, tags: _BudgetTags) -> None:
        self.tags = tags

    def visit_For(self, node: jinja2.nodes.For):
        node = self.generic_visit(node)
        node.iter = self._call("turns", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat):
        node = self.generic_visit(node)
        return self._call("concat", node.nodes, node.lineno)

    def _call(self, method: str, args: list, lineno: int) -> jinja2.nodes.Call:
        return jinja2.nodes.Call(self.tags.attr(method, lineno=lineno), args, [], None, None,
                                 lineno=lineno)


def _finalize(value):
    """Each `{{ ... }}` is a step and is bounded before it becomes text."""
    _step()
    _refuse_over(_text_size(value), "'{{ }}'")
    return value


def _bounded_output(chunks) -> str:
    """The rendered text, refused once past MAX_OUTPUT characters."""
    parts, written = [], 0
    for chunk in chunks:
        written += len(chunk)
        if written > MAX_OUTPUT:
            raise TemplateBudgetError(f"the chat template writes more than {MAX_OUTPUT} characters "
                                      f"(its budget)")
        parts.append(chunk)
    return "".join(parts)


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
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols, _BudgetTags])
    env.filters["tojson"] = _tojson
    env.filters.update({name: _checked_filter(name, f) for name, f in env.filters.items()})
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    tree = _WithinBudget(env.extensions[_BudgetTags.identifier]).visit(env.parse(template))
    return env.from_string(tree)


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
    numpy = sys.modules.get("numpy")          # a numpy value exists only once numpy is imported
    if numpy is not None and isinstance(value, numpy.generic):
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
    """The conversation written out by the template, in a rendering process. `variables` (the
    tokenizer's special tokens as strings, then the caller's extra names) are visible to the
    template as well; a transformers keyword sled does not implement among them is a TypeError
    (check_keywords)."""
    check_jinja2()
    check_keywords(variables or {})
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise TypeError("documents must be dicts with 'title' and 'text' keys")
    values = dict(messages=template_messages(conversation), tools=plain(tools),
                  documents=plain(documents), add_generation_prompt=add_generation_prompt,
                  **plain(dict(variables or {})))
    try:
        reply = _RENDERERS.run(pickle.dumps((template, values), pickle.HIGHEST_PROTOCOL))
    except WorkerOverBudget as over:
        raise TemplateBudgetError(_OVER[over.bound]) from None
    return _text_or_error(reply)


def render_in_process(template: str, values: Mapping[str, Any]) -> str:
    """The template's text for VALUES (plain values under the names it reads), rendered here:
    within every budget but RENDER_MEMORY, which only a rendering process has."""
    budget = _BUDGET.set(_Budget())
    try:
        return _bounded_output(compiled(template).generate(**values))
    finally:
        _BUDGET.reset(budget)


# -- rendering processes ------------------------------------------------------------------------
_RENDERERS = BoundedWorkers("edge_client.chat_render:render_request", memory=RENDER_MEMORY,
                            seconds=HARD_SECONDS, size=RENDERERS, max_reply=4 * MAX_OUTPUT + 1)
_OVER = {
    "memory": f"the chat template needs more than {RENDER_MEMORY >> 20} MiB at once to render (its "
              f"budget): it keeps too much alive or is hostile",
    "seconds": f"the chat template takes more than {RENDER_SECONDS:g} s to render (its budget): it "
               f"loops without end or is hostile",
    "stopped": "the chat template's rendering process stopped: the template is hostile, or the "
               "process was killed",
}
TEXT, ERROR = b"T", b"E"        # the first byte of a rendering process's reply
# The errors that come back as themselves; any other comes back as a TemplateError.
_ERRORS = {error.__name__: error for error in (
    TemplateBudgetError, jinja2.exceptions.SecurityError, jinja2.exceptions.UndefinedError,
    jinja2.exceptions.TemplateRuntimeError, jinja2.exceptions.TemplateError, TypeError, ValueError)}


def render_request(request: bytes) -> bytes:
    """In a rendering process: a pickled (template, values) to TEXT and the text in UTF-8, or
    ERROR and the error's name and message in JSON. A MemoryError is the process's to answer."""
    template, values = pickle.loads(request)
    try:
        text = render_in_process(template, values)
    except MemoryError:
        raise
    except Exception as exc:  # the template's own error, for the caller to read
        error = {"name": type(exc).__name__, "message": str(exc)[:MAX_MESSAGE]}
        return ERROR + json.dumps(error).encode()
    return TEXT + text.encode("utf-8", "surrogatepass")


def _text_or_error(reply: bytes) -> str:
    if reply[:1] == TEXT:
        return reply[1:].decode("utf-8", "surrogatepass")
    try:
        error = json.loads(reply[1:]) if reply[:1] == ERROR else {}
        name, message = str(error["name"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        raise TemplateBudgetError(_OVER["stopped"]) from None
    if name in _ERRORS:
        raise _ERRORS[name](message)
    raise jinja2.exceptions.TemplateError(f"{name}: {message}")
