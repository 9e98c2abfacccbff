"""One `--help` style for every Tandem command: each flag's default is shown.

`tandem`, `tandem-engine`, `tandem-router` and `tandem-operator` build their parsers with
`ArgumentParser` from here (its subcommands inherit it), so a user reads a flag's default
in `--help` instead of in the source. The operator imports this module too, so it stays
free of torch and of the engine's layers.
"""

from __future__ import annotations

import argparse
from typing import Any


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to a flag's help, except where it would say nothing: no
    default (None), an off switch (False), an empty list, or help that already names its
    default in its own words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        says_nothing = (action.default is None or action.default is False
                        or action.default is argparse.SUPPRESS or action.default == [])
        if says_nothing or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with `DefaultsHelpFormatter`; `add_subparsers` makes the
    subcommands' parsers of this class too, so they show their defaults as well."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

