"""Load a recipe (TOML), apply command-line overrides, and resolve each tensor's scheme.

Resolution order for one tensor: role entries (most specific glob wins: an exact role beats a
glob), then name rules in file order, then ``--override`` rules in command-line order; the last
match wins. Names match with or without a trailing ``.weight``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import RecipeError

FLOAT = "FLOAT"
DEFAULT_RECIPE = "kimi_k3.toml"


@dataclass(frozen=True)
class Rule:
    pattern: str
    scheme: str

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern) or fnmatch.fnmatchcase(name.removesuffix(".weight"), self.pattern)


@dataclass(frozen=True)
class Recipe:
    name: str
    target: str
    default: str
    roles: dict[str, str]
    rules: tuple[Rule, ...] = ()
    text: str = field(default="", repr=False)  # the TOML it came from (recorded in provenance)
    _by_role: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # role -> scheme cache

    def scheme_for(self, name: str, role: str) -> str:
        scheme = self.role_scheme(role)
        for rule in self.rules:
            if rule.matches(name):
                scheme = rule.scheme
        return scheme

    def role_scheme(self, role: str) -> str:
        """The scheme roles alone give (an exact role entry beats the longest matching glob)."""
        if role not in self._by_role:
            exact = self.roles.get(role)
            globbed = [(len(p), s) for p, s in self.roles.items() if fnmatch.fnmatchcase(role, p)]
            self._by_role[role] = exact if exact is not None else (max(globbed)[1] if globbed else self.default)
        return self._by_role[role]

    def with_overrides(self, overrides: list[str]) -> "Recipe":
        rules = list(self.rules)
        for text in overrides:
            pattern, sep, scheme = text.rpartition("=")
            if not sep or not pattern or not scheme:
                raise RecipeError(f"--override {text!r}: expected PATTERN=SCHEME, e.g. '*.mlp.down_proj=FLOAT'")
            rules.append(Rule(pattern.strip(), _check_scheme(scheme.strip(), f"--override {text!r}")))
        return Recipe(self.name, self.target, self.default, self.roles, tuple(rules), self.text)

    @property
    def sha256(self) -> str:
        h = hashlib.sha256(self.text.encode())
        for r in self.rules:
            h.update(f"\0{r.pattern}={r.scheme}".encode())
        return h.hexdigest()

    def describe(self) -> dict:
        return {"name": self.name, "target": self.target, "default": self.default, "roles": dict(self.roles),
                "rules": [{"pattern": r.pattern, "scheme": r.scheme} for r in self.rules], "sha256": self.sha256}


def _check_scheme(scheme: str, where: str) -> str:
    from ..quant import REGISTRY

    if scheme != FLOAT and scheme not in REGISTRY:
        raise RecipeError(f"{where}: unknown scheme {scheme!r}; known: {', '.join([FLOAT, *sorted(REGISTRY)])}")
    return scheme


def load_recipe(target: str, path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """The recipe for ``target`` from ``path`` (default: the shipped Kimi K3 recipe), with overrides applied."""
    if path is None:
        text = resources.files(__package__).joinpath(DEFAULT_RECIPE).read_text()
        where = f"built-in recipe {DEFAULT_RECIPE}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise RecipeError(f"{path}: cannot read recipe ({e.strerror})") from None
        where = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{where}: not valid TOML ({e})") from None
    section = (data.get("targets") or {}).get(target)
    if not isinstance(section, dict):
        have = ", ".join(sorted((data.get("targets") or {}))) or "none"
        raise RecipeError(f"{where}: no [targets.{target}] section (it has: {have})")
    default = _check_scheme(str(section.get("default", FLOAT)), where)
    roles = {str(k): _check_scheme(str(v), f"{where} [targets.{target}.roles] {k}")
             for k, v in (section.get("roles") or {}).items()}
    rules = []
    for i, r in enumerate(section.get("rules") or []):
        if not isinstance(r, dict) or "pattern" not in r or "scheme" not in r:
            raise RecipeError(f"{where}: [[targets.{target}.rules]] entry {i} needs 'pattern' and 'scheme'")
        rules.append(Rule(str(r["pattern"]), _check_scheme(str(r["scheme"]), f"{where} rule {r['pattern']!r}")))
    recipe = Recipe(str(data.get("name", Path(where).stem)), target, default, roles, tuple(rules), text)
    return recipe.with_overrides(list(overrides or []))
