"""The configuration reference (docs/configuration.md), rendered from the `jaxinfer` argument parsers so that it
cannot drift from them: `python -m jaxinfer.cli_reference > docs/configuration.md`; tests/docs checks it."""

from __future__ import annotations

import argparse

from jaxinfer.cli import PROG, make_cli_parser

HEADER = """# Configuration reference

Generated from the argument parsers by `python -m jaxinfer.cli_reference > docs/configuration.md`; a test fails
when this file and the parsers disagree. `python serve.py FLAGS` is `jaxinfer serve FLAGS`. The offline API takes
the same engine settings as keyword arguments (`LLM(model, max_model_len=..., num_kv_tokens=...)`).
"""


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreFalseAction | argparse._StoreTrueAction):
        return "not given"
    if action.default is None or action.default == []:
        return "—"
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("|", "\\|").replace("\n", " ")
    if action.choices is not None:
        text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
    return text


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    parser = make_cli_parser()
    out = [HEADER]
    for name, sub in _subparsers(parser).items():
        out.append(f"## `{PROG} {name}`\n")
        out.append(" ".join((sub.description or "").split()) + "\n")
        out.append("| flag | default | meaning |\n|---|---|---|")
        for action in sub._actions:
            if action.dest == "help":
                continue
            flag = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
            if action.dest in ("api_key",):  # read from the environment: the value here is this machine's
                default = "`$JAXINFER_API_KEY`" if name == "serve" else "`$OPENAI_API_KEY`"
            else:
                default = _default(action)
            out.append(f"| {flag} | {default} | {_help(action)} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
