"""POST /tokenize and /detokenize (vLLM's extra endpoints, outside /v1 as there): the server's
own tokenization of a prompt or a chat conversation, so a client can count tokens exactly as the
server will, and token ids back to text. Both run in the tokenize pool, off the event loop."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from blockdraft.server.errors import APIError, model_not_found
from blockdraft.server.http import ClientDisconnected, read_json_object
from blockdraft.server.params import chat_prompt
from blockdraft.server.protocol import DetokenizeRequest, TokenizeRequest, parse_request


def tokenize(ctx, req: TokenizeRequest) -> dict:
    """-> {"count", "max_model_len", "tokens": [ids], "token_strs": [str] with return_token_strs, else
    null} (vLLM's response).

    Raises:
        APIError(400): neither or both of prompt and messages; a conversation the chat template refuses.
    """
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' (text) and 'messages' (a chat conversation)", param="prompt")
    if req.prompt is not None:
        ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens) if req.prompt else []
    else:
        ids = chat_prompt(req, ctx.tokenizer, add_generation_prompt=req.add_generation_prompt)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(ctx, req: DetokenizeRequest) -> dict:
    """-> {"prompt": text} (special tokens kept, as vLLM's /detokenize).

    Raises:
        APIError(400): a token id outside the vocabulary (names the first one).
    """
    bad = next((t for t in req.tokens if not 0 <= t < ctx.model.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens has token id {bad}, outside the vocabulary [0, {ctx.model.vocab_size})",
                       param="tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}


async def handle(ctx, request: Request, detok: bool) -> dict | Response:
    """Read, check and answer one /tokenize (detok False) or /detokenize (True) request (a client
    that leaves while sending its body gets nothing: 499, as the completions endpoints).

    Raises:
        APIError: 400 for a bad body or field, 404 for a `model` this server does not serve,
            413 for a body over --max-body-bytes, 415 for a Content-Type other than application/json.
    """
    try:
        body = await read_json_object(request, ctx.config.max_body_bytes)
    except ClientDisconnected:
        return Response(status_code=499)
    req = parse_request(DetokenizeRequest if detok else TokenizeRequest, body)
    if req.model is not None and req.model != ctx.model.name:
        raise model_not_found(req.model, ctx.model.name)
    work = detokenize if detok else tokenize
    return await asyncio.get_running_loop().run_in_executor(ctx.tokenize_pool, work, ctx, req)
