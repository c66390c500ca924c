"""Tool calling the way TGI does it (docs/api.md, Structured output and tools): the tools become one JSON grammar, the
output becomes `tool_calls`.

The model is constrained to write `{"function": {"_name": NAME, ...arguments}}`, where NAME is one of the
offered functions and the arguments follow that function's parameter schema. With `tool_choice` `auto` a
`no_tool` function (one `content` string) is offered too, so the model can answer in text; `none` offers no
tool at all; `required` every tool; a named function only that one. The grammar is compact JSON (see
kettle/grammar.py), so the arguments text is taken from the output as it is, in streams and in answers alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kettle.grammar import GRAMMAR_TYPE_JSON, grammar_text
from kettle.router.errors import ApiError

NO_TOOL = "no_tool"
# TGI's default `tool_prompt`, appended after the tools when the template does not render them itself.
TOOL_PROMPT = (
    "Given the functions available, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt. Respond in the format {name: function name, parameters: dictionary of "
    "argument name and its value}.Do not use variables."
)
_NO_TOOL_FUNCTION = {
    "name": NO_TOOL,
    "description": "Open ended response with no specific tool selected",
    "parameters": {
        "type": "object",
        "properties": {"content": {"type": "string", "description": "The response content"}},
        "required": ["content"],
    },
}
# The output up to and including the function name; the grammar fixes this layout.
NAME_HEAD = re.compile(r'\{"function": \{"_name": "((?:[^"\\]|\\.)*)"')


class ToolError(ApiError):
    """A tool request that cannot be served: 422 `tool_error`."""

    status = 422
    error_type = "tool_error"

    @property
    def message(self) -> str:
        return f"Tool error: {self}"


@dataclass(frozen=True)
class ToolPlan:
    """The functions offered to the model and the JSON Schema its output must follow."""

    functions: tuple[dict[str, Any], ...]

    @property
    def schema(self) -> dict[str, Any]:
        defs = {f["name"]: _function_schema(f) for f in self.functions}
        choices = [{"$ref": f"#/$defs/{name}"} for name in defs]
        return {
            "$defs": defs,
            "type": "object",
            "properties": {"function": {"anyOf": choices}},
            "required": ["function"],
            "additionalProperties": False,
        }


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan | None:
    """The plan for a request's tools and tool_choice, or None when no tool is to be called."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("`tool_choice` needs `tools`")
        return None
    functions = [_function(tool) for tool in tools]
    choice = _choice(tool_choice)
    if choice == "none":
        return None
    if choice == "auto":
        return ToolPlan((*functions, _NO_TOOL_FUNCTION))
    if choice == "required":
        return ToolPlan(tuple(functions))
    named = [f for f in functions if f["name"] == choice]
    if not named:
        raise ToolError(f"Tool choice '{choice}' not found in provided tools")
    return ToolPlan((named[0],))


_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


def check_tool_schemas(tools: list[dict[str, Any]] | None) -> None:
    """422 `tool_error` for a tool whose parameters the grammar engine cannot compile, whatever `tool_choice`
    says: refused up front, not after generating (the engine builds parts of a schema lazily, and ignores types
    it does not know)."""
    for tool in tools or ():
        function = _function(tool)
        name, parameters = function["name"], function["parameters"]
        unknown = _unknown_type(parameters)
        if unknown is not None:
            raise ToolError(f"the parameters of `{name}` are not a valid JSON Schema: unknown type {unknown!r}")
        try:
            grammar_text(GRAMMAR_TYPE_JSON, json.dumps(parameters))
        except ValueError as error:
            raise ToolError(f"the parameters of `{name}` are not a valid JSON Schema: {error}") from None


# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _unknown_type(schema: Any) -> Any:
    """The first `type` value in `schema` or its subschemas that is not a JSON Schema type, or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [] if kind is None else [kind]
        bad = [k for k in kinds if not isinstance(k, str) or k not in _JSON_TYPES]
        if bad:
            return bad[0]
        stack.extend(node[k] for k in _SUBSCHEMA if k in node)
        stack.extend(v for k in _SUBSCHEMA_LISTS if isinstance(node.get(k), list) for v in node[k])
        stack.extend(v for k in _SUBSCHEMA_MAPS if isinstance(node.get(k), dict) for v in node[k].values())
    return None


def tools_prompt(tools: list[dict[str, Any]], tool_prompt: str | None) -> str:
    """The text TGI appends to the last message when the template does not render `tools` itself."""
    return f"\n---\n{json.dumps(tools, ensure_ascii=False)}\n{tool_prompt or TOOL_PROMPT}"


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError("each tool needs `function` with a `name`")
    if function["name"] == NO_TOOL:
        raise ToolError(f"`{NO_TOOL}` is a reserved function name")
    # TGI accepts the parameters under `arguments` too.
    parameters = function.get("parameters", function.get("arguments")) or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolError(f"the parameters of `{function['name']}` must be a JSON Schema object")
    return {"name": function["name"], "description": function.get("description"), "parameters": parameters}


def _choice(tool_choice: Any) -> str:
    """ "auto" (also when absent), "none", "required", or a function name."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        return tool_choice
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise ToolError(f"`tool_choice` must be auto, none, required, a function name or a function. Given: {tool_choice}")


def _function_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The object the model writes for one function: `_name` first, then its parameters."""
    parameters = function["parameters"]
    properties = {"_name": {"type": "string", "const": function["name"]}, **parameters.get("properties", {})}
    schema = {
        "type": "object",
        "properties": properties,
        "required": ["_name", *parameters.get("required", [])],
        "additionalProperties": False,
    }
    if "$defs" in parameters:
        schema["$defs"] = parameters["$defs"]
    return schema


@dataclass(frozen=True)
class ToolCall:
    """The parsed output: a call (name and arguments JSON text), or for `no_tool` the text answer."""

    name: str
    arguments: str
    content: str | None = None


def parse_output(text: str) -> ToolCall:
    """The call written in a whole tool output; ToolError if the output is not complete (e.g. cut by length)."""
    head = NAME_HEAD.match(text)
    if head is None:
        raise ToolError(f"Failed to parse generated text: {text!r}")
    arguments = arguments_text(text, head.end())
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ToolError(f"Failed to parse generated text: {exc}") from None
    name = json.loads(f'"{head.group(1)}"')
    if name == NO_TOOL:
        return ToolCall(name, arguments, content=str(parsed.get("content", "")))
    return ToolCall(name, arguments)


def arguments_text(text: str, after_name: int) -> str:
    """The arguments object within the output: `{` + what follows the name, without the outer object's `}`.

    On a partial output this holds back the last character, which may be that closing brace: so every partial
    result is a prefix of the final one, and a stream can send the difference as it grows."""
    rest = text[after_name:]
    body = rest[2:] if rest.startswith(", ") else rest
    return ("{" + body)[:-1]
