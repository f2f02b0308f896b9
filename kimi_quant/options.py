"""Option spellings shared by the commands: one name per meaning, old names kept hidden for one release.

An old spelling is its own hidden click option that hands its value to the new one's destination. It
does so through ``ctx.meta`` and the new option's callback, not by two options sharing a destination:
click processes the options given on the command line first, so a shared destination would be
overwritten by the other option's default in the click releases that do not arbitrate between them.
"""

from __future__ import annotations

import click


def _meta_key(dest: str) -> tuple[str, str]:
    return ("kimi-quant old option name", dest)


def takes_old_name(ctx: click.Context, param: click.Parameter, value):
    """Callback of an option that has an old spelling: the old spelling's value when that was given."""
    return ctx.meta.get(_meta_key(param.name), value)


def old_name(old: str, dest: str, new: str, **kwargs):
    """A hidden option ``old`` that sets ``dest`` (the option now spelled ``new``); decorate the new option
    with ``callback=takes_old_name`` as well."""

    def remember(ctx: click.Context, param: click.Parameter, value):
        if value is not None:
            ctx.meta[_meta_key(dest)] = value
            ctx.params[dest] = value  # where the new option was processed before this one

    return click.option(old, f"old_{dest}", hidden=True, expose_value=False, default=None, callback=remember,
                        help=f"Old name of {new}.", **kwargs)
