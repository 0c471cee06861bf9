"""A model bigger than any one peer's memory: peer processes on 127.0.0.1 given `--max-memory`
claim as many layers as fit, together serve the whole model token-identically to transformers,
and none grows past its budget; the client holds only the model's embeddings, norm and head."""

import os
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model
from tests.random_llama import CONFIG, write_random_llama

GIB = 1 << 30
BUDGET = 1.2  # GiB per peer: the 1.5 GiB model needs three of them
PEERS = 3
IDS = [3, 17, 42, 99, 5, 250, 7, 1]
NEW = 4


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("big-llama"))


def status_kib(pid: int, field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1))


@pytest.mark.slow
def test_peers_claim_layers_by_memory_and_serve_a_model_none_could_hold(big_model):
    source = resolve_model(str(big_model))
    weights = sum(f.stat().st_size for f in big_model.glob("*.safetensors"))
    assert weights > BUDGET * GIB  # no peer could hold it
    options = ["--max-memory", str(BUDGET), "--throughput", "100", "--session-limit", "64"]
    with LocalSwarm(model=str(big_model), fork=False) as swarm:
        swarm.wait_ready(swarm.launch(None, options), timeout=120)
        for proc in [swarm.launch(None, options) for _ in range(PEERS - 1)]:
            swarm.wait_ready(proc, timeout=120)
        logs = [(swarm.workdir / f"peer{i}.log").read_text() for i in range(PEERS)]
        fits = [int(re.search(r"(\d+) layers of \d+ MiB \(float32\) fit in 1229 MiB", log).group(1)) for log in logs]
        claims = sorted(tuple(map(int, re.search(r"serving layers (\d+):(\d+)", log).groups())) for log in logs)
        assert all(8 <= fit < CONFIG["num_hidden_layers"] for fit in fits), fits
        assert all(end - start <= max(fits) for start, end in claims), (claims, fits)
        assert claims[0][0] == 0 and claims[-1][1] == CONFIG["num_hidden_layers"], claims

        loop = BackgroundLoop("test-memory")
        try:
            client = loop.run(join_swarm(swarm.maddrs, client_mode=True))
            before = status_kib(os.getpid(), "RssAnon")
            model = RemoteCausalLM.build(source, client, compression="none", verify=0.0)
            client_growth = (status_kib(os.getpid(), "RssAnon") - before) * 1024
            result = loop.run(model.generate(IDS, NEW, stop_at_eos=False, decode=False))
            loop.run(client.shutdown())
        finally:
            loop.close()
        peaks = [status_kib(proc.pid, "VmHWM") * 1024 for proc in swarm.processes]
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(big_model, dtype=torch.float32).eval()
        expected = reference.generate(torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert result.token_ids == expected[0, len(IDS):].tolist()
    assert max(peaks) <= BUDGET * GIB, [p / GIB for p in peaks]
    assert client_growth < 64 << 20  # the client read its embeddings, norm and head, not the layers


@pytest.mark.slow
def test_an_int8_peer_stays_in_its_budget_while_it_serves(big_model):
    """The promise a quantized peer makes: its resident peak, loading and then serving, stays within
    `--max-memory` (its weights are a quarter of float32's; the loader's copies must not stay
    resident, and its forwards' dequantized temporaries count in its plan)."""
    source = resolve_model(str(big_model))
    # GiB: the int8 layers (384 MiB), their forwards' dequantized temporaries (4 float32 layers,
    # 256 MiB) and the process; not the float32 weights (1.5 GiB)
    budget = 1.4
    options = ["--max-memory", str(budget), "--quant", "int8", "--throughput", "100", "--session-limit", "64"]
    with LocalSwarm(model=str(big_model), fork=False) as swarm:
        proc = swarm.launch(None, options)
        swarm.wait_ready(proc, timeout=120)
        log = (swarm.workdir / "peer0.log").read_text()
        start, end = map(int, re.search(r"serving layers (\d+):(\d+)", log).groups())
        loop = BackgroundLoop("test-memory-int8")
        try:
            client = loop.run(join_swarm(swarm.maddrs, client_mode=True))
            model = RemoteCausalLM.build(source, client, compression="none", verify=0.0)
            results = [loop.run(model.generate(IDS[:n], NEW, stop_at_eos=False, decode=False)) for n in (8, 5, 3)]
            loop.run(client.shutdown())
        finally:
            loop.close()
        peak = status_kib(proc.pid, "VmHWM") * 1024
    assert (start, end) == (0, CONFIG["num_hidden_layers"]), log  # the whole model fits in int8
    assert all(len(r.token_ids) == NEW for r in results)
    assert peak <= budget * GIB, peak / GIB
