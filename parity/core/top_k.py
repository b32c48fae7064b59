"""An engine's top-k logprobs per response position, checked once where they enter parity.

ids `[positions, k]` int token ids and logprobs `[positions, k]` in nats, each row descending
(ties in any order). Fewer than k real entries only where the vocabulary is smaller than k;
`-inf` entries are kept. Every refusal is a `TopKError` naming the field, position and fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.core.errors import InputError
from parity.core.logprobs import MAX_LOGPROB


class TopKError(InputError):
    """Top-k logprobs that cannot be scored: k above the engine's maximum, top-k of another
    processing than the sampled logprobs, an id outside the vocabulary, logprobs out of
    descending order or of no distribution (mass above 1, none at all), or one id twice in a position."""


#: |top-k logprob - sampled logprob| above which the sampled token's entry in the top-k is taken to
#: come from another processing (nats). Both come from one tensor in every engine parity reads, so
#: they agree to the last bit there; the slack covers a dump stored in bfloat16 (8 bits: 2^-8
#: relative, ~4e-3 at logprob -1), far below what temperature or top-p changes.
SAME_PROCESSING_SLACK = 1e-2

#: how far one position's top-k probabilities may sum above 1 (a fraction of the mass). A bfloat16 dump
#: moves each logprob a_i by at most |a_i| 2^-9, so the sum by at most ~H/512 for H the top-k's
#: entropy (< 0.014 up to k = 1000 even uniform); logits or logprobs of no one distribution sum far above.
TOP_K_MASS_SLACK = 2e-2


def check_top_k(ids: Any, logprobs: Any, where: str, *, positions: int | None = None,
                vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 `[positions, k]`, logprobs float64 `[positions, k]`) checked, else `TopKError`."""
    try:
        ids_a = np.asarray(ids)
        lp_a = np.asarray(logprobs)
    except (TypeError, ValueError) as exc:
        raise TopKError(f"{where}: top_k_ids/top_k_logprobs must be rectangular arrays [positions, k] "
                        f"({exc})") from exc
    if lp_a.size and lp_a.dtype.kind not in "iuf":  # a cast would parse "-0.5" and take True for 1.0
        raise TopKError(f"{where}: top_k_logprobs must hold numbers, got dtype {lp_a.dtype}; give the "
                        "logprobs as floats")
    lp_a = lp_a.astype(np.float64, copy=False)
    if ids_a.size == 0 and ids_a.ndim < 2:
        ids_a = ids_a.reshape(0, lp_a.shape[1] if lp_a.ndim == 2 else 0)
        if lp_a.size == 0:  # else the shape check below names both shapes
            lp_a = lp_a.reshape(ids_a.shape)
    if ids_a.ndim != 2 or lp_a.shape != ids_a.shape:
        raise TopKError(f"{where}: top_k_ids {ids_a.shape} and top_k_logprobs {lp_a.shape} must both be "
                        "[positions, k] of one shape")
    if ids_a.size and not np.issubdtype(ids_a.dtype, np.integer):
        raise TopKError(f"{where}: top_k_ids must be integer token ids, got dtype {ids_a.dtype}")
    ids_a = ids_a.astype(np.int64, copy=False)
    if positions is not None and ids_a.shape[0] != positions:
        raise TopKError(f"{where}: top-k logprobs for {ids_a.shape[0]} positions but {positions} response "
                        "tokens; give one row per response token")
    if ids_a.shape[0] and ids_a.shape[1] == 0:
        raise TopKError(f"{where}: top-k rows are empty; ask the engine for k >= 1 logprobs")
    _first_bad(ids_a < 0, where, "top_k_ids has a negative token id", "token ids are integers >= 0")
    if vocab_size is not None:
        _first_bad(ids_a >= vocab_size, where, f"top_k_ids has an id >= the vocabulary size {vocab_size}",
                   "the top-k must come from this model's tokenizer")
    _first_bad(np.isnan(lp_a) | (lp_a > MAX_LOGPROB), where,
               f"top_k_logprobs holds NaN or a value > {MAX_LOGPROB}",
               "logprobs are <= 0 (-inf for tokens outside the sampling support)")
    _first_bad(lp_a[:, 1:] > lp_a[:, :-1], where, "top_k_logprobs are not in descending order",
               "give each position's entries most likely first, as the engine returns them")
    if lp_a.shape[1]:
        _first_bad(lp_a[:, :1] == -np.inf, where, "top_k_logprobs' first entry is -inf (its most likely "
                   "token has probability 0)", "give the top-k of the distribution sampled from")
        with np.errstate(under="ignore"):
            mass = np.exp(lp_a).sum(axis=1, keepdims=True)
        _first_bad(mass > 1.0 + TOP_K_MASS_SLACK, where, "top_k_logprobs' probabilities sum above 1 "
                   f"(by more than {TOP_K_MASS_SLACK:g}): not the logprobs of one distribution",
                   "give log_softmax values of the engine's distribution, not logits or rescaled logprobs")
    ordered = np.sort(ids_a, axis=1)
    _first_bad(ordered[:, 1:] == ordered[:, :-1], where, "top_k_ids holds one token id twice in a position",
               "each position's top-k lists distinct tokens")
    return ids_a, lp_a


def check_same_processing(ids: np.ndarray, logprobs: np.ndarray, token_ids: np.ndarray,
                          sampled: np.ndarray, where: str) -> None:
    """`TopKError` unless the top-k `[positions, k]` comes from the sampled logprobs' processing: a
    sampled token in the top-k has its logprob there, and one outside it is at most the k-th entry
    (both to `SAME_PROCESSING_SLACK`).
    """
    if ids.size == 0:
        return
    hit = ids == token_ids[:, None]
    listed = np.where(hit, logprobs, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore"):
        off = np.where(hit.any(axis=1), np.abs(listed - sampled) > SAME_PROCESSING_SLACK,
                       sampled > logprobs[:, -1] + SAME_PROCESSING_SLACK)
    _first_bad(off[:, None], where, "the top-k logprobs do not contain the sampled token's logprob as it "
               "was reported (another temperature, top-k/top-p or logprobs mode)",
               "ask the engine for its top-k in the logprobs mode and sampling of the sampled logprobs")


def _first_bad(bad: np.ndarray, where: str, what: str, fix: str) -> None:
    if bad.any():
        position = int(np.argwhere(bad)[0][0])
        raise TopKError(f"{where}: {what} (position {position}); {fix}")
