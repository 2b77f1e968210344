"""The user docs keep up with the CLI: every verb and every option has an example invocation in docs/."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from mconvert.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def example_lines(verb: str) -> list[str]:
    """Command lines `mconvert VERB ...` in docs/ (backslash continuations joined)."""
    text = "\n".join(p.read_text() for p in sorted(DOCS.rglob("*.md")))
    text = re.sub(r"\\\n\s*", " ", text)
    return [ln for ln in text.splitlines() if re.search(rf"\bmconvert {re.escape(verb)}(\s|$)", ln)]


def cli_options() -> list[tuple[str, tuple[str, ...]]]:
    """(verb, option spellings) for every option of every verb, as the CLI declares them."""
    group = typer.main.get_command(app)
    out = []
    for verb, cmd in group.commands.items():
        for p in cmd.params:
            names = tuple(n for n in (*p.opts, *p.secondary_opts) if n.startswith("--"))
            if names and "--help" not in names:
                out.append((verb, names))
    return out


def test_every_verb_and_option_has_an_example_in_the_docs():
    missing = []
    for verb, names in cli_options():
        lines = example_lines(verb)
        if not any(re.search(rf"(^|\s){re.escape(n)}(\s|=|$)", ln) for ln in lines for n in names):
            missing.append(f"mconvert {verb} {'/'.join(names)}")
    verbs = typer.main.get_command(app).commands
    missing += [f"mconvert {v} (no example at all)" for v in verbs if not example_lines(v)]
    assert not missing, "no example in docs/ for: " + ", ".join(missing)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    first_block = lines[lines.index("```") + 1 : lines.index("```", lines.index("```") + 1)]
    assert first_block[0].startswith("make demo") and any(ln.startswith("make test") for ln in first_block)
    assert all(not ln.startswith("## ") for ln in lines[: lines.index("```")])
