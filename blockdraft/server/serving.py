"""One API request end to end: check -> parse -> plan -> submit -> stream or collect -> format.

The two endpoints differ only in how a prompt is built and how a choice looks; `CompletionFormat`
and `ChatFormat` hold those differences, `Serving` everything else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from blockdraft.engine.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams
from blockdraft.server import responses as R
from blockdraft.server.async_engine import AsyncEngine, EngineDeadError, ServerBusyError, now
from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.errors import APIError, error_body, model_not_found
from blockdraft.server.http import ClientDisconnected, EventStreamResponse, read_json_object, until_disconnect
from blockdraft.server.params import Plan, build_plan, chat_prompt, completion_prompts, echo_texts, engine_refusal
from blockdraft.server.protocol import ChatCompletionRequest, CompletionRequest, base_request_id, parse_request
from blockdraft.server.tool_calls import ToolStream

logger = logging.getLogger("blockdraft.server")


@dataclass
class ServerContext:
    """What every request needs.

    HF fast tokenizers must not be used by two threads at once, so each user has its own copy:
    the engine thread (detokenizing), `tokenizer` in the one-thread `tokenize_pool` (prompts and
    chat templates, off the event loop: a 1 MiB prompt takes a while), and `token_text` (logprobs,
    on the event loop).
    """

    config: ServerConfig
    model: ModelInfo
    engine: AsyncEngine
    tokenizer: object
    token_text: R.TokenText
    tokenize_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="blockdraft-tokenize")
    )


class _Cursor:
    """How much of one choice a stream has sent.

    While a choice runs, the last (longest stop string - 1) characters are held back: a stop string
    can begin in text already produced, and the engine cuts it from the text when it completes.
    Completions also hold back the logprob entries of tokens whose text is not sent yet (`held`,
    see CompletionFormat.chunk_choice). echo: the prompt text a completions `echo` stream still has
    to send (its first chunk carries it, with the prompt's logprobs); base: its length once sent
    (the completion's text_offset values follow it). params: the choice's SamplingParams (its
    text's decoding flags, which completions' text_offset follows). tools: chat's tool-call parsing
    of this choice (a ToolStream, when the request's tool_choice asks for calls), else None.
    """

    def __init__(self, holdback: int, echo: str | None = None, params: SamplingParams | None = None,
                 tools: ToolStream | None = None) -> None:
        self.holdback = holdback
        self.tools = tools
        self.echo = echo
        self.params = params if params is not None else SamplingParams()  # None: the default flags
        self.base = 0
        self.chars = 0
        self.tokens = 0
        self.text_offsets: R.TextOffsets | None = None  # completions' text_offset, built on first use
        self.held: list[tuple[dict, int]] = []  # completions: (entry, text offset) not sent yet

    def advance(self, out: RequestOutput) -> tuple[str, list[dict] | None]:
        """(new text, logprob entries of the new tokens) since the last call."""
        end = len(out.text) if out.finished else max(self.chars, len(out.text) - self.holdback)
        delta, self.chars = out.text[self.chars : end], end
        entries = None if out.logprobs is None else out.logprobs[self.tokens :]
        self.tokens = len(out.token_ids)
        return delta, entries


class CompletionFormat:
    """/v1/completions: prompts from text or token ids; choices carry `text`."""

    request_cls = CompletionRequest
    prompt_logprobs_in_body = False  # in each choice (CompletionFormat.choice)
    id_prefix = "cmpl"
    object_full = object_chunk = "text_completion"

    def prompts(self, ctx: ServerContext, req: CompletionRequest) -> list[list[int]]:
        return completion_prompts(req, ctx.tokenizer, ctx.model)

    def choice(self, ctx: ServerContext, index: int, out: RequestOutput, plan: Plan) -> dict:
        """Choice `index` of a whole response; with `plan.echo` its prompt first (text and logprobs)."""
        logprobs = None
        if out.logprobs is not None:
            offsets = _text_offsets(ctx, plan.params[index])
            logprobs = R.completion_logprobs(out.logprobs, ctx.token_text, offsets, text_len=len(out.text))
        text = out.text
        if plan.echo:
            prompt_text = plan.prompt_texts[index]
            if logprobs is not None:
                entries = R.top_sliced(out.prompt_logprobs, plan.params[index].logprobs)
                logprobs = R.echo_logprobs(out.prompt_token_ids, entries, prompt_text, logprobs, ctx.token_text)
            text = prompt_text + text
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        if plan.prompt_logprobs is not None:  # vLLM: per choice in completions
            choice["prompt_logprobs"] = R.prompt_logprobs(out.prompt_logprobs, plan.prompt_logprobs, ctx.token_text)
        return choice

    def first_chunk_choice(self, index: int, plan: Plan) -> dict | None:
        return None

    def chunk_choice(self, ctx, index: int, cursor: _Cursor, delta: str, entries, finish: str | None,
                     out: RequestOutput) -> dict | None:
        """The choice of one stream chunk; None when there is nothing to send yet.

        With echo (cursor.echo), the choice's first chunk starts with the prompt's text and, with
        logprobs, the prompt tokens' entries (out.prompt_logprobs), as vLLM's first chunk does; the
        completion's text_offset values then count from the prompt text's start.

        A token's logprob entry is sent only once the text sent so far (cursor.chars) reaches its
        text_offset: the text of a token that may begin a stop string is held back (_Cursor), and
        the stop string, once complete, cuts the text before that token, so its offset sent early
        would point past the end of the returned text (so would a token after characters the
        engine's text keeps back before an incomplete UTF-8 character). Held entries go out with the chunk that
        sends their text, or with the last chunk, capped at the final text's length (as in the
        non-streaming response). So every chunk's offsets index the text returned up to and
        including that chunk, and the streamed offsets equal the non-streamed ones.
        """
        echo, cursor.echo = cursor.echo, None
        if echo is not None:
            cursor.base = len(echo)
        logprobs = None
        if entries is not None:
            if cursor.text_offsets is None:
                cursor.text_offsets = _text_offsets(ctx, cursor.params)
            cursor.held += zip(entries, cursor.text_offsets([e["token_id"] for e in entries]))
            # offsets never decrease: the entries to send are a prefix of the held ones
            n = len(cursor.held) if finish is not None else sum(1 for _, o in cursor.held if o <= cursor.chars)
            ready, cursor.held = cursor.held[:n], cursor.held[n:]
            if not ready and not delta and finish is None and echo is None:
                return None  # only held-back tokens: no chunk
            if echo is None:  # offsets from the prompt text's start (base 0 without echo)
                offsets = [cursor.base + min(o, cursor.chars) for _, o in ready]
                logprobs = R.completion_logprobs([e for e, _ in ready], ctx.token_text, offsets)
            else:  # echo_logprobs shifts the completion's offsets by the prompt text's length
                offsets = [min(o, cursor.chars) for _, o in ready]
                logprobs = R.echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, echo,
                                           R.completion_logprobs([e for e, _ in ready], ctx.token_text, offsets),
                                           ctx.token_text)  # fmt: skip
        return {"index": index, "text": (echo or "") + delta, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": _stop_reason(finish, out)}


class ChatFormat:
    """/v1/chat/completions: prompt from the chat template; choices carry a `message` / `delta`."""

    request_cls = ChatCompletionRequest
    prompt_logprobs_in_body = True  # vLLM: chat responses carry prompt_logprobs at the top level
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def prompts(self, ctx: ServerContext, req: ChatCompletionRequest) -> list[list[int]]:
        return [chat_prompt(req, ctx.tokenizer)]

    def choice(self, ctx: ServerContext, index: int, out: RequestOutput, plan: Plan) -> dict:
        """Choice `index` of a whole response: the assistant `message` with `out`'s text, its
        `logprobs` object when asked (else None), finish_reason and stop_reason; the message's role
        is plan.response_role (chat carries prompt_logprobs at the top level, not per choice).
        With a tool_choice plan (plan.tool_calls) the text becomes the message's tool_calls and
        content, and finish_reason follows vLLM's (server.tool_calls.ToolPlan.message)."""
        logprobs = None if out.logprobs is None else R.chat_logprobs(out.logprobs, ctx.token_text)
        message, finish = {"role": plan.response_role, "content": out.text}, out.finish_reason
        if plan.tool_calls is not None:
            message, finish = plan.tool_calls.message(plan.response_role, out.text, out.finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": out.stop_reason}

    def first_chunk_choice(self, index: int, plan: Plan) -> dict | None:
        return {"index": index, "delta": {"role": plan.response_role, "content": ""}, "logprobs": None, "finish_reason": None,
                "stop_reason": None}

    def chunk_choice(self, ctx, index: int, cursor: _Cursor, delta: str, entries, finish: str | None,
                     out: RequestOutput) -> dict | None:
        """The choice of one stream chunk: `delta` (the new text, {} when none), the logprob
        `entries` of this chunk's tokens (None: not asked), `finish` (None until the last chunk)
        and, with it, the stop_reason. Without tool calls never None: chat sends every chunk it is
        given. With tool calls (cursor.tools) the new text goes through the choice's parser: the
        delta carries the content and tool_calls items it completes, finish_reason follows vLLM's
        (ToolStream.delta), and a chunk with nothing to say (text held back, no logprobs) is None."""
        logprobs = None if entries is None else R.chat_logprobs(entries, ctx.token_text)
        if cursor.tools is None:
            message = {"content": delta} if delta else {}
        else:
            message, finish = cursor.tools.delta(delta, finish)
            if not message and logprobs is None and finish is None:
                return None
        return {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": _stop_reason(finish, out)}


class Serving:
    """Handles one endpoint's requests with a given format."""

    def __init__(self, ctx: ServerContext, fmt) -> None:
        self.ctx = ctx
        self.fmt = fmt

    async def handle(self, request: Request) -> Response:
        """Answer one request (JSON or an SSE stream). Raises APIError for every refused request
        (415 for a Content-Type other than application/json: http.read_json_object).

        A client that disconnects (while sending its body, or before its answer is complete) gets
        no answer: its engine requests are aborted, a line is logged (with request logs on) and no
        error status is counted in the metrics.
        """
        arrival = now()
        ctx = self.ctx
        try:
            body = await read_json_object(request, ctx.config.max_body_bytes)
        except ClientDisconnected as e:
            # Nobody to answer and nothing went wrong here: a log line, no error counted, as when the
            # client leaves while its answer is computed (499 is what a proxy logs for it).
            if ctx.config.log_requests:
                logger.info("%s %s: client disconnected %s, %.3f s after it arrived", request.method,
                            request.url.path[:200], e, now() - arrival)
            return Response(status_code=499)
        req = parse_request(self.fmt.request_cls, body)
        self._check_model(req)
        prompts = await asyncio.get_running_loop().run_in_executor(ctx.tokenize_pool, self.fmt.prompts, ctx, req)
        plan = build_plan(req, prompts, ctx.config, ctx.model)
        if plan.echo:
            n = len(plan.prompts) // len(prompts)  # choice c is prompt c // n
            texts = await asyncio.get_running_loop().run_in_executor(ctx.tokenize_pool, echo_texts, req, prompts,
                                                                     ctx.tokenizer, plan.prompts[::n])  # fmt: skip
            plan.prompt_texts = [texts[c // n] for c in range(len(plan.prompts))]
        rid = f"{self.fmt.id_prefix}-{base_request_id(request.headers.get('x-request-id'), req.request_id)}"
        group = await self._submit(plan, arrival, rid)
        meta = {"id": rid, "created": int(time.time()), "model": ctx.config.served_model_name}
        if req.stream:
            events = self._events(req, plan, group, meta, arrival)
            return EventStreamResponse(events, on_close=lambda: self._stream_closed(group, rid, plan, arrival))
        try:
            outs = await until_disconnect(request, group.results())
        except ClientDisconnected:
            ctx.engine.abort(group)
            self._log(rid, plan, None, arrival, "client disconnected")
            return Response(status_code=499)
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        self._log(rid, plan, outs, arrival)
        return JSONResponse(self._full_body(meta, plan, outs))

    def _stream_closed(self, group, rid: str, plan: Plan, arrival: float) -> None:
        if not group.finished and not group.failed:  # the client left mid-stream: free its KV pages now
            self.ctx.engine.abort(group)
            self._log(rid, plan, None, arrival, "client disconnected")

    def _check_model(self, req) -> None:
        name = self.ctx.config.served_model_name
        if req.model is not None and req.model != name:
            raise model_not_found(req.model, name)

    async def _submit(self, plan: Plan, arrival: float, rid: str):
        """Queue the plan's choices as one group (AsyncEngine.submit).

        Raises:
            APIError: 400 for a choice the engine refuses (params.engine_refusal: its field named,
                e.g. structured_outputs.regex for a regex that does not compile), 429 past
                --max-pending, 503 once the engine has stopped.
        """
        try:
            return await self.ctx.engine.submit(plan.prompts, plan.params, arrival, prefix=rid)
        except (ValueError, ImportError) as e:
            raise engine_refusal(e, plan) from None
        except ServerBusyError as e:
            raise APIError(429, str(e), code="server_busy") from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None

    def _full_body(self, meta: dict, plan: Plan, outs: list[RequestOutput]) -> dict:
        outs = [_shown(plan, o) for o in outs]
        body = {
            **meta,
            "object": self.fmt.object_full,
            "choices": [self.fmt.choice(self.ctx, i, o, plan) for i, o in enumerate(outs)],
            "usage": R.usage(plan.num_prompt_tokens, sum(len(o.token_ids) for o in outs),
                             self._cached_tokens(plan, outs)),
            "spec_decode_stats": R.spec_stats([o.spec for o in outs]),
        }
        if plan.prompt_logprobs is not None and self.fmt.prompt_logprobs_in_body:  # one prompt: any choice's
            body["prompt_logprobs"] = R.prompt_logprobs(outs[0].prompt_logprobs, plan.prompt_logprobs, self.ctx.token_text)
        return body

    async def _events(self, req, plan: Plan, group, meta: dict, arrival: float) -> AsyncIterator[bytes]:
        head = {**meta, "object": self.fmt.object_chunk}
        if req.include_usage:
            head["usage"] = None  # OpenAI sends null usage on every chunk but the last
        # vLLM's continuous_usage_stats: each chunk with a choice carries that choice's usage so far
        continuous = req.continuous_usage
        holdback = max((len(s) for s in plan.params[0].stop), default=1) - 1
        cursors = [_Cursor(holdback, plan.prompt_texts[i] if plan.echo else None, plan.params[i],
                           None if plan.tool_calls is None else ToolStream(plan.tool_calls))
                   for i in range(len(plan.prompts))]
        finals: dict[int, RequestOutput] = {}
        for i in range(len(cursors)):
            first = self.fmt.first_chunk_choice(i, plan)
            if first is not None:
                usage = {"usage": R.usage(len(plan.prompts[i]), 0)} if continuous else {}
                yield R.sse({**head, "choices": [first], **usage})
        try:
            async for batch in group.updates():
                for i, out in sorted(batch.items()):
                    out = _shown(plan, out)
                    frame = self._chunk(head, i, cursors[i], out, continuous)
                    if frame is not None:
                        yield frame
                    if out.finished:
                        finals[i] = out
        except EngineDeadError as e:
            yield R.sse(error_body(503, str(e)))
            yield R.SSE_DONE
            self._log(meta["id"], plan, None, arrival, f"ended with an error event ({e})")
            return
        outs = [finals[i] for i in range(len(cursors))]
        if req.include_usage:
            num_out = sum(len(o.token_ids) for o in outs)
            usage = R.usage(plan.num_prompt_tokens, num_out, self._cached_tokens(plan, outs))
            tail = {**head, "choices": [], "usage": usage}
            yield R.sse({**tail, "spec_decode_stats": R.spec_stats([o.spec for o in outs])})
        yield R.SSE_DONE
        self._log(meta["id"], plan, outs, arrival)

    def _cached_tokens(self, plan: Plan, outs: list[RequestOutput]) -> int | None:
        """usage.prompt_tokens_details.cached_tokens (None: --enable-prompt-tokens-details off):
        prompt tokens served from the prefix cache, counted as prompt_tokens is, once per prompt
        (its first choice's RequestOutput.num_cached_tokens), summed over the prompts."""
        if not self.ctx.config.enable_prompt_tokens_details:
            return None
        return sum(o.num_cached_tokens for o in outs[:: plan.n])

    def _chunk(self, head: dict, index: int, cursor: _Cursor, out: RequestOutput,
               continuous: bool = False) -> bytes | None:
        """The SSE frame of choice `index`'s new output `out` (None when there is nothing to send);
        continuous: it carries the choice's `usage` so far (prompt tokens, completion tokens)."""
        delta, entries = cursor.advance(out)
        if not delta and not entries and not out.finished and cursor.echo is None:
            return None
        choice = self.fmt.chunk_choice(self.ctx, index, cursor, delta, entries,
                                       out.finish_reason if out.finished else None, out)  # fmt: skip
        if choice is None:
            return None
        chunk = {**head, "choices": [choice]}
        if continuous:
            chunk["usage"] = R.usage(len(out.prompt_token_ids), len(out.token_ids))
        if out.finished:
            chunk["spec_decode_stats"] = R.spec_stats([out.spec])
        return R.sse(chunk)

    def _log(self, rid: str, plan: Plan, outs: list[RequestOutput] | None, arrival: float, note: str = "") -> None:
        if not self.ctx.config.log_requests:
            return
        seconds = now() - arrival
        if outs is None:
            logger.info(
                "%s: %d choice(s), %d prompt tokens, %s after %.3f s", rid, len(plan.prompts), plan.num_prompt_tokens, note, seconds
            )
            return
        reasons = ",".join(sorted({o.finish_reason or "?" for o in outs}))
        # echo with max_tokens 0: the engine's one token is not part of the answer (usage says 0)
        completion = 0 if plan.prompt_only else sum(len(o.token_ids) for o in outs)
        logger.info(
            "%s: %d choice(s), %d prompt tokens, %d completion tokens, finish=%s, %.3f s",
            rid, len(outs), plan.num_prompt_tokens, completion, reasons, seconds,
        )


def _text_offsets(ctx: ServerContext, params: SamplingParams) -> R.TextOffsets:
    """A fresh TextOffsets for one choice, decoding as its text was (`params`' flags)."""
    return R.TextOffsets(ctx.token_text.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)


def _stop_reason(finish: str | None, out: RequestOutput) -> int | str | None:
    """vLLM's `stop_reason` of a choice: the stop string or stop token id that ended it, sent with
    the chunk that finishes the choice (with its finish_reason); null in every other chunk, and for
    EOS or length (RequestOutput.stop_reason)."""
    return out.stop_reason if finish is not None else None


def _shown(plan: Plan, out: RequestOutput) -> RequestOutput:
    """`out` as the answer shows it: with echo and max_tokens 0 (Plan.prompt_only) the one token
    the engine generated is left out (no text, tokens or logprobs; finish_reason "length", as vLLM)."""
    if not plan.prompt_only:
        return out
    return dataclasses.replace(out, token_ids=[], text="", logprobs=None if out.logprobs is None else [],
                               finish_reason="length" if out.finished else None, stop_reason=None)
