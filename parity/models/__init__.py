"""Built-in tiny checkpoints, trained models from installed packages, and model loading
(`resolve_model` accepts a name or a local path)."""

from parity.models.checkpoints import (
    BUILTIN_MODELS,
    EOS_ID,
    builtin_dir,
    builtin_names,
    builtin_path,
    cache_dir,
    check_sampled_with,
    is_model_name,
    model_hash,
    model_names,
    resolve_model,
)
from parity.models.limits import ModelLimits, checkpoint_config, model_limits, parameter_count
from parity.models.trained import TRAINED_MODELS, convert_gguf, trained_dir

__all__ = ["BUILTIN_MODELS", "EOS_ID", "TRAINED_MODELS", "ModelLimits", "builtin_dir", "builtin_names",
           "builtin_path", "cache_dir", "check_sampled_with", "checkpoint_config", "convert_gguf",
           "is_model_name", "model_hash", "model_limits", "model_names", "parameter_count", "resolve_model",
           "trained_dir"]
