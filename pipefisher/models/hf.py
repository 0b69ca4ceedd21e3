"""Hugging Face Transformers models cut into pipeline stages (needs the `hf` extra: transformers).

The model is built from its config on the meta device (no download, no memory); a stage is the
part of that module tree it holds, under the same dotted names: its share of the block list
(dealt evenly, global indices), the embeddings on the first stage, final norm and heads on the
last, parameter-free modules (rotary embeddings) on every stage. So a stage's state dict is a
slice of the unsplit model's and loads into it. Stage modules are materialised on the CPU and
initialised module by module with the model's own `_init_weights`, each from a seed drawn from
(seed, module name) alone; `unsplit(seed)` initialises the whole Hugging Face model object the
same way, so every split and the unsplit model start from identical parameters. A weight tied
across stages (GPT-2's ``lm_head.weight`` = ``transformer.wte.weight``) is held by each as a copy
drawn like its source; the runtime sums their gradients.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from pipefisher.core.tensor_parallel import TensorParallelPlan
from pipefisher.models import Batch
from pipefisher.core.stage_split import stage_block_ranges
from pipefisher.models.hf_layouts import Layout, bert_pretraining_loss, find_layout
from pipefisher.models.init import derive_seed

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: config names shipped with the package (`pipefisher/models/hf_configs/<name>.json`)
SHIPPED_CONFIGS = ("gpt2-tiny", "bert-tiny", "llama-tiny", "gpt2-medium", "gpt2")
#: config fields that hold dropout probabilities, by family
DROPOUT_FIELDS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "attention_dropout",
    "mlp_dropout",
    "hidden_dropout",
)


def load_hf_config(spec: str, **overrides: Any):
    """A `transformers` config from a shipped name (SHIPPED_CONFIGS) or a config.json path (its
    ``model_type`` picks the config class), with `overrides` applied. ValueError on a bad spec."""
    from transformers import AutoConfig

    if spec in SHIPPED_CONFIGS:
        text = resources.files("pipefisher.models").joinpath("hf_configs").joinpath(f"{spec}.json").read_text()
    elif Path(spec).is_file():
        text = Path(spec).read_text()
    else:
        raise ValueError(f"hf_config: {spec!r} is neither a file nor one of {', '.join(SHIPPED_CONFIGS)}")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"hf_config: {spec} is not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"hf_config: {spec} has no model_type (it must be a Hugging Face config.json)")
    model_type = values.pop("model_type")
    from huggingface_hub.errors import StrictDataclassError

    try:
        return AutoConfig.for_model(model_type, **{**values, **overrides})
    except (ValueError, TypeError, StrictDataclassError) as exc:
        raise ValueError(f"hf_config: {spec}: {str(exc).splitlines()[0]}") from None


def hf_model_class(name: str) -> type:
    """The `transformers` model class called `name` (ValueError when there is none)."""
    import transformers

    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(
            f"hf_class: {name!r} is not a model class of transformers (e.g. GPT2LMHeadModel, "
            "BertForPreTraining, LlamaForCausalLM)"
        )
    return cls


class HfStage(nn.Module):
    """Blocks of one stage under their Hugging Face names; the first stage embeds, the last applies
    the final norm and heads. forward(x, batch): x (B, T, hidden) from the previous stage (None
    on the first stage, which reads batch["input_ids"]); returns hidden states, or the head's output."""

    def __init__(self, layout: Layout, config, first: bool, last: bool):
        super().__init__()
        self.layout, self.config, self.first, self.last = layout, config, first, last

    def forward(self, x: Tensor | None, batch: Batch) -> Any:
        if self.first:
            x = self.layout.embed(self, batch)
        if x is None:
            raise ValueError("x: a stage without embeddings needs the previous stage's hidden states")
        # masks and rotary embeddings as the unsplit model builds them from its embeddings (master dtype)
        stand_in = torch.empty(x.shape[0], x.shape[1], 1, dtype=self._master_dtype(), device=x.device)
        context = self.layout.context(self, stand_in, batch)
        blocks = self.get_submodule(self.layout.blocks)
        if not isinstance(blocks, nn.ModuleDict):
            raise TypeError(f"{self.layout.blocks}: the stage's blocks are a {type(blocks).__name__}, not a ModuleDict")
        for block in blocks.values():
            x = block(x, **context)
        return self.layout.head(self, x, batch) if self.last else x

    def _master_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


class HfStagedModel:
    """The staged-model interface (`pipefisher.models.StagedModel`) of a Hugging Face model class.

    `weights`: a safetensors file of the unsplit model ("" = initialise from the seed); a tied
    weight missing from it (as `save_pretrained` writes them) is read from its source.
    """

    def __init__(self, class_name: str, config, seq_len: int, weights: str = "", stage_blocks: tuple[int, ...] = ()):
        from transformers.initialization import no_init_weights

        self.cls = hf_model_class(class_name)
        self.config, self.seq_len, self.weights, self.stage_blocks = config, seq_len, weights, stage_blocks
        try:
            with torch.device("meta"), no_init_weights():  # parameters are initialised per stage, later
                self._skeleton = self.cls(config)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise ValueError(f"hf_config: {class_name} cannot be built from it ({str(exc).splitlines()[0]})") from None
        self.layout = find_layout(self._skeleton)
        if self.layout.data == "causal":
            self._skeleton.loss_type = "ForCausalLM"
        self.loss_parts = self.layout.loss_parts
        #: tied parameter name -> the name of the parameter it is a copy of
        self.tied = dict(self._skeleton.get_expanded_tied_weights_keys())
        self._first_to_last = [
            (source, target)
            for target, source in self.tied.items()
            if _under(source, self.layout.first) and _under(target, self.layout.last)
        ]
        self.num_blocks = len(self._skeleton.get_submodule(self.layout.blocks))
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and seq_len > positions:
            raise ValueError(f"seq_len: {seq_len} exceeds the model's {positions} positions (max_position_embeddings)")
        if weights:
            _check_safetensors(self._skeleton, weights, self.tied)

    def stage_modules(self, index: int, num_stages: int) -> list[str]:
        """Dotted names of the modules stage `index` of `num_stages` holds (blocks dealt evenly, or
        `stage_blocks` per stage)."""
        if not 0 <= index < num_stages:
            raise ValueError(f"index: expected 0..{num_stages - 1}, got {index}")
        blocks = stage_block_ranges(self.num_blocks, num_stages, self.stage_blocks)[index]
        names = [f"{self.layout.blocks}.{i}" for i in blocks]
        names += self.layout.first if index == 0 else ()
        names += self.layout.last if index == num_stages - 1 else ()
        return names + list(self.layout.every)

    def check_split(self, num_stages: int) -> None:
        """ValueError unless `num_stages` divides the blocks (see `stage_modules`) and every tied
        weight is either held by one stage or is the one copy the first and last stage hold (the
        runtime sums those)."""
        holders = [self.stage_modules(index, num_stages) for index in range(num_stages)]
        where = lambda name: {index for index, modules in enumerate(holders) if _under(name, modules)}
        for target, source in self.tied.items():
            if where(target) != where(source) and (source, target) not in self._first_to_last[:1]:
                raise ValueError(
                    f"hf_class: {self.cls.__name__} ties {target} to {source}, which {num_stages} stages "
                    "hold apart; pipefisher sums the copies of one weight tied across the first and last stage only"
                )

    def stage_ends(self, num_stages: int) -> list[str]:
        """Names of the last block of every stage but the last: where the unsplit model's hidden
        states cross a stage boundary in a split of `num_stages`."""
        ranges = stage_block_ranges(self.num_blocks, num_stages, self.stage_blocks)
        return [f"{self.layout.blocks}.{blocks[-1]}" for blocks in ranges[:-1]]

    def build_stage(self, index: int, num_stages: int, seed: int) -> HfStage:
        """Stage `index` of `num_stages` on the CPU, initialised (or loaded from `weights`) with
        each parameter a function of (seed, its module's name) alone (under `torch.device("meta")`:
        its skeleton, uninitialised). Does not touch the global RNG."""
        stage = HfStage(self.layout, self.config, index == 0, index == num_stages - 1)
        names = self.stage_modules(index, num_stages)
        for name, module in zip(names, copy.deepcopy([self._skeleton.get_submodule(n) for n in names])):
            _attach(stage, name, module)
        if torch.empty(()).device.type == "meta":
            return stage  # built under torch.device("meta"): names and shapes only, nothing to initialise
        stage.to_empty(device="cpu")
        self._initialise(stage, seed)
        held = dict(stage.named_parameters(remove_duplicate=False))
        for target, source in self.tied.items():
            if target in held and source in held:
                _set_parameter(stage, target, held[source])
            elif target in held and not self.weights:
                held[target].data.copy_(self._drawn(source, seed))
        if self.weights:
            _load_safetensors(stage, self.weights, self.tied)
        return stage

    def unsplit(self, seed: int) -> PreTrainedModel:
        """The Hugging Face model object itself, on the CPU, with the parameters every split starts from."""
        model = copy.deepcopy(self._skeleton).to_empty(device="cpu")
        self._initialise(model, seed)
        if self.weights:
            _load_safetensors(model, self.weights, self.tied)
        model.tie_weights()
        return model

    def unsplit_loss(self, model: nn.Module, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The unsplit model's own loss on `batch` (its forward with labels), and the named parts."""
        out = model(**self.layout.model_inputs(batch))
        return out.loss, (self.loss(self.layout.outputs(out, batch), batch)[1] if self.loss_parts else {})

    def activation_shape(self, stage: int, num_stages: int, micro_batch_size: int) -> tuple[int, ...]:
        """(micro_batch_size, seq_len, hidden_size): what every stage but the last sends on."""
        if not 0 <= stage < num_stages - 1:
            raise ValueError(f"stage: expected 0..{num_stages - 2} (the last stage sends nothing), got {stage}")
        return (micro_batch_size, self.seq_len, self.config.hidden_size)

    def loss(self, output: Any, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The model class's loss: causal LM (shifted next-token cross-entropy, the class's own
        `loss_function`) or BERT pre-training (masked LM + next sentence)."""
        if self.layout.data == "bert":
            return bert_pretraining_loss(output, batch)
        loss = self._skeleton.loss_function(output, batch["labels"], vocab_size=self.config.vocab_size)
        return loss, {}

    def tied_parameters(self) -> list[tuple[str, str]]:
        """The tied weight held by the first and the last stage, as ("first", source), ("last", copy)."""
        if not self._first_to_last:
            return []
        source, target = self._first_to_last[0]
        return [("first", source), ("last", target)]

    def first_order_linears(self) -> tuple[str, ...]:
        """Modules whose weight is a tied copy: they stay first-order, as their source does."""
        return tuple(sorted({target.rsplit(".", 1)[0] for target in self.tied if target.endswith(".weight")}))

    def tensor_parallel_plan(self, degree: int) -> TensorParallelPlan:
        """The layout's split of every block (`Layout.tensor_parallel`); ValueError naming the
        config field `degree` does not divide, or why the family has no split."""
        layout = self.layout
        if not layout.tensor_parallel:
            raise ValueError(f"hf_class: {layout.no_tensor_parallel}")
        for name in layout.tensor_parallel_fields:
            value = getattr(self.config, name)
            if value % degree:
                raise ValueError(f"hf_config: {name} {value} is not divisible by pipeline.tensor_parallel {degree}")
        return {f"{layout.blocks}.*.{path}": split for path, split in layout.tensor_parallel.items()}

    def recompute_plan(self, mode: str) -> tuple[str, ...]:
        """Modules `model.recompute` `mode` checkpoints: every block of the block list; ValueError
        for selective (a Hugging Face attention module computes its core inline, no module to name)."""
        if mode == "selective":
            raise ValueError(
                f"recompute: selective needs an attention core apart from its projections, which "
                f"{self.cls.__name__} computes inside its attention module; use model.recompute blocks"
            )
        return {"none": (), "blocks": (f"{self.layout.blocks}.*",)}[mode]

    def _initialise(self, root: nn.Module, seed: int) -> None:
        """The model's `_init_weights` on every module of `root`, children before parents, each
        under a CPU RNG seeded from (seed, module name); the global RNG is left as it was."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for name, module in reversed(list(root.named_modules())):
                if name:
                    torch.manual_seed(derive_seed(seed, name))
                    self._skeleton._init_weights(module)

    def _drawn(self, source: str, seed: int) -> Tensor:
        """Parameter `source` as its own module initialises it (for a copy held on another stage)."""
        module_name = source.rsplit(".", 1)[0]
        holder = nn.Module()
        _attach(holder, module_name, copy.deepcopy(self._skeleton.get_submodule(module_name)))
        holder.to_empty(device="cpu")
        self._initialise(holder, seed)
        return holder.get_parameter(source).detach()


def _under(name: str, modules: Iterable[str]) -> bool:
    return any(name.startswith(f"{module}.") for module in modules)


def _attach(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at dotted `name` under `root`, creating plain containers on the way."""
    *path, leaf = name.split(".")
    parent = root
    for part in path:
        if part not in parent._modules:
            parent.add_module(part, nn.ModuleDict())
        parent = parent.get_submodule(part)
    parent.add_module(leaf, module)


def _set_parameter(root: nn.Module, name: str, parameter: nn.Parameter) -> None:
    module_name, attribute = name.rsplit(".", 1)
    setattr(root.get_submodule(module_name), attribute, parameter)


def _safetensors_keys(root: nn.Module, file, path: str, tied: dict[str, str]):
    """(parameter, key in the file) for every parameter of `root` (a tied copy missing there is
    read from its source); ValueError naming a parameter the file lacks or has in another shape."""
    keys = set(file.keys())
    for name, parameter in root.named_parameters():
        key = name if name in keys else tied.get(name)
        if key not in keys:
            raise ValueError(f"hf_weights: {path} has no tensor {name}")
        shape = tuple(file.get_slice(key).get_shape())
        if shape != tuple(parameter.shape):
            raise ValueError(f"hf_weights: {name} is {shape} in {path}, the config makes it {tuple(parameter.shape)}")
        yield parameter, key


def _open_safetensors(path: str):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except (OSError, ValueError, SafetensorError) as exc:
        raise ValueError(f"hf_weights: cannot read {path} ({str(exc).splitlines()[0]})") from None


def _check_safetensors(root: nn.Module, path: str, tied: dict[str, str]) -> None:
    """ValueError unless the file at `path` holds every parameter of `root` in its shape."""
    with _open_safetensors(path) as file:
        for _ in _safetensors_keys(root, file, path, tied):
            pass


def _load_safetensors(root: nn.Module, path: str, tied: dict[str, str]) -> None:
    """Copy `root`'s parameters from the safetensors file at `path` (see `_safetensors_keys`)."""
    with _open_safetensors(path) as file, torch.no_grad():
        for parameter, key in _safetensors_keys(root, file, path, tied):
            parameter.copy_(file.get_tensor(key))
