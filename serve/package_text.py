"""What a server reads from a package besides its weights: the tokenizer, the end-of-sequence
ids, the chat template and the publisher's sampling settings.

Both of `flare serve`'s processes read it, each while the other part of its start goes on:
the engine process on a thread of its own from the package's arrival, beside its imports and
the weights' read (the tokenizers library lets go of the GIL while it parses a tokenizer), and
the API process while its engine loads, with the prompt length bound that only the API checks.
Read after the engine's load, as they were, they held the ready line back: 0.36 s in the
API process and 0.18 s in the engine's on this repository's CPU, for a tokenizer of 128,256
words (docs/performance.md).
"""

from __future__ import annotations

import datetime
import json
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jinja2.ext  # noqa: F401  (the templates' loopcontrols, imported here, not on a thread)
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from flare.errors import InvalidInputError, NotFoundError
from flare.serve.background import in_background
from flare.serve.models.files import PackageFiles
from flare.serve.prompt_bound import chars_per_token_bound

SAMPLING_SETTINGS = ("temperature", "top_p", "top_k")
"""generation_config.json's settings a server advertises as the publisher's defaults."""


@dataclass(frozen=True)
class PackageText:
    """A package's text side, read and checked (`read_text`)."""

    name: str
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    sampling_defaults: dict[str, Any]
    """The publisher's recommended settings, to advertise (requests are never forced)."""
    chat_template: Template | None
    special_tokens: dict[str, str | None]
    """The bos and eos tokens' text, which chat templates write."""

    @cached_property
    def chars_per_token(self) -> int | None:
        """The prompt length bound (serve/prompt_bound.py): a scan of the whole vocabulary,
        which the engine process never needs, so made on first use."""
        return chars_per_token_bound(self.tokenizer)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for chat messages, by the package's own chat template."""
        if self.chat_template is None:
            raise InvalidInputError(
                f"package {self.name} has no chat template", "use the completions API"
            )
        try:
            return self.chat_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateError as exc:
            raise InvalidInputError(f"the chat template refused these messages: {exc}") from exc


def read_text(package: PackageFiles) -> PackageText:
    """The package's text side, each file checked as it is read; raises a flare error naming
    the file that is missing or malformed."""
    tokenizer = _tokenizer(package)
    settings = package.json("tokenizer_config.json") or {}
    generation = package.json("generation_config.json") or {}
    return PackageText(
        name=package.manifest.name,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(package, tokenizer, settings, generation),
        sampling_defaults={k: generation[k] for k in SAMPLING_SETTINGS if k in generation},
        chat_template=_chat_template(package, settings),
        special_tokens={
            "bos_token": _token_text(settings.get("bos_token")),
            "eos_token": _token_text(settings.get("eos_token")),
        },
    )


def read_text_beside(package: PackageFiles) -> Future[PackageText]:
    """`read_text` on a thread of its own, begun now: the engine process reads the package's
    text while its main thread imports and its weights are read."""
    return in_background("flare-package-text", read_text, package)


def _tokenizer(package: PackageFiles) -> Tokenizer:
    """The fast tokenizer, from the checked bytes of tokenizer.json."""
    text = package.text("tokenizer.json")
    if text is None:
        raise NotFoundError(
            f"package {package.manifest.name} has no tokenizer.json",
            "rebuild it from a checkpoint with a fast tokenizer",
        )
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises plain Exception for bad input
        raise package.malformed("tokenizer.json", f"is not a tokenizer ({exc})") from None


def _eos_token_ids(
    package: PackageFiles,
    tokenizer: Tokenizer,
    settings: dict[str, Any],
    generation: dict[str, Any],
) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json's (else config.json's) and the
    tokenizer's eos token, as most servers take them."""
    config = package.json("config.json") or {}
    source = "generation_config.json" if "eos_token_id" in generation else "config.json"
    listed = generation.get("eos_token_id", config.get("eos_token_id"))
    ids = set(listed if isinstance(listed, list) else [listed] if listed is not None else [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise package.malformed(source, f"has eos_token_id {listed!r}, which is not token ids")
    eos = _token_text(settings.get("eos_token"))
    if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
        ids.add(tokenizer.token_to_id(eos))
    return frozenset(ids)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or {"content": text}."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(package: PackageFiles, settings: dict[str, Any]) -> Template | None:
    """The compiled chat template: chat_template.jinja, else tokenizer_config.json's."""
    path = "chat_template.jinja"
    source = package.text(path)
    if source is None:
        path = "tokenizer_config.json"
        source = _template_in_settings(settings)
    try:
        return None if source is None else _jinja().from_string(source)
    except TemplateError as exc:  # a syntax error: the template can render nothing
        problem = f"holds a chat template that does not parse ({exc})"
        raise package.malformed(path, problem) from None


def _template_in_settings(settings: dict[str, Any]) -> str | None:
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _jinja() -> ImmutableSandboxedEnvironment:
    """The sandbox Hugging Face renders chat templates in, with the helpers they use."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
