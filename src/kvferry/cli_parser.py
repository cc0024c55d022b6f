"""The argparse parser every ``kvferry`` command uses.

    Parser                 no abbreviations, short errors, help with defaults
    nearest_flag_error()   "unrecognized argument: --x (--x is not supported; the nearest supported flag is --y)"
    edit_distance()        what "nearest" means: at most MAX_EDITS typos away, else no guess
    package_version()      for ``kvferry --version``
    VersionAction          ``--version``, the version read only when asked for

Why a subclass: argparse's own prefix matching took ``--api-key sk-123`` for
``--api-keys FILE`` (then "cannot read sk-123"), and its error printed the
whole usage, 60 lines for ``serve``, above a one-line message. Subparsers
inherit the class (``add_subparsers`` uses the parent's type), so every
command gets the same behaviour. No heavy imports: every command loads this.
"""
from __future__ import annotations

import argparse
import copy
import sys
from typing import NoReturn

import kvferry


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already
    says what the default is (prose such as "default: the model's") or the
    default says nothing (None, False, an empty list)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.option_strings and _shows_default(action):
            help_text = action.help or ""
            if not _says_default(help_text):
                action = _copy_with_help(action, (help_text + " " if help_text else "") + "(default: %(default)s)")
        return super()._format_action(action)


def _says_default(help_text: str) -> bool:
    """Whether the help text states the default itself ("(default: the
    model's)", "off by default")."""
    lower = help_text.lower()
    return "%(default)" in help_text or "default:" in lower or "by default" in lower


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    if action.help == argparse.SUPPRESS or default is argparse.SUPPRESS:
        return False
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return False
    # Identity, not ==: a default of 0 is worth showing, False (0 == False) is not.
    return not (default is None or default is False or (isinstance(default, (str, list)) and not default))


def _copy_with_help(action: argparse.Action, help_text: str) -> argparse.Action:
    clone = copy.copy(action)
    clone.help = help_text
    return clone


class Parser(argparse.ArgumentParser):
    """``allow_abbrev=False`` and the default-showing help formatter unless
    told otherwise; ``error()`` prints a short usage line, the message and
    where the full help is, not the whole usage (``usage_on_error = False``:
    the message alone, one line). Whatever went wrong, an unknown flag on
    the command line is what the message names, with the nearest supported
    flag: argparse may otherwise blame the value after it."""

    usage_on_error = True
    # Flags this command knowingly does not take, and why (a vLLM flag kvferry
    # has no counterpart for): the error gives the reason, not a guess.
    refused: dict[str, str] = {}

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def unknown_flags(self) -> list[str]:
        """The flags of this parser's command line that it does not take (up
        to a subcommand's name, whose parser judges the rest)."""
        subcommands = {name for a in self._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}
        unknown = []
        for token in self._argv:
            if token == "--" or token in subcommands:
                break
            name = token.split("=", 1)[0]
            if (token.startswith("-") and len(token) > 1 and not _is_number(token)
                    and name not in self._option_string_actions):
                unknown.append(token)
        return unknown

    def short_usage(self) -> str:
        """``usage: PROG [-h] [options] POSITIONALS``: the positionals named,
        the options only counted (``--help`` lists them)."""
        if self.usage is not None:  # a hand-written usage is short already
            return "usage: " + (self.usage % {"prog": self.prog}).strip().split("\n")[0]
        parts = [self.prog, "[-h]"]
        if any(a.option_strings and not isinstance(a, argparse._HelpAction) for a in self._actions):
            parts.append("[options]")
        for action in self._actions:
            if action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if isinstance(action, argparse._SubParsersAction):
                parts.append("{" + ",".join(action.choices) + "} ...")
                continue
            name = action.metavar or action.dest
            name = name if isinstance(name, str) else name[0]
            parts.append({"?": f"[{name}]", "*": f"[{name} ...]", "+": f"{name} [{name} ...]"}.get(action.nargs, name))
        return "usage: " + " ".join(parts)

    def format_help(self) -> str:
        """argparse's help, with the short usage line when the full one
        would run over a screen (``serve`` takes 80 flags)."""
        if self.usage is not None or sum(1 for a in self._actions if a.option_strings) <= 12:
            return super().format_help()
        self.usage = self.short_usage().removeprefix("usage: ").removeprefix(self.prog).replace("%", "%%")
        self.usage = "%(prog)s" + self.usage
        try:
            return super().format_help()
        finally:
            self.usage = None

    def error(self, message: str) -> NoReturn:
        unknown = self.unknown_flags()
        if unknown and not message.startswith("unrecognized"):
            message = nearest_flag_message(self, unknown)
        line = f"{self.prog}: error: {message}\n"
        if self.usage_on_error:
            line = f"{self.short_usage()}\n{line}(`{self.prog} --help` lists every option)\n"
        sys.stderr.write(line)
        sys.exit(2)

    def option_strings(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


# A guess further than this from the flag typed misleads more than it helps
# (difflib's ratio matched --enable-lora with --disable-log-stats).
MAX_EDITS = 2


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with adjacent transpositions (optimal string
    alignment): --prot is one edit from --port."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def nearest_flag(name: str, flags: list[str]) -> str | None:
    """The supported flag within MAX_EDITS edits of ``name`` (one edit for
    names of four letters or fewer), the closest; None when none is."""
    limit = 1 if len(name.lstrip("-")) <= 4 else MAX_EDITS
    scored = sorted((edit_distance(name, flag), flag) for flag in flags)
    return scored[0][1] if scored and scored[0][0] <= limit else None


def nearest_flag_message(parser: Parser, unknown: list[str]) -> str:
    """``unrecognized argument: --prot (--prot is not supported; the nearest
    supported flag is --port)``: the first unknown flag's reason when the
    command refuses it knowingly, else the supported flag a typo away, if
    any."""
    flags = [u for u in unknown if u.startswith("-")]
    message = f"unrecognized argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}"
    if not flags:
        return message
    name = flags[0].split("=", 1)[0]
    reason = getattr(parser, "refused", {}).get(name)
    if reason is not None:
        return f"{message} ({name}: {reason})"
    match = nearest_flag(name, parser.option_strings())
    return message + (f" ({name} is not supported; the nearest supported flag is {match})" if match
                      else f" ({name} is not supported)")


def nearest_flag_error(parser: Parser, unknown: list[str]) -> NoReturn:
    """Exit for arguments ``parser`` does not take (``nearest_flag_message``)."""
    parser.error(nearest_flag_message(parser, unknown))


def package_version() -> str:
    """The installed distribution's version; the source's when run from a
    checkout that is not installed."""
    # Not at the top: importlib.metadata (email, zipfile, csv) was ~40 ms of
    # every command's start, and of every process spawned under the CLI.
    import importlib.metadata

    try:
        return importlib.metadata.version("kvferry")
    except importlib.metadata.PackageNotFoundError:
        return kvferry.__version__


class VersionAction(argparse.Action):
    """``--version``: prints ``kvferry VERSION`` and exits, reading the
    version only then (argparse's own "version" action takes the string
    when the parser is built, for every command line)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show program's version number and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        print(f"kvferry {package_version()}", file=sys.stdout, flush=True)  # stdout, as argparse's
        parser.exit()
