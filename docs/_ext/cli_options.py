"""Sphinx extension: the options of a ``python -m gpipe`` command, from its argparse parser.

``.. cli-options:: demo`` renders every option of ``python -m gpipe demo`` as a definition
list (the option with its value, then its help), from :func:`gpipe._cli.build_parser`, so the
reference cannot lack an option the command takes, or list one it does not.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _subparser(name: str) -> argparse.ArgumentParser:
    from gpipe._cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise ValueError(f"python -m gpipe has no command {name!r}")


def option_lines(name: str) -> list[str]:
    """reStructuredText lines: each option of the command and its help."""
    lines: list[str] = []
    for action in _subparser(name)._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.nargs == 0:
            usage = ", ".join(action.option_strings)
        else:
            metavar = action.metavar or (
                "{" + ",".join(map(str, action.choices)) + "}"
                if action.choices
                else action.dest.upper()
            )
            usage = ", ".join(f"{option} {metavar}" for option in action.option_strings)
        help_text = (action.help or "") % {"default": action.default}
        # Options and commands in the help as literals (smart quotes would turn -- into a dash).
        help_text = re.sub(r"(?<![\w`])(--[\w-]+|pip install \w+)", r"``\1``", help_text)
        lines += [f"``{usage}``", f"   {help_text}"]
    return lines


class CliOptions(SphinxDirective):
    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        self.state.nested_parse(
            StringList(option_lines(self.arguments[0]), source="gpipe._cli.build_parser"),
            self.content_offset,
            container,
        )
        return list(container.children)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("cli-options", CliOptions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
