"""Tool calling on the wire (chat completions): the functions a request offers (`tools`), how
it lets the model use them (`tool_choice`, `parallel_tool_calls`), the calls an assistant
message carries in a conversation's history, and `chat_template_kwargs` for the template."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvfleet.engine.protocol.base import OpenAIBaseModel

MAX_TOOLS = 128


class FunctionSpec(OpenAIBaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class ToolSpec(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(OpenAIBaseModel):
    """A call an assistant message made, in a conversation's history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(OpenAIBaseModel):
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_choice_mode(self) -> str | None:
        """None (no tools in play), "auto", "required", or the name of the function the
        model must call; ValueError for a choice the tools cannot meet."""
        tools = self.tools or []
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if choice is None:
            return "auto" if tools else None
        if choice == "none":
            return None
        if not tools:
            raise ValueError(f"tool_choice {_shown(choice)} needs tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names the function {choice.function.name!r}, which is not "
                    f"among the tools: {names}"
                )
            return choice.function.name
        return choice

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (none when tool_choice is "none")."""
        if self.tool_choice_mode() is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]


def _shown(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
