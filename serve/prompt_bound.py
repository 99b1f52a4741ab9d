"""The most input characters one token of a tokenizer can stand for: a lower bound on a text's
number of tokens from its number of characters alone, which refuses a prompt that cannot fit
the context without tokenizing it (serve/prompts.py).

No token stands for more input characters than the longest string in the vocabulary (added
tokens included), times how much the tokenizer's normalizer can shrink text. That holds for BPE
vocabularies whose pre-tokenizer and normalizer drop no characters, which covers the
tokenizers of every recipe that generates (Llama 2 and 3, Mistral, Qwen). Where it may not hold
(a normalizer that strips accents or whitespace, a WordPiece or Unigram model that folds any
unknown word into one token), there is no bound, and every prompt is tokenized.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer

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
