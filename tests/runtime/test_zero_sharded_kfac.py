"""K-FAC under ZeRO-2/3 (FSDP2 over each stage's replicas): FSDP reduce-scatters the gradients
inside the stage's last backward, so the preconditioning op runs after it on the reduced
gradients gathered whole, each replica keeping its shard of the result. Trains like the
single-process reference; the plan names the gathers; gradient workers are refused in one line."""

import pytest
import torch
from _workers import unit_profile
from torch import nn
from _zero_runs import assert_sharded_equals_reference, zero_config

from pipefisher.config import ConfigError
from pipefisher.core.profile import load_profile
from pipefisher.core.ir import OpKind
from pipefisher.core.topology import Topology
from pipefisher.methods.kfac.engine import KFACEngine
from pipefisher.methods.kfac.method import KfacConfig
from pipefisher.planning.comm.actions import (
    Action,
    ActionKind,
    fsdp_grad_collective,
    fsdp_group,
    grad_pipes_collective,
    unshard_collective,
)
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.runtime.training.assembly import build_schedule
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.pipefisher_run import make_plan

#: the kfac section of tests/runtime/test_zero.py's curvature case
SECTION = {"refresh_steps": 2, "factor_decay": 0.5, "damping": 0.01}


def kfac_config(schedule, zero, folder, **overrides):
    """K-FAC on 2 stages x 2 replicas, 4 steps (two refresh cycles: the second preconditions),
    planned from a made-up profile saved in `folder` (`unit_profile`: no measuring)."""
    config = zero_config(
        schedule,
        zero,
        "kfac",
        2,
        optimizer={"lr": 0.05},
        run={"steps": 4},
        kfac={**SECTION, "profile": str(folder / "profile.yaml")},
    ).with_overrides(**overrides)
    unit_profile(config, build_schedule(config).num_stages).save(folder / "profile.yaml")
    return config


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "zero"), [("1f1b", 3), ("gpipe", 2)])
def test_sharded_kfac_equals_the_reference(schedule, zero, tmp_path):
    assert_sharded_equals_reference(kfac_config(schedule, zero, tmp_path), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_the_reduce_scatter_rides_the_last_backward_and_preconditioning_gathers_after_it(schedule, tmp_path):
    """In the replayed plan of a ZeRO-3 K-FAC run, each replicated stage's ``grad`` is launched
    right before its last backward of the step and waited for right after it, although the
    preconditioning op (P) comes later; P is right after its own gathers (``unshard`` of P); with
    two pipes (Chimera) P first waits for the sum over the pipes (``grad_pipes``)."""
    config = kfac_config(schedule, 3, tmp_path)
    schedule = build_schedule(config)
    plan = make_plan(config, schedule, load_profile(config.section("kfac").profile)).plan
    topology = Topology(schedule, data_parallel=2)
    comm = replay(plan_actions(topology, plan, path=config.gradient_path))
    checked = 0
    for step in comm.steps:
        for rank, actions in enumerate(step):
            runs = [i for i, a in enumerate(actions) if a.kind is ActionKind.RUN]
            for precondition in [i for i in runs if actions[i].op.kind is OpKind.PRECONDITION]:
                op = actions[precondition].op
                last = max(i for i in runs if actions[i].op.kind is OpKind.BACKWARD and actions[i].op.stage == op.stage)
                assert precondition > last
                group = fsdp_group(op.stage, op.pipe, schedule.num_pipes)
                grad = fsdp_grad_collective(op.stage, group)
                assert actions[last - 1] == Action(ActionKind.LAUNCH, grad), actions[last - 1]
                assert actions[last + 1] == Action(ActionKind.WAIT, grad), actions[last + 1]
                assert actions.count(Action(ActionKind.LAUNCH, grad)) == 1, "one reduce-scatter per stage and step"
                gathers = unshard_collective(op.stage, op, group)
                assert actions[precondition - 2 : precondition] == (
                    Action(ActionKind.LAUNCH, gathers),
                    Action(ActionKind.WAIT, gathers),
                )
                if schedule.num_pipes > 1:
                    summed = Action(ActionKind.WAIT, grad_pipes_collective(op.stage, topology.replica_of(rank)))
                    assert actions[precondition - 3] == summed, "P reads the gradient summed over the pipes"
                checked += 1
    held = 2 if schedule.num_pipes > 1 else 1  # Chimera: a rank holds one stage of each pipe
    assert checked == 4 * held * len(comm.steps), "every stage copy is preconditioned in every step"


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"grad_worker_fraction": 0.5}, r"^kfac.grad_worker_fraction: .*ZeRO-2/3.*use kfac.grad_worker_fraction 1"),
        ({"first_order": "lamb"}, r"^kfac.first_order: lamb's trust ratio .*use kfac.first_order adamw or sgd"),
    ],
)
def test_what_sharded_kfac_does_not_run_is_refused_in_one_line(section, says, tmp_path):
    """Gradient workers need every replica's whole reduced gradient; LAMB for the rest, whole norms."""
    with pytest.raises(ConfigError, match=says) as error:
        kfac_config("1f1b", 3, tmp_path, kfac=section)
    assert "\n" not in str(error.value)


def precondition_shards(rank: int, world: int) -> tuple[bool, float, float]:
    """One K-FAC engine (committed inverses, KL clip) preconditions a model's gradients plain,
    then the same gradients sharded over `world` gloo ranks as FSDP2 shards them (dim 0, a layer
    of 5 rows: uneven); (each whole result equals the plain one, the clip scale, plain and
    sharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4, bias=False))
    engine = KFACEngine(model, KfacConfig(damping=0.01), grad_scale=8.0, kl_clip=1e-4)
    with engine.capture(0):
        model(torch.randn(8, 3)).square().mean().backward()
    for info in engine.layers():
        for factor in ("A", "B"):
            engine.curvature(info.name, factor, 0)
            engine.invert(info.name, factor)
        engine.commit(info.name)
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    plain = engine.precondition_all(lr=0.1).clip_scale
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    for prefix, module in (("0", model[0]), ("2", model[2])):
        for name, p in list(module.named_parameters(recurse=False)):
            shard = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
            shard.grad = distribute_tensor(gradients[f"{prefix}.{name}"], mesh, [Shard(0)])
            setattr(module, name, shard)
    sharded = engine.precondition_all(lr=0.1).clip_scale
    equal = all(
        torch.allclose(p.grad.full_tensor(), expected[name], rtol=1e-6, atol=1e-7)
        for name, p in model.named_parameters()
    )
    assert plain is not None and sharded is not None
    return equal, float(plain), float(sharded)


@pytest.mark.dist
def test_sharded_gradients_are_preconditioned_and_clipped_as_whole_ones():
    """`precondition_all` on FSDP2-sharded gradients: each replica reads them whole, keeps its
    rows of the preconditioned result, and KL-clips its shard by the whole gradients' factor."""
    for equal, plain, sharded in run_group(precondition_shards, 2, timeout=20, deadline=60):
        assert equal
        assert plain < 1, "the clip acts"
        assert sharded == pytest.approx(plain, rel=1e-6)
