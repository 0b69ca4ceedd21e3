"""The run configuration: its sections (`sections`; the model, data and optimizer sections live with
their packages, the methods' with their methods), the run (`run`: loading, checks) and the
run-file key reference generated from the declarations (`reference`)."""

from pipefisher.config.run import (
    FIRST_ORDER,
    RunConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    stage_replica_count,
)
from pipefisher.config.stage_split import check_stage_blocks, split_hint, stage_count_terms
from pipefisher.config.sections import (
    CheckpointConfig,
    CommConfig,
    PipelineConfig,
    RunSettings,
)
from pipefisher.core.settings import ConfigError
from pipefisher.data.settings import DataConfig
from pipefisher.methods.settings import RefreshConfig
from pipefisher.models.settings import ModelConfig
from pipefisher.optim.settings import OptimizerConfig

__all__ = [
    "FIRST_ORDER",
    "CheckpointConfig",
    "CommConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "RefreshConfig",
    "RunConfig",
    "RunSettings",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "check_stage_blocks",
    "split_hint",
    "stage_count_terms",
    "stage_replica_count",
]
