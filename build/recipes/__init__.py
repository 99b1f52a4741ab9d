"""Recipes: one per model family, chosen by config.json's architecture."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flare.build.recipes.base import Recipe
from flare.build.recipes.bert import BertRecipe
from flare.build.recipes.llama import LlamaRecipe
from flare.errors import InvalidInputError

RECIPES: tuple[Recipe, ...] = (LlamaRecipe(), BertRecipe())


def recipe_for(config: Mapping[str, Any]) -> tuple[Recipe, str]:
    """The recipe for config.json's architecture, or an error listing the supported ones."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise InvalidInputError(
            f"config.json must name exactly one architecture, got {architectures!r}",
            "fix config.json",
        )
    for recipe in RECIPES:
        if architectures[0] in recipe.architectures:
            return recipe, architectures[0]
    supported = ", ".join(a for r in RECIPES for a in r.architectures)
    raise InvalidInputError(
        f"no recipe for architecture {architectures[0]}", f"supported: {supported}"
    )
