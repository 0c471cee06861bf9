"""The bodies of `run-peer` and `infer`, kept apart from argument parsing."""

from __future__ import annotations

import logging
import sys

from p2pfusion.client.adapters import Adapter
from p2pfusion.client.generation import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ModelError, RequestError
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config
from p2pfusion.peer.runtime import PeerOptions
from p2pfusion.peer.service import serve

log = logging.getLogger("p2pfusion")


async def run_peer(args, device: str) -> None:
    source = resolve_model(args.model)
    config = load_config(source)
    if args.layers is not None and args.layers[1] > config.num_hidden_layers:
        raise ModelError(
            f"layer range {args.layers[0]}:{args.layers[1]} is out of bounds for {source.name} "
            f"(0:{config.num_hidden_layers})"
        )
    if args.max_layers is not None and args.max_layers < 1:
        raise ModelError("--max-layers must be at least 1")
    _check_device(device)
    options = PeerOptions(
        source=source,
        initial_peers=[] if args.new_swarm else args.initial_peers,
        layers=args.layers,
        max_layers=args.max_layers,
        backup=args.backup,
        throughput=args.throughput,
        device=device,
        host=args.host,
        port=args.port,
        data_port=args.data_port,
        identity=args.identity,
        address_file=args.address_file,
        max_length=args.max_length,
        compression=args.compression,
        training_memory=args.training_memory,
    )

    def ready(maddrs: list[str]) -> None:
        print("peer is serving; others join with:", file=sys.stderr)
        for maddr in maddrs:
            print(maddr, flush=True)

    await serve(options, on_ready=ready)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ModelError(f"{device} is not available on this machine (CUDA devices: {torch.cuda.device_count()})")
    elif device == "mps" and not torch.backends.mps.is_available():
        raise ModelError("mps is not available on this machine")


async def infer(args) -> None:
    if args.max_new_tokens < 1:
        raise RequestError("--max-new-tokens must be at least 1")
    if not args.prompt.strip():
        raise RequestError("the prompt is empty")
    model = RemoteCausalLM(resolve_model(args.model), compression=args.compression)
    if args.adapter is not None:
        model.adapter = Adapter.load(args.adapter, model.config, model.source.name)
    ids = model.encode(args.prompt, args.chat)
    model.swarm = swarm = await join_swarm(args.initial_peers, client_mode=True)
    try:
        decoder = _StreamingDecoder(model.tokenizer)
        result = await model.generate(ids, args.max_new_tokens, args.temperature, args.seed, decoder.push)
        decoder.finish()
    finally:
        await swarm.shutdown()
    steps = max(len(result.token_ids) - 1, 1)
    log.info(
        "%d tokens; prefill %.2f s; decode %.1f tokens/s",
        len(result.token_ids), result.prefill_seconds, steps / max(result.decode_seconds, 1e-9),
    )


class _StreamingDecoder:
    """Print text as tokens arrive, without splitting multi-byte characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.printed = 0

    def push(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[self.printed:])
            sys.stdout.flush()
            self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        sys.stdout.write(text[self.printed:] + "\n")
        sys.stdout.flush()
