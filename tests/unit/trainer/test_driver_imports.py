"""The Trainer's driver (the service, its recipes, the learner group) imports no torch: only its
learners load it, which keeps every Trainer start about 2 s shorter (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_the_driver_imports_no_torch():
    code = ("import sys\n"
            "import services.cli, services.trainer.service, services.trainer.learners, services.trainer.recipes\n"
            "from services.trainer.recipes import BUILT_IN\n"
            "assert BUILT_IN\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers', 'peft'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
