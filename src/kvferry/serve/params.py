"""OpenAI request -> (prompt token ids, SamplingParams), with the edge checks.

Everything here raises ``APIError`` (400) naming the field, so bad input is
rejected before it reaches the engine loop. Tokenization happens here, on
the HTTP side, because the context-length checks need the prompt length and
so that the engine loop thread spends its time on steps only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2

from kvferry.model.tokenizer import PromptTooLong
from kvferry.sampling import SamplingParams, StructuredOutputsParams
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from kvferry.structured.spec import GrammarSpec, check_compiles
from kvferry.serve.tools import ToolPlan, message_dicts

# Field names SamplingParams may name in a ValueError, mapped to the request
# field the client sent (they are the same except for top_logprobs).
_PARAM_FIELDS = {
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "logprobs",
}


# prompts x n: each prompt is its own engine request of n sequences; the
# bound keeps one request from flooding the scheduler (the same 2048 as
# OpenAI's bound on embeddings inputs).
MAX_COMPLETION_SEQUENCES = 2048


@dataclass(slots=True, frozen=True)
class CompletionPrompt:
    """One prompt of a completions request: its token ids, and the text the
    client sent (None when it sent token ids)."""

    ids: list[int]
    text: str | None = None


def too_long(exc: PromptTooLong, where: str, param: str, max_model_len: int) -> APIError:
    """The 400 of a text refused before encoding (Tokenizer.max_prompt_chars)."""
    return bad_request(
        f"{where}: This model's maximum context length is {max_model_len} tokens, which hold at most "
        f"{exc.max_chars} characters of text for this tokenizer. However, your {where} has {exc.num_chars} "
        "characters. Please shorten it.", param)


def completion_prompts(req: CompletionRequest, tokenizer: Any, vocab_size: int, max_model_len: int | None = None,
                       max_chars: int | None = None) -> list[CompletionPrompt]:
    """The prompts of a completions request, as OpenAI and vLLM read
    ``prompt``: a string, a list of strings, token ids (one prompt), or a
    list of token-id lists. Every one is checked here (400 naming
    ``prompt``), so that a bad one fails the request before any runs.
    ``max_chars``: a string prompt longer than this cannot fit the context
    (``max_model_len``) and is refused before encoding."""
    prompt = req.prompt
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # one prompt as token ids
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    if len(items) * req.n > MAX_COMPLETION_SEQUENCES:
        raise bad_request(f"prompt holds {len(items)} prompts and n is {req.n}: {len(items) * req.n} sequences; "
                          f"at most {MAX_COMPLETION_SEQUENCES} (prompts x n) per request", "prompt")
    out = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if not item:
            raise bad_request(f"{where} must not be empty", "prompt")
        if isinstance(item, str):
            try:
                out.append(CompletionPrompt(tokenizer.encode(item, max_chars=max_chars), item))
            except PromptTooLong as exc:
                raise too_long(exc, where, "prompt", max_model_len or 0) from None
            continue
        bad = next((t for t in item if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
        out.append(CompletionPrompt(list(item)))
    return out


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Any, plan: ToolPlan, template: str | None,
                    add_generation_prompt: bool = True, param: str = "messages",
                    special_tokens_in_content: bool = False, max_model_len: int | None = None,
                    max_chars: int | None = None) -> list[int]:
    """Render the chat template (with the request's tools) and encode it. The
    template already writes BOS / role tokens, so no special tokens are added
    again; special-token text inside the messages and tools stays plain text
    (a user cannot open a system turn by typing one) unless the server runs
    with --allow-special-tokens-in-content. A rendered conversation longer
    than ``max_chars`` cannot fit the context and is refused before encoding."""
    if not messages:
        raise bad_request(f"{param} must not be empty", param)
    dicts = plan.template_messages(message_dicts(messages))
    try:
        return tokenizer.encode_chat(dicts, add_generation_prompt=add_generation_prompt, tools=plan.tools or None,
                                     chat_template=template, special_tokens_in_content=special_tokens_in_content,
                                     max_chars=max_chars)
    except PromptTooLong as exc:
        raise too_long(exc, param, param, max_model_len or 0) from None
    except jinja2.TemplateError as exc:
        raise bad_request(f"chat template error: {exc}", param) from exc
    except (ValueError, TypeError) as exc:  # no chat template; a template tripping over odd input
        raise bad_request(f"chat template error: {exc}", param) from exc


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       prompt_param: str, limits: "MaxTokens | None" = None,
                       param: str = "max_tokens", which: str | None = None) -> int:
    """Check the prompt and max_tokens against the context length (as vLLM
    does: prompt + max_tokens must fit) and the server's cap; None means the
    server default, else "up to the context" (capped by the limit).
    ``which``: the prompt's name in a request of several (``prompt[2]``),
    put before the context-length errors."""
    limits = limits or MaxTokens()
    where = f"{which}: " if which else ""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"{where}This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt.",
            prompt_param,
        )
    if requested is None:
        room = max_model_len - num_prompt_tokens
        return min(room, limits.default or room, limits.limit or room)
    if requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if limits.limit is not None and requested > limits.limit:
        raise bad_request(f"{param} must be at most {limits.limit} on this server, got {requested}", param)
    if num_prompt_tokens + requested > max_model_len:
        raise bad_request(
            f"{where}This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} in the "
            "completion). Please reduce the length of the prompt or the completion.",
            param,
        )
    return requested


@dataclass(slots=True, frozen=True)
class MaxTokens:
    """The server's generation-length policy (--max-tokens-default / -limit)."""

    default: int | None = None
    limit: int | None = None


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    plan: ToolPlan | None = None) -> SamplingParams:
    """Build SamplingParams; its own checks raise ValueError naming the field.
    ``plan``: the request's tools, whose grammar enforces tool_choice."""
    _reject_unsupported(req)
    structured = structured_outputs(req, plan.grammar if plan is not None else None)
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=_or(req.temperature, 1.0),
            top_p=_or(req.top_p, 1.0),
            top_k=_or(req.top_k, 0),
            min_p=_or(req.min_p, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0),
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured,
            kv_retention_s=req.kv_retention_s,
        )
    except ValueError as exc:
        raise bad_request(str(exc), named_field(str(exc))) from exc


def structured_outputs(req: SamplingFields, tool_grammar: str | None = None) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever one way it was asked
    for; compiled here (without a tokenizer) so that a bad schema, regex or
    grammar is a 400 naming the field and never reaches the core."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        wrapper = fmt.json_schema
        if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema"), dict):
            raise bad_request("response_format.json_schema.schema must be a JSON object",
                              "response_format.json_schema.schema")
        asked.append(("response_format.json_schema.schema", {"json": wrapper["schema"]}))
    text = getattr(req, "text", None)  # /v1/responses: the same kinds, under text.format
    constraint = text.format.constraint() if text is not None and text.format is not None else None
    if constraint is not None:
        asked.append(constraint)
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        fields = {"json": so.json_, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
                  "grammar": so.grammar}
        asked.append(("structured_outputs", {k: v for k, v in fields.items() if v not in (None, False)}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name, None) is not None:
            asked.append((name, {kind: getattr(req, name)}))
    if tool_grammar is not None:
        asked.append(("tool_choice", {"grammar": tool_grammar}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"only one output constraint per request is allowed, got {names}", asked[1][0])
    param, kwargs = asked[0]
    try:
        structured = StructuredOutputsParams(**kwargs)
        check_compiles(GrammarSpec.from_params(structured), param)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith(param):
            message = f"{param}: {message}"
        raise bad_request(message, param) from None
    return structured


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat asks with a bool plus a count; the engine wants the count."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if not req.logprobs:
        return None
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
    return req.top_logprobs or 0


def _reject_unsupported(req: SamplingFields) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (beam search / best-of is not supported)", "best_of")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def named_field(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_FIELDS else None


def raise_for_model(requested: str | None, served_names: list[str]) -> str:
    """The model name to report back; 404 for a name this server does not serve."""
    if requested is None or requested == "":
        return served_names[0]
    if requested not in served_names:
        raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
    return requested
