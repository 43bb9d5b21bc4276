"""Request bodies of the Explorer's HTTP API.

Chat Completions follows the OpenAI spec's field order; Kaizen's additions are fenced off at the
end. Unknown request fields are ignored (as vLLM does), so clients written for other servers work;
fields we accept but cannot honour are rejected by the service with a 400 that names them.

Every body whose strings reach the buffer is checked here first (``_Recorded``): a string no
database can store (a lone surrogate, a NUL) or an id wider than its column gets a 400 naming the
field, because once accepted its record could never be written.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator, model_validator

from services.common.checkpoints import AGENT_NAME
from services.common.hints import HINT_MAX_CHARS
from services.common.http.errors import APIError, check_storable
from services.common.storable import RUN_ID_MAX, TASK_ID_MAX

# JSON numbers and booleans only: "0.7" or true where a number belongs is a client bug to report.
Float = Annotated[float, Strict()]
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]


def _grouping_id(value: Any) -> Any:
    # Integers are ids too (Trinity's clients send an integer run_id, some an integer task_id);
    # stored as their decimal string, as chat requests store them. A boolean is a client bug.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if value is not None and not isinstance(value, str):
        raise ValueError("must be a string or an integer")
    return value


def _reward(value: Any) -> Any:
    # A pass/fail verdict is a reward too: true is 1.0, false 0.0.
    return float(value) if isinstance(value, bool) else value


# task_id / run_id: a string or an integer (kept as its decimal string).
GroupingId = Annotated[Annotated[str, Strict()], BeforeValidator(_grouping_id)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


STOP_MAX_CHARS = 1000
AGENT_PATTERN = AGENT_NAME.pattern


def check_grouping_id(value: Any, param: str) -> None:
    """task_id and run_id land in buffer columns of fixed width."""
    limit = TASK_ID_MAX if param.endswith("task_id") else RUN_ID_MAX
    if isinstance(value, str) and len(value) > limit:
        raise APIError(400, f"{param} is {len(value)} characters long; at most {limit} are allowed", param=param,
                       code="invalid_request")


class _Recorded(_Lenient):
    """A body whose strings end up in the buffer: checked before anything else.

    APIError (not ValueError) so that pydantic lets it through and the client gets the field's
    path and a clear reason instead of a generic validation message.
    """

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in cls.model_fields:
                if name in data:
                    check_storable(data[name], name)
        return data


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class OtherPart(_Lenient):
    type: str


ContentPart = Union[TextPart, OtherPart]


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoiceFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class StreamOptions(_Lenient):
    include_usage: Bool | None = None


class ChatCompletionRequest(_Recorded):
    messages: list[Message] = Field(min_length=1)
    model: str = Field(min_length=1)
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    max_tokens: Int | None = Field(default=None, ge=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    n: Int | None = Field(default=None, ge=1, le=128)
    presence_penalty: Float | None = None
    response_format: dict[str, Any] | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None

    # Extensions, not in the OpenAI spec
    return_token_ids: Bool | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        # Stop sequences are stored with every choice of every call: unbounded ones multiply storage.
        if any(len(x) > STOP_MAX_CHARS for x in ([v] if isinstance(v, str) else v or ())):
            raise ValueError(f"a stop sequence may be at most {STOP_MAX_CHARS} characters long")
        return v


class DemonstrationRequest(_Recorded):
    """Kaizen's own endpoint: a conversation and the ideal assistant reply, stored as a committed
    demonstration the Trainer learns from by supervised terms (cold start)."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    response: Message
    task_id: GroupingId | None = None
    comment: str | None = Field(default=None, max_length=10_000)

    @model_validator(mode="after")
    def _reply(self) -> "DemonstrationRequest":
        r = self.response
        if r.role != "assistant":
            raise ValueError("response must be an assistant message")
        if r.content in (None, "", []) and not r.tool_calls:
            raise ValueError("response needs content or tool_calls")
        check_grouping_id(self.task_id, "task_id")
        return self


class FeedbackRequest(_Recorded):
    """Compatible with Trinity-RFT's serve-mode body. Without ``msg_ids``, ``task_id`` + ``run_id``
    name an episode and the reward reaches every call of it (an extension).

    Feedback in words (extensions), each alone or beside a reward: ``hint``, what should have been
    done (every named call learns from it by on-policy self-distillation), and ``correction``, the
    reply one call should have given (it becomes a demonstration for that call's prompt)."""

    msg_ids: list[str] | None = Field(default=None, min_length=1, max_length=10_000)
    reward: Annotated[Float | None, BeforeValidator(_reward)] = None
    hint: str | None = None
    correction: Message | None = None
    task_id: GroupingId | None = None
    run_id: GroupingId | None = None
    labels: list[str] | None = None
    comment: str | None = Field(default=None, max_length=10_000)
    source: str | None = Field(default=None, max_length=128)
    agent: str | None = Field(default=None, min_length=1, max_length=128)  # episode feedback: only this agent's calls
    expected: Any = None  # what the run was expected to produce (JSON); a gated release's replay scores with it
    # a retry of this feedback sends it again under the same key: applied once (also the Idempotency-Key header)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=128)

    def digest(self) -> str:
        """The body's fingerprint, its idempotency key aside: a key reused with another body is refused."""
        body = self.model_dump(mode="json", exclude={"idempotency_key"}, exclude_none=True)
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @field_validator("expected")
    @classmethod
    def _small(cls, v: Any) -> Any:
        if v is not None and len(json.dumps(v, default=str)) > 10_000:
            raise ValueError("expected must serialize to at most 10,000 characters of JSON")
        return v

    @field_validator("msg_ids")
    @classmethod
    def _check_ids(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not i for i in v):
            raise ValueError("msg_ids must not contain empty strings")
        return v

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("reward must be a finite number")
        return v

    @field_validator("hint")
    @classmethod
    def _hint(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("hint must not be empty (leave it out to send a reward alone)")
        if v is not None and len(v) > HINT_MAX_CHARS:
            raise ValueError(f"hint has {len(v)} characters; at most {HINT_MAX_CHARS}")
        return v

    @field_validator("correction")
    @classmethod
    def _correction(cls, v: Message | None) -> Message | None:
        if v is not None and v.role != "assistant":
            raise ValueError("correction must be an assistant message (the reply the agent should have given)")
        if v is not None and v.content in (None, "", []) and not v.tool_calls:
            raise ValueError("correction needs content or tool_calls")
        return v

    @model_validator(mode="after")
    def _widths(self) -> "FeedbackRequest":
        if self.msg_ids is None and (self.task_id is None or self.run_id is None):
            raise APIError(400, "missing required parameter 'msg_ids' (or task_id and run_id, to reward a whole episode)",
                           param="msg_ids", code="invalid_request")
        if self.reward is None and self.hint is None and self.correction is None:
            raise APIError(400, "missing required parameter 'reward' (or a 'hint' or a 'correction': feedback in words)",
                           param="reward", code="invalid_request")
        if self.correction is not None and (self.msg_ids is None or len(set(self.msg_ids)) != 1):
            raise APIError(400, "a correction is the reply of one call: name that call alone in msg_ids",
                           param="correction", code="invalid_request")
        check_grouping_id(self.task_id, "task_id")
        check_grouping_id(self.run_id, "run_id")
        if self.agent is not None and self.msg_ids is not None:
            raise APIError(400, "'agent' narrows an episode's feedback (task_id + run_id) to one agent's calls; "
                           "msg_ids already name the calls", param="agent", code="invalid_request")
        return self

    @property
    def episode(self) -> bool:
        return self.msg_ids is None


class CommitRequest(_Recorded):
    """Trinity's extra keys (run_id, time_threshold) are accepted and ignored."""

    task_id: GroupingId | None = None
    msg_ids: list[str] | None = Field(default=None, max_length=10_000)

    @field_validator("msg_ids")
    @classmethod
    def _not_empty(cls, v: list[str] | None) -> list[str] | None:
        # An empty list once meant "everything in the buffer", other agents' and tenants' included.
        if v is not None and not v:
            raise ValueError("msg_ids is empty: name at least one id, or leave msg_ids out to commit by task_id")
        return v


class RollbackRequest(_Recorded):
    """POST /admin/rollback (Kaizen's own): serve ``to`` (default: the version the serving one was
    trained from) at once."""

    agent: str = Field(pattern=AGENT_PATTERN)
    to: int | None = Field(default=None, ge=0, le=2**31 - 1)
    reason: str | None = Field(default=None, max_length=2000)


class ReleaseDecisionRequest(_Recorded):
    """POST /admin/release (Kaizen's own): decide a candidate by hand."""

    agent: str = Field(pattern=AGENT_PATTERN)
    version: int = Field(ge=1, le=2**31 - 1)
    decision: Literal["promote", "reject"]
    reason: str | None = Field(default=None, max_length=2000)


# ---------------------------------------------------------------------------------------------
# Response bodies. Built once by services/explorer/serving/chat.py for plain and streaming answers.


def _unset(value: Any) -> bool:
    return value is None


# An optional key left out of the JSON when it has no value (extensions, and delta fields).
Omitted = Field(default=None, exclude_if=_unset)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: str | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class StreamToolCall(ResponseToolCall):
    index: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = Omitted


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str

    # Extensions, not in the OpenAI spec
    experience_id: str
    token_ids: list[int] | None = Omitted


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str

    # Extensions, not in the OpenAI spec
    prompt_token_ids: list[int] | None = Omitted


class Delta(BaseModel):
    role: Literal["assistant"] | None = Omitted
    content: str | None = Omitted
    tool_calls: list[StreamToolCall] | None = Omitted


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None

    # Extensions, not in the OpenAI spec
    experience_id: str
    token_ids: list[int] | None = Omitted


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = Omitted

    # Extensions, not in the OpenAI spec
    prompt_token_ids: list[int] | None = Omitted


class Demonstration(BaseModel):
    object: Literal["demonstration"] = "demonstration"
    experience_id: str
    agent: str
    prompt_tokens: int
    response_tokens: int


# ---------------------------------------------------------------------------------------------
# The Responses API (POST /v1/responses), served by translating to a chat request:
# services/explorer/translate/responses.py. Field order as in OpenAI's spec; input items are checked there.


class ResponsesRequest(_Recorded):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=128)
    include: list[str] | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    store: Bool | None = None
    stream: Bool | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    text: dict[str, Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None

    # Extensions, not in the OpenAI spec
    seed: Int | None = None
    return_token_ids: Bool | None = None


# ---------------------------------------------------------------------------------------------
# Anthropic's Messages API (POST /v1/messages), served by translating to a chat request:
# services/explorer/translate/messages.py. Content blocks are checked there.


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Recorded):
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: Int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: Bool | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=1.0)
    tool_choice: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_k: Int | None = None
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)


class CompletionRequest(_Recorded):
    """POST /v1/completions (legacy text completions): served by services/explorer/translate/completions.py."""

    model: str = Field(min_length=1)
    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: Int | None = Field(default=None, ge=1)
    echo: Bool | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    max_tokens: Int | None = Field(default=None, ge=1)
    n: Int | None = Field(default=None, ge=1, le=128)
    presence_penalty: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None

    # Extensions, not in the OpenAI spec
    metadata: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    return_token_ids: Bool | None = None
