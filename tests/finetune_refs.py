"""Local references for fine-tuning tests: transformers' own model (with PEFT for LoRA) carrying the
same trainable parameters as a distributed model, so losses and gradients can be compared."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.models.tuning import LORA
from tests.conftest import reference_model


def randomize(adapter: Adapter, seed: int = 1, scale: float = 0.05) -> None:
    """LoRA's B starts at zero (so its A gets no gradient) and deep prompts at zero: give every
    parameter random values, so every gradient is tested."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * scale)


class LocalReference:
    """transformers' model with a copy of `adapter`'s parameters, trained the same way."""

    def __init__(self, source, adapter: Adapter):
        self.model = reference_model(source)
        self.model.requires_grad_(False)
        self.mode = adapter.tuning.mode
        self.prompt = None
        self.hooks = []
        if self.mode == LORA:
            tuning = adapter.tuning
            config = LoraConfig(r=tuning.rank, lora_alpha=tuning.alpha, target_modules=list(tuning.targets), lora_dropout=0.0)
            self.model = get_peft_model(self.model, config)
            self.params = {}
            for name, param in self.model.named_parameters():
                if "lora_" in name:
                    ours = name.replace("base_model.model.model.", "").replace(".default.weight", "")
                    self.params[ours] = param
        else:
            self.prompt = torch.nn.Parameter(adapter.soft_prompt.detach().clone())
            self.params = {"soft_prompt": self.prompt}
            for name, param in adapter.named_remote():  # layers.L.prompt, added before layer L
                layer = int(name.split(".")[1])
                self.params[name] = torch.nn.Parameter(param.detach().clone())
                self.hooks.append(self.model.model.layers[layer].register_forward_pre_hook(_adder(self.params[name])))
        self.load(adapter)

    def load(self, adapter: Adapter) -> None:
        with torch.no_grad():
            ours = dict(adapter.named_remote())
            if adapter.soft_prompt is not None:
                ours["soft_prompt"] = adapter.soft_prompt
            for name, param in self.params.items():
                param.copy_(ours[name])

    def trainable(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def __call__(self, input_ids, attention_mask=None, labels=None):
        if self.prompt is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        batch, count = input_ids.shape[0], self.prompt.shape[0]
        embeds = self.model.get_input_embeddings()(input_ids)
        embeds = torch.cat([self.prompt.expand(batch, -1, -1), embeds], dim=1)
        if attention_mask is not None:
            attention_mask = torch.cat([torch.ones(batch, count, dtype=attention_mask.dtype), attention_mask], dim=1)
        out = self.model(inputs_embeds=embeds, attention_mask=attention_mask)
        out.logits = out.logits[:, count:].contiguous()
        if labels is not None:  # over the same positions as without a prompt
            out.loss = self.model.loss_function(out.logits, labels, vocab_size=self.model.config.vocab_size)
        return out

    def grads(self) -> dict[str, torch.Tensor]:
        return {name: p.grad for name, p in self.params.items()}


def _adder(prompt: torch.Tensor):
    def hook(_module, args):
        hidden = args[0]
        count = prompt.shape[0]
        return (torch.cat([hidden[:, :count] + prompt, hidden[:, count:]], dim=1), *args[1:])

    return hook


def distributed_grads(model) -> dict[str, torch.Tensor]:
    adapter = model.adapter
    grads = {name: p.grad for name, p in adapter.named_remote()}
    if adapter.soft_prompt is not None:
        grads["soft_prompt"] = adapter.soft_prompt.grad
    return grads


def assert_same_step(model, out, reference: LocalReference, expected) -> None:
    """The distributed model's loss and gradients are local autograd's (after both backward passes)."""
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=0)
    ours, theirs = distributed_grads(model), reference.grads()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert theirs[name].abs().max() > 0, name
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-4, rtol=0, msg=name)
