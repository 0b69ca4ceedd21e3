"""The most bytes a stage's backward allocates at once beyond what its forward kept: the
gradients in flight and the weight gradients before they are added into the stage's gradient
buffer. Pure Python: no torch.

Read off the live bytes of real stages' backwards (tests/test_activation_memory.py). The runtime
points every parameter's `.grad` at a view of the stage's flat gradient buffer
(`pipefisher.runtime.gradient_path.buffers.GradientBuffer`), so autograd's accumulation adds each
weight gradient into it in place; until then the gradient is a tensor of its own, one Linear's at
a time (autograd runs a parameter's accumulation as soon as its gradient is ready). Under
bf16/fp16 a Linear's weight gradient is computed in the compute dtype against the cast weight and
cast to the fp32 parameter's dtype before it is added: both forms are alive at the cast. The
embeddings run in fp32 outside autocast and their backward builds a dense gradient of each table
(vocab × h, positions × h), the largest alive with the gradient reaching the embeddings; by then
the stage's blocks have released what they saved for this micro-batch.
"""

from __future__ import annotations

from pipefisher.planning.memory.activations import PRECISIONS, ModelShape, _head_bytes, _residual_bytes, block_bytes


def _weight_gradient_bytes(elements: int, c: int) -> int:
    """A weight gradient of `elements` before its accumulation: in the compute dtype, then
    (c < 4) also its fp32 cast, both alive at the cast."""
    return elements * (c + (4 if c < 4 else 0))


def backward_transient_bytes(
    shape: ModelShape,
    first: bool,
    last: bool,
    micro_batch_size: int,
    precision: str = "fp32",
    recompute: str = "none",
    tensor_parallel: int = 1,
    weight_casts: bool = True,
    blocks: int = 0,
) -> int:
    """The most bytes a stage's backward allocates beyond what the forward kept, at once, the
    largest of three phases that run one after the other (each one's tensors are freed before
    the next):

    - the last stage's heads: the loss's gradients of the log-probabilities and of the logits
      (2·b·p·V, fp32, p the head's rows), then the decoder's backward: the logits' gradient in
      the compute dtype, the decoder's weight gradient (`_weight_gradient_bytes`, V·h; BERT's
      bias V too), its input's gradient and the transform's (2·b·p·h), less the log-softmax's
      saved output (b·p·V·4), released by then;
    - the blocks', one at a time, net of what the block's backward has released by then (the
      stage's bytes count it all): the second feed-forward Linear's backward, its output's
      gradient (b·s·h), its input's (b·s·f), its weight's (h·f/T) and bias's; under bf16/fp16
      its weight gradient at the cast instead if larger, both forms, when its saved input (b·s·f)
      is released; at least the attention's q, k, v and output gradients (4·b·s·h) with an h·h/T
      weight gradient; under recompute "blocks" plus that block's activations, rebuilt; on the
      last stage less what the heads saved, released by then;
    - the first stage's embeddings (BERT, GPT-2, Llama): the dense gradient of the largest table
      (vocab or `shape.positions` rows × h, fp32) and the b·s·h gradient reaching them, less what
      the stage's `blocks` saved for the micro-batch, released by then (0 blocks: nothing).

    `weight_casts` as in `micro_batch_bytes` (the blocks' saved bytes released)."""
    b, c = micro_batch_size, PRECISIONS[precision]
    s, h, v = shape.seq_len, shape.hidden, shape.vocab
    f = shape.ffn // tensor_parallel
    head = 0
    if last and v:
        rows = b * shape.head_rows
        bias = v if shape.kind == "bert" else 0
        # the log-softmax's saved output (rows·V·4, fp32) is released by the decoder's backward
        decoder = rows * v * (c - 4) + _weight_gradient_bytes(v * h, c) + 2 * rows * h * c + 4 * bias
        head = max(2 * rows * v * 4, decoder)
    r = _residual_bytes(shape, first, c)
    bsf, bsh = b * s * shape.ffn, b * s * h
    # the second feed-forward Linear's backward, its saved input released by its weight's cast
    block = bsh * c + max(bsf * c + h * f * c, _weight_gradient_bytes(h * f, c) if c < 4 else 0) + h * c
    block = max(block, 4 * bsh * c + _weight_gradient_bytes(h * h // tensor_parallel, c))  # the attention's
    if recompute == "blocks":
        block += block_bytes(shape, b, c, r, "none", tensor_parallel, weight_casts)
    if last:  # the heads' saved tensors (the log-softmax's b·p·V·4 among them) are released by then
        block -= _head_bytes(shape, b, c, r, weight_casts)
    embedding = 0
    if first and shape.kind != "tiny":
        table = max(v, shape.positions if shape.kind in ("bert", "gpt2") else 0)
        released = blocks * block_bytes(shape, b, c, r, recompute, tensor_parallel, weight_casts)
        embedding = table * h * 4 + b * s * h * 4 - released
    return max(head, block, embedding)
