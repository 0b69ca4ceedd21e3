"""Steps to a target loss: K-FAC vs SGD vs Adam on a small, ill-conditioned MLP regression.

Each optimizer's learning rate is tuned over a grid (the fewest steps wins); the same task,
initialisation and full batch for all. Usage::

    python experiments/kfac_training.py [--target 1e-4] [--max-steps 3000] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass

import torch
from torch.nn.functional import mse_loss

from pipefisher.methods.kfac import KFAC, KFACNumericsWarning
from pipefisher.cli.scripts import entry_point

LR_GRIDS: dict[str, tuple[float, ...]] = {
    "sgd": tuple(10.0 ** (e / 4) for e in range(-12, 1)),  # 1e-3 .. 1
    "adam": tuple(10.0 ** (e / 4) for e in range(-12, -1)),  # 1e-3 .. 0.56
    "kfac": tuple(10.0 ** (e / 4) for e in range(-8, 1)),  # 1e-2 .. 1
}
MOMENTUM = 0.9  # heavy-ball momentum of SGD, also under K-FAC's preconditioned gradients
KFAC_SETTINGS = {"damping": 3e-3, "factor_decay": 0.9, "kl_clip": 1e-2}


@dataclass(frozen=True)
class Result:
    """Best learning rate of one optimizer and the steps it needed (None: target not reached)."""

    optimizer: str
    lr: float
    steps: int | None
    final_loss: float


def make_task(seed: int = 0, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (n, 16) with feature scales spread over 1e-2 .. 1e1 (ill-conditioned), targets (n, 4)
    from a random tanh teacher network."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 1, 16)
    x = torch.randn(n, 16, generator=gen) * scales
    w1 = torch.randn(16, 32, generator=gen) / scales[:, None] / 4
    w2 = torch.randn(32, 4, generator=gen) / math.sqrt(32)
    return x, torch.tanh(x @ w1) @ w2


def make_model(seed: int = 1) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


def steps_to_target(optimizer: str, lr: float, target: float, max_steps: int) -> tuple[int | None, float]:
    """Full-batch training steps until the loss is ≤ ``target`` and the last loss seen."""
    x, y = make_task()
    model = make_model()
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    kfac = KFAC(model, **KFAC_SETTINGS) if optimizer == "kfac" else None
    loss = float("inf")
    for step in range(max_steps + 1):
        opt.zero_grad()
        if kfac is None:
            out = mse_loss(model(x), y)
            out.backward()
        else:
            with kfac.capture():
                out = mse_loss(model(x), y)
                out.backward()
            kfac.update_curvature()
            kfac.update_inverses()
            kfac.precondition(lr)
        loss = out.item()
        if loss <= target:
            return step, loss
        if not math.isfinite(loss):
            return None, loss
        opt.step()
    return None, loss


def tune(optimizer: str, target: float, max_steps: int) -> Result:
    """Fewest steps to ``target`` over the optimizer's learning-rate grid."""
    best = Result(optimizer, float("nan"), None, float("inf"))
    for lr in LR_GRIDS[optimizer]:
        steps, loss = steps_to_target(optimizer, lr, target, max_steps)
        if steps is not None and (best.steps is None or steps < best.steps):
            best = Result(optimizer, lr, steps, loss)
        elif best.steps is None and loss < best.final_loss:
            best = Result(optimizer, lr, None, loss)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=1e-4, help="target full-batch MSE")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", KFACNumericsWarning)  # from grid points that diverge
    results = [tune(name, args.target, args.max_steps) for name in ("kfac", "sgd", "adam")]
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
        return
    print(f"target loss {args.target:g}, at most {args.max_steps} steps\n")
    print("| optimizer | tuned lr | steps to target | final loss |\n|---|---|---|---|")
    for r in results:
        steps = str(r.steps) if r.steps is not None else f"> {args.max_steps}"
        print(f"| {r.optimizer} | {r.lr:.3g} | {steps} | {r.final_loss:.3g} |")


if __name__ == "__main__":
    sys.exit(entry_point(main, "kfac_training"))
