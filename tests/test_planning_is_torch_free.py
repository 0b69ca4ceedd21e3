import subprocess
import sys

PLANNING = [
    "pipefisher.ir",
    "pipefisher.schedules",
    "pipefisher.validate",
    "pipefisher.profile",
    "pipefisher.simulate",
    "pipefisher.methods",
    "pipefisher.tasks",
    "pipefisher.plan",
    "pipefisher.pack",
    "pipefisher.pack_report",
    "pipefisher.pack_text",
    "pipefisher.pack_greedy",
    "pipefisher.pack_plan",
    "pipefisher.pack_weights",
    "pipefisher.capture_memory",
    "pipefisher.zero",
    "pipefisher.comm_volume",
    "pipefisher.comm_plan",
    "pipefisher.kaisa",
    "pipefisher.memory",
    "pipefisher.transformer_profile",
    "pipefisher.config",
    "pipefisher.viz.cli",
    "pipefisher.viz.layout",
    "pipefisher.viz.text",
    "pipefisher.viz.chrome",
    "pipefisher.viz.figure",
    "pipefisher.viz.timeline_io",
    "pipefisher.cli_args",
    "pipefisher.run_checks",
    "pipefisher.cli",
]


def test_planning_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in PLANNING) + "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
