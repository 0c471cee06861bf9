"""Fine-tuning through real peers on 127.0.0.1 with the Python API: losses, logits and gradients of
soft prompts, deep prompts and LoRA match transformers (and PEFT) on the same model; generate
matches; adapters round-trip through PEFT's format; bad input gets clear errors."""

import threading

import pytest
import torch
from peft import PeftModel

from p2pfusion import AutoDistributedModelForCausalLM
from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.tune.adapter import Adapter, TuningConfig
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.route.pieces import split_batch
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ModelError, RequestError
from transformers import LlamaConfig

from tests.conftest import COMMON, reference_model
from tests.finetune_refs import LocalReference, assert_same_step, distributed_grads, randomize
from tests.swarm import peers_in_background

IDS = torch.tensor([[3, 17, 42, 99, 5, 250, 7, 1, 8, 30], [0, 0, 0, 6, 5, 4, 3, 2, 77, 12]])
MASK = torch.tensor([[1] * 10, [0, 0, 0] + [1] * 7])  # the second sequence is left-padded
LABELS = IDS.masked_fill(MASK == 0, -100)
RANGES = [(0, 2), (2, 3), (3, 4)]


def _check_step(model, reference: LocalReference, peers=()) -> None:
    out = model(IDS, attention_mask=MASK, labels=LABELS)
    if peers:  # they keep each step's activations until its backward pass, and no longer
        assert all(peer.server.graph_bytes > 0 for peer in peers)
    out.loss.backward()
    assert all(peer.server.graph_bytes == 0 for peer in peers)
    expected = reference(IDS, attention_mask=MASK, labels=LABELS)
    expected.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=0)
    assert_same_step(model, out, reference, expected)
    if model.adapter.tuning.mode != "prompt":  # parameters on every remote layer (deep prompts: from layer 1)
        layers = {int(name.split(".")[1]) for name in distributed_grads(model) if name.startswith("layers.")}
        assert layers == set(range(model.adapter.tuning.mode == "deep_prompt", model.config.num_hidden_layers))


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen2", "mistral"])
def test_gradients_of_every_tuning_mode_match_local_autograd(tiny_models, family):
    source = tiny_models[family]
    with peers_in_background(source, RANGES) as (peers, maddrs, _):
        model = AutoDistributedModelForCausalLM.from_pretrained(str(source.folder), initial_peers=maddrs)
        try:
            for mode in ("prompt", "deep_prompt", "lora"):
                tuning = TuningConfig(mode, rank=4, prompt_tokens=3)
                model.set_adapter(Adapter(model.config, tuning, model.get_input_embeddings()))
                randomize(model.adapter)
                _check_step(model, LocalReference(source, model.adapter), peers)
        finally:
            model.close()


def test_generate_save_load_and_peft_merge(tiny_models, tmp_path):
    source = tiny_models["llama"]
    with peers_in_background(source, RANGES) as (_, maddrs, peers_loop):
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(source.folder), initial_peers=maddrs, tuning="lora", lora_rank=4, lora_targets=["q_proj", "v_proj", "down_proj"]
        )
        try:
            randomize(model.adapter, scale=0.2)
            reference = LocalReference(source, model.adapter)
            with torch.no_grad():  # greedy, on a left-padded batch, through the peers' KV caches
                ours = model.generate(IDS, attention_mask=MASK, max_new_tokens=12, do_sample=False)
                theirs = reference.model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=12, do_sample=False)
                assert ours.tolist() == theirs.tolist()
                torch.manual_seed(7)
                ours = model.generate(IDS[:1], max_new_tokens=12, do_sample=True, top_k=20, temperature=0.8)
                torch.manual_seed(7)
                theirs = reference.model.generate(input_ids=IDS[:1], max_new_tokens=12, do_sample=True, top_k=20, temperature=0.8)
                assert ours.tolist() == theirs.tolist()
                with pytest.raises(RequestError, match="beam search"):
                    model.generate(IDS[:1], max_new_tokens=2, num_beams=2)
                logits = model(IDS, attention_mask=MASK).logits

            model.save_adapter(tmp_path / "adapter")
            peft_model = PeftModel.from_pretrained(reference_model(source), tmp_path / "adapter").eval()
            merged = peft_model.merge_and_unload()
            with torch.no_grad():
                torch.testing.assert_close(merged(IDS, attention_mask=MASK).logits, logits, atol=1e-5, rtol=0)

            model.set_adapter(None)
            with torch.no_grad():
                plain = model(IDS, attention_mask=MASK).logits
                assert (plain - logits).abs().max() > 1e-3  # the adapter mattered
                model.load_adapter(tmp_path / "adapter")
                torch.testing.assert_close(model(IDS, attention_mask=MASK).logits, logits, atol=1e-6, rtol=0)

            # a soft prompt in generate, and both adapters through the CLI's generation loop (infer --adapter)
            prompt = Adapter(model.config, TuningConfig("prompt", prompt_tokens=3), model.get_input_embeddings())
            randomize(prompt, scale=0.5)
            for adapter in (model.adapter, prompt):
                model.set_adapter(adapter)
                with torch.no_grad():
                    ours = model.generate(IDS[:1], max_new_tokens=8, do_sample=False)[0, IDS.shape[1]:].tolist()
                    assert ours == _reference_greedy(LocalReference(source, adapter), IDS[:1], 8)
                assert peers_loop.run(_cli_generation(source, maddrs, adapter, IDS[0].tolist(), 8)) == ours
        finally:
            model.close()


def _reference_greedy(reference: LocalReference, ids: torch.Tensor, tokens: int) -> list[int]:
    if reference.prompt is None:
        return reference.model.generate(input_ids=ids, max_new_tokens=tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    embeds = torch.cat([reference.prompt[None], reference.model.get_input_embeddings()(ids)], dim=1)
    return reference.model.generate(inputs_embeds=embeds, max_new_tokens=tokens, do_sample=False)[0].tolist()


async def _cli_generation(source, maddrs, adapter, ids: list[int], tokens: int) -> list[int]:
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client)
        model.adapter = adapter
        return (await model.generate(ids, tokens, stop_at_eos=False, decode=False)).token_ids
    finally:
        await client.shutdown()


def test_concurrent_clients_train_their_own_parameters(tiny_models):
    source = tiny_models["llama"]
    # no memory for keeping activations: every backward pass recomputes its forward
    with peers_in_background(source, RANGES, training_memory=0) as (peers, maddrs, _):
        models = [
            AutoDistributedModelForCausalLM.from_pretrained(str(source.folder), initial_peers=maddrs, tuning="lora", lora_rank=4)
            for _ in range(2)
        ]
        try:
            for seed, model in enumerate(models):
                randomize(model.adapter, seed=seed + 10)
            references = [LocalReference(source, model.adapter) for model in models]
            errors = []

            def train(model, reference):
                try:
                    for _ in range(3):  # steps interleave on the peers; each must see only its own adapter
                        for p in [*model.adapter.parameters(), *reference.trainable()]:
                            p.grad = None
                        _check_step(model, reference)
                        with torch.no_grad():
                            for p in model.adapter.parameters():
                                p -= 0.1 * p.grad
                        reference.load(model.adapter)
                except Exception as exc:  # reported in the main thread below
                    errors.append(exc)

            threads = [threading.Thread(target=train, args=pair) for pair in zip(models, references)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, errors
            assert all(peer.server.graph_bytes == 0 for peer in peers)
        finally:
            for model in models:
                model.close()


def test_a_backward_pass_uses_the_parameters_of_its_forward(tiny_models):
    """A forward, new parameter values (sent for the next forward), then the first forward's
    backward: peers that recompute it do so with the values it ran with."""
    source = tiny_models["llama"]
    with peers_in_background(source, RANGES, training_memory=0) as (_, maddrs, _):
        model = AutoDistributedModelForCausalLM.from_pretrained(str(source.folder), initial_peers=maddrs, tuning="lora", lora_rank=2)
        try:
            randomize(model.adapter)
            reference = LocalReference(source, model.adapter)
            out = model(IDS, attention_mask=MASK, labels=LABELS)
            with torch.no_grad():
                for p in model.adapter.parameters():
                    p.mul_(2.0)
            model(IDS[:1], labels=IDS[:1])  # a training forward: the session gets the new values
            out.loss.backward()
            expected = reference(IDS, attention_mask=MASK, labels=LABELS)
            expected.loss.backward()
            assert_same_step(model, out, reference, expected)
        finally:
            model.close()


def _lora_model(source, maddrs):
    # gradients compared to 1e-4 travel raw (`auto` may pick a lossy codec on a busy machine's links)
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(source.folder), initial_peers=maddrs, tuning="lora", lora_rank=2, compression="none"
    )


def _step_matches_local(model, source) -> None:
    randomize(model.adapter)
    reference = LocalReference(source, model.adapter)
    out = model(IDS, attention_mask=MASK, labels=LABELS)
    out.loss.backward()
    expected = reference(IDS, attention_mask=MASK, labels=LABELS)
    expected.loss.backward()
    assert_same_step(model, out, reference, expected)


def test_a_backward_pass_that_gives_nan_is_computed_again_and_one_that_always_does_is_refused(tiny_models):
    """The middle peer's first backward pass gives NaN (a compute fault: the inputs were finite):
    it computes the pass again, and the client's gradients are local autograd's. A pass that gives
    NaN every time is refused with an error that names the layers."""
    source = tiny_models["llama"]
    with peers_in_background(source, RANGES) as (peers, maddrs, _):
        stage = peers[1].server.stage
        backward, calls = stage.backward, []

        def faulty(graph, grad_output):
            grad_in, params = backward(graph, grad_output)
            calls.append(len(params))
            if len(calls) == 1 or always.is_set():
                params = [torch.full_like(p, float("nan")) for p in params]
            return grad_in, params

        always = threading.Event()
        stage.backward = faulty
        model = _lora_model(source, maddrs)
        try:
            _step_matches_local(model, source)
            assert calls == [4, 4]  # layer 2's q_proj and v_proj, A and B: computed twice

            always.set()
            out = model(IDS, attention_mask=MASK, labels=LABELS)
            with pytest.raises(RequestError, match=r"backward: layers 2:3 compute NaN or infinity from this step's inputs"):
                out.loss.backward()
        finally:
            model.close()


@pytest.mark.parametrize("sent", ["adapter", "input"])
def test_a_peer_that_sends_nan_gradients_is_routed_around(tiny_models, sent):
    """One of two peers of some layers sends NaN gradients once (its adapter's, of layers 2:3; or
    its input's, of layers 0:2), as a lying or broken peer would past its own check: the client
    blames that peer, and the step's forward and backward are computed again through the other,
    with local autograd's gradients."""
    source = tiny_models["llama"]
    twin = 1 if sent == "adapter" else 0
    with peers_in_background(source, [*RANGES, RANGES[twin]]) as (peers, maddrs, _):
        calls = []

        def lying(index, backward):
            async def wrapped(session, inputs, grad):
                (grad_in, params), seconds = await backward(session, inputs, grad)
                calls.append(index)
                if len(calls) == 1 and sent == "adapter":
                    params = [torch.full_like(p, float("nan")) for p in params]
                elif len(calls) == 1:
                    grad_in = torch.full_like(grad_in, float("inf"))
                return (grad_in, params), seconds
            return wrapped

        for index in (twin, 3):
            peers[index].server.compute.backward = lying(index, peers[index].server.compute.backward)
        model = _lora_model(source, maddrs)
        try:
            _step_matches_local(model, source)
            assert len(calls) == 2 and calls[0] != calls[1], calls
        finally:
            model.close()


def test_a_large_batch_goes_in_chunks_with_the_same_gradients(tiny_models):
    """130 sequences of 128 tokens exceed one step's 8192 tokens: they go as 3 chunks, whose
    gradients add up to the whole batch's."""
    source = tiny_models["llama"]
    ids = torch.randint(0, 256, (130, 128), generator=torch.Generator().manual_seed(3))
    with peers_in_background(source, RANGES) as (_, maddrs, _):
        # megabytes a chunk: `auto` may send them as int8 when a link measured slow on this busy
        # 2-core machine, and gradients compared to 1e-4 must travel raw
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(source.folder), initial_peers=maddrs, tuning="lora", lora_rank=2, compression="none"
        )
        try:
            randomize(model.adapter)
            reference = LocalReference(source, model.adapter)
            embeds = model.get_input_embeddings()(ids)
            out = model(inputs_embeds=embeds, labels=ids)  # inputs_embeds work as input_ids do
            out.loss.backward()
            assert len(split_batch(embeds, None, ids)) == 3  # the case this test is about
            expected = reference(ids, labels=ids)
            expected.loss.backward()
            assert_same_step(model, out, reference, expected)
        finally:
            model.close()


def test_bad_input_gets_clear_errors(tiny_models, tmp_path):
    with pytest.raises(RequestError, match="unknown tuning mode 'ia3'"):
        AutoDistributedModelForCausalLM.from_pretrained(None, initial_peers=["/ip4/127.0.0.1/tcp/1"], tuning="ia3")

    wider = LlamaConfig(**{**COMMON, "hidden_size": 96})  # adapters made for other models
    deeper = LlamaConfig(**{**COMMON, "num_hidden_layers": 6})
    source = tiny_models["llama"]
    Adapter(wider, TuningConfig("lora", rank=4)).save(tmp_path / "wider", source)
    Adapter(deeper, TuningConfig("deep_prompt", prompt_tokens=2)).save(tmp_path / "deeper", source)
    with peers_in_background(source, RANGES) as (_, maddrs, _):
        model = AutoDistributedModelForCausalLM.from_pretrained(str(source.folder), initial_peers=maddrs, tuning="lora")
        try:
            with pytest.raises(ModelError, match=r"does not fit this model: .*q_proj.lora_A.weight is \[4, 96\], this model needs \[4, 64\]"):
                model.load_adapter(tmp_path / "wider")
            with pytest.raises(ModelError, match="does not fit this model: it has layers.4.prompt"):
                model.load_adapter(tmp_path / "deeper")
            with pytest.raises(ModelError, match="cannot read the adapter"):
                model.load_adapter(tmp_path / "missing")
            with pytest.raises(RequestError, match="token ids in 0..255"):
                model(IDS + 250)
            with pytest.raises(RequestError, match="labels must have the inputs' shape"):
                model(IDS, labels=IDS[:, :-1])
            with pytest.raises(RequestError, match="larger than the peers accept"):
                model(torch.zeros(700, 128, dtype=torch.long), labels=torch.zeros(700, 128, dtype=torch.long))
            out = model(IDS, attention_mask=MASK, labels=LABELS)  # the client still works afterwards
            assert torch.isfinite(out.loss)
        finally:
            model.close()


def test_a_peer_dying_mid_step_costs_a_retry_not_the_result(tiny_models, forks):
    """The middle peer is killed (SIGKILL) between a step's forward and backward passes: the step is
    retried on a route through a warm backup, with the loss and gradients of an undisturbed step."""
    source = tiny_models["llama"]
    fixed = ["--throughput", "100"]
    with LocalSwarm(model=str(source.folder), forks=forks) as swarm:
        first = swarm.launch((0, 2), fixed)
        swarm.wait_ready(first)
        middle, last, backup = swarm.launch((2, 3), fixed), swarm.launch((3, 4), fixed), swarm.launch((2, 3), [*fixed, "--backup"])
        middle_id = swarm.wait_ready(middle)[0].rsplit("/p2p/", 1)[1]
        for proc in (last, backup):
            swarm.wait_ready(proc)
        model = AutoDistributedModelForCausalLM.from_pretrained(str(source.folder), initial_peers=swarm.maddrs, tuning="lora", lora_rank=4)
        try:
            randomize(model.adapter)
            reference = LocalReference(source, model.adapter)
            out = model(IDS, attention_mask=MASK, labels=LABELS)
            route = [hop.peer_id for hop in model.model.swarm.tuning.connection.session.route]
            assert route[1] == middle_id  # backups serve only when something failed
            middle.kill()
            middle.wait()
            out.loss.backward()
            assert model.model.swarm.tuning.recoveries >= 1
            expected = reference(IDS, attention_mask=MASK, labels=LABELS)
            expected.loss.backward()
            assert_same_step(model, out, reference, expected)
        finally:
            model.close()
