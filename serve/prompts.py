"""Prompts as token ids: chat rendering and tokenizing, off the event loop, after a cheap bound
on the length.

Tokenizing is the one piece of request-sized work before the engine: megabytes of text take
seconds. The routes run it on a worker thread (tokenizers lets go of the GIL while it encodes),
so the event loop keeps answering /health and streaming other requests meanwhile. And before
it, a lower bound on the number of tokens, from the number of characters alone
(serve/prompt_bound.py, read with the package's tokenizer), refuses a prompt that cannot fit
the context without tokenizing it at all.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from flare.errors import FlareError
from flare.serve.errors import ApiError
from flare.serve.runtime import Runtime


def token_ids(tokenizer: Tokenizer, text: str, special: bool) -> list[int]:
    """The text's token ids (`special`: with the special tokens the tokenizer adds), as
    `encode` gives them, without the character offsets that `encode` tracks and a server never
    reads: an 8K-token prompt took 6.6-13 ms with them on the H200's host, and 45% less
    without them on this project's CPU (docs/performance.md)."""
    return tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids


class Prompts:
    """Prompt token ids for one runtime; each call is meant for a worker thread."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.chars_per_token = runtime.text.chars_per_token

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids as given, or the text's, with the special tokens the model expects."""
        if isinstance(prompt, list):
            return prompt
        self._check_bound(prompt, "prompt")
        return token_ids(self.runtime.tokenizer, prompt, special=True)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The messages rendered by the package's chat template, then tokenized (the template
        writes the special tokens itself)."""
        try:
            text = self.runtime.text.render_chat(messages)
        except (ValueError, FlareError) as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        self._check_bound(text, "messages")
        return token_ids(self.runtime.tokenizer, text, special=False)

    def min_tokens(self, text: str) -> int:
        """A number of tokens the text has at least (0 where there is no bound)."""
        return 0 if self.chars_per_token is None else -(-len(text) // self.chars_per_token)

    def _check_bound(self, text: str, param: str) -> None:
        least, context = self.min_tokens(text), self.runtime.context_length
        if least >= context:
            raise ApiError(
                400, f"the prompt is at least {least} tokens; the context is {context}", param=param
            )
