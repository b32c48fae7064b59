"""Built-in tiny checkpoints and model loading (`resolve_model` accepts a name or a local path)."""

from parity.models.checkpoints import (
    BUILTIN_MODELS,
    EOS_ID,
    builtin_names,
    builtin_path,
    cache_dir,
    model_hash,
    resolve_model,
)

__all__ = ["BUILTIN_MODELS", "EOS_ID", "builtin_names", "builtin_path", "cache_dir", "model_hash",
           "resolve_model"]
