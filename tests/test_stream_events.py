"""A streamed token's server-sent event: the fast text path writes, byte for byte, the event the
general path builds from its dicts, whatever the text, the model's name or the finish reason."""

from __future__ import annotations

import json

import pytest

from flare.serve.api import _Reply
from flare.serve.engine.output import Delta

TEXTS = ["", " w12", 'quote " and \\ backslash', "line\nbreak\ttab\x01", "é漢字🙂", "\u2028"]


@pytest.mark.parametrize("kind", ["chat.completion", "text_completion"])
@pytest.mark.parametrize("model", ["l1b", 'odd "name" é'])
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_a_token_event_is_the_general_event_byte_for_byte(
    kind: str, model: str, reason: str | None
) -> None:
    reply = _Reply(kind, model, runtime=None, prompt_tokens=3)  # type: ignore[arg-type]
    for text in TEXTS:
        delta = Delta(text, [7], None, reason)
        event = reply._text_event(delta)
        assert event == reply._event([reply._chunk_choice(delta)])
        assert event.startswith("data: ") and event.endswith("\n\n")
        parsed = json.loads(event[len("data: ") :])
        choice = parsed["choices"][0]
        assert parsed["model"] == model and choice["finish_reason"] == reason
        got = choice["delta"].get("content", "") if kind.startswith("chat") else choice["text"]
        assert got == text
