"""Recipes: which tensor gets which scheme, per target. Data (TOML), not code."""

from .recipe import Recipe, load_recipe

__all__ = ["Recipe", "load_recipe"]
