"""How a stage runs its share of a Hugging Face model family: the block list, what the first and
last stages hold, and the few lines of the family's forward around the blocks.

A `Layout` is recognised from the module tree of the model class (`find_layout`): GPT-2
(``transformer.h``), BERT for pre-training (``bert.encoder.layer``) and Llama-like decoders
(``model.layers`` with ``model.embed_tokens``, ``model.norm``, ``model.rotary_emb``). Every stage
rebuilds the attention mask (and rotary embeddings) from the micro-batch with the library's own
functions, as the unsplit model does, so that nothing but hidden states crosses stages. A
micro-batch without ``attention_mask`` has no padding: the mask functions then return None and
SDPA runs with `is_causal` (or no mask), free to take its flash kernel, with no host sync. BERT's
MLM head runs on ``mlm_positions`` only when the micro-batch has them (`pipefisher.models.mlm`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pipefisher.core.tensor_parallel import Split
from pipefisher.models import Batch
from pipefisher.models.mlm import at_mlm_positions, mlm_loss

#: block keyword arguments from (stage, stand-in (B, T, 1) in the dtype of the stage's parameters,
#: which the unsplit model's embeddings have, micro-batch)
BlockContext = Callable[[nn.Module, Tensor, Batch], dict[str, Any]]


@dataclass(frozen=True)
class Layout:
    """One family's cut. Paths are dotted module names of the Hugging Face model.

    `first`/`last`: modules held by the first/last stage only; `every`: parameter-free modules
    every stage holds. `embed(stage, batch)` -> hidden states (B, T, hidden); `head(stage, x,
    batch)` -> the last stage's output; `model_inputs(batch)`: keyword arguments of the unsplit
    model's forward, labels included; `outputs(model_output, batch)`: that forward's result as
    `head` returns it.
    """

    blocks: str
    #: config model types whose forward is this layout's (others with the same modules are refused)
    model_types: tuple[str, ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    every: tuple[str, ...]
    data: Literal["causal", "bert"]
    embed: Callable[[nn.Module, Batch], Tensor]
    context: BlockContext
    head: Callable[[nn.Module, Tensor, Batch], Any]
    model_inputs: Callable[[Batch], dict[str, Tensor | None]]
    outputs: Callable[[Any, Batch], Any]
    loss_parts: tuple[str, ...] = ()
    #: config fields that must be false/null: they change the forward in ways this layout does not follow
    unsupported: tuple[str, ...] = ()
    #: Megatron's split of a block (paths under the block list's ``<i>``), {} when the family has none
    tensor_parallel: dict[str, Split] = field(default_factory=dict)
    #: config fields a tensor-parallel degree must divide
    tensor_parallel_fields: tuple[str, ...] = ()
    #: why the family has no tensor-parallel split, for the error
    no_tensor_parallel: str = ""


def _positions(like: Tensor) -> Tensor:
    """Position ids (1, T) of a (B, T, ...) tensor, on its device."""
    return torch.arange(like.shape[1], device=like.device).unsqueeze(0)


def _causal_context(stage: nn.Module, stand_in: Tensor, batch: Batch) -> dict[str, Any]:
    """The blocks' causal mask (None without padding) and positions. `create_causal_mask` gets no
    position ids: it would only read them (a host sync) to detect packed sequences restarting
    their positions within a row, which pipefisher's positions (0 .. T - 1 per row) never do."""
    from transformers.masking_utils import create_causal_mask

    no_cache = {_cache_keyword(create_causal_mask): None}
    mask = create_causal_mask(
        config=stage.config, inputs_embeds=stand_in, attention_mask=batch.get("attention_mask"), **no_cache
    )
    return {"attention_mask": mask, "position_ids": _positions(stand_in), "use_cache": False}


@functools.cache
def _cache_keyword(create_causal_mask: Callable[..., Any]) -> str:
    """The name of `create_causal_mask`'s cache argument: `cache` from transformers 5.24 on
    (where `past_key_values` warns that it is deprecated), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _rotary_context(stage: nn.Module, stand_in: Tensor, batch: Batch) -> dict[str, Any]:
    context = _causal_context(stage, stand_in, batch)
    context["position_embeddings"] = stage.get_submodule("model.rotary_emb")(
        stand_in, position_ids=context["position_ids"]
    )
    return context


def _bidirectional_context(stage: nn.Module, stand_in: Tensor, batch: Batch) -> dict[str, Any]:
    from transformers.masking_utils import create_bidirectional_mask

    return {
        "attention_mask": create_bidirectional_mask(
            config=stage.config, inputs_embeds=stand_in, attention_mask=batch.get("attention_mask")
        )
    }


def _gpt2_embed(stage: nn.Module, batch: Batch) -> Tensor:
    ids = batch["input_ids"]
    hidden = stage.get_submodule("transformer.wte")(ids) + stage.get_submodule("transformer.wpe")(_positions(ids))
    return stage.get_submodule("transformer.drop")(hidden)


def _causal_inputs(batch: Batch) -> dict[str, Tensor | None]:
    return {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "labels": batch["labels"]}


def _bert_inputs(batch: Batch) -> dict[str, Tensor | None]:
    return {
        "input_ids": batch["input_ids"],
        "token_type_ids": batch["token_type_ids"],
        "attention_mask": batch.get("attention_mask"),
        "labels": batch["mlm_labels"],
        "next_sentence_label": batch["nsp_labels"],
    }


def _bert_head(stage: nn.Module, x: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """(MLM logits at the batch's MLM positions, NSP logits): the heads of BertForPreTraining."""
    return stage.get_submodule("cls")(at_mlm_positions(x, batch), stage.get_submodule("bert.pooler")(x))


def bert_pretraining_loss(output: tuple[Tensor, Tensor], batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
    """BertForPreTraining's loss: masked-LM cross-entropy (mean over labelled positions,
    `pipefisher.models.mlm.mlm_loss`) plus next-sentence cross-entropy (mean over the
    micro-batch); parts detached."""
    mlm_logits, nsp_logits = output
    mlm = mlm_loss(mlm_logits, batch)
    nsp = F.cross_entropy(nsp_logits.reshape(-1, 2), batch["nsp_labels"].reshape(-1))
    return mlm + nsp, {"mlm": mlm.detach(), "nsp": nsp.detach()}


LAYOUTS: dict[str, Layout] = {
    "transformer.h": Layout(
        blocks="transformer.h",
        model_types=("gpt2",),
        first=("transformer.wte", "transformer.wpe", "transformer.drop"),
        last=("transformer.ln_f", "lm_head"),
        every=(),
        data="causal",
        embed=_gpt2_embed,
        context=_causal_context,
        head=lambda stage, x, batch: stage.get_submodule("lm_head")(stage.get_submodule("transformer.ln_f")(x)),
        model_inputs=_causal_inputs,
        outputs=lambda out, batch: out.logits,
        unsupported=("add_cross_attention",),
        no_tensor_parallel="GPT-2 projects query, key and value with one fused Conv1D (c_attn), which pipefisher does not split; "
        "use a Llama-like model (e.g. hf_config llama-tiny)",
    ),
    "bert.encoder.layer": Layout(
        blocks="bert.encoder.layer",
        model_types=("bert",),
        first=("bert.embeddings",),
        last=("bert.pooler", "cls"),
        every=(),
        data="bert",
        embed=lambda stage, batch: stage.get_submodule("bert.embeddings")(
            input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"]
        ),
        context=_bidirectional_context,
        head=_bert_head,
        model_inputs=_bert_inputs,
        outputs=lambda out, batch: (at_mlm_positions(out.prediction_logits, batch), out.seq_relationship_logits),
        loss_parts=("mlm", "nsp"),
        unsupported=("is_decoder", "add_cross_attention"),
        no_tensor_parallel="Hugging Face's BERT attention reshapes by its configured head count, which a shard does not have; "
        "use model.kind bert (the same architecture, split) or a Llama-like model",
    ),
    "model.layers": Layout(
        blocks="model.layers",
        model_types=("llama", "mistral", "qwen2"),
        first=("model.embed_tokens",),
        last=("model.norm", "lm_head"),
        every=("model.rotary_emb",),
        data="causal",
        embed=lambda stage, batch: stage.get_submodule("model.embed_tokens")(batch["input_ids"]),
        context=_rotary_context,
        head=lambda stage, x, batch: stage.get_submodule("lm_head")(stage.get_submodule("model.norm")(x)),
        model_inputs=_causal_inputs,
        outputs=lambda out, batch: out.logits,
        unsupported=("sliding_window",),
        tensor_parallel={
            **{f"self_attn.{name}": Split.COLUMN for name in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": Split.ROW,
            "mlp.gate_proj": Split.COLUMN,
            "mlp.up_proj": Split.COLUMN,
            "mlp.down_proj": Split.ROW,
        },
        tensor_parallel_fields=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
    ),
}


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def find_layout(model: nn.Module) -> Layout:
    """The layout of `model` (a Hugging Face model, possibly on the meta device); ValueError naming
    what is missing when it has no block list recognised here or lacks a module the cut needs."""
    name = type(model).__name__
    for blocks, layout in LAYOUTS.items():
        if not _has(model, blocks):
            continue
        missing = [path for path in (*layout.first, *layout.last, *layout.every) if not _has(model, path)]
        if missing:
            raise ValueError(
                f"hf_class: {name} has the block list {blocks} but not {', '.join(missing)}: choose the class with the "
                "pretraining head (GPT2LMHeadModel, BertForPreTraining, LlamaForCausalLM, ...)"
            )
        model_type = getattr(model.config, "model_type", None)
        if model_type not in layout.model_types:
            raise ValueError(
                f"hf_class: {name} (model_type {model_type}) has the block list {blocks}, but its forward is not "
                f"one pipefisher follows; supported model types there: {', '.join(layout.model_types)}"
            )
        held = (blocks, *layout.first, *layout.last, *layout.every)
        left = sorted(
            {
                parameter.rsplit(".", 1)[0]
                for parameter, _ in model.named_parameters()
                if not any(parameter.startswith(f"{module}.") for module in held)
            }
        )
        if left:
            raise ValueError(f"hf_class: {name} has parameters no stage would hold ({', '.join(left)})")
        for key in layout.unsupported:
            if getattr(model.config, key, None):
                raise ValueError(
                    f"hf_config: {name}: config field {key} = {getattr(model.config, key)!r} is not supported by "
                    f"the {blocks} splitter; set it to null/false in the config"
                )
        kinds = set(getattr(model.config, "layer_types", None) or ()) - {"full_attention"}
        if kinds:
            raise ValueError(
                f"hf_config: {name}: layer_types {sorted(kinds)} are not supported (only full_attention layers)"
            )
        return layout
    raise ValueError(
        f"hf_class: {name} has no block list pipefisher recognises ({', '.join(LAYOUTS)}): supported are GPT2LMHeadModel, "
        "BertForPreTraining, LlamaForCausalLM and models laid out like them"
    )
