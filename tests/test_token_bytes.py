"""Chat logprobs' `bytes` are each token's raw bytes (serve/token_bytes.py): joined in order,
a continuation's tokens give its text's UTF-8 back, characters that several tokens share
included, in both kinds of vocabulary that real checkpoints ship."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers

from flare.build.tiny import SPECIAL_TOKENS, write_tokenizer
from flare.serve.token_bytes import TokenBytes

TEXT = "naïve café: 日本語 ✓ 🎉 done"


def test_a_byte_level_vocabulary_gives_each_tokens_own_bytes(tmp_path: Path) -> None:
    """GPT-2's alphabet (Llama 3, Qwen): the tiny BPE splits these characters across tokens,
    each of which decodes alone to U+FFFD; their bytes still join into the characters."""
    write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw = TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXT).ids
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # characters split up
    assert b"".join(raw(i) for i in ids) == TEXT.encode()
    for special in SPECIAL_TOKENS:
        assert raw(tokenizer.token_to_id(special)) == special.encode()
    assert raw(tokenizer.get_vocab_size() + 5) == b""


def sentencepiece_with_byte_fallback() -> Tokenizer:
    """Llama 2's and Mistral's kind: `▁` for a space, `<0xNN>` for a byte not in the
    vocabulary, and a decoder that undoes both."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("▁", "n", "a", "i", "v", "e", "c", "f", "d", "o", "▁d", "▁do", "▁don", "▁done"):
        vocab[piece] = len(vocab)
    merges = [("▁", "d"), ("▁d", "o"), ("▁do", "n"), ("▁don", "e")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


def test_a_sentencepiece_vocabulary_gives_byte_pieces_as_bytes_and_its_mark_as_a_space() -> None:
    tokenizer = sentencepiece_with_byte_fallback()
    raw = TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXT).ids
    assert tokenizer.id_to_token(ids[-1]) == "▁done"
    assert any(tokenizer.id_to_token(i).startswith("<0x") for i in ids)
    assert b"".join(raw(i) for i in ids) == (" " + TEXT).encode()
    assert tokenizer.decode(ids) == TEXT
