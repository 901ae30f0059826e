# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a llama.cpp source tree says about its RPC backend, read before it is built.

- ``HASH_THRESHOLD`` (``ggml/src/ggml-rpc/ggml-rpc.cpp``): llama-server sends the hash of a
  weight tensor larger than this first, and a worker's rpc-server with ``-c`` loads it from its
  cache; ``rpc_cache_seed`` seeds exactly those tensors.  Sources without it have no such cache.
- ``RPC_PROTO_MAJOR_VERSION`` (``ggml/include/ggml-rpc.h``): client and server must agree on it;
  ``rpc_hello`` checks the workers answer the major the build recorded.

The ``llamacpp_source_facts`` module runs this on the builder; the build script writes the result
into the artifact's ``BUILDINFO.json``.  Stdlib only (``llamafleet.core.llamacpp_source``).
"""

from __future__ import annotations

import os
import re

from .atomic_file import read_text

RPC_SOURCE = "ggml/src/ggml-rpc/ggml-rpc.cpp"
RPC_HEADER = "ggml/include/ggml-rpc.h"

# A definition of HASH_THRESHOLD at the start of a line: `const size_t HASH_THRESHOLD = 10 * 1024 * 1024;`
# (static / constexpr and any integer type accepted) or `#define HASH_THRESHOLD (10 * 1024 * 1024)`.
# The value is kept whole and evaluated below.
_THRESHOLD_DEF = re.compile(
    r"^[ \t]*(?:(?:static[ \t]+)?(?:constexpr|const)[ \t]+(?:[\w:]+[ \t]+)+HASH_THRESHOLD[ \t]*=[ \t]*([^;\n]*);"
    r"|#[ \t]*define[ \t]+HASH_THRESHOLD[ \t]+([^\n]*?)[ \t]*(?://.*)?$)",
    re.MULTILINE)
_ANY_THRESHOLD_DEF = re.compile(r"\bHASH_THRESHOLD\b[ \t]*=(?!=)|#[ \t]*define[ \t]+HASH_THRESHOLD\b")
_PROTO_MAJOR = re.compile(r"^[ \t]*#[ \t]*define[ \t]+RPC_PROTO_MAJOR_VERSION[ \t]+\(?[ \t]*(\d+)[ \t]*\)?[ \t]*(?://.*|/\*.*)?$",
                          re.MULTILINE)
_INT_LITERAL = re.compile(r"^(\d+)[uUlL]*$")


class SourceFactsError(ValueError):
    """The source defines a fact in a form this parser does not understand (it never guesses)."""


def _product(expression: str) -> int:
    """``10 * 1024 * 1024`` (integer literals, optional u/l suffixes, parentheses around it) -> 10485760."""
    text = expression.strip()
    while text.startswith("(") and text.endswith(")"):
        text = text[1:-1].strip()
    value = 1
    for factor in text.split("*"):
        match = _INT_LITERAL.match(factor.strip())
        if not match:
            raise SourceFactsError("HASH_THRESHOLD = %s: only products of integer literals are understood" % expression)
        value *= int(match.group(1))
    return value


def parse_hash_threshold(rpc_source: str) -> int | None:
    """The HASH_THRESHOLD that ggml-rpc.cpp's text defines, in bytes; None when it defines none."""
    match = _THRESHOLD_DEF.search(rpc_source)
    if match is None:
        if _ANY_THRESHOLD_DEF.search(rpc_source):
            raise SourceFactsError("HASH_THRESHOLD is defined in a form this parser does not read")
        return None
    return _product(match.group(1) if match.group(1) is not None else match.group(2))


def parse_rpc_proto_major(rpc_header: str) -> int | None:
    """The RPC_PROTO_MAJOR_VERSION that ggml-rpc.h's text defines; None when it defines none."""
    match = _PROTO_MAJOR.search(rpc_header)
    if match is None:
        if re.search(r"#\s*define\s+RPC_PROTO_MAJOR_VERSION\b", rpc_header):
            raise SourceFactsError("RPC_PROTO_MAJOR_VERSION is defined in a form this parser does not read")
        return None
    return int(match.group(1))


def read_source_facts(src: str) -> dict:
    """``{rpc_hash_threshold, rpc_protocol}`` of the llama.cpp tree at ``src`` (None for what it lacks).

    :raises SourceFactsError: ``src`` is not a llama.cpp tree, or a definition is unreadable
        (the message names the file).
    """
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        raise SourceFactsError("%s is not a llama.cpp source tree (no CMakeLists.txt)" % src)
    facts = {}
    for key, relative, parse in (("rpc_hash_threshold", RPC_SOURCE, parse_hash_threshold),
                                 ("rpc_protocol", RPC_HEADER, parse_rpc_proto_major)):
        path = os.path.join(src, relative)
        text = read_text(path)
        try:
            facts[key] = None if text is None else parse(text)
        except SourceFactsError as exc:
            raise SourceFactsError("%s: %s" % (path, exc)) from exc
    return facts
