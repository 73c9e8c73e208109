"""The repository describes the product as it is now; its history lives in git.

This check scans every Markdown file, and the comments and docstrings of every Python file,
for text that only makes sense as a work log: numbered work sessions or issues, commit ids
cited as provenance, and references to files outside the repository. A hit names the file,
the line and the text, so the fix is to restate what is true now (and why) in its place.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".git", ".venv", "build", "__pycache__", ".pytest_cache", "node_modules"}

# Each pattern is built from pieces so this file does not match itself.
HISTORY_PATTERNS = {
    "numbered work session": re.compile(r"\b" + "st" + r"op\s+#?\d", re.IGNORECASE),
    "numbered issue": re.compile(r"\b" + "iss" + r"ue\s+#?\d", re.IGNORECASE),
    "commit id": re.compile(
        r"(?<![\w./#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w./-])"),
    "file outside the repository": re.compile(
        "|".join(["platform" + "-facts", r"\.\./" + "shared", "/" + "work/"])),
}


def history_hits(text: str) -> list[tuple[str, str]]:
    """(kind, matched text) for every work-history pattern found in ``text``."""
    return [(kind, match.group(0))
            for kind, pattern in HISTORY_PATTERNS.items()
            for match in pattern.finditer(text)]


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings: the prose a reader sees."""
    prose = [(tok.start[0], tok.string)
             for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first_line = body[0].lineno
                for offset, line in enumerate(body[0].value.value.splitlines()):
                    prose.append((first_line + offset, line))
    return prose


def _skipped(part: str) -> bool:
    """Tools' directories, not the repository's prose: ``.venv-torch-*`` is a side venv
    (make torch-compat)."""
    return part in SKIPPED_DIRS or part.endswith(".egg-info") or part.startswith(".venv-")


def repository_prose() -> list[tuple[Path, int, str]]:
    """(file, line, text) for every Markdown line and every Python comment or docstring line."""
    found = []
    for path in sorted(ROOT.rglob("*")):
        if any(_skipped(part) for part in path.relative_to(ROOT).parts):
            continue
        if path.suffix == ".md":
            lines = enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        elif path.suffix == ".py":
            lines = python_prose(path.read_text(encoding="utf-8"))
        else:
            continue
        found.extend((path, number, text) for number, text in lines)
    return found


def test_repository_has_no_work_history():
    problems = [f"{path.relative_to(ROOT)}:{number}: {kind} {matched!r} in: {text.strip()[:120]}"
                for path, number, text in repository_prose()
                for kind, matched in history_hits(text)]
    assert not problems, (
        "work-history text in the repository (state what is true now and why; history lives "
        "in git):\n" + "\n".join(problems))


@pytest.mark.parametrize("sample, kind", [
    ("St" + "op 19 changed no library code", "numbered work session"),
    ("see is" + "sue #4's target", "numbered issue"),
    ("measured at " + "bae7c6f", "commit id"),
    ("read ../" + "shared/notes first", "file outside the repository"),
    ("a view never writes through (platform" + "-facts)", "file outside the repository"),
])
def test_check_catches_history(sample, kind):
    assert kind in [hit_kind for hit_kind, _ in history_hits(sample)]


@pytest.mark.parametrize("sample", [
    "stops when every rank is done", "bf16 and fp32", "seed 1234567", "the deadbeef_tensor name",
    "torch.float8_e4m3fn", "a 0x7fffffff bound",
])
def test_check_allows_ordinary_text(sample):
    assert history_hits(sample) == []


def test_python_prose_reads_comments_and_docstrings_only():
    source = 'x = "st' + 'op 3"\n# comment\ndef f():\n    """doc line"""\n'
    assert [text for _, text in python_prose(source)] == ["# comment", "doc line"]
