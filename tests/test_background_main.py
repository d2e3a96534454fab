"""A model whose classes live in the program's own script (``__main__``), compiled in the
background: the script runs in the program's process only, never again in a worker."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import subprocess_env

pytest.importorskip("torch")
pytest.importorskip("cloudpickle")

TIMEOUT = 600

# No "if __name__ == '__main__':" guard, a side effect and an argument read at the top:
# a worker that ran this script would add its pid to the file, and fail at sys.argv[2]
# (the worker's own argv has no such entry).
SCRIPT = textwrap.dedent('''
    import os
    import sys

    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    WIDTH = int(sys.argv[2])

    import anyio
    import torch
    from torch import nn

    import aiocompile.torch as aiotorch


    def gelu_twice(x):
        return nn.functional.gelu(nn.functional.gelu(x))


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)

        def forward(self, x):
            return gelu_twice(self.conv(x)) + x


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(WIDTH, 4)

        def forward(self, x):
            return self.head(self.block(x).mean(-1))


    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, WIDTH, 16)


    async def serve():
        compiled = aiotorch.compile_in_background(model, strict=True)
        try:
            with torch.no_grad():
                expected = model(x)
                first = compiled(x)
                shape = await compiled.ready(x)
                out = compiled(x)
            print(json.dumps({
                "state": shape.state, "error": None if shape.error is None else str(shape.error),
                "first_equal": bool(torch.equal(first, expected)),
                "close": bool(torch.allclose(out, expected, rtol=1e-4, atol=1e-5)),
                "compiled_calls": compiled.status().shapes[0].compiled_calls, "pid": os.getpid(),
            }))
        finally:
            await compiled.aclose()


    import json

    anyio.run(serve, backend=sys.argv[3])
''')


@pytest.mark.timeout(TIMEOUT)
def test_an_unguarded_script_compiles_its_model_and_runs_only_in_its_own_process(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    pids = tmp_path / "pids"
    run = subprocess.run([sys.executable, str(script), str(pids), "8", "asyncio"], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=tmp_path,
                         env=subprocess_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")))
    assert run.returncode == 0, run.stderr[-3000:]
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    pid = answer.pop("pid")
    assert answer == {"state": "compiled", "error": None, "first_equal": True, "close": True,
                      "compiled_calls": 1}, run.stderr[-3000:]
    # The script's top level ran once: in the program's process.
    assert pids.read_text().split() == [str(pid)]
