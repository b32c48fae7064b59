"""The stages a probe captures, by kind, and their names in forward order; data only, no torch. A stage
is `[rows, width]` per sequence: a row per fed position, or per response token for "logits"."""

from __future__ import annotations

from collections.abc import Iterable

from parity.core.errors import ConfigError

#: stage kind -> what it captures (the names are the same on the training forward and in vLLM).
STAGE_KINDS: dict[str, str] = {
    "embed": "the token embeddings",
    "attn": "each decoder layer's attention output (after o_proj, before the residual add)",
    "router": "each MoE layer's router logits [tokens, experts] (MoE models only)",
    "mlp": "each decoder layer's MLP or MoE output (before the residual add)",
    "layer": "each decoder layer's output: the residual stream after it",
    "norm": "the final norm's output",
    "logits": "the logits of each response token",
}


def check_stage_kinds(kinds: Iterable[str] | str | None) -> tuple[str, ...]:
    """`kinds` (None: all; a comma-separated string or an iterable) as `STAGE_KINDS` keys in forward order."""
    if kinds is None:
        return tuple(STAGE_KINDS)
    chosen = [k.strip() for k in kinds.split(",")] if isinstance(kinds, str) else [str(k) for k in kinds]
    chosen = [k for k in chosen if k]
    unknown = [k for k in chosen if k not in STAGE_KINDS]
    if unknown or not chosen:
        raise ConfigError(f"stages must name at least one of {list(STAGE_KINDS)}; unknown: "
                          f"{unknown or chosen!r} (e.g. --stages layer,logits)")
    return tuple(k for k in STAGE_KINDS if k in chosen)


def stage_order(kinds: Iterable[str], num_layers: int, moe_layers: Iterable[int] = ()) -> list[str]:
    """Stage names in forward order: "embed", then per layer i "layer.<i>.attn", "layer.<i>.router"
    (MoE layers only), "layer.<i>.mlp", "layer.<i>", then "norm", "logits"; only the given kinds."""
    kinds = set(kinds)
    moe = set(moe_layers)
    names = ["embed"] if "embed" in kinds else []
    for i in range(num_layers):
        names += [f"layer.{i}.attn"] if "attn" in kinds else []
        names += [f"layer.{i}.router"] if "router" in kinds and i in moe else []
        names += [f"layer.{i}.mlp"] if "mlp" in kinds else []
        names += [f"layer.{i}"] if "layer" in kinds else []
    return names + [k for k in ("norm", "logits") if k in kinds]


def stage_kind(name: str) -> str:
    """"layer.3.attn" -> "attn", "layer.3" -> "layer", "norm" -> "norm"."""
    parts = name.split(".")
    if parts[0] != "layer":
        return parts[0]
    return parts[2] if len(parts) > 2 else "layer"


#: rank of a decoder layer's stages within the layer, in forward order.
_WITHIN_LAYER = {"attn": 0, "router": 1, "mlp": 2, "layer": 3}
_LAST = 1 << 62


def stage_rank(name: str) -> tuple[int, int]:
    """Sort key of a stage name in forward order (as `stage_order`): "embed", layer by layer (by index,
    not text: "layer.10" after "layer.2"), "norm", "logits"; other names last, in their given order."""
    parts = name.split(".")
    if parts[0] == "layer" and len(parts) > 1 and parts[1].isdigit():
        return int(parts[1]) + 1, _WITHIN_LAYER.get(stage_kind(name), 4)
    return {"embed": (0, 0), "norm": (_LAST, 0), "logits": (_LAST, 1)}.get(name, (_LAST, 2))
