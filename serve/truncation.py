"""Inputs cut to a model's context before they are tokenized, so a huge input costs what a
context's worth of it does.

An embedding model sees only the first `length` tokens of an input (sentence-transformers
tokenizes the whole input, then cuts it). Tokenizing 4 MiB of text to keep 256 tokens takes
seconds of CPU and leaves hundreds of MiB in the allocator; so flare tokenizes a prefix of the
input instead, and takes its ids only where they are sure to be the whole input's, cut:

- The tokenizer splits text into words (pre-tokens) by looking at each character and its
  neighbours only, and normalizes it character by character (decomposing, lowercasing,
  stripping accents; the canonical order of combining marks changes only a run of marks,
  which lies in one word): then cutting the text changes only the last word of the prefix.
  Composition (NFC, NFKC) is not local in this sense: a mark after the cut can compose with
  a character of an earlier word ("=" and U+0338 make "≠", a word of its own where "=" was
  punctuation), so a tokenizer that composes is tokenized whole.
- An added token (`[MASK]`) is matched in the raw text: a cut inside one makes other words of
  the prefix ("[" then "mas"), but only within the last M characters, M the longest added
  token. So the words before one that begins M characters or more before the cut are whole
  and the same as in the whole input.
- The model turns each word into tokens by itself.

So the prefix's first K tokens (K: the length less the special tokens the post-processor adds)
are the input's first K tokens when a token after them begins another word at least M
characters before the cut. Otherwise the prefix grows (by GROWTH, to the whole input at most)
and is tokenized again. Where the tokenizer's parts are not known to be local (a regex
normalizer, a pre-tokenizer that looks far ahead, an added token matched on normalized text),
the whole input is tokenized (once).

The first prefix is a guess that fits text whose words are in the vocabulary:
`length` x (the longest vocabulary entry + 1 for a separator) characters. There is no bound to
make it sure: whitespace, a word folded into one unknown token or marks a normalizer strips
stand for any number of characters, and the check above is what makes the cut sound.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Encoding, Tokenizer

GROWTH = 4
"""How much a prefix too short to decide grows: at most 4/3 of the whole input's work."""
LOCAL_NORMALIZERS = {
    "BertNormalizer",
    "Lowercase",
    "StripAccents",
    "NFD",
    "NFKD",
}
"""Normalizers that change a character by itself (or reorder a run of combining marks)."""
LOCAL_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
"""Pre-tokenizers that split where a character's class changes (whitespace, punctuation)."""


class Truncation:
    """Token ids of texts as a model sees them: cut to `length` tokens, special tokens
    included; `tokenizer` must neither truncate nor pad."""

    def __init__(self, tokenizer: Tokenizer, length: int) -> None:
        self.tokenizer = tokenizer
        self.room = length - tokenizer.num_special_tokens_to_add(False)
        """Tokens of the input that the model sees beside the special ones."""
        spec = json.loads(tokenizer.to_str())
        self.margin = _added_token_margin(spec)
        """M above, or None where no prefix is sure (the whole input is tokenized)."""
        longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.first_prefix = length * (longest + 1)

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, cut to the length; a prefix of the text is tokenized where it
        gives the same ids, the whole text where none is sure to."""
        ids: list[list[int]] = [[] for _ in texts]
        size = self.first_prefix if self.margin is not None else max(map(len, texts), default=0)
        todo = list(range(len(texts)))
        while todo:
            prefixes = [texts[i][:size] for i in todo]
            encodings = self.tokenizer.encode_batch(prefixes, add_special_tokens=False)
            undecided = []
            for i, encoding in zip(todo, encodings, strict=True):
                if len(texts[i]) <= size or self._settled(encoding, size):
                    ids[i] = self._cut(encoding)
                else:
                    undecided.append(i)
            todo, size = undecided, size * GROWTH
        return ids

    def _settled(self, encoding: Encoding, size: int) -> bool:
        """Whether the prefix's first `room` tokens are the whole text's: a token after them
        begins another word at least `margin` characters before the cut."""
        if len(encoding) <= self.room:
            return False
        last_kept = encoding.token_to_word(self.room - 1)
        for token in range(self.room, len(encoding)):
            word = encoding.token_to_word(token)
            if word != last_kept:
                start, _ = encoding.token_to_chars(token)
                begins_a_word = None not in (word, last_kept)
                return begins_a_word and start <= size - (self.margin or 0)
        return False

    def _cut(self, encoding: Encoding) -> list[int]:
        """The ids the model sees: the first `room` tokens with the special tokens added, as
        the tokenizer's own truncation would give them."""
        encoding.truncate(self.room)
        return self.tokenizer.post_process(encoding).ids


def _added_token_margin(spec: dict[str, Any]) -> int | None:
    """The longest added token, where normalizer and pre-tokenizer are local and every added
    token is matched in the raw text; else None."""
    added = spec.get("added_tokens") or []
    local = (
        _is_local(spec.get("normalizer"), "normalizers", LOCAL_NORMALIZERS)
        and _is_local(spec.get("pre_tokenizer"), "pretokenizers", LOCAL_PRE_TOKENIZERS)
        and not any(token.get("normalized") for token in added)
    )
    return max((len(token["content"]) for token in added), default=0) if local else None


def _is_local(spec: dict[str, Any] | None, parts: str, local: set[str]) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_is_local(part, parts, local) for part in spec.get(parts, []))
    return spec.get("type") in local
