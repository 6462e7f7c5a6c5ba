"""`blockdraft serve`: load the model (and drafter), build the app, run uvicorn until interrupted."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

from blockdraft.server.config import ServerConfig

logger = logging.getLogger("blockdraft.server")
SHUTDOWN_GRACE_S = 5.0  # a shutdown waits this long for requests in flight, then fails those left (503)


def config_from_args(args) -> ServerConfig:
    """ServerConfig from the `serve` subcommand's arguments (the API key may come from
    $BLOCKDRAFT_API_KEY so that it does not show in the process list).

    Raises:
        ValueError: an empty --api-key (e.g. `--api-key "$KEY"` with KEY unset), which would
            otherwise serve without authentication; an empty $BLOCKDRAFT_API_KEY counts as unset.
            An empty or blank --served-model-name (ServerConfig), which would otherwise become
            the --model value unnoticed.
    """
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty (an unset shell variable?): give the key, or leave --api-key out "
                         "to serve without authentication")
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("BLOCKDRAFT_API_KEY") or None,
        # only a name not given defaults to --model: an empty one (an unset variable?) is refused
        served_model_name=args.model if args.served_model_name is None else args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_pending=args.max_pending,
        log_requests=not args.no_request_log,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )


def check_address(host: str, port: int) -> None:
    """Refuse a `--host` that does not resolve or a `--port` already taken, by binding a socket
    there and closing it (another process could still take the port before uvicorn binds).

    Raises:
        ValueError: naming --host / --port and the reason.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve to an address this machine has: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on --host {host!r} --port {port}: {e.strerror}") from None


# Tokens of context `serve` needs at least, unless --max-model-len asks for less on purpose: a
# chat template with a short question and room to answer (a pool of 1 page left every chat
# request failing after a normal start).
MIN_SERVE_CONTEXT = 256


def check_pool_can_serve(args) -> None:
    """Refuse, before any weights load, a --num-kv-blocks pool that would cap the context below
    MIN_SERVE_CONTEXT tokens when --max-model-len is not given (with it, LLM checks that the pool
    holds that many). A model whose own context is shorter than the pool is not refused.

    Raises:
        ValueError: naming --num-kv-blocks, the pool's tokens and the pages needed.
    """
    blocks, page = args.num_kv_blocks, args.kv_block_size
    if args.max_model_len is not None or blocks is None or blocks < 1 or page < 1:
        return  # default pools hold far more (1024 pages on the CPU, the model's context on CUDA); < 1: CacheConfig
    pool = blocks * page
    if pool >= MIN_SERVE_CONTEXT:
        return
    from blockdraft.preflight import read_target_config

    _, _, target = read_target_config(args.model, args.cache_dir)  # config.json only (fetched if need be)
    if pool >= target.max_position_embeddings:
        return  # the model's own context is the limit, not the pool
    raise ValueError(
        f"--num-kv-blocks {blocks} x --kv-block-size {page} is a KV pool of {pool} tokens, which would cap the "
        f"context at {pool} tokens (the model's is {target.max_position_embeddings}): too few to serve, a chat "
        f"template alone takes tens of tokens. Give --num-kv-blocks {-(-MIN_SERVE_CONTEXT // page)} or more "
        f"({MIN_SERVE_CONTEXT} tokens), or --max-model-len {pool} to serve so short a context on purpose"
    )


def _context_note(max_model_len: int, model_len: int, kv, explicit: bool) -> str:
    """The start-up line's context words: the length in effect (what /v1/models reports) and what set it.

    max_model_len: the engine's; model_len: the model's max_position_embeddings; kv: the engine's
    KVCacheManager (num_blocks, kv_block_size); explicit: --max-model-len was given.
    """
    if explicit:
        return f"context {max_model_len} tokens (--max-model-len; the model's is {model_len})"
    if max_model_len < model_len:  # the pool capped it: say so, it is not the model's
        return (f"context {max_model_len} tokens (capped by the KV pool of {kv.num_blocks} pages x {kv.kv_block_size} "
                f"tokens; the model's is {model_len}: raise --num-kv-blocks for more)")
    return f"context {max_model_len} tokens (the model's)"


def _admission_note(sched) -> str:
    """The start-up line's admission batching words: the effective setting, or why none applies."""
    if sched.mixed_prefill:
        return " (admissions join decode steps: no admission batching)"
    if sched.admission_batch_ratio == 0:
        return ", admission batching off"
    return (f", admission batching ratio {sched.admission_batch_ratio:g} (wait at most "
            f"{sched.admission_max_wait_steps} steps)")


def serve(args) -> int:
    """Run the server in the foreground; returns the exit code.

    Raises:
        ValueError / FileNotFoundError: bad settings, unknown model, bad drafter (from the loaders),
            a --max-model-len the model or the KV pool cannot hold, a pool too small to serve
            (check_pool_can_serve).
    """
    import uvicorn

    from blockdraft.drafters import check_draft_flags
    from blockdraft.engine_args import llm_from_args, resolve_draft_from_args
    from blockdraft.server.api import build_app

    check_draft_flags(args.draft, args.no_draft, args.num_speculative_tokens, args.draft_vocab_size,
                      args.speculative_disable_by_batch_size)  # before binding and logging: a quick refusal
    config = config_from_args(args)
    check_address(config.host, config.port)  # before a minute of loading, not after
    check_pool_can_serve(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    draft = resolve_draft_from_args(args)  # may log why auto decodes plainly
    llm = llm_from_args(args, draft, max_logprobs=args.max_logprobs)  # the server's limit is the engine's: they agree
    app = build_app(llm, config)
    if llm.default_sampling_params:  # vLLM's start-up warning, with the values (which vLLM logs next)
        from blockdraft.generation_config import overridden_message

        logger.warning("%s", overridden_message(llm.default_sampling_params, llm.generation_config_file,
                                                "relaunch with `--generation-config vllm`"))
    elif llm.generation_config_file is not None:  # read, but nothing in it to apply: say so
        logger.info("%s sets no sampling defaults: requests that leave a field out get OpenAI's",
                    llm.generation_config_file)
    spec = llm.speculator
    drafter = f"DFlash drafter {draft}, K={spec.num_speculative_tokens}" if spec is not None else "no drafter"
    if spec is not None and getattr(spec, "draft_head", None) is not None:
        drafter += f", draft vocab {spec.draft_head.size}"
    engine = llm.engine
    if engine.runner.disable_by_batch_size is not None:
        drafter += f", no drafts in steps of {engine.runner.disable_by_batch_size}+ requests"
    graphs = engine.runner.graphs_captured
    sched = engine.scheduler.config  # the effective limits: the step budget's default depends on the device
    steps = (f"CUDA graphs {'on' if graphs else 'off'}, async scheduling {'on' if engine.async_scheduling else 'off'}, "
             f"mixed prefill {'on' if sched.mixed_prefill else 'off'}{_admission_note(sched)}, step budget "
             f"{sched.max_num_batched_tokens} tokens, up to {sched.max_num_seqs} requests"
             f"{', batch-invariant kernels' if args.batch_invariant else ''}")
    context = _context_note(engine.max_model_len, llm.target.config.max_position_embeddings, engine.scheduler.kv,
                            args.max_model_len is not None)
    auth = "API key required on /v1/*" if config.api_key else "no API key (anyone who can reach the port)"

    def started(ports: list[int]) -> None:  # after the bind: the port the OS chose for --port 0
        urls = " and ".join(_url(config.host, port) for port in ports)
        logger.info("serving %r (%s; %s) on %s, %s, %s", config.served_model_name, drafter, steps, urls, context, auth)

    def grace_expired() -> None:
        n = app.state.ctx.engine.fail_open("the server is shutting down")
        if n:
            logger.info("shutdown: %d request(s) still running after %g s answered with 503 / a stream error event",
                        n, SHUTDOWN_GRACE_S)

    server = _uvicorn_server(uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level,
                                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5), started, grace_expired)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised SIGINT (as uvicorn.run)
        pass
    return 0 if server.started else 3  # 3: uvicorn's exit status when it could not start


def _url(host: str, port: int) -> str:
    """http://HOST:PORT, the host in brackets when it is an IPv6 address."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(config, on_started: Callable[[list[int]], None],
                    on_grace_expired: Callable[[], None] | None = None, grace_s: float | None = None):
    """A uvicorn.Server that calls `on_started(ports)` once its sockets are bound and listening,
    with their ports (the OS picks one for port 0; a host with several addresses may get one each),
    and, when a shutdown (Ctrl-C, SIGTERM) has waited `grace_s` seconds (SHUTDOWN_GRACE_S) for
    requests in flight, `on_grace_expired()`: it fails them cleanly (503 / a stream error event)
    before uvicorn's own timeout (config.timeout_graceful_shutdown, longer) would cancel their
    tasks, which clients saw as plain-text 500s and streams cut without an error."""
    import uvicorn

    grace = SHUTDOWN_GRACE_S if grace_s is None else grace_s

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)  # binds, or exits with uvicorn's message
            ports = sorted({sock.getsockname()[1] for server in self.servers for sock in server.sockets})
            on_started(ports)

        async def shutdown(self, sockets=None) -> None:
            async def fail_after_grace() -> None:
                await asyncio.sleep(grace)
                on_grace_expired()

            watchdog = asyncio.create_task(fail_after_grace()) if on_grace_expired is not None else None
            try:
                await super().shutdown(sockets)  # stops accepting, waits for the requests in flight
            finally:
                if watchdog is not None:
                    watchdog.cancel()

    return Server(config)
