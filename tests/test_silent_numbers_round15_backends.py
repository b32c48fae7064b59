"""Round 15, backends (registry's shared cache, the HF adapter, borrowed backends): numbers that were
silently wrong.

- the HF backend loaded a checkpoint without `check_loaded`: a tensor missing from the files ran
  randomly initialised, one the model does not use was dropped, and the rollouts came from another
  model (the reference engine refuses both);
- `shared_backend` kept a started backend for the process whatever happened to its files: after an
  edit of generation_config.json (or the weights) it served the old eos ids (and weights);
- its cache key was the model argument's text: a relative path from another working directory, and
  Path("tiny-llama") (a directory) after "tiny-llama" (the built-in model), got the other checkpoint's
  backend;
- a running backend passed to compare with tensor_parallel=N was not checked against the degree it
  runs (the training forward then scores in N's layout what a degree-1 engine sampled), and a shared
  one whose files changed since it started was accepted.
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from parity import compare
from parity.backends import Backend, get_backend, registry, shared_backend
from parity.backends.borrowed import check_borrowed
from parity.core.errors import ConfigError, ParityError
from parity.models.checkpoints import builtin_path

pytestmark = pytest.mark.usefixtures("one_thread")


def _copy(root: Path, name: str = "m") -> Path:
    path = root / name
    shutil.copytree(builtin_path("tiny-llama"), path)
    return path


def _edit_weights(path: Path, edit) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def _set_eos(path: Path, eos: int) -> None:
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos,
                                                             "pad_token_id": 0}))


class Fake(Backend):
    """Starts nothing: the model path, dtype and eos ids `Backend` reads, and the meta a test sets."""

    name = "hf"

    def generate(self, requests):
        raise AssertionError("a refused call must not sample")

    def _score(self, pairs, sampling):
        raise AssertionError("a refused call must not score")

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fakes(monkeypatch):
    """shared_backend starting `Fake`s, in a cache of its own (the session's engines are not touched)."""
    monkeypatch.setattr(registry, "get_backend", lambda name, model, *, dtype, **o: Fake(model, dtype=dtype))
    monkeypatch.setattr(registry, "_SHARED", {})
    return Fake


# -- the HF backend checks what it loaded ------------------------------------------------------------


def test_hf_refuses_a_checkpoint_missing_a_tensor(tmp_path):
    path = _copy(tmp_path)
    _edit_weights(path, lambda w: w.pop("model.layers.0.mlp.down_proj.weight"))
    # before: accepted, the down projection randomly initialised (score [-12.38, -7.81] vs [-10.19, -8.16])
    with pytest.raises(ConfigError, match=re.escape("lacks tensor 'model.layers.0.mlp.down_proj.weight'")):
        get_backend("hf", path, dtype="float32")


def test_hf_refuses_a_tensor_the_model_does_not_use(tmp_path):
    path = _copy(tmp_path)
    extra = "model.layers.0.mlp.extra.weight"
    _edit_weights(path, lambda w: w.__setitem__(extra, np.zeros((4, 4), np.float32)))
    with pytest.raises(ConfigError, match=re.escape(f"holds tensor {extra!r}")):
        get_backend("hf", path, dtype="float32")


def test_hf_still_loads_a_complete_checkpoint(tmp_path):
    with get_backend("hf", _copy(tmp_path), dtype="float32") as hf:
        assert hf.score([((1, 40, 41), (42, 43))])[0].shape == (2,)


# -- shared_backend follows the checkpoint's files ---------------------------------------------------


def test_shared_hf_backend_restarts_after_its_checkpoint_changed(tmp_path):
    path = _copy(tmp_path)
    first = shared_backend("hf", path, dtype="float32")
    try:
        before = first.score([((1, 40, 41), (42, 43))])[0]
        assert shared_backend("hf", path, dtype="float32") is first  # unchanged files: the same engine
        _set_eos(path, 7)
        _edit_weights(path, lambda w: w.__setitem__("lm_head.weight", w["lm_head.weight"] * 2))
        second = shared_backend("hf", path, dtype="float32")
        # before: the same engine, eos (2,) and the old weights
        assert second is not first and second.eos_ids == (7, 2)
        assert not torch.allclose(second.score([((1, 40, 41), (42, 43))])[0], before)
    finally:
        registry.close_shared_backend("hf", path, dtype="float32")


def test_a_stale_shared_backend_is_closed_and_replaced(tmp_path, fakes):
    path = _copy(tmp_path)
    first = shared_backend("hf", path, dtype="float32")
    _set_eos(path, 9)
    second = shared_backend("hf", path, dtype="float32")
    assert second is not first and first.closed and second.eos_ids == (9, 2)
    assert shared_backend("hf", path, dtype="float32") is second


def test_a_relative_path_from_another_directory_is_another_checkpoint(tmp_path, fakes, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _copy(tmp_path / "a", "ck")
    _set_eos(_copy(tmp_path / "b", "ck"), 5)
    monkeypatch.chdir(tmp_path / "a")
    one = shared_backend("hf", "ck", dtype="float32")
    monkeypatch.chdir(tmp_path / "b")
    other = shared_backend("hf", "ck", dtype="float32")
    # before: b's call got a's backend (eos (2,)) though b's checkpoint stops on 5
    assert other is not one and other.eos_ids == (5, 2) and one.eos_ids == (2,)
    assert not getattr(one, "closed", False)  # both stay served: neither is stale
    monkeypatch.chdir(tmp_path / "a")
    assert shared_backend("hf", "ck", dtype="float32") is one


def test_a_name_and_a_directory_spelled_like_it_are_not_one_backend(tmp_path, fakes, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _set_eos(_copy(tmp_path, "tiny-llama"), 6)
    local = shared_backend("hf", Path("tiny-llama"), dtype="float32")
    assert local.eos_ids == (6, 2)
    # before: the string got the directory's backend; it is refused as ambiguous here (resolve_model)
    with pytest.raises(ParityError, match="both a model name and the checkpoint directory"):
        shared_backend("hf", "tiny-llama", dtype="float32")


def test_a_built_in_name_and_its_directory_share_one_backend(fakes):
    by_name = shared_backend("hf", "tiny-llama", dtype="float32")
    assert shared_backend("hf", builtin_path("tiny-llama"), dtype="float32") is by_name


def test_close_shared_backend_finds_it_by_either_spelling(tmp_path, fakes, monkeypatch):
    path = _copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    backend = shared_backend("hf", "m", dtype="float32")
    assert registry.close_shared_backend("hf", path, dtype="float32") and backend.closed
    assert not registry.close_shared_backend("hf", tmp_path / "gone", dtype="float32")


# -- a running backend checked against the call --------------------------------------------------------


def test_borrowed_backend_of_another_tensor_parallel_degree_is_refused(tmp_path):
    backend = Fake(_copy(tmp_path), dtype="float32")
    backend.meta["tensor_parallel_size"] = 1
    with pytest.raises(ConfigError, match="runs tensor_parallel_size=1 but tensor_parallel=2"):
        check_borrowed(backend, model=str(backend.model_path), dtype="float32", tensor_parallel=2)
    assert check_borrowed(backend, model=None, dtype=None, tensor_parallel=1) is backend
    # before: compare sampled with it and scored the rollouts in the TP-invariant layout of degree 2
    with pytest.raises(ConfigError, match="tensor_parallel_size=1 but tensor_parallel=2"):
        compare(backend=backend, model=str(backend.model_path), dtype="float32", prompts=[[1, 40, 41]],
                sampling={"max_tokens": 2}, tensor_parallel=2, gold=False)


def test_borrowed_shared_backend_whose_files_changed_is_refused(tmp_path, fakes):
    path = _copy(tmp_path)
    backend = shared_backend("hf", path, dtype="float32")
    assert check_borrowed(backend, model=str(path), dtype="float32") is backend
    _set_eos(path, 8)
    # before: accepted; it samples (and stops) as the old files say, the training forward loads the new
    with pytest.raises(ConfigError, match="files changed since it started"):
        check_borrowed(backend, model=str(path), dtype="float32")
    own = Fake(path, dtype="float32")  # a backend of the caller's own is the caller's to keep current
    assert check_borrowed(own, model=str(path), dtype="float32") is own


def test_borrowed_backend_started_on_a_relative_path_is_the_directory_it_started_on(tmp_path, monkeypatch):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        _copy(tmp_path / folder, "ck")
    _set_eos(tmp_path / "b" / "ck", 5)
    monkeypatch.chdir(tmp_path / "a")
    backend = Fake("ck", dtype="float32")
    monkeypatch.chdir(tmp_path / "b")
    # before: accepted, "ck" resolved from here for both: the backend samples a/ck (eos 2), the
    # training forward loads b/ck (eos 5)
    with pytest.raises(ConfigError, match=re.escape(f"serves {tmp_path / 'a' / 'ck'}, not model 'ck'")):
        check_borrowed(backend, model="ck", dtype="float32")
    assert check_borrowed(backend, model=str(tmp_path / "a" / "ck"), dtype="float32") is backend
