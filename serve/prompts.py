"""Prompts as token ids: chat rendering and tokenizing, off the event loop, after a cheap bound
on the length.

Tokenizing is the one piece of request-sized work before the engine: megabytes of text take
seconds. The routes run it on a worker thread (tokenizers lets go of the GIL while it encodes),
so the event loop keeps answering /health and streaming other requests meanwhile. And before
it, a lower bound on the number of tokens, from the number of characters alone, refuses a
prompt that cannot fit the context without tokenizing it at all.

The bound: no token stands for more input characters than the longest string in the vocabulary
(added tokens included), times how much the tokenizer's normalizer can shrink text. That holds
for BPE vocabularies whose pre-tokenizer and normalizer drop no characters, which covers the
tokenizers of every recipe that generates (Llama 2 and 3, Mistral, Qwen). Where it may not
hold (a normalizer that strips accents or whitespace, a WordPiece or Unigram model that folds
any unknown word into one token), there is no bound, and every prompt is tokenized.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer

from flare.errors import FlareError
from flare.serve.errors import ApiError
from flare.serve.runtime import Runtime

NFC_SHRINK = 4
"""At most this many characters compose into one under NFC: the longest canonical
decomposition of any character (U+1F82) is 4, and NFD(NFC(x)) = NFD(x) has at least as many
characters as x."""
NFKC_SHRINK = 18
"""The same under NFKC: the longest compatibility decomposition (U+FDFA) is 18."""
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
"""Pre-tokenizers that split text without dropping any of it."""
NORMALIZER_SHRINK = {
    "NFD": 1,
    "NFKD": 1,
    "Lowercase": 1,
    "Prepend": 1,
    "ByteLevel": 1,
    "NFC": NFC_SHRINK,
    "NFKC": NFKC_SHRINK,
}
"""How many input characters one normalized character can stand for, per normalizer."""


def chars_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """The most input characters one token of this tokenizer can stand for, or None where no
    such bound is sure (see the module's docstring)."""
    spec = json.loads(tokenizer.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _bpe_keeps_every_character(spec):
        return None
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return longest * shrink


def _bpe_keeps_every_character(spec: dict[str, Any]) -> bool:
    """A BPE model (no run of unknown characters fused into one token) behind a pre-tokenizer
    that drops nothing."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return False
    fuses_unknown = (
        model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback")
    )
    return not fuses_unknown and _pre_tokenizer_keeps(spec.get("pre_tokenizer"))


def _pre_tokenizer_keeps(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(p) for p in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in KEEPING_PRE_TOKENIZERS


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """How many input characters one normalized character can stand for; None: unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_normalizer_shrink(n) for n in spec.get("normalizers", [])]
        return None if None in factors else math.prod(factors)  # type: ignore[arg-type]
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if pattern is None or not content:  # a regex, or a deletion: no bound
            return None
        return max(1, math.ceil(len(pattern) / len(content)))
    return NORMALIZER_SHRINK.get(kind)


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
        self.chars_per_token = chars_per_token_bound(runtime.tokenizer)

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
            text = self.runtime.render_chat(messages)
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
