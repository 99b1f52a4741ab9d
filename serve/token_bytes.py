"""A token's own bytes, for the `bytes` of chat logprob entries.

OpenAI's `bytes` are the token's raw UTF-8 bytes, which a client joins to rebuild characters
that several tokens share (an emoji, a CJK character in a byte-level vocabulary). The token's
decoded text cannot give them: a token that holds part of a character decodes to U+FFFD. So
they are read from the vocabulary's own spelling of the token, undone as the tokenizer's
decoder would: the byte-level alphabet (GPT-2, Llama 3, Qwen), or SentencePiece's `<0xNN>`
byte pieces and its `▁` for a space (Llama 2, Mistral). Any other vocabulary spells its
tokens as text: their UTF-8.
"""

from __future__ import annotations

import json
import re
from functools import cache, cached_property

from tokenizers import Tokenizer

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""SentencePiece's spelling of one raw byte (byte fallback)."""
SPACE_MARK = "\u2581"
"""SentencePiece's `▁`, a space in the text."""


@cache
def byte_level_alphabet() -> dict[str, int]:
    """The byte-level vocabulary's character for each byte, inverted: printable Latin-1
    bytes stand for themselves, the other 68 for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {char: byte for byte, char in chars.items()}


class TokenBytes:
    """A tokenizer's token ids to their raw bytes, each worked out once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._known.get(token_id)
        if found is None:
            found = self._known[token_id] = self._bytes_of(token_id)
        return found

    @cached_property
    def _added(self) -> set[int]:
        return set(self.tokenizer.get_added_tokens_decoder())

    @cached_property
    def _decoders(self) -> set[str]:
        """The kinds of the tokenizer's decoder and of the decoders it chains."""
        spec = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        steps = spec.get("decoders") or [spec]
        return {step.get("type", "") for step in steps if isinstance(step, dict)}

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:  # spelled as its text in any vocabulary
            return piece.encode()
        if "ByteLevel" in self._decoders:
            alphabet = byte_level_alphabet()
            if all(char in alphabet for char in piece):
                return bytes(alphabet[char] for char in piece)
            return piece.encode()
        if "ByteFallback" in self._decoders and (byte := BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        if self._decoders & {"Metaspace", "Replace"}:
            piece = piece.replace(SPACE_MARK, " ")
        return piece.encode()
