"""The registry of ``shadow`` commands: each module of ``shadow.cli`` registers its command with ``@command``, and
``shadow.cli.main`` builds the parser from what registered (adding a command is adding one module).

>>> @command("hello", "say hello")
... def execute(args): print("hello"); return 0      # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    help: str
    execute: Callable[[argparse.Namespace], int]  # returns the exit status
    arguments: Callable[[argparse.ArgumentParser], None]  # adds the subcommand's own arguments


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] | None = None):
    """Register ``execute(args) -> int`` as the subcommand ``name``; ``arguments(parser)`` adds its options."""

    def register(execute: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"shadow command {name!r} is already registered (by "
                             f"{COMMANDS[name].execute.__module__}.{COMMANDS[name].execute.__qualname__})")
        COMMANDS[name] = Command(name, help, execute, arguments or (lambda parser: None))
        return execute

    return register


class Failure(Exception):
    """A command cannot go on: its message (one line: the problem and the fix) is printed, the exit status is 2."""


def fail(message: str) -> int:
    """Print ``message`` as shadow's error and return the exit status of a usage error (2)."""
    print(f"shadow: error: {message}", file=sys.stderr)
    return 2
