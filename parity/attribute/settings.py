"""`Setting`: how one side of a comparison runs the forward, and the axes attribution compares along.

A setting fixes what can change a token's numbers without changing the tokens (kernels, dtype, batch
composition, layout, prefill or decode). A setting against itself is always exactly zero, so each
`AXES` entry changes one thing between side A (the trainer) and B (the engine) and shows its drift.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from parity import kernels as _kernels
from parity.attribute.axes import AXES
from parity.core.errors import ConfigError
from parity.core.strict import check_dtype
from parity.engine import LAYOUTS
from parity.engine.inputs import kernel_families

#: "prefill": one teacher-forced forward over prompt + response (the training forward).
#: "decode": the prompt in one prefill, then one response token per step against the KV cache,
#: every sequence of the micro-batch packed into each step (what the reference engine does).
MODES: tuple[str, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class Setting:
    """One way to run the forward over a fixed set of sequences.

    kernels: the families switched batch-invariant ("invariant": all, "native": none).
    micro_batch_size: sequences per forward (None: all in one). layout: "right"/"left" padding of a
    [micro_batch, max_len] batch, or "packed" into one row (which mode "decode" needs).
    """

    kernels: frozenset[str] = frozenset(_kernels.FAMILIES)
    dtype: str = "float32"
    micro_batch_size: int | None = None
    layout: str = "right"
    mode: str = "prefill"
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", kernel_families(self.kernels))
        check_dtype(self.dtype, "setting.dtype")
        size = self.micro_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"setting.micro_batch_size must be an integer >= 1 or None (all sequences "
                              f"in one forward), got {size!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"setting.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.mode not in MODES:
            raise ConfigError(f"setting.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "decode" and self.layout != "packed":
            raise ConfigError("setting.layout must be 'packed' with mode='decode': decode steps pack every "
                              "sequence's next token into one row, as the reference engine does")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"setting.device must be a device name such as 'cpu' or 'cuda', "
                              f"got {self.device!r}")

    def with_kernels(self, families: Iterable[str] | str) -> Setting:
        """The same setting with `families` switched invariant (and every other family native)."""
        return dataclasses.replace(self, kernels=families)

    @property
    def kernels_label(self) -> str:
        """"invariant", "native", or the invariant families joined by "+" (in `FAMILIES` order)."""
        if self.kernels == frozenset(_kernels.FAMILIES):
            return "invariant"
        if not self.kernels:
            return "native"
        return "+".join(f for f in _kernels.FAMILIES if f in self.kernels)

    @property
    def label(self) -> str:
        """One line for tables, e.g. `float32 · batch 1 · right-padded · prefill · invariant kernels`."""
        batch = "batch all" if self.micro_batch_size is None else f"batch {self.micro_batch_size}"
        layout = "packed" if self.layout == "packed" else f"{self.layout}-padded"
        device = "" if self.device == "cpu" else f" · {self.device}"
        return f"{self.dtype} · {batch} · {layout} · {self.mode}{device} · {self.kernels_label} kernels"

    def to_dict(self) -> dict[str, object]:
        """JSON form; `kernels` as a sorted list."""
        return {**dataclasses.asdict(self), "kernels": sorted(self.kernels), "label": self.label}


def axis_settings(axis: str, *, dtype: str = "float32", device: str = "cpu",
                  kernels: Iterable[str] | str = "invariant") -> tuple[Setting, Setting]:
    """(side A, side B) of a named axis (`AXES`): identical but for the one thing the axis varies
    (the "dtype" axis ignores `dtype`)."""
    base = Setting(kernels=kernels, dtype=dtype, device=device)
    pairs = {
        "batch": (dataclasses.replace(base, micro_batch_size=1), base),
        "layout": (base, dataclasses.replace(base, layout="packed")),
        "mode": (dataclasses.replace(base, layout="packed"),
                 dataclasses.replace(base, layout="packed", mode="decode")),
        "dtype": (dataclasses.replace(base, dtype="bfloat16"), dataclasses.replace(base, dtype="float16")),
    }
    if axis not in pairs:
        raise ConfigError(f"axis must be one of {list(AXES)}, got {axis!r}")
    return pairs[axis]
