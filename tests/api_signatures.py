"""The signatures docs/api.md writes, against the code (run by tests/test_api_signatures.py
in a process of each framework, as ``hp``'s tensor-parallel names are the framework's).

A section's signatures are the first ```python block under its ``## `` heading, which
every section that documents functions opens with: each statement there that starts with
``hp.<name>(`` is a signature (parameters, ``*``, defaults; the ``-> ...`` that may follow
says what it returns, in words, and is not compared), and one assigned to names
(``norm = hp.clip_grad_norm_(...)``) is a call, whose arguments must bind.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import hyper_parallel as hp

API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"
_STATEMENT = re.compile(r"^(?:[\w, ]+ = )?hp\.\w+\(")


def documented() -> list:
    """``[(heading, statement)]``: every ``hp.`` call written in a section's first block,
    its continuation lines joined and comments dropped, one per call."""
    out = []
    for section in re.split(r"^## ", API_MD.read_text(encoding="utf-8"), flags=re.M)[1:]:
        heading = section.splitlines()[0]
        block = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
        text, depth = "", 0
        for line in block.group(1).splitlines() if block else []:
            if not text and not _STATEMENT.match(line):
                continue
            text += line.split("#")[0].strip() + " "
            depth = text.count("(") - text.count(")")
            if depth == 0:
                out += [(heading, call) for call in _calls(text)]
                text = ""
    return out


def _calls(text: str) -> list:
    """``"hp.a(x), hp.b() -> y"``: ``["hp.a(x)", "hp.b()"]``, an assignment kept in front."""
    calls, start, depth = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ")" and depth == 0:
            calls.append(text[start:i + 1].strip())
            rest = text[i + 1:].lstrip()
            if not rest.startswith(", hp."):
                return calls
            start = text.index("hp.", i)
    return calls


def mismatches() -> list:
    """``[(heading, statement, what differs)]``; where ``inspect`` has no signature (a
    builtin type: torch's ``Shard``), nothing is compared."""
    out = []
    for heading, statement in documented():
        target, _, call = statement.rpartition(" = ")
        name = re.match(r"hp\.(\w+)\(", call).group(1)
        if name not in hp.__all__:
            out.append((heading, statement, f"hp.{name} is not in hp.__all__"))
            continue
        try:
            actual = inspect.signature(getattr(hp, name))
        except ValueError:
            continue
        problem = _bind(actual, call) if target else _compare(actual, call)
        if problem:
            out.append((heading, statement, problem))
    return out


def _compare(actual: inspect.Signature, call: str) -> str | None:
    args = call[call.index("(") + 1:-1]
    try:
        written = ast.parse(f"def f({args}): pass").body[0].args
    except SyntaxError:
        return f"({args}) is not a Python parameter list; the code has {_plain(actual)}"
    params = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in written.args] + \
        [(a.arg, inspect.Parameter.KEYWORD_ONLY) for a in written.kwonlyargs]
    defaults = dict(zip([a.arg for a in written.args][::-1], written.defaults[::-1]))
    defaults.update({a.arg: d for a, d in zip(written.kwonlyargs, written.kw_defaults) if d})
    if params != [(p.name, p.kind) for p in actual.parameters.values()]:
        return f"the code has {_plain(actual)}"
    for param in actual.parameters.values():
        default = defaults.get(param.name)
        has_default = param.default is not inspect.Parameter.empty
        # the page's default evaluated among hp's names (MixedPrecisionPolicy(), 5 * 1024**3)
        if (default is not None) != has_default or (
                has_default and eval(ast.unparse(default), vars(hp)) != param.default):  # noqa: S307
            return (f"{param.name}'s default is written "
                    f"{ast.unparse(default) if default is not None else 'as none'}; "
                    f"the code has {_plain(actual)}")
    return None


def _plain(signature: inspect.Signature) -> str:
    """The signature without its annotations, as the page writes them."""
    return str(signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty)
                    for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty))


def _bind(actual: inspect.Signature, call: str) -> str | None:
    written = ast.parse(call).body[0].value
    try:
        actual.bind(*written.args, **{k.arg: k.value for k in written.keywords})
    except TypeError as error:
        return f"the call's arguments do not bind to {actual}: {error}"
    return None
