"""`python -m blockdraft` runs the `blockdraft` command (where the console script is not on PATH)."""

import subprocess
import sys
from pathlib import Path

from blockdraft import __version__

ROOT = Path(__file__).resolve().parents[1]


def test_python_dash_m_runs_the_command():
    run = subprocess.run([sys.executable, "-m", "blockdraft", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert (run.returncode, run.stdout.strip()) == (0, f"blockdraft {__version__}")
    bad = subprocess.run([sys.executable, "-m", "blockdraft", "generate", "hi", "--max-tokens", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "max_tokens (--max-tokens) must be an integer >= 1, got 0" in bad.stderr
