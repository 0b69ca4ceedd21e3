"""`Comm.broadcast` sends one flat buffer per root, dtype and device (`coalesced`) instead of one
broadcast per tensor: gradient workers broadcast every layer of a stage, and per-tensor calls cost
a launch (and, on gloo, a round trip) each."""

from __future__ import annotations

import torch

from pipefisher.runtime.primitives.comm import coalesced


def test_one_buffer_per_root_and_dtype_and_the_receiver_gets_every_tensor_back():
    torch.manual_seed(0)
    sent = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2).double(), torch.randn(4, 3).t(), torch.randn(7)]
    roots = [0, 1, 0, 0, 1]
    root_batches = coalesced(list(zip(sent, roots)), rank=0)
    assert [(b.root, b.flat.dtype, len(b.tensors)) for b in root_batches] == [
        (0, torch.float32, 2),
        (1, torch.float32, 2),
        (0, torch.float64, 1),
    ]
    received = [torch.zeros_like(t) for t in sent]
    batches = coalesced(list(zip(received, roots)), rank=1)
    for batch, root_batch in zip(batches, root_batches):
        if batch.receives:  # what the broadcast writes into the receiver's flat buffer
            batch.flat.copy_(root_batch.flat)
    for batch in batches:
        batch.unpack()
    for got, want, root in zip(received, sent, roots):
        assert torch.equal(got, want) == (root == 0)  # rank 1's own tensors are not received
