#!/bin/bash
# The planner's speed at 8, 64 and 1,024 GPUs with one process and with two (`--jobs`), interleaved;
# prints CPU (user, sys) and wall seconds with the load average, then checks that the --json
# answers of both agree (the `seconds` field aside). Takes about 4 min on 2 cores.
#     bash experiments/planner_speed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
p8="pipefisher plan schedules/bert-large-chimera-8x8.yaml --gpus 8 --memory-gb 16 --json"
p64="pipefisher plan schedules/bert-large-chimera-8x8.yaml --gpus 64 --memory-gb 16 --json"
p1024="pipefisher plan schedules/gpt3-175b-1024.yaml --gpus 1024 --memory-gb 80 --json"
p1024+=" --reference-csv profiles/reference/bert-large_time_memory_p100.csv"
run() {  # NAME JOBS COMMAND...
    local name=$1 jobs=$2
    shift 2
    echo -n "$name --jobs $jobs, load $(cut -d' ' -f1 /proc/loadavg): "
    /usr/bin/time -f "%U s user, %S s sys, %e s wall" "$@" --jobs "$jobs" 2>&1 >"$out/$name-$jobs.json" | tail -1
}
for _ in 1 2 3; do run p8 1 $p8; run p8 2 $p8; done
for _ in 1 2; do run p64 1 $p64; run p64 2 $p64; done
run p1024 2 $p1024
run p1024 1 $p1024
python3 - "$out" <<'PY'
import json, sys
for name in ("p8", "p64", "p1024"):
    one, two = (json.load(open(f"{sys.argv[1]}/{name}-{jobs}.json")) for jobs in (1, 2))
    one.pop("seconds"), two.pop("seconds")
    print(name, "answers identical" if one == two else "ANSWERS DIFFER")
PY
