"""Run our Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

The variable is read when `@triton.jit` decorates a function -- Triton's own library functions
(tl.zeros, tl.max, ...) at `import triton`, ours when their module is imported -- so it must be
set before either happens. An interpreter test module calls `require_interpreter()` first thing:
on a machine without CUDA (where compiled kernels cannot run anyway) it sets the variable for
the rest of the process, and it skips the module when Triton is missing, when CUDA is present
(the compiled kernels are tested under tests/gpu) or when Triton or a kernel module was already
imported without the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch


def require_interpreter(*kernel_modules: str) -> None:
    """Enable the interpreter for this process or skip the calling test module (module level).

    kernel_modules: dotted names of the modules whose kernels the tests run; if one was imported
    (decorated) before the interpreter was on, the module is skipped rather than run compiled.
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the compiled kernels are tested under tests/gpu", allow_module_level=True)
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    late = [name for name in kernel_modules if name in sys.modules and not _interpreted(sys.modules[name])]
    if isinstance(tl.zeros, JITFunction) or late:
        pytest.skip(
            f"triton ({', '.join(late) or 'its library'}) was imported before TRITON_INTERPRET=1 was set; "
            "run this module on its own",
            allow_module_level=True,
        )


def _interpreted(module) -> bool:
    from triton.runtime.jit import JITFunction

    return not any(isinstance(obj, JITFunction) for obj in vars(module).values())


@pytest.fixture(autouse=True)
def numpy_index_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter turns 1-element arrays into loop bounds with `int(array)`, which
    NumPy >= 2.4 refuses for ndim > 0; index the element instead (for the test's duration).
    Import it into an interpreter test module to apply it to every test there."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
