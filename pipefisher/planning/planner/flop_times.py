"""Per-stage times from FLOPs: planning without a profile (`FlopTimes`). Pure Python: no torch.

Every timed op is its flops at a calibrated share of the hardware's dense peak for its dtype, plus
a fixed cost per execution (launches and small-kernel latency, ms):

    time = flops / (peak(dtype) x share) + overhead_ms

- forward of a block: `block_flops` (Linears + attention core) x micro-batch, / T at tensor
  parallelism T (each rank computes its shard); backward: twice the forward's flops; both in the
  run's precision (`run.precision` bf16 → the bf16 peak, fp16 → fp16, fp32 → fp32: PyTorch leaves
  TF32 off for matmuls by default, so fp32 runs are taken at the fp32 peak).
- the last stage's heads (vocabulary projection, BERT's transform: `sources.part_flops`) at the
  forward and backward shares, without an overhead; embeddings' lookups count as none.
- the curvature method's tasks on each Linear shard: its own flop counts
  (`CurvatureMethod.task_flops`, keyed by time key) at the share of their kind (the key's work:
  curvature, refresh, precondition; a fold, SOAP's U op, at the precondition's: `EFFICIENCY_OF`)
  on the peak of the task's dtype (fp64 tasks on the fp32 peak: equal on A100/H100, twice
  P100's/V100's fp64 rate; with `run.tf32` float32 tasks, and an fp32 run's blocks, on the tf32
  peak where the hardware lists one). A shard's statistic the shards share
  (`TaskRules.shared_part`) is built from 1/T of the rows, as in `transformer_profile`.
- the step end: the first-order optimizer's memory traffic, `OPTIMIZER_BYTES_PER_PARAMETER` per
  parameter of the stage's shard at the hardware's memory bandwidth (the only bytes term), plus
  the method's own work there (its ``step_end`` counts: Shampoo's and SOAP's preconditioning) at
  the precondition's share, which is also the stage's `method_step_end` (the first-order step is
  simulated without it).
- tensor-parallel all-reduces and everything the prediction adds (reductions, hops, recomputation)
  are `transformer_profile`'s and `predict`'s, on the hardware's links.

The shares and overheads (`EFFICIENCY`) are fitted to the PipeFisher paper's P100 block times
(`profiles/reference/bert-*_time_memory_p100.csv`, fp32, 128 tokens; `flop_calibration.fit_p100`
recomputes them and `tests/test_flop_times.py` holds the constants to it). The same shares of the
peak are assumed for tensor-core dtypes on other GPUs; docs/planner.md ("Planning without a
profile") compares that with the project's H100 measurements and the Megatron-LM paper.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from pipefisher.core.profile import LayerProfile, Profile
from pipefisher.core.profile_flops import STEP_END_FLOPS
from pipefisher.core.tensor_parallel import BLOCK_SPLITS
from pipefisher.methods.flops import MatrixShape, TaskFlops
from pipefisher.methods.registry import REFERENCE_METHOD, task_rules
from pipefisher.methods.registry import method as curvature_method
from pipefisher.planning.memory.activations import PRECISIONS
from pipefisher.planning.planner.hardware import Hardware
from pipefisher.planning.planner.model_sizes import ModelSizes, PlanError
from pipefisher.planning.planner.sources import part_flops
from pipefisher.planning.recompute import block_flops
from pipefisher.planning.transformer_profile import BlockTimes, block_layer_shapes, transformer_profile


@dataclass(frozen=True)
class Efficiency:
    """How fast one kind of op runs: `share` of the dtype's dense peak its flops run at (0..1) and
    `overhead_ms` added per execution; `per` says what one execution is, `source` where it comes from."""

    share: float
    overhead_ms: float
    per: str
    source: str


_P100 = "fit to profiles/reference/bert-{base,large}_time_memory_p100.csv (fp32, P100 10.6 TFLOP/s)"
#: the efficiency table (docs/planner.md, "Planning without a profile"); `flop_calibration.fit_p100`
#: recomputes it from the CSVs
EFFICIENCY = {
    "forward": Efficiency(0.642, 0.651, "block forward", f"{_P100}: time_f, 14 rows, least squares"),
    "backward": Efficiency(0.727, 0.762, "block backward", f"{_P100}: time_b, 14 rows, least squares"),
    "curvature": Efficiency(0.816, 0.104, "factor statistic", f"{_P100}: time_kron / 12 factors, least squares"),
    "refresh": Efficiency(0.490, 2.634, "factor refresh", f"{_P100}: time_inv / 12 factors, Cholesky count, 2 models"),
    "precondition": Efficiency(0.699, 0.158, "layer precondition", f"{_P100}: time_prec / 6 layers, 2 models"),
}
#: a work kind costed at another's efficiency: the method's end of step (the same products of the
#: gradient with the factors' matrices as the precondition) and a fold of the gradient into the
#: statistics (products of the gradient with itself)
EFFICIENCY_OF = {STEP_END_FLOPS: "precondition", "fold": "precondition"}
#: bytes an optimizer step moves per parameter: AdamW reads fp32 parameter, gradient and two
#: moments and writes parameter and moments (7 x 4), plus the low-precision weight copy (4)
OPTIMIZER_BYTES_PER_PARAMETER = 32
#: micro-batch sizes a search tries (the run file's own is added)
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: a task's dtype (torch name) -> the peak it runs at
TASK_PEAK = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}


def op_ms(flops: float, peak_tflops: float, efficiency: Efficiency) -> float:
    """Milliseconds of one execution of `flops` at `efficiency` on a `peak_tflops` peak."""
    return flops / (peak_tflops * 1e12 * efficiency.share) * 1e3 + efficiency.overhead_ms


@dataclass(frozen=True)
class FlopTimes:
    """Times from flops on `hardware` (module docstring) for a run of `sizes` in `precision`
    (fp32, bf16, fp16), planning `method` (a curvature method or a first-order name) with its
    run-file `section` (None: first-order only); `tf32`: the run's float32 products on the
    hardware's tf32 peak where it lists one (`run.tf32`)."""

    #: its step end was measured in its own run's layout (ZeRO-1 owners' and gradient workers'
    #: shares of the method's work in it); else a layout's profile divides that work among them
    #: (`layout_profile`)
    measured_step_end: ClassVar[bool] = False
    sizes: ModelSizes
    hardware: Hardware
    precision: str
    method: str
    section: Any = None
    micro_batch_sizes: tuple[int, ...] = DEFAULT_MICRO_BATCH_SIZES
    tensor_parallel: tuple[int, ...] | None = None  # any degree the model allows
    tf32: bool = False
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def check(
        cls,
        sizes: ModelSizes,
        hardware: Hardware,
        precision: str,
        planned: str,
        section: Any = None,
        micro_batch_sizes: tuple[int, ...] = DEFAULT_MICRO_BATCH_SIZES,
        tf32: bool = False,
    ) -> FlopTimes:
        """The source, or PlanError where the hardware has no peak for the precision or the
        curvature method declares no flop counts."""
        if precision not in PRECISIONS:
            raise PlanError(f"run.precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
        if hardware.peak(precision) is None:
            held = ", ".join(dtype for dtype, _ in hardware.peak_tflops)
            raise PlanError(
                f"--hardware {hardware.name}: no {precision} peak (it lists {held}); set run.precision to one of those"
            )
        if section is not None and not curvature_method(planned).flops:
            raise PlanError(
                f"--times flops: {planned} declares no flop counts (CurvatureMethod.flops); give --profile of a "
                f"`pipefisher profile --optimizer {planned}` run"
            )
        return cls(sizes, hardware, precision, planned, section, tuple(sorted(set(micro_batch_sizes))), tf32=tf32)

    def describe(self) -> str:
        """One line for the plan's header."""
        on_tf32 = self.tf32 and self.hardware.peak("tf32") is not None
        named = "tf32" if on_tf32 and self.precision == "fp32" else self.precision
        tf32 = ", float32 products on its tf32 peak (run.tf32)" if on_tf32 else ""
        return (
            f"flops at calibrated shares of the {self.hardware.name}'s {self._peak(self.precision):g} TFLOP/s "
            f"{named} peak{tf32}"
        )

    def profile(
        self,
        pieces: int,
        micro_batch_size: int,
        tensor_parallel: int,
        split_backward: bool = False,
        stage_blocks: tuple[int, ...] = (),
    ) -> Profile:
        """The modelled profile of `pieces` stages of one tensor-parallel rank (times in ms), of
        `stage_blocks` blocks each where given (else even); a split backward (`split_backward`)
        takes the backward's time in two halves."""
        key = (pieces, micro_batch_size, tensor_parallel, stage_blocks)
        if key not in self._cache:
            self._cache[key] = self._profile(pieces, micro_batch_size, tensor_parallel, stage_blocks)
        return self._cache[key]

    def _peak(self, dtype: str) -> float:
        """The hardware's peak for `dtype`: "fp64" on the fp32 peak (presets list no fp64), "fp32"
        on tf32's under `tf32` where listed, a dtype the hardware does not list on fp32's."""
        if dtype == "fp64":
            dtype = "fp32"
        elif dtype == "fp32" and self.tf32 and self.hardware.peak("tf32"):
            dtype = "tf32"
        found = self.hardware.peak(dtype) or self.hardware.peak("fp32")
        if found is None:
            raise PlanError(f"--hardware {self.hardware.name}: no {dtype} or fp32 peak to time the method's tasks on")
        return found

    def _profile(
        self, pieces: int, micro_batch_size: int, tensor_parallel: int, stage_blocks: tuple[int, ...]
    ) -> Profile:
        sizes, peak = self.sizes, self._peak(self.precision)
        curvature = self.section is not None
        name = self.method if curvature else REFERENCE_METHOD
        rules = task_rules(name)
        linear, core = block_flops(sizes.hidden, sizes.ffn, sizes.seq_len)
        rank_flops = (linear + core) * micro_batch_size / tensor_parallel
        forward = op_ms(rank_flops, peak, EFFICIENCY["forward"])
        backward = op_ms(2 * rank_flops, peak, EFFICIENCY["backward"])
        link = self.hardware.tensor_parallel_link(tensor_parallel)
        profile = transformer_profile(
            # transformer_profile divides a block's times by T: give it T x one rank's
            BlockTimes(forward * tensor_parallel, backward * tensor_parallel, 0.0, 0.0, 0.0),
            sizes.blocks,
            pieces,
            sizes.hidden,
            sizes.ffn,
            micro_batch_size,
            device=f"{self.hardware.name} (flop model)",
            seq_len=sizes.seq_len,
            capture_dtype_bytes=PRECISIONS[self.precision],
            tensor_parallel=tensor_parallel,
            tp_bandwidth_gbps=link.bandwidth_gbps,
            tp_latency_us=link.latency_us,
            method=name,
            rules=rules,
            stage_blocks=stage_blocks,
            capture_positions=1 if curvature and self.section.captures_per_sequence() else None,
        )
        head = part_flops(sizes)[1] * micro_batch_size / tensor_parallel
        head_forward = head / (peak * 1e12 * EFFICIENCY["forward"].share) * 1e3
        head_backward = 2 * head / (peak * 1e12 * EFFICIENCY["backward"].share) * 1e3
        blocks = stage_blocks or (sizes.blocks / pieces,) * pieces  # checked by transformer_profile
        tasks = self._layer_tasks(micro_batch_size, tensor_parallel, rules) if curvature else {}
        stages = []
        for index, stage in enumerate(profile.stages):
            last = index == pieces - 1
            method_end = sum(_suffix_tasks(layer, tasks).get(STEP_END_FLOPS, 0.0) for layer in stage.layers)
            step_end = self._step_end_ms(blocks[index], tensor_parallel) + method_end
            stages.append(
                replace(
                    stage,
                    forward=stage.forward + (head_forward if last else 0.0),
                    backward=stage.backward + (head_backward if last else 0.0),
                    weight=stage.weight + (head_backward / 2 if last and stage.weight else 0.0),
                    step_end=step_end,
                    method_step_end=method_end,
                    layers=tuple(_timed(layer, tasks) for layer in stage.layers),
                )
            )
        return replace(profile, stages=tuple(stages))

    def _step_end_ms(self, blocks: float, tensor_parallel: int) -> float:
        """The optimizer step of the shard of a stage of `blocks` blocks: its parameters' bytes at
        the memory bandwidth."""
        sizes = self.sizes
        parameters = blocks * (4 * sizes.hidden**2 + 2 * sizes.hidden * sizes.ffn) / tensor_parallel
        seconds = parameters * OPTIMIZER_BYTES_PER_PARAMETER / (self.hardware.memory_bandwidth_gbps * 1e9)
        return seconds * 1e3

    def _layer_tasks(self, micro_batch_size: int, tensor_parallel: int, rules) -> dict[str, dict[str, float]]:
        """Layer suffix -> time key -> ms of the method's tasks on the layer's shard, each at its
        work's efficiency; its work in the optimizer step (`STEP_END_FLOPS`) and its fold at the
        precondition's (`EFFICIENCY_OF`)."""
        settings = self.section
        tokens = micro_batch_size * self.sizes.seq_len
        found = {}
        for suffix, din, dout in block_layer_shapes(self.sizes.hidden, self.sizes.ffn, tensor_parallel):
            flops = curvature_method(self.method).task_flops(
                settings, MatrixShape(dout, din, has_bias=True), tokens, micro_batch_size
            )
            shared = rules.shared_part(BLOCK_SPLITS[suffix].value) if tensor_parallel > 1 else None
            found[suffix] = {
                key: self._task_ms(key, counted, 1 / tensor_parallel if key == f"curvature.{shared}" else 1.0)
                for key, counted in flops.items()
                if _efficiency_key(key) in EFFICIENCY
            }
        return found

    def _task_ms(self, key: str, counted: TaskFlops, rows_share: float) -> float:
        peak = self._peak(TASK_PEAK.get(counted.dtype, "fp32"))
        return op_ms(counted.total * rows_share, peak, EFFICIENCY[_efficiency_key(key)])


def _efficiency_key(key: str) -> str:
    """The `EFFICIENCY` entry a task of time key `key` runs at: its work's, or `EFFICIENCY_OF`'s."""
    work = key.split(".")[0]
    return EFFICIENCY_OF.get(work, work)


def _suffix_tasks(layer: LayerProfile, tasks: dict[str, dict[str, float]]) -> dict[str, float]:
    """The task times of `layer`'s suffix (it is named ``block<i>.<suffix>``); {} for none."""
    return tasks.get(layer.name.split(".", 1)[1], {})


def _timed(layer: LayerProfile, tasks: dict[str, dict[str, float]]) -> LayerProfile:
    """`layer` with its suffix's task times, where there are any (its end-of-step work is its stage's)."""
    found = {key: ms for key, ms in _suffix_tasks(layer, tasks).items() if key != STEP_END_FLOPS}
    return layer.with_times(found) if found else layer
