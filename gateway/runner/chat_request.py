"""A conversation and how to render it, checked alike for the HTTP and the gRPC API."""

from __future__ import annotations

from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2, tokenizer_pb2

# The speakers a turn may have (ChatMessage.role); the HTTP API maps OpenAI's "developer" to "system".
ROLES = ("system", "user", "assistant", "tool")


def chat_request(
    turns: list[sampling_pb2.ChatMessage],
    add_generation_prompt: bool | None,
    continue_final_message: bool,
    template_kwargs_json: str = "",
    prefix: str = "",
) -> tokenizer_pb2.ApplyChatTemplateRequest:
    """The ApplyChatTemplateRequest for `turns`: a generation prompt unless the last (assistant)
    message is to be continued. `prefix` goes before field names in errors."""
    if not turns:
        raise InvalidArgument(f"{prefix}messages", "must be a non-empty array of messages")
    for index, turn in enumerate(turns):
        if turn.role not in ROLES:
            raise InvalidArgument(
                f"{prefix}messages[{index}].role", f"must be one of {', '.join(ROLES)}, got {turn.role[:32]!r}"
            )
    if continue_final_message and add_generation_prompt:
        raise InvalidArgument(f"{prefix}continue_final_message", "cannot be combined with add_generation_prompt true")
    if continue_final_message and turns[-1].role != "assistant":
        raise InvalidArgument(f"{prefix}continue_final_message", "needs the last message to be the assistant's")
    return tokenizer_pb2.ApplyChatTemplateRequest(
        messages=turns,
        continue_final_message=continue_final_message,
        template_kwargs_json=template_kwargs_json,
        add_generation_prompt=not continue_final_message if add_generation_prompt is None else add_generation_prompt,
    )
