"""Compiled stages (`run.compile`): each repeated block of a stage compiled with `torch.compile`,
as torchtitan compiles per transformer block, so one graph serves every block of a stage.

A block is a child of a container (ModuleList, ModuleDict, Sequential) whose children all have
one class: BERT's `encoder.layer`, the regression model's `blocks`, a Hugging Face stage's
decoder blocks (`transformer.h`, `model.layers`, ...). No model names its blocks to this module.
Blocks are compiled in place (`nn.Module.compile`), so module and parameter names, state-dict
keys and parameters stay those of the eager stage: checkpoints, the optimizer and curvature
methods, which name modules by their names, see no difference. Compilation happens at a block's
first call, on the device it runs on.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

#: containers whose children may be repeated blocks
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def repeated_blocks(module: nn.Module) -> Iterator[nn.Module]:
    """The children of every container under `module` whose children all have one class (not
    itself a container), outermost first; the inside of a block found is not searched."""
    for child in module.children():
        members = list(child.children()) if isinstance(child, CONTAINERS) else []
        if members and len({type(member) for member in members}) == 1 and not isinstance(members[0], CONTAINERS):
            yield from members
        else:
            yield from repeated_blocks(child)


def compile_blocks(module: nn.Module) -> int:
    """Compile the repeated blocks of stage `module` in place (`repeated_blocks`); returns how
    many it compiled now (a block compiled before is left as it is)."""
    compiled = 0
    for block in repeated_blocks(module):
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile()
            compiled += 1
    return compiled
