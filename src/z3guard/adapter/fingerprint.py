"""Fingerprints of the DeepSpeed code a speed path was written against.

A speed path replaces or re-implements some of DeepSpeed's methods, and is proven bit-identical to the
code it replaces, not to whatever a later release puts there. So each path names the stock code it stands
on; at install its fingerprint is computed from the source actually loaded and compared with the ones
its tests passed on. Where it differs (another release, a local patch, someone else's monkey-patch), that
path alone stays off. The fingerprint ignores what cannot change behaviour (comments, blank lines,
docstrings, line breaks inside brackets) and nothing else, and depends on no Python version's `ast`.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import io
import textwrap
import tokenize
from pathlib import Path
from typing import Iterable

# A target is "module:Qualified.name" (a function or method) or "module:/relative/file" (a file shipped
# in the package, for kernels compiled from source at run time).
Target = str

_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}


def normalise(source: str) -> str:
    """`source` as tokens, without comments, blank lines or docstrings; one token per line."""
    out: list[str] = []
    tokens = _fstrings_whole(list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline)))
    expect_docstring = skip_newline = False
    for i, tok in enumerate(tokens):
        if tok.type in _SKIPPED:
            continue
        if skip_newline and tok.type == tokenize.NEWLINE:
            skip_newline = False
            continue
        if tok.type == tokenize.INDENT:
            expect_docstring = out[-2:] == ["OP :", "NEWLINE"]
            out.append("INDENT")
            continue
        if expect_docstring and tok.type == tokenize.STRING:
            nxt = next((t for t in tokens[i + 1:] if t.type not in _SKIPPED), None)
            if nxt is not None and nxt.type == tokenize.NEWLINE:
                expect_docstring, skip_newline = False, True
                continue  # a docstring, and the end of its line
        expect_docstring = False
        name = tokenize.tok_name[tok.type]
        out.append(name if tok.type in (tokenize.NEWLINE, tokenize.DEDENT) else f"{name} {tok.string}")
    return "\n".join(out)


def _fstrings_whole(tokens: list[tokenize.TokenInfo]) -> list[tokenize.TokenInfo]:
    """Python 3.12 splits an f-string into parts (FSTRING_START ... FSTRING_END); earlier ones give one
    STRING token. Join the parts back, so that a fingerprint does not depend on the Python version."""
    start_type = getattr(tokenize, "FSTRING_START", None)
    if start_type is None:
        return tokens
    end_type = tokenize.FSTRING_END
    out: list[tokenize.TokenInfo] = []
    depth, first = 0, None
    for tok in tokens:
        if tok.type == start_type:
            depth += 1
            first = first or tok
            continue
        if depth:
            if tok.type == end_type:
                depth -= 1
                if not depth:
                    text = _span(first.line, first.start, tok.end) if first.start[0] == tok.end[0] else None
                    out.append(tok._replace(type=tokenize.STRING, string=text or "<f-string>", start=first.start))
                    first = None
            continue
        out.append(tok)
    return out


def _span(line: str, start: tuple[int, int], end: tuple[int, int]) -> str:
    return line[start[1]:end[1]]


@functools.cache
def _module_tree(module_name: str) -> tuple[ast.Module, list[str]]:
    text = inspect.getsource(importlib.import_module(module_name))
    return ast.parse(text), text.splitlines(keepends=True)


def definition(target: Target) -> tuple[ast.AST, str]:
    """The `def` or `class` that `target` names, found in its module's source (the code as written, not
    what a decorator returns at run time), with its text, decorators included."""
    module_name, _, attr = target.partition(":")
    node: ast.AST
    node, lines = _module_tree(module_name)
    for part in attr.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part)
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return node, "".join(lines[start - 1:node.end_lineno])


def parameters(target: Target) -> list[str]:
    """The parameter names of the function `target` names, as written."""
    node, _ = definition(target)
    args = node.args
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]


def _resolve(target: Target) -> str:
    module_name, _, attr = target.partition(":")
    if attr.startswith("/"):
        path = Path(importlib.import_module(module_name).__file__).parent / attr[1:]
        return path.read_text()
    return normalise(definition(target)[1])


def of(targets: Iterable[Target]) -> str:
    """One fingerprint over `targets`, in order; raises when one cannot be found or read."""
    digest = hashlib.sha256()
    for target in targets:
        digest.update(target.encode() + b"\0" + _resolve(target).encode() + b"\0")
    return digest.hexdigest()[:16]
