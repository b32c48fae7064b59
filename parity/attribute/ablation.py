"""Op-family ablation: which kernel family makes side B's logprobs drift from side A's.

Both sides run each kernel configuration on the same tokens: every family invariant (the baseline:
zero along a batch, layout or mode axis by construction, a floor along dtype); one family native
("added": what it causes alone); every family native but one ("removed": catches drift that shows
only together with another family's). A family's share is its added mean |Δlogp| (negatives as 0)
over the sum; ranked by share, then removed, then `FAMILIES` order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from parity import kernels as _kernels
from parity.attribute.runner import Run, run
from parity.attribute.settings import Setting
from parity.core.errors import ConfigError, InputError
from parity.core.types import Sequences, as_pairs
from parity.drift.metrics import summarize
from parity.engine.inputs import kernel_families
from parity.models.loading import LoadedModel


@dataclass(frozen=True)
class Drift:
    """Drift of side B's raw logprobs from side A's over every response token, in nats; k3_kl:
    Schulman's k3 estimate of KL(B || A) per token."""

    max_abs: float
    mean_abs: float
    k3_kl: float

    @classmethod
    def between(cls, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Drift:
        """Drift of per-sequence logprobs `b` from `a` (each [len(response)]); InputError unless both
        hold the same sequences' lengths and finite values (a missing logprob would be read as 0.0)."""
        if [len(x) for x in a] != [len(y) for y in b]:
            raise InputError(f"side A has logprobs of lengths {[len(x) for x in a]} and side B of "
                             f"{[len(y) for y in b]}; drift compares the same tokens of the same sequences")
        for side, values in (("A", a), ("B", b)):
            bad = [i for i, x in enumerate(values) if not bool(torch.isfinite(x).all())]
            if bad:
                raise InputError(f"side {side}'s logprobs of sequences {bad} are NaN or infinite (its "
                                 "forward overflowed): their drift is undefined; run that side in a wider "
                                 "dtype")
        width = max(len(x) for x in a)
        padded = np.zeros((2, len(a), width), dtype=np.float64)
        mask = np.zeros((len(a), width), dtype=bool)
        for i, (x, y) in enumerate(zip(a, b)):
            padded[0, i, :len(x)] = x.numpy()
            padded[1, i, :len(y)] = y.numpy()
            mask[i, :len(x)] = True
        s = summarize(padded[0], padded[1], mask)
        return cls(max_abs=s["max_abs_logprob_diff"], mean_abs=s["mean_abs_logprob_diff"], k3_kl=s["k3_kl"])

    def to_dict(self) -> dict[str, float]:
        return {"max_abs_logprob_diff": self.max_abs, "mean_abs_logprob_diff": self.mean_abs,
                "k3_kl": self.k3_kl}


@dataclass(frozen=True)
class FamilyAttribution:
    """One kernel family's part in the drift (nats): added = native_only - baseline, removed =
    all_native - invariant_only (mean_abs), share = max(added, 0) over the sum, in [0, 1]."""

    family: str
    native_only: Drift
    invariant_only: Drift
    added: float
    removed: float
    share: float

    def to_dict(self) -> dict[str, object]:
        return {"family": self.family, "native_only": self.native_only.to_dict(),
                "invariant_only": self.invariant_only.to_dict(), "added": self.added,
                "removed": self.removed, "share": self.share}


@dataclass(frozen=True)
class OpAttribution:
    """The result of `attribute_ops`: drift per kernel configuration, families ranked first to last."""

    setting_a: Setting
    setting_b: Setting
    baseline: Drift
    all_native: Drift
    families: tuple[FamilyAttribution, ...]
    num_sequences: int
    num_tokens: int

    @property
    def ranking(self) -> list[str]:
        """Family names, largest share of the drift first."""
        return [f.family for f in self.families]

    def to_dict(self) -> dict[str, object]:
        """JSON form (what reports store and `parity.render.attribution` draws from)."""
        return {"setting_a": self.setting_a.to_dict(), "setting_b": self.setting_b.to_dict(),
                "baseline": self.baseline.to_dict(), "all_native": self.all_native.to_dict(),
                "families": [f.to_dict() for f in self.families], "ranking": self.ranking,
                "num_sequences": self.num_sequences, "num_tokens": self.num_tokens}


def attribute_ops(model: str | LoadedModel, sequences: Sequences, setting_a: Setting, setting_b: Setting, *,
                  families: Iterable[str] | None = None) -> OpAttribution:
    """Attribute the drift of `setting_b` from `setting_a` on `sequences` to kernel families (`families`
    ablated one at a time, default all); the settings' own `kernels` are ignored."""
    if not isinstance(setting_a, Setting) or not isinstance(setting_b, Setting):
        raise ConfigError("setting_a and setting_b must be parity.attribute.Setting instances")
    if setting_a != setting_b and setting_a.with_kernels(()) == setting_b.with_kernels(()):
        raise ConfigError("setting_a and setting_b differ only in kernels, which attribute_ops ignores (it "
                          "switches the families itself on both sides): it would compare one forward with "
                          "itself; vary another field, or compare kernels with layer_diff")
    pairs = as_pairs(sequences)
    if not any(response for _, response in pairs):
        raise InputError("every response in sequences is empty; attribution scores response tokens, so give "
                         "at least one sequence a non-empty response")
    everything = frozenset(_kernels.FAMILIES)
    wanted = everything if families is None else kernel_families(families)
    chosen = [f for f in _kernels.FAMILIES if f in wanted]  # in FAMILIES order, the ranking's tie-break
    if not chosen:
        raise ConfigError(f"families is empty; give at least one of {list(_kernels.FAMILIES)}")
    runs: dict[Setting, Run] = {}

    def drift(invariant: frozenset[str]) -> Drift:
        logprobs = []
        for side in (setting_a, setting_b):
            setting = side.with_kernels(invariant)
            if setting not in runs:
                runs[setting] = run(model, pairs, setting)
            logprobs.append(runs[setting].logprobs)
        return Drift.between(*logprobs)

    baseline, all_native = drift(everything), drift(frozenset())
    native_only = {f: drift(everything - {f}) for f in chosen}
    invariant_only = {f: drift(frozenset({f})) for f in chosen}
    added = {f: native_only[f].mean_abs - baseline.mean_abs for f in chosen}
    total = sum(max(a, 0.0) for a in added.values())
    rows = [FamilyAttribution(family=f, native_only=native_only[f], invariant_only=invariant_only[f],
                              added=added[f], removed=all_native.mean_abs - invariant_only[f].mean_abs,
                              share=max(added[f], 0.0) / total if total > 0 else 0.0) for f in chosen]
    rows.sort(key=lambda r: (-r.share, -r.removed))  # stable: ties keep FAMILIES order
    scored = runs[setting_a.with_kernels(everything)].logprobs
    return OpAttribution(setting_a=setting_a, setting_b=setting_b, baseline=baseline, all_native=all_native,
                         families=tuple(rows), num_sequences=len(scored),
                         num_tokens=sum(len(lp) for lp in scored))
