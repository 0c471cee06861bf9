"""AutoDistributedModelForCausalLM: a transformers causal LM whose decoder layers run in the swarm.

The object is the family's own causal-LM class (e.g. LlamaForCausalLM, subclassed) built with no
decoder layers: embeddings, final norm and LM head are local. Its inner decoder is replaced by a
RemoteDecoder, which sends hidden states through the swarm. So `forward` (loss from labels,
logits, output classes) and `generate` are transformers' own code, and the model trains like any
torch module: `loss.backward()` reaches the peers and comes back as gradients of the client's
trainable parameters (soft prompts, deep prompts, LoRA).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch
from torch import nn
from transformers import Cache, GenerationConfig
from transformers.modeling_outputs import BaseModelOutputWithPast

from p2pfusion.client.checks.policy import MAX_REWINDS
from p2pfusion.client.checks.verifier import Verifier
from p2pfusion.client.core import ClientCore
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.options import ClientOptions
from p2pfusion.client.route.failover import ResilientSession
from p2pfusion.client.route.params import SessionParams
from p2pfusion.client.route.planner import new_tokens_within
from p2pfusion.client.tune.adapter import Adapter, TuningConfig
from p2pfusion.client.tune.layers import RemoteLayers, SwarmLayers
from p2pfusion.errors import RequestError, RouteError
from p2pfusion.models.cache_arg import NEW, OLD, cache_arg, given_cache
from p2pfusion.models.source import resolve_model
from p2pfusion.models.tuning import DEFAULT_LORA_TARGETS


class WrongResults(Exception):
    """Verification caught wrong results mid-generation: `generate` starts again without the liar."""


class RemoteCache(Cache):
    """Stands for the peers' KV caches during `generate`: an inference session kept open between
    steps, its results checked at the client's verification rate. Its length counts the caller's
    tokens (not the soft prompt's); its session holds up to `session_length` positions."""

    def __init__(self, layers: SwarmLayers, params: SessionParams | None, session_length: int):
        super().__init__(layers=[])
        self.swarm = layers
        self.params = params
        self.session_length = session_length
        self.length = 0
        self.session: ResilientSession | None = None
        self.verifier: Verifier | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def is_compileable(self) -> bool:
        return False

    def step(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, tokens: int) -> torch.Tensor:
        swarm, core = self.swarm, self.swarm.core
        if self.session is None:
            self.session = swarm.run(core.open_session(self.session_length, self.params, batch=hidden.shape[0]))
            self.verifier = core.verifier(self.session)
        if self.verifier is None:
            out = swarm.run(self.session.step(hidden, mask, positions))
        else:
            out = swarm.run(self.verifier.step(hidden, mask, positions))
            if swarm.run(self.verifier.poll()) is not None:
                raise WrongResults()
        self.length += tokens
        return out

    def verified(self) -> bool:
        """Check the results not checked yet: True when they hold (or verification is off)."""
        return self.verifier is None or self.swarm.run(self.verifier.finish()) is None

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise RequestError("beam search through the swarm is not supported; use greedy decoding or sampling")

    def close(self) -> None:
        if self.verifier is not None:
            self.swarm.run(self.verifier.close())
            self.verifier = None
        if self.session is not None:
            self.swarm.run(self.session.close())
            self.session = None


class RemoteDecoder(nn.Module):
    """In place of the family's decoder model: local embeddings and final norm around the swarm."""

    def __init__(self, inner: nn.Module, swarm: SwarmLayers, adapter: Adapter | None, dtype: torch.dtype):
        super().__init__()
        self.config = inner.config
        self.embed_tokens = inner.embed_tokens
        self.norm = inner.norm
        self.adapter = adapter
        self.swarm = swarm
        self.dtype = dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(
        self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None, **kwargs,
    ) -> BaseModelOutputWithPast:
        cache = given_cache(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise RequestError("pass exactly one of input_ids and inputs_embeds")
        if cache is not None and not isinstance(cache, RemoteCache):
            raise RequestError("the cache (past_key_values) must be a RemoteCache: the peers hold the KV caches")
        if input_ids is not None:
            vocab = self.embed_tokens.num_embeddings
            if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
                raise RequestError(f"input_ids must be integers of shape [batch, tokens], got {input_ids.dtype} {list(input_ids.shape)}")
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
                raise RequestError(f"input_ids must be token ids in 0..{vocab - 1}")
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if embeds.dim() != 3 or embeds.shape[-1] != self.config.hidden_size:
            raise RequestError(f"inputs_embeds must be [batch, tokens, {self.config.hidden_size}], got {list(embeds.shape)}")
        batch, tokens = embeds.shape[:2]
        past = 0 if cache is None else cache.get_seq_length()
        positions = _positions(position_ids, batch, tokens, past)
        mask = _mask(attention_mask, batch, past + tokens)
        prompt = 0 if self.adapter is None else self.adapter.prompt_length
        if prompt:  # the soft prompt sits before every sequence, at positions 0..prompt-1
            if past == 0:
                soft = self.adapter.soft_prompt.to(embeds.dtype).expand(batch, -1, -1)
                embeds = torch.cat([soft, embeds], dim=1)
                positions = torch.cat([torch.arange(prompt).expand(batch, -1), positions + prompt], dim=1)
            else:
                positions = positions + prompt
            if mask is not None:
                mask = torch.cat([torch.ones(batch, prompt, dtype=mask.dtype), mask], dim=1)
        hidden = self._layers(embeds.to(self.dtype), mask, positions, cache, tokens)
        if prompt and past == 0:
            hidden = hidden[:, prompt:]
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), **{cache_arg(BaseModelOutputWithPast): cache})

    def _layers(self, hidden, mask, positions, cache: RemoteCache | None, tokens: int) -> torch.Tensor:
        if cache is not None:
            return cache.step(hidden.detach(), mask, positions, tokens)
        params = [] if self.adapter is None else [p for _, p in self.adapter.named_remote()]
        if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
            return RemoteLayers.apply(hidden, self.swarm, mask, positions, self.adapter, *params)
        remote = None if self.adapter is None else self.adapter.session_params()
        return self.swarm.forward_once(hidden.detach(), mask, positions, remote)


def _positions(position_ids: torch.Tensor | None, batch: int, tokens: int, past: int) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(past, past + tokens).expand(batch, -1)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2 or position_ids.shape[1] != tokens or position_ids.shape[0] not in (1, batch):
        raise RequestError(f"position_ids must be [batch, {tokens}], got {list(position_ids.shape)}")
    return position_ids.expand(batch, -1).to(torch.long)


def _mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        raise RequestError(f"attention_mask must be [batch, length] = [{batch}, {length}], got {list(attention_mask.shape)}")
    return None if bool(attention_mask.all()) else attention_mask.to(torch.long)


def _prompt_length(args: tuple, kwargs: dict) -> int:
    """The prompt's length in tokens, from `generate`'s arguments as transformers takes them."""
    inputs = kwargs.get("inputs_embeds")
    if inputs is None:
        inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return 1 if inputs is None else int(inputs.shape[1])  # no input: transformers starts from one BOS token


class DistributedModelMixin:
    """What a distributed model adds to the family's causal-LM class."""

    model: RemoteDecoder

    @property
    def adapter(self) -> Adapter | None:
        return self.model.adapter

    def set_adapter(self, adapter: Adapter | None) -> None:
        """Use these trainable parameters from now on (None: the plain model)."""
        self.model.adapter = adapter

    def forward(
        self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
        labels=None, use_cache=None, logits_to_keep=0, **kwargs,
    ):
        cache = given_cache(kwargs)
        inputs = input_ids if input_ids is not None else inputs_embeds
        if labels is not None and inputs is not None and tuple(labels.shape) != tuple(inputs.shape[:2]):
            raise RequestError(f"labels must have the inputs' shape {list(inputs.shape[:2])}, got {list(labels.shape)}")
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep,
            **{cache_arg(super().forward.__func__): cache}, **kwargs,
        )

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or config.num_beams or 1) > 1:
            raise RequestError("beam search through the swarm is not supported; use greedy decoding or sampling")
        if kwargs.get(NEW) is not None or kwargs.get(OLD) is not None:
            return super().generate(*args, **kwargs)
        swarm, adapter = self.model.swarm, self.model.adapter
        reserved = 0 if adapter is None else adapter.prompt_length  # positions the soft prompt takes
        limit = swarm.run(swarm.core.longest_session()) - reserved
        prompt = _prompt_length(args, kwargs)
        wanted = kwargs.get("max_new_tokens", config.max_new_tokens)
        if wanted is None:
            wanted = kwargs.get("max_length", config.max_length) - prompt
        fits = new_tokens_within(prompt, wanted, limit)
        if fits < wanted:
            kwargs["max_new_tokens"] = wanted = fits
        params = None if adapter is None else adapter.session_params()
        for _ in range(MAX_REWINDS):  # wrong results caught: the liar is distrusted, generate again
            cache = RemoteCache(swarm, params, prompt + wanted + reserved)
            try:
                result = super().generate(*args, **{cache_arg(super().forward.__func__): cache}, **kwargs)
                if cache.verified():
                    return result
            except WrongResults:
                pass
            finally:
                cache.close()
        raise RouteError(f"results failed verification {MAX_REWINDS} times in one generation")

    @cached_property
    def tokenizer(self):
        """The model's tokenizer (transformers' AutoTokenizer, from the model's folder)."""
        return self.model.swarm.core.tokenizer

    def save_adapter(self, path: str | Path) -> None:
        if self.model.adapter is None:
            raise RequestError("this model has no adapter to save: load it with tuning=... or load_adapter()")
        self.model.adapter.save(path, self.model.swarm.core.source)

    def load_adapter(self, path: str | Path) -> Adapter:
        adapter = Adapter.load(path, self.config, self.model.swarm.core.source)
        self.set_adapter(adapter)
        return adapter

    def close(self) -> None:
        """Leave the swarm and stop the client's network thread."""
        self.model.swarm.close()


_CLASSES: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Distributed{base.__name__}", (DistributedModelMixin, base), {})
    return _CLASSES[base]


class AutoDistributedModelForCausalLM:
    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        initial_peers: list[str] | tuple[str, ...] = (),
        *,
        tuning: str | None = None,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: tuple[str, ...] | list[str] = DEFAULT_LORA_TARGETS,
        prompt_tokens: int = 16,
        adapter: str | Path | None = None,
        options: ClientOptions | None = None,
        **settings,
    ):
        """The model (a local folder, a .gguf file, a Hub id, or None for the default model) served by
        the swarm that `initial_peers` belong to. `tuning` ("prompt", "deep_prompt" or "lora") adds
        fresh trainable parameters; `adapter` loads saved ones instead. The client's options come as
        `options` or as keyword settings (`verify=0.0`, `swarm_secret=PATH`, ...: client/options.py);
        every layer runs in the swarm, so `local_layers` is refused."""
        tuning_config = None if tuning is None else TuningConfig(
            tuning, rank=lora_rank, alpha=lora_alpha, targets=tuple(lora_targets), prompt_tokens=prompt_tokens
        )
        options = ClientOptions.of(options, settings)
        if options.local_layers:
            raise RequestError("local_layers: the fine-tuning model runs every layer in the swarm")
        if not initial_peers:
            raise RequestError("initial_peers is empty: pass the multiaddr of at least one peer of the swarm")
        core = ClientCore(resolve_model(model), options)
        head = core.head
        if (core.source.folder / "generation_config.json").is_file():
            head.generation_config = GenerationConfig.from_pretrained(core.source.folder)
        loop = BackgroundLoop()
        try:
            loop.run(core.join(initial_peers))
        except BaseException:
            loop.close()
            raise
        trainable = None
        if adapter is not None:
            trainable = Adapter.load(adapter, core.config, core.source)
        elif tuning_config is not None:
            trainable = Adapter(core.config, tuning_config, head.get_input_embeddings())
        head.model = RemoteDecoder(head.model, SwarmLayers(core, loop), trainable, options.dtype)
        head.config = head.model.config = core.config  # the whole model's, as users and generate expect
        head.__class__ = _distributed_class(type(head))
        return head
