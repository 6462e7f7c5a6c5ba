"""Errors about one named parameter, worded for the Python API; the CLI adds the flag's name.

    raise param_error("top_p", f"top_p must be in (0, 1], got {top_p!r}")
    # Python API: "top_p must be in (0, 1], got 2.0"
    # CLI (cli.main, when the command has --top-p): "top_p (--top-p) must be in (0, 1], got 2.0"

The same checks serve both callers (SamplingParams, LLM, the engine configs), so a message can
only name the Python parameter; the flag is added where the value came from a flag.

Also the check of an output file flag (check_writable_file, refuse_unwritable), shared by the CLI
commands and the `python -m blockdraft.bench.*` scripts, which must not import blockdraft.cli.
"""

from __future__ import annotations

import os
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
    Python wording a flag's value cannot take is dropped there: "must be None or an integer >= 1"
    reads "must be an integer >= 1" (a flag left out is the None). A message without a param_error
    parameter, or one the command has no flag for, is unchanged; a message that starts with its
    parameter as a field inside a flag's JSON ("structured_outputs.regex is invalid ...", param
    "regex") names that flag after it."""
    message = str(error)
    param = getattr(error, "param", None)
    head = re.match(r"(\w+)\.([\w.]+)", message)  # "structured_outputs.choice must ...": a field of a flag's JSON
    if head and param in head.group(2).split(".") and flag_of(head.group(1)) in flags:
        return f"{head.group(0)} ({flag_of(head.group(1))}){message[head.end():]}"
    if param is None or flag_of(param) not in flags:
        return message
    message = message.replace("must be None or ", "must be ")
    # a whole word, not part of a path or a quoted value ('/tmp/draft' stays as it is)
    return re.sub(rf"(?<![\w./'\"-]){re.escape(param)}(?![\w/'\"-])", f"{param} ({flag_of(param)})", message, count=1)


def check_unicode_text(text: str, what: str, param: str | None = None) -> None:
    """Refuse text that is not valid Unicode, so that it cannot reach the tokenizer (whose own error
    is a bare TypeError from its Rust side): a lone surrogate code point U+D800-U+DFFF, which is what
    bytes that are not UTF-8 become in a command line (Python's surrogateescape: byte 0xE9 arrives
    as U+DCE9) and what a JSON "\\ud800" escape decodes to.

    `what` names the text ("prompt 0", "stop string 'x'"); `param`: the parameter, for a param_error
    (the CLI then names its flag). Raises:
        ValueError: naming `what`, the character's position and, for an escaped byte, the byte.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        found = (f"byte 0x{code - 0xDC00:02X}, which is not UTF-8," if 0xDC80 <= code <= 0xDCFF
                 else f"a lone surrogate U+{code:04X}")
        message = (f"{what} is not valid Unicode text: {found} at character {e.start}; give UTF-8 text "
                   f"(e.g. convert a Latin-1 file with `iconv -f latin1 -t utf-8`)")
        raise (param_error(param, message) if param else ValueError(message)) from None


def check_unicode_texts(value, what: str, param: str | None = None) -> None:
    """check_unicode_text on every string in `value`: a str, or dicts (keys and values) and lists
    nested (a chat message, tool definitions, a JSON Schema)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            check_unicode_text(node, what, param)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def check_writable_file(path: str, flag: str = "--json", example: str = "report.json") -> None:
    """Refuse an output file path before any work, so that minutes of decoding are not lost
    writing it: a missing (or non-folder) parent, a path that is a folder, an unwritable location.

    `example`: the file name suggested inside a folder given instead of a file.
    Raises:
        ValueError: naming `flag` and `path`.
    """
    folder = os.path.dirname(os.path.abspath(path))
    # "out/" or an existing folder: open() would raise IsADirectoryError only after the run
    if str(path).endswith((os.sep, "/")) or os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder: give a file path, e.g. {os.path.join(path, example)!r}")
    if not os.path.exists(folder):
        raise ValueError(f"{flag} {path!r}: folder {folder!r} does not exist")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: {folder!r} is a file, not a folder")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path!r}: not writable")
    # os.access says yes to root on a read-only or pseudo file system (/sys): open it for real
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        why = e.strerror or e
        if not existed:  # e.g. /proc: ENOENT although the folder exists
            why = f"{folder!r} refuses new files: {why}"
        raise ValueError(f"{flag} {path!r}: not writable ({why})") from None
    if not existed:
        os.remove(path)


def refuse_unwritable(parser, flag: str, path: str | None) -> None:
    """`parser.error` (one usage line, exit 2) when `path` (given with `flag`) is no writable file
    path (check_writable_file); nothing when `path` is None or empty (flag not given)."""
    if not path:
        return
    try:
        check_writable_file(path, flag)
    except ValueError as e:
        parser.error(str(e))
