"""Signature blocks of the docs (``hp.name(params) -> result``) against the library's.

Design note
-----------
A block that lists a public name's parameters is a specification, not a program: ``*``
alone and ``-> result`` are not call syntax, so it cannot run. What it claims can be
checked: each statement ``[target =] hp.NAME(...)[ -> result]`` (or ``with hp.NAME(...) as
x:``) is read as the parameter list of ``def NAME(...)`` and compared with
``inspect.signature(hp.NAME)``: the same names in the same order; where the doc writes a
default, the same default (evaluated among hyper_parallel's names); keyword-only where the
doc writes ``*``. A name documented in several statements (a call per framework) is
checked against the union of their parameters, which must be all of the real ones.
``name=name`` (a call passing a variable) asserts only the name. Runs in the test process:
reading signatures loads no framework.
"""

from __future__ import annotations

import ast
import inspect
import re

_ARROW = re.compile(r"\)\s*->[^#\n]*")


def _statements(code: str) -> list[str]:
    """Top-level statements, comments dropped, a statement ending where its brackets close."""
    out, current, depth = [], [], 0
    for line in code.splitlines():
        text = line.split("#", 1)[0].rstrip()
        if not text.strip():
            continue
        if depth == 0 and line[:1] in (" ", "\t"):  # the body of a `with` (`...`)
            continue
        current.append(text)
        depth += sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")
        if depth == 0:
            out.append(" ".join(current))
            current = []
    if current:
        raise ValueError(f"unbalanced brackets in {current!r}")
    return out


def documented_calls(code: str) -> list[tuple[str, ast.arguments, str]]:
    """(name, parsed parameter list, statement) for every ``hp.NAME(...)`` statement."""
    calls = []
    for statement in _statements(code):
        text = _ARROW.sub(")", statement)
        match = re.match(r"^(?:with\s+)?(?:[\w, ]+=\s*)?hp\.(\w+)\((.*)\)(?:\s+as\s+\w+:)?\s*$",
                         text)
        if match is None:
            raise ValueError(f"not a signature statement: {statement!r}")
        name, params = match.groups()
        tree = ast.parse(f"def {name}({params}): pass")
        calls.append((name, tree.body[0].args, statement))
    return calls


def check_signature_block(code: str, namespace: dict) -> list[str]:
    """Every difference between the block's signatures and the library's (empty: none)."""
    problems = []
    by_name: dict[str, list] = {}
    for name, args, statement in documented_calls(code):
        by_name.setdefault(name, []).append((args, statement))
    for name, documented in by_name.items():
        real = inspect.signature(namespace[name]).parameters
        seen = set()
        for args, statement in documented:
            positional = [a.arg for a in args.posonlyargs + args.args]
            kwonly = [a.arg for a in args.kwonlyargs]
            names = positional + kwonly
            seen.update(names)
            real_order = [p for p in real if p in names]
            if names != real_order or any(p not in real for p in names):
                problems.append(f"hp.{name}: the doc lists {names}, the library has "
                                f"{list(real)} ({statement})")
                continue
            defaults = dict(zip(positional[len(positional) - len(args.defaults):],
                                args.defaults))
            defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults)
                             if d is not None})
            for param, node in defaults.items():
                if isinstance(node, ast.Name) and node.id == param:
                    continue  # `grads=grads`: a call passing it, no default claimed
                actual = real[param].default
                if actual is inspect.Parameter.empty:
                    problems.append(f"hp.{name}: the doc gives {param} a default, the library "
                                    "none")
                    continue
                claimed = eval(compile(ast.Expression(node), "<doc>", "eval"), dict(namespace))
                if claimed != actual:
                    problems.append(f"hp.{name}: {param} defaults to {actual!r}, the doc says "
                                    f"{ast.unparse(node)}")
            for param in names:  # a default the library has must be in the doc's list
                if param not in defaults and real[param].default is not inspect.Parameter.empty:
                    problems.append(f"hp.{name}: the doc shows {param} without its default "
                                    f"{real[param].default!r}")
            if args.vararg is None and kwonly:  # the doc wrote `*`
                for param in kwonly:
                    if real[param].kind is not inspect.Parameter.KEYWORD_ONLY:
                        problems.append(f"hp.{name}: {param} is not keyword-only")
                for param in positional:
                    if real[param].kind is inspect.Parameter.KEYWORD_ONLY:
                        problems.append(f"hp.{name}: {param} is keyword-only, the doc lists "
                                        "it before `*`")
        missing = [p for p in real if p not in seen]
        if missing:
            problems.append(f"hp.{name}: the doc omits parameter(s) {missing}")
    return problems
