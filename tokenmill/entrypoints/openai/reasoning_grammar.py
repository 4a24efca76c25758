"""Structured output under a reasoning parser: the constraint applies to the answer, not the reasoning.

The engine applies a request's grammar from its first output token. So the grammar itself lets
the reasoning through: an xgrammar structural tag `sequence[reasoning, whitespace, answer]` (the
reasoning any text up to </think>, from the parser's `reasoning_format()`; the answer the request's
JSON schema, regex, EBNF grammar or choices), printed as EBNF and compiled by the engine like any
`grammar` constraint (in its grammar process, with its time limit and cache). vLLM instead turns
the grammar on once the reasoning has ended; the outputs allowed are the same.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams

from tokenmill.entrypoints.openai.errors import BadRequest
from tokenmill.entrypoints.openai.reasoning_parsers import ReasoningParser

# Between </think> and the answer (Qwen3 writes "\n\n").
_GAP = {"type": "regex", "pattern": r"[ \t\r\n]{0,8}"}
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def answer_format(params: StructuredOutputsParams) -> dict[str, Any]:
    """The constraint as an xgrammar structural-tag format."""
    if params.json is not None:
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        fmt: dict[str, Any] = {"type": "json_schema", "json_schema": schema}
        if params.disable_any_whitespace:  # the nearest a structural tag has: one whitespace at most between tokens
            fmt["max_whitespace_cnt"] = 1
        return fmt
    if params.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if params.regex is not None:
        return {"type": "regex", "pattern": params.regex}
    if params.grammar is not None:
        return {"type": "grammar", "grammar": params.grammar}
    if params.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in params.choice]}
    raise BadRequest("structured_outputs has no constraint", "structured_outputs")


def reasoning_grammar(parser: type[ReasoningParser], params: StructuredOutputsParams) -> str:
    """EBNF for `params` after the parser's reasoning (blocking: xgrammar builds it)."""
    import xgrammar as xgr  # ~2 s to import: only once a constrained request comes to a reasoning model

    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [parser.reasoning_format(), _GAP, answer_format(params)]}}
    return str(xgr.Grammar.from_structural_tag(json.dumps(tag)))


async def constrain_answer(parser: type[ReasoningParser], params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """The constraint to run with: `params` on the answer only. A constraint xgrammar refuses is a
    400 naming `param` (the request field it came from)."""
    try:
        ebnf = await asyncio.to_thread(reasoning_grammar, parser, params)
    except BadRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar's errors on a bad schema, regex or grammar
        message = _XGR_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
        raise BadRequest(f"invalid {param}: {message}", param) from None
    return StructuredOutputsParams(grammar=ebnf)
