"""What loading the built-in model imports: torch._dynamo costs ~1.6 s of every load and nothing on
the load path needs it (nn.Embedding's own initialisation on the meta device pulled it in)."""

import subprocess
import sys

CHECK = """
import sys
from engine.api import Engine, EngineConfig
engine = Engine(EngineConfig(model="builtin:smollm2-135m", device="cpu", backend="tandem"))
print("torch._dynamo" in sys.modules)
"""


def test_loading_the_builtin_model_does_not_import_dynamo():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
