"""The bodies of `run-peer`, `infer` and `api`, kept apart from argument parsing."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from typing import TextIO

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.swarm_lm import SwarmLM
from p2pfusion.client.generate.text import TextPieces
from p2pfusion.client.options import ClientOptions
from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.errors import ConfigError, ModelError, RequestError
from p2pfusion.models.formats import DTYPES, WeightFormat
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config
from p2pfusion.net.secret import load_secret
from p2pfusion.peer.runtime import PeerOptions
from p2pfusion.peer.service import serve

log = logging.getLogger("p2pfusion")


async def run_peer(args, device: str) -> None:
    secret = load_secret(args.swarm_secret)  # a bad file fails before the model loads
    models = args.model or [None]
    if len(models) > 1 and args.layers is not None:
        raise ConfigError("--layers names layers of one model: give one --model with it")
    source, *others = [resolve_model(model) for model in models]
    config = load_config(source)
    if args.layers is not None and args.layers[1] > config.num_hidden_layers:
        raise ModelError(
            f"layer range {args.layers[0]}:{args.layers[1]} is out of bounds for {source.name} "
            f"(0:{config.num_hidden_layers})"
        )
    _check_device(device)
    if args.train is not None and (args.dtype != "float32" or args.quant is not None or args.backup or len(models) > 1):
        raise ConfigError("--train trains float32 weights of one model: drop --dtype, --quant, --backup and extra --model")
    options = PeerOptions(
        source=source,
        initial_peers=[] if args.new_swarm else args.initial_peers,
        layers=args.layers,
        max_layers=args.max_layers,
        dtype=DTYPES[args.dtype],
        quant=None if args.quant is None else WeightFormat(args.quant),
        max_memory=args.max_memory,
        backup=args.backup,
        throughput=args.throughput,
        decode_threads=args.decode_threads,
        device=device,
        host=args.host,
        announce_host=args.announce_host,
        port=args.port,
        data_port=args.data_port,
        identity=args.identity,
        address_file=args.address_file,
        session_limit=args.session_limit,
        compression=args.compression,
        training_memory=args.training_memory,
        cache_memory=args.cache_mib,
        client_sessions=args.sessions_per_client,
        max_sessions=args.max_sessions,
        idle_timeout=float(args.idle_timeout),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        swarm_secret=secret,
        train=args.train,
        run_driver=args.run_driver,
    )

    def ready(maddrs: list[str]) -> None:
        print("peer is serving; others join with:", file=sys.stderr)
        for maddr in maddrs:
            print(maddr, flush=True)

    await serve(options, on_ready=ready, others=others)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ModelError(f"{device} is not available on this machine (CUDA devices: {torch.cuda.device_count()})")
    elif device == "mps" and not torch.backends.mps.is_available():
        raise ModelError("mps is not available on this machine")


def client_options(args) -> ClientOptions:
    """The client's options as infer, chat and api take them (a bad file or value fails here, first)."""
    return ClientOptions(
        compression=args.compression, verify=args.verify, canaries=args.canaries, swarm_secret=args.swarm_secret,
        trusted_peers=args.trusted_peers, local_layers=args.local_layers, min_precision=args.min_precision,
        speculate=args.speculate, draft_model=args.draft_model,
    )


async def client_model(args) -> RemoteCausalLM:
    """The client (client/core.py) with its generation engine, and the user's adapter: the swarm
    joined while the model loads, so an unreachable swarm is said at once."""
    options = client_options(args)
    model = await RemoteCausalLM.connect(args.initial_peers, args.model, options)
    try:
        if args.adapter is not None:
            model.adapter = Adapter.load(args.adapter, model.config, model.source)
    except BaseException:
        await model.core.leave()
        raise
    return model


async def infer(args, started: float) -> None:
    """`started`: when the command started (perf_counter), for the progress lines."""
    if not args.prompt.strip():
        raise RequestError("the prompt is empty")
    model = await client_model(args)
    try:
        await model.core.longest_session()  # a prompt is refused at the length the swarm accepts, not the model's
        ids = model.encode(args.prompt, args.chat)
        log.info("loaded %s in %.1f s; prompt: %d tokens", model.source.name, time.perf_counter() - started, len(ids))
        decoder = StreamingDecoder(model.tokenizer)
        result = await model.generate(
            ids, args.max_new_tokens, args.temperature, args.seed, decoder.push, on_rewind=decoder.rewind,
            hold=holds(args, decoder.out),
        )
        decoder.finish()
    finally:
        await model.core.leave()
    decoded = max(len(result.token_ids) - 1, 1)
    per_step = "" if result.steps is None else f"; {len(result.token_ids) / result.steps:.2f} tokens per swarm step"
    log.info(
        "%d tokens; prefill %.2f s; decode %.1f tokens/s%s",
        len(result.token_ids), result.prefill_seconds, decoded / max(result.decode_seconds, 1e-9), per_step,
    )


async def api(args) -> None:
    # the port first: one in use fails before the model loads
    from p2pfusion.api.app import listen
    from p2pfusion.api.guard import APILimits

    options = client_options(args)
    limits = APILimits(
        tuple(args.api_key or ()), args.max_body, requests_per_user=args.requests_per_user,
        allowed_hosts=tuple(args.allowed_hosts or ()),
    )
    sock = listen(args.host, args.port)
    await serve_api(sock, args.initial_peers, args.model, limits, options)


async def serve_api(
    sock: socket.socket, initial_peers: list[str], model: str | None, limits=None, options: ClientOptions | None = None,
) -> None:
    """The OpenAI-compatible API on `sock` (listening) until SIGINT or SIGTERM, in this loop with
    its swarm client, within `limits` (api.guard.APILimits; None: the defaults)."""
    # fastapi and uvicorn load for this command only, not for every peer
    from p2pfusion.api.app import base_url, create_app, model_names, server
    from p2pfusion.api.guard import APILimits

    lm = await SwarmLM.connect(initial_peers, model, options)
    try:
        http = server(create_app(lm, model_names(lm), limits or APILimits()))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(http, "should_exit", True))
        url = base_url(sock)
        log.info("serving %s: the OpenAI-compatible API at %s/v1, a web chat at %s/", lm.model.source.name, url, url)
        await http.serve(sockets=[sock])
        log.info("stopped serving; leaving the swarm")
    finally:
        await lm.close()


def holds(args, out: TextIO) -> bool:
    """Whether to print only checked text: when asked to, and when the text goes to a file or a
    pipe, which keep whatever was printed."""
    return args.hold_until_checked or not out.isatty()


class StreamingDecoder:
    """Print text as tokens arrive, without splitting multi-byte characters."""

    def __init__(self, tokenizer, out: TextIO | None = None):
        self.pieces = TextPieces(tokenizer)
        self.out = out or sys.stdout

    def push(self, token: int) -> None:
        added = self.pieces.add(token)
        if added:
            self.out.write(added)
            self.out.flush()

    def rewind(self, kept: int) -> None:
        """Verification withdrew the tokens after the first `kept`: say so, and print the text that
        stands again, on a line of its own; the corrected tokens follow it."""
        text = self.pieces.keep(kept)
        self.out.write("\n")
        self.out.flush()
        print("p2pfusion: a peer's results behind the text above failed verification; corrected:", file=sys.stderr)
        self.out.write(text)
        self.out.flush()

    def finish(self) -> None:
        self.out.write(self.pieces.rest() + "\n")
        self.out.flush()
