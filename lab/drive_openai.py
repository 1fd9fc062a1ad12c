"""The lab's requests over each device's OpenAI-compatible API, with the official client.

The API streams text, not token ids: an output whose text equals the reference's decoded text is
recorded with the reference's ids (they decode to it, so the count of tokens is right); any other
output is recorded as its text encoded again by the target's tokenizer (an estimate of its ids,
so lost/duplicated counts stay in tokens). An answer is complete when its stream says why it
finished; the client's read timeout (STALL_TIMEOUT_S: to the first piece, then between pieces)
ends an attempt that stopped moving, as a retryable "timeout".
"""
from __future__ import annotations

import openai

from lab.drive import STALL_TIMEOUT_S, Attempt, reference_text

UNAVAILABLE_STATUS = {502, 503, 504}     # the device has no server now: worth sending again


class OpenAISender:
    def __init__(self, clock, fields: dict, tokenizer=None, timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.clock, self.fields, self.tokenizer, self.timeout_s = clock, fields, tokenizer, timeout_s
        self.clients: dict[str, openai.AsyncOpenAI] = {}
        self.models: dict[str, str] = {}

    async def __aenter__(self) -> "OpenAISender":
        return self

    async def __aexit__(self, *exc) -> None:
        for client in self.clients.values():
            await client.close()

    def _client(self, handle) -> openai.AsyncOpenAI:
        url = handle.api_url.rstrip("/")
        if url not in self.clients:
            self.clients[url] = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none",
                                                   max_retries=0, timeout=self.timeout_s)
        return self.clients[url]

    async def _model(self, client: openai.AsyncOpenAI, url: str) -> str:
        """The model the device serves (it refuses any other name)."""
        if url not in self.models:
            listed = await client.models.list()
            self.models[url] = listed.data[0].id if listed.data else ""
        return self.models[url]

    async def send(self, handle, prompt: str, reference: list[int] | None = None) -> Attempt:
        attempt = Attempt()
        client = self._client(handle)
        try:
            await self._stream(client, handle, prompt, attempt)
        except openai.APIStatusError as error:
            attempt.kind = "unavailable" if error.status_code in UNAVAILABLE_STATUS else "api"
            attempt.error = f"{error.status_code}: {error.message}"
        except openai.APITimeoutError:
            attempt.kind, attempt.error = "timeout", f"the device's API: nothing new within {self.timeout_s:g} s"
        except (openai.APIConnectionError, OSError) as error:
            attempt.kind, attempt.error = "unavailable", f"the device's API: {error or type(error).__name__}"
        except openai.APIError as error:      # an error event in the middle of the stream
            attempt.kind, attempt.error = "api", f"the device's API: {error}"
        attempt.done_at = self.clock()
        attempt.token_ids = self._ids(attempt.text, reference)
        return attempt

    async def _stream(self, client, handle, prompt: str, attempt: Attempt) -> None:
        fields = self.fields
        seed = {} if fields["seed"] is None else {"seed": fields["seed"]}
        stream = await client.completions.create(
            model=await self._model(client, handle.api_url.rstrip("/")), prompt=prompt, stream=True,
            max_tokens=fields["max_tokens"], temperature=fields["temperature"],
            top_p=fields["top_p"], extra_body={"top_k": fields["top_k"]}, **seed)
        async for chunk in stream:
            piece = chunk.choices[0].text if chunk.choices else ""
            if piece and attempt.first_token_at is None:
                attempt.first_token_at = self.clock()
            if piece:
                attempt.text += piece
                attempt.chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                attempt.complete = True

    def _ids(self, text: str, reference: list[int] | None) -> list[int]:
        if self.tokenizer is None:
            return []
        if reference is not None and text == reference_text(self.tokenizer, reference):
            return list(reference)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []
