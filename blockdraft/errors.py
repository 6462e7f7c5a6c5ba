"""Errors about one named parameter, worded for the Python API; the CLI adds the flag's name.

    raise param_error("top_p", f"top_p must be in (0, 1], got {top_p!r}")
    # Python API: "top_p must be in (0, 1], got 2.0"
    # CLI (cli.main, when the command has --top-p): "top_p (--top-p) must be in (0, 1], got 2.0"

The same checks serve both callers (SamplingParams, LLM, the engine configs), so a message can
only name the Python parameter; the flag is added where the value came from a flag.
"""

from __future__ import annotations

import re


def param_error(param: str, message: str, kind: type[Exception] = ValueError) -> Exception:
    """`kind(message)` about the Python parameter `param`, which `message` names as a whole word;
    its `.param` lets the CLI name the flag (flag_message)."""
    error = kind(message)
    error.param = param
    return error


def flag_of(param: str) -> str:
    """The CLI flag of a Python parameter: max_num_seqs -> --max-num-seqs."""
    return "--" + param.replace("_", "-")


def flag_message(error: BaseException, flags) -> str:
    """`error`'s message, its parameter's first mention followed by the flag when it is in `flags`
    (the option strings of the command that ran): "top_p must ..." -> "top_p (--top-p) must ...".
    A message without a param_error parameter, or one the command has no flag for, is unchanged."""
    message = str(error)
    param = getattr(error, "param", None)
    if param is None or flag_of(param) not in flags:
        return message
    return re.sub(rf"(?<![\w.-]){re.escape(param)}(?![\w-])", f"{param} ({flag_of(param)})", message, count=1)
