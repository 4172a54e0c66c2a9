"""What users of vLLM type by habit on this project's command lines, and what a usage error then
adds: the option to type instead."""

from __future__ import annotations

from collections.abc import Mapping

import click


class HintedCommand(click.Command):
    """A command whose usage errors end with the hint for the first habit (a flag, or the first
    word) they were typed with: ``habits`` maps each such word to its hint."""

    habits: Mapping[str, str] = {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # the parser consumes ``args``
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            words = {arg.split("=", 1)[0] for arg in given if arg.startswith("-")} | set(given[:1])
            hints = [hint for word, hint in self.habits.items() if word in words]
            if hints:
                e.message = f"{e.message.rstrip('.')}. {hints[0]}"
                if isinstance(e, click.NoSuchOption):
                    e.possibilities = None  # click's guess by spelling ("Did you mean '--out'?") would mislead
            raise


def hinted(habits: Mapping[str, str]) -> type[HintedCommand]:
    """A :class:`HintedCommand` class for ``habits`` (``@click.command(cls=hinted({...}))``)."""
    return type("Hinted", (HintedCommand,), {"habits": dict(habits)})
