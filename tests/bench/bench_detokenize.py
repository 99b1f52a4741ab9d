"""What detokenizing costs the host a token: `TextStream.push` (the tokenizers library's
`DecodeStream`, then the stop strings), by what the tokens decode to.

A decode step detokenizes every sequence's new token on the engine thread, so its cost a token
is host time a sequence a step. `DecodeStream` holds a token back while the text it decodes
ends in a replacement character (a UTF-8 character split over byte tokens), and decodes its
whole held-back window again at the next token; a stream of byte tokens that never completes a
character (a random-weight model's, or the fixed logits of `bench_host_loop.py`) makes that
window grow by a token a step. Three streams are timed, each a request's N tokens pushed in
order, microseconds a token over the second half of them:

- `words`: gpu_serving.py's word-level tokenizer of Llama-3's 128,256 ids, random ids;
- `text`: the tiny byte-level BPE (build/tiny.py), the ids of English text;
- `split bytes`: the same BPE, one byte token that is not a character alone (0xE2), repeated.

    python tests/bench/bench_detokenize.py [--tokens 64,256,1024]

Nothing asserts on time: the script prints its figures.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench: gpu_serving's tokenizer

from gpu_serving import write_tokenizer as write_word_tokenizer

from flare.build.tiny import write_tokenizer
from flare.serve.engine.output import TextStream

TEXT = (
    "A content-addressed store keeps each blob under the digest of its bytes, so two packages "
    "that share a tensor share its blob, and a reader checks what it reads against its name. "
)


def per_token(tokenizer: Tokenizer, ids: Callable[[int], list[int]], counts: list[int]) -> str:
    """Microseconds a push over tokens (count/2, count] of a fresh stream, for each count."""
    figures = []
    for count in counts:
        stream = TextStream(tokenizer, [])
        tokens = ids(count)
        for token in tokens[: count // 2]:
            stream.push(token)
        started = time.perf_counter()
        for token in tokens[count // 2 :]:
            stream.push(token)
        figures.append(f"{1e6 * (time.perf_counter() - started) / (count - count // 2):.2f}")
    return " | ".join(figures)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", default="64,256,1024")
    args = parser.parse_args()
    counts = [int(n) for n in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        (root / "words").mkdir()
        write_word_tokenizer(root / "words", 128256)
        words = Tokenizer.from_file(str(root / "words" / "tokenizer.json"))
        (root / "bpe").mkdir()
        write_tokenizer(root / "bpe")
        bpe = Tokenizer.from_file(str(root / "bpe" / "tokenizer.json"))
    draw = random.Random(0)
    text = bpe.encode(TEXT * 200, add_special_tokens=False).ids
    split = bpe.token_to_id("â")  # byte 0xE2 in the byte-level alphabet (GPT-2's: itself)
    streams = {
        "words": (words, lambda n: [draw.randrange(1, 128256) for _ in range(n)]),
        "text": (bpe, lambda n: text[:n]),
        "split bytes": (bpe, lambda n: [split] * n),
    }
    print("| stream | " + " | ".join(f"µs a token, tokens {n // 2}-{n}" for n in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for name, (tokenizer, ids) in streams.items():
        print(f"| {name} | {per_token(tokenizer, ids, counts)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
