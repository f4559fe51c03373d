"""StructuredOutputsParams: a constraint that generated text must satisfy.

vLLM's names (vllm.sampling_params.StructuredOutputsParams): exactly one of
json (a JSON schema), regex, choice, grammar (EBNF) or json_object is set."""
from __future__ import annotations

import json as json_lib
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgument

# Bounds on what one request may ask the grammar compiler to do.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
# Longest run of whitespace between JSON tokens: room for a newline and three
# levels of four-space indentation.
MAX_JSON_WHITESPACE = 16

FIELD = "sampling_params.structured_outputs"


@dataclass
class StructuredOutputsParams:
    # A JSON schema, as a dict or its JSON text: the output is a JSON value it accepts.
    json: str | dict[str, Any] | None = None
    # The whole output matches this regular expression.
    regex: str | None = None
    # The output is one of these strings.
    choice: list[str] | None = None
    # The output is a sentence of this EBNF grammar (GBNF-style, root rule `root`).
    grammar: str | None = None
    # The output is any JSON object.
    json_object: bool = False
    # JSON only: no whitespace but one space after ':' and ','. Otherwise any
    # whitespace may separate tokens, in runs of at most MAX_JSON_WHITESPACE
    # characters (a small model at a high temperature would go on forever).
    disable_any_whitespace: bool = False

    @property
    def kind(self) -> str:
        """The name of the constraint set (validate() checks there is exactly one)."""
        return self._constraints_set()[0]

    def _constraints_set(self) -> list[str]:
        kinds = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        return kinds + ["json_object"] if self.json_object else kinds

    @property
    def json_text(self) -> str | None:
        """The JSON schema as text (how it crosses the gRPC APIs)."""
        if self.json is None or isinstance(self.json, str):
            return self.json
        return json_lib.dumps(self.json)

    def validate(self) -> None:
        """Raises InvalidArgument naming the problem; whether the schema, regex or
        grammar compiles is checked by the engine core's grammar compiler."""
        kinds = self._constraints_set()
        if len(kinds) != 1:
            raise InvalidArgument(FIELD, "set exactly one of json, regex, choice, grammar and "
                                  f"json_object (got {', '.join(kinds) or 'none'})")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise InvalidArgument(f"{FIELD}.choice", f"must list 1 to {MAX_CHOICES} strings")
        spec = self.json_text or self.regex or self.grammar or ""
        if len(spec) > MAX_SPEC_CHARS:
            raise InvalidArgument(f"{FIELD}.{kinds[0]}",
                                  f"has {len(spec)} characters; at most {MAX_SPEC_CHARS}")
