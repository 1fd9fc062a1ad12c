"""Chat templates of the built-in models, and the token that ends a chat turn.

A built-in model's GGUF may carry its template (`tokenizer.chat_template` in the GGUF metadata:
SmolLM2 does, and transformers keeps it when it converts the file); Gemma 3's GGUF carries none,
so its family's documented turn format is written here (GEMMA3, Google's own template for the
instruction-tuned Gemma 3 checkpoints):

    <bos><start_of_turn>user
    hi<end_of_turn>
    <start_of_turn>model
    Hello!<end_of_turn>
    <start_of_turn>model          <- add_generation_prompt=True ends here

Each alias names its template in sled.models.BUILTIN (one entry per alias); with_chat_template()
gives a tokenizer that lacks one the template of its built-in model: at conversion, and when a
copy converted before templates were carried is loaded. A template never changes the tokenizer's
fingerprint (that hashes the vocabulary and special ids only).

A chat reply ends where the template ends an assistant turn (Gemma's <end_of_turn>, ChatML's
<|im_end|>), which is not always the model's EOS (Gemma's is <eos>): turn_end_ids() finds that
token from the template itself, so it holds for any model with a template.
"""
from __future__ import annotations

from pathlib import Path

from sled.cache import cache_dir
from sled.gguf_metadata import read_metadata

GEMMA3 = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n"
)

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"   # where a GGUF file carries its template

# What turn_end_ids() puts in an assistant turn to find what the template writes after it.
_REPLY_MARK = "sled-reply-mark"


def gguf_chat_template(path: Path) -> str | None:
    """The chat template a GGUF file carries in its metadata, None when it has none (a
    ValueError of one line when the file cannot be read)."""
    template = read_metadata(path, (CHAT_TEMPLATE_KEY,)).get(CHAT_TEMPLATE_KEY)
    return str(template) if template is not None else None


def builtin_chat_template(alias: str) -> str | None:
    """The chat template of a built-in model: the one written for it, else its GGUF's own."""
    from sled.models import BUILTIN, gguf_path   # a cycle: sled.models imports this module

    model = BUILTIN.get(alias)
    if model is None:
        return None
    return model.chat_template or gguf_chat_template(gguf_path(alias))


def builtin_alias(model_id: str) -> str | None:
    """The built-in alias a model id names: the alias itself, or its converted checkpoint."""
    from sled.models import BUILTIN   # a cycle: sled.models imports this module

    if model_id in BUILTIN:
        return model_id
    path = Path(model_id).expanduser()
    converted = cache_dir() / "hf"
    if path.name in BUILTIN and path.parent.resolve() == converted.resolve():
        return path.name
    return None


def with_chat_template(tokenizer, model_id: str):
    """TOKENIZER, given its built-in model's chat template when it has none (the same object)."""
    alias = builtin_alias(model_id)
    if not getattr(tokenizer, "chat_template", None) and alias is not None:
        tokenizer.chat_template = builtin_chat_template(alias)
    return tokenizer


def turn_end_ids(tokenizer, template: str | None = None) -> list[int]:
    """The special token that closes an assistant turn in the chat template ([] when the
    template writes none, or writes plain text there).

    Gemma 3: a turn "...Hello!<end_of_turn>\\n" gives [106]; ChatML "...<|im_end|>\\n" gives
    the id of <|im_end|>.
    """
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _REPLY_MARK}]
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False)
    except Exception:  # a template that refuses this conversation names no turn end
        return []
    after = text[text.rfind(_REPLY_MARK) + len(_REPLY_MARK):] if _REPLY_MARK in text else ""
    ids = tokenizer(after, add_special_tokens=False).input_ids if after else []
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(
        getattr(tokenizer, "added_tokens_decoder", {}))
    return [ids[0]] if ids and ids[0] in special else []
