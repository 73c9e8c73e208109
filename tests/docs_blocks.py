"""The ```python blocks of README.md and docs/*.md, each named by file, heading and index.

Design note
-----------
tests/test_docs_examples.py runs every block as written; this module only finds them, so the
rank side (tests/docs_examples_scenarios.py) and the test process agree on a block's id and
text. A block is a fenced block opened by a line that is, after any indentation, exactly
```` ```python ````; an indented block (inside a list item) is dedented by its opening fence's
indentation. Its id is ``"<file>#<nearest heading above it>#<index among that heading's
python blocks>"`` (index from 0), so inserting a block under one heading renames no block
under another. Fences of other languages (```sh, ```json, bare ```) are skipped whole, so a
python-looking line inside them is never taken for a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<lang>[^`\s]*)\s*$")
_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    id: str        # "docs/api.md#Quick start#0"
    file: str      # path relative to the repository root
    heading: str
    line: int      # 1-based line of the opening fence
    code: str      # the block's text, dedented

    def compile(self):
        """The block's code object; tracebacks name the file, heading and line of the doc."""
        padded = "\n" * self.line + self.code  # line numbers in tracebacks are the doc's
        return compile(padded, f"{self.file} ({self.heading})", "exec")


def doc_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """The python blocks of one markdown file, in order."""
    rel = path.relative_to(REPO_ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    heading = "(top)"
    counts: dict[str, int] = {}
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            match = _HEADING.match(lines[i])
            if match:
                heading = match.group("title")
            i += 1
            continue
        indent, ticks = fence.group("indent"), fence.group("ticks")
        close = re.compile(rf"^[ \t]*`{{{len(ticks)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{rel}:{i + 1}: a fence that is never closed")
        if fence.group("lang") == "python":
            body = []
            for k in range(i + 1, j):
                text = lines[k]
                if text.strip() and not text.startswith(indent):
                    raise ValueError(f"{rel}:{k + 1}: a line of a python block indented less "
                                     "than its fence")
                body.append(text[len(indent):])
            index = counts.get(heading, 0)
            counts[heading] = index + 1
            out.append(Block(f"{rel}#{heading}#{index}", rel, heading, i + 1,
                             "\n".join(body) + "\n"))
        i = j + 1
    return out


def all_blocks() -> dict[str, Block]:
    """Every python block of README.md and docs/*.md, by id."""
    return {b.id: b for path in doc_files() for b in blocks_of(path)}
