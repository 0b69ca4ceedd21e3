"""Planning runs without torch: every module under the torch-free folders imports without it."""

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipefisher"
#: folders whose every module is torch-free, and the torch-free modules of the other folders
TORCH_FREE_FOLDERS = ("core", "schedules", "planning", "cli", "config")
TORCH_FREE_MODULES = (
    "methods/__init__",
    "methods/method",
    "methods/settings",
    "methods/registry",
    "viz/layout",
    "viz/text",
    "viz/chrome",
    "viz/figure",
    "models/settings",
    "data/settings",
    "optim/settings",
    "methods/inputs",
    "methods/flops",
    "methods/flop_report",
    "core/plugins",
)
#: the modules of those folders that run training: the `run` and `profile` commands import them
#: only once a run starts (`cli.main`, in the list, holds the other commands to no torch)
TRAINING_DRIVERS = ("cli/training", "cli/step_report")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def torch_free_modules() -> list[str]:
    paths = [
        path
        for folder in TORCH_FREE_FOLDERS
        for path in (PACKAGE / folder).rglob("*.py")
        if path.relative_to(PACKAGE).with_suffix("").as_posix() not in TRAINING_DRIVERS
    ]
    paths += [PACKAGE / f"{name}.py" for name in TORCH_FREE_MODULES]
    # every method's declaration (its section, task rules, where its torch parts live), flop counts and package
    paths += [
        path for path in (PACKAGE / "methods").glob("*/*.py") if path.name in ("__init__.py", "method.py", "flops.py")
    ]
    return sorted(module_name(path) for path in paths)


def test_the_folders_hold_the_planning_code():
    modules = torch_free_modules()
    assert {"pipefisher.planning.packing.pack", "pipefisher.planning.comm.replay", "pipefisher.core.ir"} <= set(modules)


def test_planning_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in torch_free_modules()) + "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
