"""Remote backward through real peers: input gradients match local autograd on transformers' model,
also when a peer lies in its training forwards (a checked forward is computed again without it)."""

import dataclasses

import pytest
import torch
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.route.planner import find_route
from p2pfusion.client.route.session import RouteSession
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RequestError
from p2pfusion.net.compression import Purpose
from tests.conftest import reference_model
from tests.swarm import running_peers
from tests.test_verify import noise

IDS = torch.tensor([[3, 17, 42, 99, 5, 250, 7, 1], [9, 8, 7, 6, 5, 4, 3, 2]])


async def _open(client, model, purpose):
    route = find_route(await client.lookup(model.source.key), model.config.num_hidden_layers)
    return await RouteSession(client.transport, route, 16, purpose=purpose).open()


async def _scenario(source):
    model = RemoteCausalLM.build(source)
    embeds = model.head.get_input_embeddings()(IDS).detach()
    async with running_peers(source, [(0, 2), (2, 3), (3, 4)]) as (_, maddrs):
        client = await join_swarm(maddrs, client_mode=True)
        try:
            inference = await _open(client, model, Purpose.INFERENCE)
            with pytest.raises(RequestError, match="opened for training"):
                await inference.backward(torch.zeros(2, 8, 64))
            await inference.close()
            session = await _open(client, model, Purpose.TRAINING)
            try:
                out = await session.step(embeds)
                with pytest.raises(RequestError, match="no forward of step 7"):
                    await session.backward(torch.zeros(2, 8, 64), step=7)
                with pytest.raises(RequestError, match="gradient must be"):
                    await session.backward(torch.zeros(2, 7, 64))
                retried, _ = await session.backward(torch.ones_like(out))  # the bad gradient cost nothing
            finally:
                await session.close()
            model.core.swarm = client
            loss, grad = await model.train_step(IDS, IDS)
        finally:
            await client.shutdown()
    return loss, grad, retried


def assert_local_step(source, loss: torch.Tensor, grad: torch.Tensor):
    """The loss and input gradient of `train_step(IDS, IDS)` are local autograd's; returns the model."""
    ref = reference_model(source)
    embeds = ref.get_input_embeddings()(IDS).detach().requires_grad_(True)
    expected = ref(inputs_embeds=embeds, labels=IDS)
    expected.loss.backward()
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, embeds.grad, atol=1e-6, rtol=1e-4)
    return ref


def test_input_gradients_match_local_autograd(tiny_models):
    source = tiny_models["llama"]
    loss, grad, retried = uvloop.run(_scenario(source))
    ref = assert_local_step(source, loss, grad)
    assert grad.abs().max() > 0
    # the gradient sent again was all ones: the gradient of the sum of the last layer's output
    # (before the final norm, which runs on the client) with respect to the input embeddings
    ref.model.norm = torch.nn.Identity()
    embeds = ref.get_input_embeddings()(IDS).detach().requires_grad_(True)
    ref.model(inputs_embeds=embeds).last_hidden_state.sum().backward()
    torch.testing.assert_close(retried, embeds.grad, atol=1e-5, rtol=1e-4)


def lie_in_training(peer) -> None:
    """The peer's training forwards (and, so replays show it, its inference steps) come back noisy."""
    stage = peer.server.stage
    honest_graph, honest = stage.forward_for_backward, stage.forward

    def graph(*args, **kwargs):
        out = honest_graph(*args, **kwargs)
        return dataclasses.replace(out, output=noise(out.output))

    stage.forward_for_backward = graph
    stage.forward = lambda *args, **kwargs: noise(honest(*args, **kwargs))


async def _lied_to(source):
    async with running_peers(source, [(0, 2), (2, 3), (2, 3), (3, 4)]) as (peers, maddrs):
        liar = peers[1]
        lie_in_training(liar)
        client = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, client, verify=1.0, compression="none")  # the tight bar
            model.core.health.observed = {liar.swarm.peer_id: 1e6}  # its layers go to the liar first
            loss, grad = await model.train_step(IDS, IDS)
            return loss, grad, model.core.access().distrusted, liar.swarm.peer_id
        finally:
            await client.shutdown()


def test_a_checked_training_forward_is_computed_again_without_the_liar(tiny_models):
    source = tiny_models["llama"]
    loss, grad, distrusted, liar = uvloop.run(_lied_to(source))
    assert_local_step(source, loss, grad)
    assert distrusted == {liar}
