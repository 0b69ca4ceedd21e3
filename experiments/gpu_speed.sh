#!/usr/bin/env bash
# Issue 43's GPU figures in one short run on one CUDA device (~8 minutes on an H100/H200):
# MFU of one bf16 stage against the plain loop, the executor's casts and batch building, the
# methods' per-step work stacked against looped (in float32, then on TF32 tensor cores as
# run.tf32 runs it), and the host syncs inside a step.
#   bash experiments/gpu_speed.sh OUT_DIR     # OUT_DIR gets one file per measurement and a log
# Each part has its own time limit, so one that hangs or fails costs only its share.
set -u
out="${1:?usage: bash experiments/gpu_speed.sh OUT_DIR}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L >"$out/device.txt" 2>&1
python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)" >>"$out/device.txt" 2>&1

part() {  # part NAME SECONDS COMMAND...: run COMMAND with a limit, its output in OUT_DIR/NAME.log
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*" | tee -a "$out/log.txt"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "   exit $? after ${SECONDS}s in all" | tee -a "$out/log.txt"
}

part overhead 240 python experiments/bench_overhead.py --device cuda --precision bf16 --arms one-stage \
    --models bert-base,gpt2-124m --optimizers adamw --steps 10 --repeats 3 --compile --out "$out/overhead.md"
part executor 60 python experiments/executor_host.py --device cuda --steps 20
part methods 120 python experiments/bench_methods.py --device cuda --hidden 768 --blocks 12 --repeats 5
part methods-tf32 90 python experiments/bench_methods.py --device cuda --hidden 768 --blocks 12 --repeats 3 --tf32
part syncs 60 python experiments/gpu_check.py schedules/tiny-cpu.yaml --device cuda --precision bf16 \
    --optimizer muon --steps 8 --sync-debug 3 --json "$out/syncs.json"
