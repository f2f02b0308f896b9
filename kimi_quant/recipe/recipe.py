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
    override: bool = False  # from --override: a pattern that matches no tensor is a typo, refused by make_plan

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
    group_size: int = 0  # a3: per-group int4 for W4A8_DYNAMIC (``group_size = G`` in the target's section)
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
            rules.append(Rule(pattern.strip(), _check_scheme(scheme.strip(), f"--override {text!r}", self.target),
                              override=True))
        return Recipe(self.name, self.target, self.default, self.roles, tuple(rules), self.text, self.group_size)

    @property
    def sha256(self) -> str:
        h = hashlib.sha256(self.text.encode())
        for r in self.rules:
            h.update(f"\0{r.pattern}={r.scheme}".encode())
        return h.hexdigest()

    def describe(self) -> dict:
        d = {"name": self.name, "target": self.target, "default": self.default, "roles": dict(self.roles),
             "rules": [{"pattern": r.pattern, "scheme": r.scheme} for r in self.rules], "sha256": self.sha256}
        if self.group_size:  # only then: recipes without it describe (and fingerprint) as before
            d["group_size"] = self.group_size
        return d


def _check_scheme(scheme: str, where: str, target: str) -> str:
    from ..quant import REGISTRY
    from ..targets import TARGETS

    if scheme != FLOAT and scheme not in REGISTRY:
        raise RecipeError(f"{where}: unknown scheme {scheme!r}; known: {', '.join([FLOAT, *sorted(REGISTRY)])}")
    t = TARGETS.get(target)
    if t is not None and not t.allows(scheme):
        raise RecipeError(f"{where}: scheme {scheme} is not for target {t.name} (it takes {t.scheme_names()})")
    return scheme


def _table(value, what: str, where: str, kind=dict):
    """``value`` if it is a TOML table (or array, for ``kind=list``); absent means empty."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        shape = "a table" if kind is dict else "an array of tables"
        raise RecipeError(f"{where}: {what} must be {shape}, got {type(value).__name__} {value!r}")
    return value


def load_recipe(target: str, path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """The recipe for ``target`` from ``path`` (default: the shipped Kimi K3 recipe), with overrides applied."""
    from ..model.spec import KNOWN_ROLES

    if path is None:
        text = resources.files(__package__).joinpath(DEFAULT_RECIPE).read_text(encoding="utf-8")
        where = f"built-in recipe {DEFAULT_RECIPE}"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")  # TOML is UTF-8 whatever the locale says
        except OSError as e:
            raise RecipeError(f"{path}: cannot read recipe ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise RecipeError(f"{path}: not a TOML recipe (not UTF-8 text: byte {e.start})") from None
        where = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{where}: not valid TOML ({e})") from None
    except RecursionError:
        raise RecipeError(f"{where}: TOML nested too deeply to be a recipe") from None
    targets = _table(data.get("targets"), "'targets'", where)
    section = targets.get(target)
    if not isinstance(section, dict):
        have = ", ".join(sorted(targets)) or "none"
        raise RecipeError(f"{where}: no [targets.{target}] section (it has: {have})")
    default = _check_scheme(str(section.get("default", FLOAT)), f"{where} [targets.{target}] default", target)
    roles = {}
    for k, v in _table(section.get("roles"), f"[targets.{target}.roles]", where).items():
        if not any(fnmatch.fnmatchcase(r, k) for r in KNOWN_ROLES):
            raise RecipeError(f"{where}: [targets.{target}.roles] {k!r} names no role; known roles: "
                              f"{', '.join(KNOWN_ROLES)} (globs allowed)")
        roles[str(k)] = _check_scheme(str(v), f"{where} [targets.{target}.roles] {k}", target)
    rules = []
    for i, r in enumerate(_table(section.get("rules"), f"[[targets.{target}.rules]]", where, list)):
        if not isinstance(r, dict) or "pattern" not in r or "scheme" not in r:
            raise RecipeError(f"{where}: [[targets.{target}.rules]] entry {i} needs 'pattern' and 'scheme'")
        rules.append(Rule(str(r["pattern"]), _check_scheme(str(r["scheme"]), f"{where} rule {r['pattern']!r}", target)))
    group_size = section.get("group_size", 0)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 0:
        raise RecipeError(f"{where}: [targets.{target}] group_size must be a non-negative integer, got {group_size!r}")
    recipe = Recipe(str(data.get("name", Path(where).stem)), target, default, roles, tuple(rules), text, group_size)
    return recipe.with_overrides(list(overrides or []))
