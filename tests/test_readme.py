"""The README's Python snippets run as written, against a real local swarm of the default model and
a `p2pfusion api` in front of it (on a free port where the README says 8000)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from tests.api_process import api_url, launch_api

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.mark.slow
def test_readme_python_snippets_run(default_model, tmp_path, forks):
    blocks = python_blocks()
    assert blocks
    with LocalSwarm(model=None, forks=forks) as swarm:
        swarm.start(even_ranges(30, 3))
        # the README's first peer writes its addresses with `--address-file peer1.addr`
        shutil.copy(swarm.workdir / "peer0.addr", tmp_path / "peer1.addr")
        api = launch_api(["--initial-peers", swarm.maddrs[0]], tmp_path / "api.log", forks)
        try:
            url = api_url(api, tmp_path / "api.log")
            for i, block in enumerate(blocks):
                script = tmp_path / f"readme_{i}.py"
                script.write_text(block.replace("http://127.0.0.1:8000", url))
                proc = subprocess.run(
                    [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
                )
                assert proc.returncode == 0, proc.stderr
                if "OpenAI(" in block:
                    # a sampled reply may end in blank lines: its text is what follows the list of models
                    listed, _, reply = proc.stdout.partition("\n")
                    assert "SmolLM2-135M-Instruct" in listed and len(reply.strip()) > 20, proc.stdout
        finally:
            api.terminate()
            api.wait(30)
    assert (tmp_path / "my-adapter" / "adapter_config.json").is_file()
    assert proc.stdout.startswith("The capital of Zorvia is")
