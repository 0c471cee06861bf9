"""`SwarmTrainer`: the synchronous Python API of a training run's driver (docs/training.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from p2pfusion.client.core import ClientCore
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.options import ClientOptions
from p2pfusion.client.run.config import RunConfig
from p2pfusion.client.run.driver import TrainingRun
from p2pfusion.errors import RequestError
from p2pfusion.models.formats import layer_shapes
from p2pfusion.models.source import cache_root, resolve_model
from p2pfusion.models.stage import write_model

log = logging.getLogger(__name__)


class SwarmTrainer:
    """Trains the weights of the replicas of run `run` (peers started with `run-peer --train RUN`).

    ```python
    trainer = SwarmTrainer.connect(None, initial_peers=[...], run="my-run", sync_every=20, lr=3e-4)
    for batch in batches:
        loss = trainer.step(batch["input_ids"], labels=batch["labels"])
    trainer.save_pretrained("trained")   # a Hugging Face folder transformers loads
    trainer.close()
    ```
    """

    def __init__(self, loop: BackgroundLoop, core: ClientCore, run: TrainingRun):
        self._loop = loop
        self._core = core
        self._run = run

    @classmethod
    def connect(
        cls, model: str | None = None, initial_peers=(), run: str = "run", *, options: ClientOptions | None = None,
        **settings,
    ) -> SwarmTrainer:
        """Join the swarm and take up run `run` where its replicas are. `settings` are RunConfig's
        (sync_every, lr, betas, eps, weight_decay, outer_lr, outer_momentum, averaging, max_lr, replicas,
        identity, ...); the run's replicas obey the driver whose identity created the run;
        `options` the client's (a private swarm's `swarm_secret`, say: client/options.py). The run
        trains float32 weights: its driver's embeddings and head are float32 too."""
        if not initial_peers:
            raise RequestError("initial_peers is empty: pass the multiaddr of at least one peer of the swarm")
        try:
            config = RunConfig(run, **settings)
        except TypeError as exc:
            raise RequestError(f"unknown training setting: {exc}") from None
        config.check()
        options = options if options is not None else ClientOptions()
        if options.dtype != torch.float32 or options.local_layers:
            raise RequestError("a training run's driver holds float32 embeddings and head, and runs no layer itself")
        core = ClientCore(resolve_model(model), options)
        if config.identity is None:
            kept = cache_root() / "drivers"
            kept.mkdir(parents=True, exist_ok=True)
        identity = config.identity or str(cache_root() / "drivers" / f"{core.source.key}.{config.run}.key")
        loop = BackgroundLoop()
        try:
            swarm = loop.run(core.join(initial_peers, identity))
            driver = TrainingRun(swarm, core.source, core.head, core.num_layers, config)
            loop.run(driver.start())
        except BaseException:
            loop.close()
            raise
        return cls(loop, core, driver)

    @property
    def step_count(self) -> int:
        return self._run.step

    @property
    def round(self) -> int:
        return self._run.round

    @property
    def redone(self) -> int:
        """Steps run again because a replica failed during them."""
        return self._run.redone

    @property
    def averaged_bytes(self) -> int:
        """Bytes the averaging rounds of the replicas online now moved, as they report them."""
        return self._loop.run(self._run.averaged_bytes())

    def _checked(self, input_ids: torch.Tensor, labels: torch.Tensor | None, mask: torch.Tensor | None):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise RequestError("input_ids must be an integer tensor of shape [batch, tokens]")
        vocab = self._run.head.get_input_embeddings().num_embeddings
        if input_ids.numel() == 0 or int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise RequestError(f"input_ids must be token ids in 0..{vocab - 1}")
        labels = input_ids if labels is None else labels
        if tuple(labels.shape) != tuple(input_ids.shape):
            raise RequestError(f"labels must have the inputs' shape {list(input_ids.shape)}, got {list(labels.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
            raise RequestError(f"attention_mask must have the inputs' shape {list(input_ids.shape)}")
        return input_ids.long(), labels.long(), mask

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             lr: float | None = None) -> float:
        """One inner step (labels default to the inputs; -100 marks tokens without loss); its mean loss."""
        ids, labels, mask = self._checked(input_ids, labels, attention_mask)
        return self._loop.run(self._run.train_step(ids, labels, mask, self._run.config.lr if lr is None else lr))

    def outer_step(self) -> None:
        """An outer step now (the run takes one every `sync_every` steps by itself)."""
        self._loop.run(self._run.outer_step())

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> float:
        ids, labels, mask = self._checked(input_ids, labels, attention_mask)
        return self._loop.run(self._run.evaluate(ids, labels, mask))

    def save_pretrained(self, path: str | Path) -> Path:
        """Write the model with the run's weights (those of its last outer step) as a Hugging Face
        folder: `from_pretrained(path)` loads it, and `run-peer --model PATH --train RUN` trains on from it."""
        source = self._run.source
        path = Path(path)
        weights = self._loop.run(self._run.stage_weights(lambda r: layer_shapes(source.folder, r.start, r.end)))
        write_model(source, weights, path)
        run = self._run
        (path / "p2pfusion_training.json").write_text(json.dumps({
            "base_model_key": source.key, "run": run.config.run, "outer_steps": run.round, "inner_steps": run.step,
        }, indent=2) + "\n")
        log.info("saved the weights of outer step %d of run %s to %s", run.round, run.config.run, path)
        return path

    def close(self) -> None:
        if not self._loop.loop.is_closed():
            self._loop.run(self._core.leave())
            self._loop.close()

    def __enter__(self) -> SwarmTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
