"""The one error hierarchy of parity.

Every error parity raises on bad input is a `ParityError` whose message names the offending
field and says how to fix it, so users never see a traceback from deep inside torch.
"""

from __future__ import annotations


class ParityError(Exception):
    """Base class of every error parity raises on purpose."""


class ConfigError(ParityError, ValueError):
    """A configuration value (sampling parameter, tolerance, case field, option) is invalid."""


class InputError(ParityError, ValueError):
    """Input data (token ids, logprob arrays, masks, routes, dumps) is malformed."""


class ModelNotFoundError(ParityError, LookupError):
    """A model argument is neither a built-in checkpoint name nor a local HF checkpoint path."""


class BackendUnavailableError(ParityError, ImportError):
    """A backend's package is not installed here; the message names the extra to install."""


class BackendError(ParityError, RuntimeError):
    """A backend failed while starting, generating or scoring."""


class UnsupportedError(BackendError):
    """The backend, or the build of it installed here, refuses an operation (e.g. sleep mode on a
    CPU build); the message quotes the backend's reason. Checks report it as skipped, not failed."""
