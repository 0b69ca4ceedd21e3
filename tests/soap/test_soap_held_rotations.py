"""SOAP's P op (`SoapEngine.hold_rotations`): the gradient rotated into its eigenbases before the
step end, here or by a helper (`rotation_buffer`), scaled there by the ratio of the gradient's
norms, gives the directions of rotating the step end's gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipefisher.methods.soap import SoapConfig, SoapEngine
from pipefisher.methods.soap.step import rotate_in

SETTINGS = SoapConfig(block_size=4)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 6), nn.Linear(6, 10), nn.Linear(10, 6))


def set_gradients(net: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def scale_gradients(net: nn.Module, factor: float) -> None:
    """What clipping and fp16's unscaling do between the P op and the step end."""
    for p in net.parameters():
        p.grad.mul_(factor)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("factors", [(1.0, 0.37, 2.5), (1.0, 0.37, 0.0)])
def test_held_rotations_here_or_received_give_the_step_ends_directions(factors, stacked):
    """Three steps: the first takes the bases (nothing held: no matrix is started), then one matrix
    rotated by the P op, one received from a "helper" (rotated with the bases as it holds them)
    and one left to the step end; each step's gradients are scaled by its factor of `factors`
    after the P op (0: a zero gradient at the step end). Directions equal the plain step end's
    on the scaled gradients to float32's rounding. `stacked` (a GPU's batched products): the 4 x 4
    blocks of all three matrices share one group, held, received and rotated at the step end."""
    plain_net, held_net = model(), model()
    plain, held = SoapEngine(plain_net, SETTINGS), SoapEngine(held_net, SETTINGS)
    plain.stack_blocks = held.stack_blocks = stacked
    names = [info.name for info in held.matrices()]
    for seed, factor in enumerate(factors):
        for net in (plain_net, held_net):
            set_gradients(net, seed)
        received = held.rotation_buffer(names[1])
        state = held._matrix(names[1])
        if state.started:
            grad = held_net.get_parameter(names[1]).grad
            received.copy_(rotate_in([state], [grad.reshape(state.info.shape)], stacked=False)[0])
        held.hold_rotations([names[0]], received=[names[1]])
        for net in (plain_net, held_net):
            scale_gradients(net, factor)
        plain.precondition_all()
        held.precondition_all()
        for (name, ours), theirs in zip(held_net.named_parameters(), plain_net.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_what_is_held_is_what_the_step_end_steps_with():
    """A rotation held of another gradient than the step end's changes the direction: the step end
    reads the held rotation, not the gradient it is handed."""
    plain_net, held_net = model(), model()
    plain, held = SoapEngine(plain_net, SETTINGS), SoapEngine(held_net, SETTINGS)
    for net, engine in ((plain_net, plain), (held_net, held)):
        set_gradients(net, 0)
        engine.precondition_all()
        set_gradients(net, 1)
    held.hold_rotations([info.name for info in held.matrices()])
    set_gradients(held_net, 2)
    set_gradients(plain_net, 2)
    scale_gradients(plain_net, 1.0)
    plain.precondition_all()
    held.precondition_all()
    assert not torch.allclose(held_net[0].weight.grad, plain_net[0].weight.grad, atol=1e-3)
