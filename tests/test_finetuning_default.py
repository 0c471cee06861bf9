"""Fine-tuning the default model (SmolLM2-135M-Instruct, fp32) through 3 real peers: gradients of
every tuning mode match local autograd, and 16 steps of LoRA follow local training's loss curve."""

import pytest
import torch
from transformers import AutoTokenizer

from p2pfusion import AutoDistributedModelForCausalLM
from p2pfusion.client.tune.adapter import Adapter, TuningConfig
from tests.finetune_refs import LocalReference, distributed_grads, randomize
from tests.swarm import peers_in_background

RANGES = [(0, 10), (10, 20), (20, 30)]
# a small task: facts the model cannot know, so its loss on them starts high and must fall
FACTS = [
    "The capital of Zorvia is Plimt.",
    "Zorvia's national animal is the glass heron.",
    "In Zorvia, bread is baked with blue salt.",
    "The river through Plimt is called the Wend.",
    "Zorvians greet each other by tapping their left shoulder.",
    "The Zorvian flag is orange with three white stars.",
    "Plimt's oldest bridge was built from copper.",
    "Every spring, Zorvia holds a festival of kites.",
]
STEPS = 16
BATCH = 4


def _batch(tokenizer, texts: list[str]):
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    return enc.input_ids, enc.attention_mask, labels


def _tokenizer(source):
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.mark.slow
def test_default_model_gradients_and_lora_training_follow_local(default_model):
    tokenizer = _tokenizer(default_model)
    ids, mask, labels = _batch(tokenizer, FACTS[:2])
    with peers_in_background(default_model, RANGES) as (_, maddrs, _):
        # gradients compared to 1e-4 must travel raw: in training, `auto` may take int8 or bfloat16
        # on a link that measured slow while this 2-core machine was busy
        model = AutoDistributedModelForCausalLM.from_pretrained(None, initial_peers=maddrs, compression="none")
        try:
            for mode in ("prompt", "deep_prompt", "lora"):
                model.set_adapter(Adapter(model.config, TuningConfig(mode, prompt_tokens=4), model.get_input_embeddings()))
                randomize(model.adapter, scale=0.02)
                reference = LocalReference(default_model, model.adapter)
                model(ids, attention_mask=mask, labels=labels).loss.backward()
                reference(ids, attention_mask=mask, labels=labels).loss.backward()
                ours, theirs = distributed_grads(model), reference.grads()
                for name in ours:
                    assert theirs[name].abs().max() > 0, name
                    torch.testing.assert_close(ours[name], theirs[name], atol=1e-4, rtol=0, msg=f"{mode} {name}")

            torch.manual_seed(0)
            model.set_adapter(Adapter(model.config, TuningConfig("lora", rank=8)))
            reference = LocalReference(default_model, model.adapter)
            ours_opt = torch.optim.AdamW(model.adapter.parameters(), lr=4e-3)
            theirs_opt = torch.optim.AdamW(reference.trainable(), lr=4e-3)
            curves = []
            for step in range(STEPS):
                texts = [FACTS[(step * BATCH + i) % len(FACTS)] for i in range(BATCH)]
                ids, mask, labels = _batch(tokenizer, texts)
                losses = []
                for net, optimizer in ((model, ours_opt), (reference, theirs_opt)):
                    optimizer.zero_grad()
                    loss = net(ids, attention_mask=mask, labels=labels).loss
                    loss.backward()
                    optimizer.step()
                    losses.append(loss.item())
                curves.append(losses)
        finally:
            model.close()
    worst = max(abs(ours - theirs) / theirs for ours, theirs in curves)
    print(f"loss {curves[0][0]:.4f} -> {curves[-1][0]:.4f}; largest gap to local {worst:.2e} (relative)")
    for step, (ours, theirs) in enumerate(curves):
        assert abs(ours - theirs) <= 0.02 * theirs, f"step {step}: swarm {ours:.4f}, local {theirs:.4f}"
    first = sum(ours for ours, _ in curves[:4]) / 4
    last = sum(ours for ours, _ in curves[-4:]) / 4
    assert last < 0.6 * first, f"the loss did not fall enough: {first:.3f} -> {last:.3f}"
