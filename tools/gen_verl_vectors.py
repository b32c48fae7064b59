"""Generate verl rollout-correction test vectors for `tests/test_correction.py`.

Runs verl 0.9.1's own `compute_rollout_correction_and_rejection_mask` on inputs built here
and writes inputs + outputs to `tests/data/verl_vectors/*.json`. Not part of the test suite:
it needs verl in a separate environment (never in parity's own venv), e.g.

    python3 -m venv /tmp/verlenv
    /tmp/verlenv/bin/pip install torch==2.13.0 numpy packaging
    /tmp/verlenv/bin/pip install --no-deps verl==0.9.1
    /tmp/verlenv/bin/python tools/gen_verl_vectors.py

`import verl` pulls in Ray, tensordict and transformers, none of which the two files used here
need for the functions called. So this script loads verl's real `utils/torch_functional.py`
and `trainer/ppo/rollout_corr_helper.py` from the installed package by path, with stand-ins
for the imports that only serve other functions (`DataProto` is replaced by a dict wrapper).
All numbers come from verl's code unchanged.

Arrays are float64 (logprobs) and int64 (mask, as verl's `response_mask`); JSON floats use
repr, which round-trips float64 exactly.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import torch

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "verl_vectors"


def _stub(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []  # lets submodules be registered below it
    sys.modules[name] = module
    return module


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_verl_helper() -> types.ModuleType:
    """verl's rollout_corr_helper module, loaded without verl's heavy package imports."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.submodule_search_locations is None:
        raise SystemExit("verl is not installed in this environment; see the module docstring")
    root = Path(next(iter(spec.submodule_search_locations)))

    class DataProto:
        @staticmethod
        def from_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return dict(tensors)

    for name in ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo", "verl.trainer.config",
                 "verl.workers", "verl.workers.config"):
        _stub(name)
    _stub("verl.protocol", DataProto=DataProto)
    _stub("verl.trainer.config.algorithm", RolloutCorrectionConfig=dict)
    _stub("verl.workers.config.actor", PolicyLossConfig=dict)
    _stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    _stub("tensordict", TensorDict=dict)
    _stub("transformers", PreTrainedTokenizer=object)
    _load_file("verl.utils.torch_functional", root / "utils" / "torch_functional.py")
    version = (root / "version" / "version").read_text().strip()
    helper_path = root / "trainer" / "ppo" / "rollout_corr_helper.py"
    helper = _load_file("verl.trainer.ppo.rollout_corr_helper", helper_path)
    helper.VERL_VERSION = version
    return helper


def make_inputs(seed: int, batch: int, seq: int, noise: float, spikes: int) -> dict[str, np.ndarray]:
    """Right-padded responses of random lengths (row 1 empty), peaked rollout logprobs, a train
    policy that drifts by `noise` nats per token plus `spikes` large outliers (some beyond the
    ±20 safety clamp), and finite junk in padded slots that must be ignored."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, seq + 1, size=batch)
    lengths[1] = 0
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    rollout = np.log(rng.beta(0.6, 0.2, size=(batch, seq)).clip(1e-12, 1.0))
    drift = rng.normal(0.0, noise, size=(batch, seq))
    flat = np.flatnonzero(mask)
    where = rng.choice(flat, size=min(spikes, flat.size), replace=False)
    drift.flat[where] = rng.choice([-25.0, -4.0, -1.5, 1.2, 3.0, 22.0], size=where.size)
    train = np.minimum(rollout + drift, 0.0)
    pad = mask == 0
    train[pad] = rng.uniform(-9.0, 0.0, size=pad.sum())
    rollout[pad] = rng.uniform(-9.0, 0.0, size=pad.sum())
    return {"train_logprobs": train, "rollout_logprobs": rollout, "mask": mask}


RS_THRESHOLDS = {
    "token_k1": "0.7_1.4",
    "token_k2": 0.02,
    "token_k3": 0.02,
    "seq_sum_k1": "0.3_3.0",
    "seq_sum_k2": 0.5,
    "seq_sum_k3": 0.5,
    "seq_mean_k1": 1.05,
    "seq_mean_k2": 0.01,
    "seq_mean_k3": 0.01,
    "seq_max_k2": 0.5,
    "seq_max_k3": 0.5,
}


def configs() -> list[dict[str, object]]:
    """Every rollout_is level x every rollout_rs option (and none), plus IcePop, batch
    normalization, float/string/shared/per-option thresholds and chained options."""
    out: list[dict[str, object]] = []
    for rollout_is in (None, "token", "sequence"):
        for option in (None, *RS_THRESHOLDS):
            cfg: dict[str, object] = {"rollout_is": rollout_is, "rollout_is_threshold": 2.0}
            if option is not None:
                cfg.update(rollout_rs=option, rollout_rs_threshold=RS_THRESHOLDS[option])
            out.append(cfg)
    for rollout_is in ("token", "sequence"):
        for threshold in ("0.5_2.0", "0.8_1.5", 1.2, "3.0", 50.0):
            for normalize in (False, True):
                out.append({"rollout_is": rollout_is, "rollout_is_threshold": threshold,
                            "rollout_is_batch_normalize": normalize})
    out += [
        {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
         "rollout_rs_threshold": 1.5},
        {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1,seq_mean_k3",
         "rollout_rs_threshold": "0.6_1.6,0.02"},
        {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "rollout_is_batch_normalize": True,
         "rollout_rs": "seq_sum_k1, seq_max_k3 ,token_k2", "rollout_rs_threshold": "0.2_5.0,1.0,0.05"},
        {"rollout_rs": "seq_mean_k2,seq_mean_k3,seq_max_k2", "rollout_rs_threshold": 0.05},
        {"rollout_rs": "token_k3,token_k3,seq_sum_k2", "rollout_rs_threshold": "0.03,0.8"},
        {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
         "rollout_rs_threshold": "0.9_1.2"},
        {"rollout_rs": "token_k2", "rollout_rs_threshold": 100.0},
    ]
    return out


def _jsonable(x: object) -> object:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def run_case(
    helper: types.ModuleType, inputs: dict[str, np.ndarray], cfg: dict[str, object]
) -> dict[str, object]:
    """verl's outputs for one config; when verl raises, the exception's type name instead
    (verl divides by zero computing the effective sample size when every weight is zero)."""
    try:
        weights, new_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=torch.from_numpy(inputs["train_logprobs"]),
            rollout_log_prob=torch.from_numpy(inputs["rollout_logprobs"]),
            response_mask=torch.from_numpy(inputs["mask"]),
            **cfg,
        )
    except ZeroDivisionError as exc:
        return {"config": cfg, "verl_raises": type(exc).__name__}
    for key, value in metrics.items():
        if not math.isfinite(value):
            raise SystemExit(f"non-finite verl metric {key}={value} for {cfg}; adjust the inputs")
    return {
        "config": cfg,
        "weights": None if weights is None else _jsonable(weights["rollout_is_weights"]),
        "new_mask": _jsonable(new_mask),
        "metrics": dict(sorted(metrics.items())),
    }


def main() -> None:
    helper = load_verl_helper()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    datasets = {
        "small_drift": make_inputs(seed=1, batch=8, seq=24, noise=0.05, spikes=4),
        "spiky": make_inputs(seed=2, batch=10, seq=32, noise=0.3, spikes=24),
    }
    for name, inputs in datasets.items():
        cases = [run_case(helper, inputs, cfg) for cfg in configs()]
        doc = {
            "generator": "tools/gen_verl_vectors.py",
            "verl_version": helper.VERL_VERSION,
            "torch_version": torch.__version__,
            "inputs": {k: _jsonable(v) for k, v in inputs.items()},
            "cases": cases,
        }
        path = OUT_DIR / f"{name}.json"
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        print(f"wrote {path} ({len(cases)} cases, {path.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
