"""Text of a growing output, safe to hand out piece by piece (the local API, MQTT responses,
`sled generate`): the one incremental detokeniser."""
from __future__ import annotations

from collections.abc import Collection, Sequence

from edge_client.stop_strings import StopStrings


class OutputText:
    """Incremental detokenisation with stop strings.

    Each token re-decodes the whole output and the caller is sent only the new suffix. Text is
    held back while it ends in "\\ufffd" (a character whose bytes are still arriving) or in the
    start of a stop string. End ids (EOS, stop ids) count as tokens but have no text. Stops are
    looked for only where a new one can begin (from the text handed out, less a stop's length),
    so each token costs the new text and the stops' lengths (edge_client.stop_strings).

    With stops=["\\n\\n"], outputs "a", "b\\n", "\\nc": take() gives "a", then "b" (the "\\n"
    may start a stop), then nothing more: the text is "ab" and stopped is True.

    `decode_options` go to tokenizer.decode (default: special tokens skipped, spaces as they are;
    an option given as None is left to the tokenizer's own default).
    """

    def __init__(self, tokenizer, stops: Sequence[str] = (), end_ids: Collection[int] = (),
                 **decode_options) -> None:
        self.tokenizer = tokenizer
        self.stops = StopStrings(stops)
        self.end_ids = set(end_ids)
        options = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False, **decode_options}
        self.decode_options = {key: value for key, value in options.items() if value is not None}
        self.ids: list[int] = []       # tokens whose text is part of the output
        self.tokens = 0                # completion tokens, end ids included
        self.text = ""
        self.sent = 0                  # characters of text already handed out
        self.stopped = False           # a stop string was found (and cut off)

    def add(self, token_ids: list[int]) -> None:
        for token in token_ids:
            if self.stopped:
                return
            self.tokens += 1
            if token in self.end_ids:
                continue
            self.ids.append(token)
            self.text = self.tokenizer.decode(self.ids, **self.decode_options)
            self._cut_at_stop()

    def _cut_at_stop(self) -> None:
        # text[:sent] is out and held back no stop's start: a new stop begins after it
        found = self.stops.first(self.text, max(0, self.sent - self.stops.longest))
        if found >= 0:
            self.text = self.text[:found]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (all of it when final)."""
        end = len(self.text) if final or self.stopped else self._safe_end()
        new = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return new

    def _safe_end(self) -> int:
        end = len(self.text.rstrip("\ufffd"))
        return end - self.stops.held(self.text[:end])
