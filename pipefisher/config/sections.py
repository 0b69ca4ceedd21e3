"""The sections of a run file other than the curvature methods' (`pipefisher.methods.settings`),
each key declared once: its type, default, range and one line of documentation. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipefisher.core.names import Backend, Precision, Recompute
from pipefisher.core.settings import COUNT_CEILING, STEP_CEILING, setting
from pipefisher.models.registry import model_kind
from pipefisher.schedules import SCHEDULES


#: the BERT presets of `pipefisher.models.bert.BERT_PRESETS` (a test holds the two to the same names)
BertPreset = Literal["bert-tiny", "bert-mini", "bert-4x128", "bert-base", "bert-large"]


@dataclass(frozen=True)
class ModelConfig:
    """The model and how it is cut into stages."""

    kind: str = setting(
        "transformer",
        "a kind of `pipefisher.models.registry`: transformer/mlp: a small regression model; bert: BERT pretraining "
        "(MLM + NSP); hf: a Hugging Face model (the hf extra)",
    )
    preset: BertPreset = setting("bert-tiny", "bert: the size of the model (`pipefisher.models.bert.BERT_PRESETS`)")
    config_json: str = setting("", 'a Hugging Face BERT config.json instead of the preset ("" = the preset)')
    hf_config: str = setting(
        "gpt2-tiny",
        "hf: a config.json path, or a config shipped with pipefisher (gpt2-tiny, bert-tiny, llama-tiny, gpt2-medium)",
    )
    hf_class: str = setting("", 'hf: the transformers class ("" = the config\'s first `architectures` entry)')
    hf_weights: str = setting("", 'hf: a safetensors file to load the weights from ("" = initialise)')
    dropout: float = setting(
        -1.0,
        "dropout probability of bert/hf models",
        low=0,
        high=1,
        high_open=True,
        special=(-1.0,),
        note="-1 = the config's own",
    )
    layers: int = setting(4, "transformer/mlp: blocks (split evenly over the stages)", low=0, low_open=True)
    hidden: int = setting(32, "transformer/mlp: width of a block", low=0, low_open=True)
    heads: int = setting(2, "transformer: attention heads (divides hidden)", low=0, low_open=True)
    ffn: int = setting(64, "transformer: feed-forward width", low=0, low_open=True)
    seq_len: int = setting(8, "tokens per sequence (every kind)", low=0, low_open=True)
    input_dim: int = setting(16, "transformer/mlp: features per input token", low=0, low_open=True)
    output_dim: int = setting(4, "transformer/mlp: regression targets per token", low=0, low_open=True)
    recompute: Recompute = setting(
        "none",
        "activation recomputation: blocks keeps each block's input and recomputes its inside in the backward; "
        "selective only the attention core (scores, softmax, dropout); none keeps everything",
    )

    @property
    def identity(self) -> str:
        """The model in one line, as a profile records what it measured (its `model`): "bert
        bert-base", "hf gpt2-tiny", "transformer layers 4 hidden 32 heads 2 ffn 64", ...; files
        by their name. Two runs of one identity time alike per micro-batch of one shape."""
        return model_kind(self.kind).identity(self)


@dataclass(frozen=True)
class DataConfig:
    """Micro-batches, a pure function of (seed, step, micro-batch id)."""

    kind: Literal["synthetic", "bert", "causal"] = setting(
        "synthetic", "synthetic: regression data; bert: sentence pairs with masking; causal: next-token prediction"
    )
    seed: int = setting(0, "seed of the data")
    micro_batch_size: int = setting(4, "sequences per micro-batch", low=0, low_open=True)
    corpus: str = setting(
        "embedded",
        'text: "embedded" (English text shipped with Python) or a file (one sentence per line, blank line between documents)',
    )
    vocab: str = setting("", 'bert: a WordPiece vocab.txt ("" = train one of vocab_size on the corpus)')
    tokenizer: str = setting("", 'causal: a byte-level BPE tokenizer.json ("" = train one of vocab_size on the corpus)')
    vocab_size: int = setting(4000, "size of a tokenizer trained on the corpus", low=0, low_open=True)
    mask_prob: float = setting(0.15, "bert: share of tokens masked", low=0, high=1, low_open=True, high_open=True)
    cache_dir: str = setting("", 'where tokenizers and tokens are cached ("" = the default cache folder)')
    holdout: float = setting(
        0.0,
        "text: share of the corpus's documents never trained on, for held-out evaluation (0 = none)",
        low=0,
        high=1,
        high_open=True,
    )


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline: world size = stages x data_parallel x tensor_parallel."""

    schedule: str = setting("1f1b", f"pipeline schedule: {', '.join(SCHEDULES)}")
    stages: int = setting(2, "pipeline depth D: ranks per pipeline", low=0, low_open=True, ceiling=COUNT_CEILING)
    micro_batches: int = setting(
        4, "micro-batches per step of each pipeline", low=0, low_open=True, ceiling=COUNT_CEILING
    )
    chunks: int = setting(2, "interleaved: model chunks per rank", low=0, low_open=True, ceiling=COUNT_CEILING)
    data_parallel: int = setting(1, "copies of the pipeline", low=0, low_open=True, ceiling=COUNT_CEILING)
    tensor_parallel: int = setting(
        1,
        "processes each block is split over, Megatron-style (attention by heads, the MLP by its "
        "hidden features); a rank's processes share a node",
        low=0,
        low_open=True,
        ceiling=COUNT_CEILING,
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer; a curvature method preconditions, then SGD steps what it preconditions and
    its section's `first_order` rule the rest (weight decay skips biases and LayerNorm weights)."""

    name: str = setting("sgd", "sgd, adamw, lamb, or a curvature method (its section holds its settings)")
    lr: float = setting(
        0.05,
        "learning rate after warm-up (a curvature method's: its section's lr unless 0; see its first_order)",
        low=0,
        low_open=True,
    )
    momentum: float = setting(0.0, "SGD momentum", low=0, high=1, high_open=True)
    weight_decay: float = setting(0.0, "decoupled weight decay (0 = off)", low=0)
    betas: tuple[float, float] = setting(
        (0.9, 0.999),
        "AdamW/LAMB moment decays (also read by a curvature method's Adam grafting)",
        low=0,
        high=1,
        high_open=True,
    )
    eps: float = setting(1e-8, "AdamW/LAMB epsilon", low=0, low_open=True)
    clip_norm: float = setting(0.0, "clip the global gradient norm, after preconditioning (0 = off)", low=0)
    warmup_steps: int = setting(0, "steps of linear warm-up", low=0, ceiling=STEP_CEILING)
    decay: Literal["constant", "linear"] = setting("constant", "after warm-up: constant, or linear to 0 at decay_steps")
    decay_steps: int = setting(
        0,
        "step at which linear decay reaches 0 (0 = the run's last step; fix it when --resume splits a run)",
        low=0,
        ceiling=STEP_CEILING,
    )
    zero: int = setting(
        0,
        "ZeRO stage: 1 shards the optimizer state over each stage's replicas (its owner updates and broadcasts each parameter)",
        low=0,
        high=1,
        note="0 = off, 1 = the optimizer state sharded over each stage's replicas",
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints, also written when a signal stops the run."""

    dir: str = setting("", 'folder of the checkpoints ("" = none)')
    every: int = setting(0, "steps between checkpoints (0 = only at the end)", low=0, ceiling=STEP_CEILING)
    keep: int = setting(2, "newest complete checkpoints kept", low=1)
    resume: Literal["never", "auto", "always"] = setting(
        "never",
        "never: start at step 0; auto: continue from the newest checkpoint that verifies, if any; always: require one",
    )


@dataclass(frozen=True)
class CommConfig:
    """Gradient compression over the data-parallel dimension."""

    powersgd_rank: int = setting(
        0, "rank r of PowerSGD for each replicated stage's gradient reduction (0 = off)", low=0
    )
    powersgd_start_step: int = setting(
        0, "first step (0-based) that compresses; earlier ones reduce uncompressed", low=0, ceiling=STEP_CEILING
    )


@dataclass(frozen=True)
class RunSettings:
    """How the run is carried out."""

    steps: int = setting(3, "steps of the whole run", low=0, low_open=True, ceiling=STEP_CEILING)
    seed: int = setting(0, "seed of the model's initialisation")
    backend: Backend = setting("auto", "torch.distributed backend (auto: nccl on GPUs, gloo on CPUs)")
    master_addr: str = setting("127.0.0.1", "address of rank 0 for local launches")
    master_port: int = setting(
        0,
        "port of the local launcher's rendezvous store (0: a free one, bound at once, so runs on one host "
        "never collide)",
        low=0,
        high=65535,
    )
    timeout: float = setting(60.0, "seconds any rank may wait for another before the run aborts", low=0, low_open=True)
    metrics: str = setting("", 'file that gets one JSON line per step ("" = none)')
    precision: Precision = setting(
        "fp32", "fp32, or bf16/fp16 autocast with fp32 master weights, optimizer and curvature state"
    )
    loss_scale: float = setting(
        65536.0, "fp16: initial loss scale (halved on overflow, doubled after 2000 clean steps)", low=0, low_open=True
    )
    bucket_mb: float = setting(25.0, "size of the gradient all-reduce buckets, MiB", low=0, low_open=True)
    in_order: bool = setting(False, "hold every process group to NCCL's in-order rule (a test mode for gloo)")
    trace: str = setting(
        "",
        'folder for one PyTorch profiler trace per rank (rank<R>.json, Chrome/Perfetto format) of the traced steps ("" = none)',
    )
    trace_from: int = setting(
        3, "first traced step, 1-based (the steps before it warm up)", low=1, ceiling=STEP_CEILING
    )
    trace_steps: int = setting(2, "how many steps the trace covers", low=1, ceiling=STEP_CEILING)
    compile: bool = setting(
        False,
        "compile each stage's repeated blocks with torch.compile (pipelined runs; the reference stays "
        "eager); refused by methods that capture with hooks and by the zero-bubble schedules (zb-h1, zbv, dualpipev)",
    )
