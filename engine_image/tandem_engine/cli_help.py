"""One `--help` style for every Tandem command: each flag's default is shown.

`tandem`, `tandem-engine`, `tandem-router` and `tandem-operator` build their parsers with
`ArgumentParser` from here (its subcommands inherit it), so a user reads a flag's default
in `--help` instead of in the source. A mistyped flag, command or choice is answered
by the parser it was meant for (a subcommand's own usage, not the top level's) with the
closest spellings it knows ("did you mean --port?"), as git and cargo do. The operator
imports this module too, so it stays free of torch and of the engine's layers.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn


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
    """argparse's parser with `DefaultsHelpFormatter` and "did you mean" for unknown
    flags and invalid choices; `add_subparsers` makes the subcommands' parsers of
    `_SubcommandParser`, so they show their defaults and report their own mistakes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        kwargs.setdefault("parser_class", _SubcommandParser)
        return super().add_subparsers(**kwargs)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.unrecognized(extras)
        return parsed

    def unrecognized(self, extras: list[str]) -> NoReturn:
        """Exit 2 with this parser's usage, the arguments it does not take and, for each
        unknown flag, the closest spelling among this parser's flags."""
        known = [s for action in self._actions for s in action.option_strings]
        hints = []
        for extra in extras:
            flag = extra.split("=", 1)[0]
            if flag.startswith("-") and flag not in known:
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                if close:
                    hints.append((flag, close[0]))
        message = f"unrecognized arguments: {' '.join(extras)}"
        if len(hints) == 1:
            message += f" (did you mean {hints[0][1]}?)"
        elif hints:
            message += " (" + "; ".join(f"{flag}: did you mean {close}?"
                                        for flag, close in hints) + ")"
        self.error(message)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices],
                                              n=1, cutoff=0.6) if action.choices else []
            if not close:
                raise
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r} (did you mean {close[0]!r}? choose "
                f"from {', '.join(map(str, action.choices))})") from exc


class _SubcommandParser(ArgumentParser):
    """A subcommand's parser. argparse hands a subcommand's unknown arguments up to the
    top-level parser, whose error shows the top-level usage (`tandem [-h] COMMAND`); this
    one reports them itself, with its own usage and flags. Nothing is lost: the arguments
    after a subcommand all belong to it, the top level never parses them."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.unrecognized(extras)
        return parsed, []

