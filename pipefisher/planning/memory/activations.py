"""Bytes of activations a pipeline stage keeps per micro-batch, and their peak per rank over a
schedule. Pure Python: no torch.

Counted are the tensors autograd saves from a stage's forward until its backward (each storage
once, parameters excluded), plus what pipefisher's stage runtime holds beside them (the stage's
input and output tensors, `pipefisher.runtime.pipeline.stage.StageRuntime`). The per-block
counts were read off `torch.autograd.graph.saved_tensors_hooks` on the real modules
(`pipefisher.runtime.training.memory_probe.saved_bytes`; the tests compare them again). In the
notation of Korthikanti et al. 2022 (b micro-batch size, s sequence, h hidden, a heads, f
feed-forward width, c bytes of the compute dtype (4 fp32, 2 bf16), r bytes of the residual
stream), one block of dropout 0 keeps, in bytes:

    BERT (post-LN):  bsh(x + 6c + 2r) + 2bsf·c + bs(c + 16) + 4abs      x = c if r = c else 3c
    GPT-2 (pre-LN):  bsh(2r + 6c) + 5bsf·c + 16bs + 4abs                (gelu_new keeps 4 tensors)
    tiny (pre-LN):   bsh(2r + 6c) + 2bsf·c + 16bs + 4abs
    Llama (RMSNorm): bsh(8 + 2r + 2c + n1 + n2 + 2c·kv/a) + 4bsf·c + 8bs + 4abs  n1 = 4 if c = 4 else 3c, n2 = 4 if c = 4 else 2c

at fp32 (c = r = 4) BERT's block is sbh·(32 + 8f/h) bytes, sbh·64 at f = 4h, against Korthikanti
et al.'s sbh·(34 + 5as/h) for 2-byte activations with 1-byte dropout masks and the s² scores: at
dropout 0 pipefisher keeps no masks and flash attention keeps no scores. Under bf16 autocast (as on the CPU: LayerNorm keeps its input dtype,
cross-entropy and the log-sum-exp run in fp32) a Linear whose input needs a gradient keeps a
bf16 copy of its weight per micro-batch (2 bytes × weight elements) where each forward casts anew
(the runtime under ZeRO-2/3); without FSDP the runtime's step cache holds one copy of every
Linear's weight and bias per stage for the whole step instead (`step_cast_bytes`,
`weight_casts=False` here; `pipefisher.runtime.gradient_path.precision.Precision.step_casts`),
whatever the micro-batches in flight. The residual stream is fp32
on the first stage (fp32 embeddings; tiny's embedding is a Linear, bf16) and bf16 on the others
(they receive bf16). Dropout p > 0 (BERT, CPU): masks of c bytes per dropped element and the
attention's math path (three a·s² tensors per block) instead of flash attention.
Recompute "blocks" keeps a block's input only (bsh·r) and, during one block's backward, that
block's full activations again (`pipefisher.planning.memory.backward`); "selective" drops the
attention core's own saved tensors (log-sum-exp, mask, the s² tensors), keeping its inputs q, k, v and its
output (the next Linear saves it anyway).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.core.names import RECOMPUTE_MODES
from pipefisher.planning.comm.send_waits import SendWait, schedule_send_waits
from pipefisher.planning.memory.activation_rows import linear_peaks, weighted_micro_batches

PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
KINDS = ("bert", "tiny", "llama", "gpt2")
#: bytes of int64 token ids and labels
ID_BYTES = 8


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes as the activation model takes them. `kv_heads`: Llama's key/value
    heads (0 = `heads`); `inputs`/`outputs`: tiny's input features and regression targets per
    token; `dropout`: the probability of BERT's dropout layers; `predictions`: positions per
    sequence BERT's MLM head runs on (the data's `mlm_positions` width; 0 = all `seq_len`);
    `positions`: rows of BERT's or GPT-2's position-embedding table (0: not above `vocab`), whose
    dense gradient the backward builds; `stage_blocks`: blocks per stage (`pipeline.stage_blocks`;
    empty: dealt evenly)."""

    kind: str
    blocks: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    kv_heads: int = 0
    inputs: int = 0
    outputs: int = 0
    dropout: float = 0.0
    predictions: int = 0
    positions: int = 0
    stage_blocks: tuple[int, ...] = ()

    @property
    def head_rows(self) -> int:
        """Positions per sequence the vocabulary head and its loss run on."""
        return self.predictions or self.seq_len

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.dropout and self.kind != "bert":
            raise ValueError(f"dropout: the model covers dropout > 0 for bert only; use 0 for {self.kind}")

    @classmethod
    def from_sizes(cls, sizes, heads: int, seq_len: int, dropout: float = 0.0) -> ModelShape:
        """BERT's shape from `pipefisher.planning.memory.transformer_state.TransformerSizes`."""
        return cls("bert", sizes.blocks, sizes.hidden, heads, sizes.ffn, sizes.vocab, seq_len, dropout=dropout)


def _check(shape: ModelShape, blocks: int, precision: str, recompute: str, tensor_parallel: int) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: {recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if blocks < 0:
        raise ValueError(f"blocks: expected 0 or more, got {blocks}")
    if tensor_parallel < 1 or shape.heads % tensor_parallel or shape.ffn % tensor_parallel:
        raise ValueError(f"tensor_parallel: {tensor_parallel} does not divide heads {shape.heads} and ffn {shape.ffn}")


def _residual_bytes(shape: ModelShape, first: bool, c: int) -> int:
    """Bytes per element of the residual stream: the stage input's dtype (bf16 received from the
    previous stage), on the first stage the embedding's output (fp32, tiny's Linear: c)."""
    return c if not first or shape.kind == "tiny" else 4


def block_linear_elements(shape: ModelShape, tensor_parallel: int = 1) -> tuple[int, int]:
    """(weight, bias) elements of one block's Linears on one tensor-parallel rank: what autocast
    casts to the compute dtype (Llama's Linears have no biases)."""
    h, t, f = shape.hidden, tensor_parallel, shape.ffn // tensor_parallel
    if shape.kind == "llama":
        kv = (shape.kv_heads or shape.heads) // t
        return 2 * h * h // t + 2 * h * kv * (h // shape.heads) + 3 * h * f, 0
    return 4 * h * h // t + 2 * h * f, 3 * h // t + f + 2 * h


def block_bytes(
    shape: ModelShape,
    b: int,
    c: int,
    r: int,
    recompute: str = "none",
    tensor_parallel: int = 1,
    weight_casts: bool = True,
) -> int:
    """Bytes one block keeps for a micro-batch of `b` sequences (module docstring), its input
    included; `c`, `r`: bytes of the compute dtype and of the residual stream. Under tensor
    parallelism the attention and feed-forward interiors are a rank's shard (1/T of the heads and
    of f), the residual stream whole. `weight_casts` False: the low-precision weight copies are
    the step cache's, not the micro-batch's (`step_cast_bytes`)."""
    if recompute == "blocks":
        return b * shape.seq_len * shape.hidden * r
    s, h, t = shape.seq_len, shape.hidden, tensor_parallel
    bsh, bs, inner, f = b * s * h, b * s, b * s * h // t, shape.ffn // t
    bsf, bas = b * s * f, b * (shape.heads // t) * s
    stats = 4 * bs * 4  # two norms' mean and rstd (RMSNorm: rstd twice), fp32
    core = 4 * bas + (bs * c if shape.kind == "bert" else 0)  # log-sum-exp; BERT's float mask
    if shape.kind == "bert":
        x = c if r == c else 3 * c
        held = bsh * (x + 2 * r + c) + inner * 4 * c + bsf * 2 * c
        if shape.dropout:  # math attention: q·scale, kᵀ, softmax, mask, dropped probs; two hidden masks, output copy
            core = 3 * bas * s * c
            held += 2 * bsh * c
    elif shape.kind in ("gpt2", "tiny"):
        held = bsh * (2 * r + 2 * c) + inner * 4 * c + bsf * (5 if shape.kind == "gpt2" else 2) * c
    else:
        kv = (shape.kv_heads or shape.heads) // t
        head = h // shape.heads
        n1, n2 = (4, 4) if c == 4 else (3 * c, 2 * c)
        held = bsh * (8 + 2 * r + n1 + n2) + inner * 2 * c + 2 * bs * kv * head * c + 4 * bsf * c
        stats = 2 * bs * 4
    if recompute == "selective":
        core = 0
    weights = block_linear_elements(shape, t)[0] if weight_casts and c == 2 else 0
    return held + core + stats + 2 * weights


def _embedding_bytes(shape: ModelShape, b: int, c: int) -> int:
    s, bs = shape.seq_len, b * shape.seq_len
    if shape.kind == "bert":  # ids, token types, positions; LayerNorm's input and statistics (+ dropout's mask)
        return (
            2 * bs * ID_BYTES
            + s * ID_BYTES
            + bs * shape.hidden * 4
            + 2 * bs * 4
            + (bs * shape.hidden * 4 if shape.dropout else 0)
        )
    if shape.kind == "gpt2":
        return bs * ID_BYTES + s * ID_BYTES
    if shape.kind == "tiny":
        return bs * shape.inputs * c
    return bs * ID_BYTES


def head_linear_elements(shape: ModelShape) -> tuple[int, int]:
    """(weight, bias) elements of the last stage's Linears: BERT's transform, tied decoder, pooler
    and NSP classifier; GPT-2's and Llama's lm_head (no bias); tiny's regression head."""
    h, v = shape.hidden, shape.vocab
    if shape.kind == "bert":
        return h * h + v * h + h * h + 2 * h, h + v + h + 2
    if shape.kind == "tiny":
        return shape.outputs * h, shape.outputs
    return v * h, 0


def _head_bytes(shape: ModelShape, b: int, c: int, r: int, weight_casts: bool = True) -> int:
    """The last stage's final norm, heads, logits and loss (log-softmax in fp32, labels, scalars),
    and, with `weight_casts`, the low-precision copies of the heads' weights the micro-batch saves."""
    s, h, v = shape.seq_len, shape.hidden, shape.vocab
    bs, bsh = b * s, b * s * h
    if (
        shape.kind == "bert"
    ):  # on the head's rows: transform (dense, gelu, LayerNorm), decoder; pooler, NSP, both losses
        bp = b * shape.head_rows
        gathered = bsh * r + bp * ID_BYTES if shape.predictions else 0  # the gather keeps its input and positions
        held = bp * h * (c + 2 * c + c) + 2 * bp * 4 + b * h * c + (b * h * c if c != r else 0) + gathered
        loss = bp * v * 4 + bp * ID_BYTES + b * 2 * 4 + b * ID_BYTES + 16
    elif shape.kind == "gpt2":  # ln_f, lm_head, cross-entropy
        held = bsh * (r + c) + 2 * bs * 4
        loss = bs * v * 4 + bs * ID_BYTES + 4
    elif shape.kind == "tiny":  # norm, regression head, MSE (output and targets in fp32)
        held = bsh * (r + c) + 2 * bs * 4
        loss = 2 * bs * shape.outputs * 4
    else:  # RMSNorm, lm_head, cross-entropy
        held = bsh * (4 + r + c) + bs * 4
        loss = bs * v * 4 + bs * ID_BYTES + 4
    return held + loss + (2 * head_linear_elements(shape)[0] if weight_casts and c == 2 else 0)


def step_cast_bytes(
    shape: ModelShape, blocks: int, first: bool, last: bool, precision: str = "fp32", tensor_parallel: int = 1
) -> int:
    """Bytes of the low-precision copies of a stage's Linear weights and biases that the step
    cache keeps from the stage's first forward of a step to its optimizer step, one copy whatever
    the micro-batches (`pipefisher.runtime.gradient_path.precision.Precision.step_casts`): every
    Linear autocast runs, tiny's input Linear on the first stage included (0 under fp32)."""
    c = PRECISIONS[precision]
    if c == 4:
        return 0
    elements = blocks * sum(block_linear_elements(shape, tensor_parallel))
    if first and shape.kind == "tiny":
        elements += shape.inputs * shape.hidden + shape.hidden
    if last:
        elements += sum(head_linear_elements(shape))
    return c * elements


def micro_batch_bytes(
    shape: ModelShape,
    blocks: int,
    first: bool,
    last: bool,
    micro_batch_size: int,
    precision: str = "fp32",
    recompute: str = "none",
    tensor_parallel: int = 1,
    weight_casts: bool = True,
) -> int:
    """Bytes a stage of `blocks` blocks (with the embeddings if `first`; the final norm, heads,
    logits and loss if `last`) keeps for one micro-batch from its forward until its backward,
    on one tensor-parallel rank. `weight_casts`: with the low-precision weight copies its autograd
    graph saves (False: the step cache holds them once per step instead, `step_cast_bytes`).
    ValueError naming a bad argument."""
    _check(shape, blocks, precision, recompute, tensor_parallel)
    b, c = micro_batch_size, PRECISIONS[precision]
    r = _residual_bytes(shape, first, c)
    bsh = b * shape.seq_len * shape.hidden
    total = blocks * block_bytes(shape, b, c, r, recompute, tensor_parallel, weight_casts)
    if not first:
        # the received input (c bytes) is held; the first block's saved input is that same tensor
        # unless it keeps a copy (Llama's RMSNorm upcasts a bf16 input to fp32)
        total += bsh * c if shape.kind == "llama" and c != 4 and blocks and recompute != "blocks" else 0
        total += 0 if blocks else bsh * c
    else:
        total += _embedding_bytes(shape, b, c)
    if shape.kind == "llama" and blocks and recompute != "blocks":
        total += 2 * shape.seq_len * (shape.hidden // shape.heads) * 4  # rotary cos and sin, shared by the blocks
    if last:
        total += _head_bytes(shape, b, c, r, weight_casts) + 4  # and the loss the stage holds for its backward
    else:
        total += bsh * r  # the stage's output, held for its backward
    return total


def weight_pending_bytes(
    shape: ModelShape,
    blocks: int,
    first: bool,
    last: bool,
    micro_batch_size: int,
    precision: str = "fp32",
    weight_casts: bool = True,
) -> int:
    """Bytes a micro-batch still holds between its input gradient (op B) and its weight gradient
    (op W) under the split backward (`pipefisher.runtime.pipeline.split_backward`): PyTorch keeps
    the graph below the parameters' join points, i.e. every saved tensor of the blocks (what
    autograd saved for them is not freed by the input gradient, which retains the graph), and the
    gradient reaching each join point (a Linear's or LayerNorm's output: about 6 bsh + 2 bsf per
    block, in the compute dtype). The last stage's heads keep theirs too, and the gradient of the
    logits (the decoder's output) takes the place of the freed log-softmax, the same size. The
    first stage's input (token ids) needs no gradient, so its backward runs whole at B and holds
    nothing (0). `weight_casts` as in `micro_batch_bytes`."""
    if first:
        return 0
    c = PRECISIONS[precision]
    b = micro_batch_size
    r = _residual_bytes(shape, first, c)
    bsh, bsf = b * shape.seq_len * shape.hidden, b * shape.seq_len * shape.ffn
    grads = blocks * (bsh * 6 + bsf * 2) * c
    saved = blocks * block_bytes(shape, b, c, r, weight_casts=weight_casts)
    return saved + grads + (_head_bytes(shape, b, c, r, weight_casts) if last else 0)


#: per position of an op whose output a rank sends, where it waits for the send (`send_waits`;
#: None: at the step's end)
SendWaits = Mapping[int, SendWait | None]


def activation_held(
    ops: Sequence,
    stage_bytes: Sequence[int],
    pending_bytes: Sequence[int],
    transient_bytes: Sequence[int],
    weighted: set[tuple],
    sent_bytes: Sequence[tuple[int, int]] | None = None,
    waits: SendWaits | None = None,
) -> list[tuple[int, int]]:
    """Per op of one rank's op list (ops without activations, e.g. curvature tasks, change
    nothing), the activation bytes held (during, after) it: a forward adds its stage's
    `stage_bytes`; a backward counts its stage's `transient_bytes` on top of what is held when it
    starts, then frees the stage bytes and, where `weighted` holds its (pipe, stage, micro-batch),
    adds the stage's `pending_bytes` until the weight op frees them. `sent_bytes` per stage:
    (forward, backward) bytes its op's send holds beyond the stage bytes
    (`pipefisher.planning.memory.peak.stage_sent_bytes`), from the op to the rank's wait for the
    send, `waits` (of the sends to other ranks, `pipefisher.planning.comm.send_waits`; a wait
    right after an op counts as held at its end). None of both: no sends counted."""
    added, freed_before, freed_after = _sends_held(ops, sent_bytes, waits)
    held, result = 0, []
    for position, op in enumerate(ops):
        held -= freed_before.get(position, 0)
        during = held
        if op.kind is OpKind.FORWARD:
            held += stage_bytes[op.stage] + added.get(position, 0)
            during = held
        elif op.kind is OpKind.BACKWARD:
            during = held + transient_bytes[op.stage]
            weight = pending_bytes[op.stage] if (op.pipe, op.stage, op.micro_batch) in weighted else 0
            held += weight - stage_bytes[op.stage] + added.get(position, 0)
        elif op.kind is OpKind.WEIGHT:
            held -= pending_bytes[op.stage]
        result.append((max(during, held), held))
        held -= freed_after.get(position, 0)
    return result


def _sends_held(
    ops: Sequence[Op], sent_bytes: Sequence[tuple[int, int]] | None, waits: SendWaits | None
) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Per position: the bytes the op's send holds from it on, and the bytes the waits there free
    before the op runs and after it."""
    added: Counter[int] = Counter()
    before: Counter[int] = Counter()
    after: Counter[int] = Counter()
    if sent_bytes is None or waits is None:
        return added, before, after
    for position, slot in waits.items():
        op = ops[position]
        size = sent_bytes[op.stage][0 if op.kind is OpKind.FORWARD else 1]
        added[position] = size
        if slot is not None:
            (after if slot.after_run else before)[slot.position] += size
    return added, before, after


def activation_peaks(
    schedule: Schedule,
    stage_bytes: Sequence[int],
    pending_bytes: Sequence[int],
    transient_bytes: Sequence[int] | None = None,
    sent_bytes: Sequence[tuple[int, int]] | None = None,
) -> list[int]:
    """Per rank, the most activation bytes held at once over its op order (`activation_held`;
    `transient_bytes` per stage, `backward_transient_bytes`, and `sent_bytes`, held until the
    waits of `pipefisher.planning.comm.send_waits`: none when not given). Non-negative int bytes
    take the fast path, `pipefisher.planning.memory.activation_rows.linear_peaks` (equal results)."""
    if len(stage_bytes) != schedule.num_stages or len(pending_bytes) != schedule.num_stages:
        raise ValueError(
            f"stage_bytes, pending_bytes: one per stage ({schedule.num_stages}), got "
            f"{len(stage_bytes)} and {len(pending_bytes)}"
        )
    transient = transient_bytes if transient_bytes is not None else [0] * schedule.num_stages
    fast = linear_peaks(schedule, stage_bytes, pending_bytes, transient, sent_bytes)
    if fast is not None:
        return fast
    weighted = weighted_micro_batches(schedule)
    no_sends: list[SendWaits | None] = [None] * schedule.num_ranks
    waits = no_sends if sent_bytes is None else schedule_send_waits(schedule)
    return [
        max(
            (
                during
                for during, _ in activation_held(
                    ops, stage_bytes, pending_bytes, transient, weighted, sent_bytes, waits[rank]
                )
            ),
            default=0,
        )
        for rank, ops in enumerate(schedule.ranks)
    ]
