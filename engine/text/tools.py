"""Tools in a chat request (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`), checked
once for every frontend, and what they ask of the template, the sampler and the answer.

- The chat template gets them as transformers' `apply_chat_template(tools=...)` passes them
  (and `tool_choice`, `parallel_tool_calls` as variables of its own, for templates that read them).
- `tool_choice` `required` or a named function constrains the answer to calls (a structural
  tag in the server's tool-call format, `tool_parsers.ToolFormat.structural_tag`): never an
  invalid call. `auto` leaves the model free and parses what it writes, which needs the
  server's `--tool-call-parser`; `none` parses nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.engine.sampling import StructuredOutput
from pdserve.engine.text.tool_parsers import TOOL_FORMATS, ToolFormat

ToolChoice = Literal["none", "auto", "required", "function"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_NO_PARAMETERS = '{"type":"object","properties":{}}'  # OpenAI: omitted parameters are an empty list


@dataclass(frozen=True, slots=True)
class Function:
    """One function tool: its name, description and the JSON schema of its arguments (JSON text)."""

    name: str
    description: str = ""
    parameters: str = _NO_PARAMETERS

    def template_tool(self) -> dict[str, Any]:
        """The tool as templates read it: OpenAI's `{"type": "function", "function": {...}}`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools and what it asks of them.

    choice: "none" (no calls: the answer is text), "auto" (the model decides), "required"
        (calls only, to any of the functions), "function" (one call, to `function_name`: as
        OpenAI's and vLLM's named tool choice).
    parallel: more than one call allowed (False: exactly one when calls are forced).
    """

    functions: tuple[Function, ...]
    choice: ToolChoice = "auto"
    function_name: str = ""
    parallel: bool = True

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, f in enumerate(self.functions):
            if not _NAME.match(f.name):
                raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {f.name!r}")
            if f.name in seen:
                raise ValueError(f"tools[{i}].function.name: {f.name!r} is given twice")
            seen.add(f.name)
        if self.choice not in ("none", "auto", "required", "function"):
            raise ValueError(f"tool_choice must be none, auto, required or a function, got {self.choice!r}")
        if self.choice in ("required", "function") and not self.functions:
            raise ValueError(f"tool_choice {self.choice} needs tools")
        if self.choice == "function" and self.function_name not in seen:
            raise ValueError(f"tool_choice names the function {self.function_name!r}, which is not in tools "
                             f"({sorted(seen)})")

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls (constrained by a grammar)."""
        return self.choice in ("required", "function")

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: the tools, and the choice in OpenAI's form."""
        choice: Any = self.choice
        if self.choice == "function":
            choice = {"type": "function", "function": {"name": self.function_name}}
        return {"tools": [f.template_tool() for f in self.functions], "tool_choice": choice,
                "parallel_tool_calls": self.parallel}

    def structured(self, fmt: ToolFormat) -> StructuredOutput:
        """The grammar of a forced answer: calls in `fmt`, to the allowed functions."""
        allowed = [f for f in self.functions if self.choice != "function" or f.name == self.function_name]
        tag = fmt.structural_tag([(f.name, json.loads(f.parameters)) for f in allowed],
                                 self.parallel and self.choice == "required")
        return StructuredOutput("structural_tag", structural_tag=tag)


def tool_request(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
                 parallel_tool_calls: bool | None) -> ToolRequest | None:
    """A ToolRequest from OpenAI's fields (None: no tools and no choice); ValueError naming the field."""
    if not tools and tool_choice in (None, "none", "auto"):  # nothing to call: a plain chat
        return None
    functions = tuple(_function(i, t) for i, t in enumerate(tools or ()))
    choice, name = _choice(tool_choice)
    return ToolRequest(functions, choice, name, True if parallel_tool_calls is None else parallel_tool_calls)


def _function(i: int, tool: Mapping[str, Any]) -> Function:
    if tool.get("type", "function") != "function":
        raise ValueError(f"tools[{i}].type must be function, got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"tools[{i}].function needs a name")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"tools[{i}].function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        return Function(function["name"], description)
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema of an object")
    from pdserve.engine.grammar import schema_error  # here: grammar.py (xgrammar) needs torch

    text = json.dumps(parameters, separators=(",", ":"))
    error = schema_error(text)
    if error is not None:
        raise ValueError(f"tools[{i}].function.parameters: unsupported or invalid JSON schema: {error}")
    return Function(function["name"], description, text)


def _choice(tool_choice: str | Mapping[str, Any] | None) -> tuple[ToolChoice, str]:
    if tool_choice is None:
        return "auto", ""  # OpenAI's default when tools are given
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}")
        return tool_choice, ""  # type: ignore[return-value]
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(function, Mapping) or not isinstance(
            function.get("name"), str):
        raise ValueError('tool_choice must be none, auto, required or {"type": "function", "function": '
                         '{"name": ...}}')
    return "function", function["name"]


def tool_format(name: str) -> ToolFormat | None:
    """The format `--tool-call-parser` names ("": none); ValueError for an unknown name."""
    if not name:
        return None
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; use one of {sorted(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]
