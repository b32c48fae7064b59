"""Round 15, model loading, checkpoints, the HF backend and JSONL reading: numbers that were silently
wrong (or records that grew wrongly).

- `load_model`'s cache stamp covered config.json and the weights only: after generation_config.json's
  eos_token_id was edited, the reference engine kept stopping on the old ids for the rest of the
  process while every other backend read the new ones;
- eos_token_id `true` stopped on id 1, `2.5` and `"2"` on id 2 (vLLM never stops on "2"), `[2, null]`
  crashed with a TypeError;
- a tokenizer_config.json without added_tokens_decoder (saved before transformers 4.34) and a
  special_tokens_map.json naming another eos: transformers (so vLLM) stops on special_tokens_map's,
  the reference on tokenizer_config's;
- a generation_config.json without eos_token_id fell back to config.json's, which vLLM never reads
  when the file exists (`try_get_generation_config`): the reference stopped where vLLM runs on;
- the HF backend listed its whole padded batch in every row's meta: B^2 entries per batch in records;
- a JSONL file starting with a UTF-8 BOM (Windows editors) was refused as invalid JSON.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from parity.backends import shared_backend
from parity.core.errors import ConfigError, InputError
from parity.core.tables import read_jsonl
from parity.core.types import Request, SamplingParams
from parity.models.checkpoints import builtin_path, checkpoint_stamp, eos_token_ids, tokenizer_eos_id
from parity.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _copy(tmp_path: Path, name: str = "tiny-llama") -> Path:
    path = tmp_path / "m"
    shutil.copytree(builtin_path(name), path)
    return path


def _write(path: Path, data: object) -> None:
    """Write JSON and move the mtime on, so a rewrite within one clock tick is still seen."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(json.dumps(data))
    os.utime(path, ns=(before + 10**9, before + 10**9))


# --- 1. the model cache sees the files that decide where a sample stops ------------------------------


def test_an_edited_generation_config_is_read_again_by_load_model(tmp_path):
    path = _copy(tmp_path)
    first = load_model(path)
    assert first.eos_token_ids == (2,) and load_model(path) is first
    _write(path / "generation_config.json", {"eos_token_id": [2, 7]})
    again = load_model(path)  # was: the cached model, still stopping on (2,) only
    assert again is not first and again.eos_token_ids == (2, 7) == eos_token_ids(path)


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json", "tokenizer.model", "added_tokens.json"])
def test_the_stamp_covers_the_stop_files(tmp_path, name):
    path = _copy(tmp_path)
    before = checkpoint_stamp(path)
    target = path / name
    if target.exists():  # rewritten in place: the same size, a new mtime
        os.utime(target, ns=(target.stat().st_mtime_ns + 10**9,) * 2)
    else:  # added
        target.write_text("{}")
    assert checkpoint_stamp(path) != before
    (path / "README.md").write_text("notes")  # a file no number depends on keeps the cache
    after = checkpoint_stamp(path)
    (path / "README.md").write_text("other notes")
    assert checkpoint_stamp(path) == after


# --- 2. eos_token_id: integers only; generation_config.json alone when present ---------------------


@pytest.mark.parametrize("eos", [True, 2.5, "2", [2, None], [2, True], "</s>"])
def test_an_eos_token_id_that_is_no_token_id_is_refused(tmp_path, eos):
    path = _copy(tmp_path)
    _write(path / "generation_config.json", {"eos_token_id": eos})
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id must be a token id or"):
        eos_token_ids(path)


def test_integer_eos_ids_still_read(tmp_path):
    path = _copy(tmp_path)
    for eos, want in ((7, (7, 2)), ([2, 7], (2, 7)), ([], (2,)), (None, (2,))):
        _write(path / "generation_config.json", {"eos_token_id": eos})
        assert eos_token_ids(path) == want


def test_config_json_eos_is_read_only_without_a_generation_config(tmp_path):
    path = _copy(tmp_path)
    config = json.loads((path / "config.json").read_text())
    _write(path / "config.json", {**config, "eos_token_id": 7})
    _write(path / "generation_config.json", {"temperature": 0.6})
    # vLLM: GenerationConfig.from_pretrained finds the file, with no eos; the tokenizer's </s> stops
    assert eos_token_ids(path) == (2,)  # was (7, 2)
    (path / "generation_config.json").unlink()
    assert eos_token_ids(path) == (7, 2)  # GenerationConfig.from_model_config(config.json)


def test_the_tokenizer_eos_is_the_one_transformers_loads(tmp_path):
    from transformers import AutoTokenizer

    path = _copy(tmp_path)
    _write(path / "special_tokens_map.json", {"eos_token": "<s>"})  # tokenizer_config.json says </s>
    legacy = AutoTokenizer.from_pretrained(path).eos_token_id
    assert legacy == 1 and tokenizer_eos_id(path) == 1 and eos_token_ids(path) == (2, 1)  # was 2, (2,)
    config = json.loads((path / "tokenizer_config.json").read_text())
    added = {"content": "</s>", "special": True, "lstrip": False, "rstrip": False, "normalized": False,
             "single_word": False}
    _write(path / "tokenizer_config.json", {**config, "added_tokens_decoder": {"2": added}})
    assert AutoTokenizer.from_pretrained(path).eos_token_id == 2 == tokenizer_eos_id(path)


# --- 3. the HF backend's seed batch: once per batch, not once per row ------------------------------


def test_hf_lists_each_seed_batch_once():
    hf = shared_backend("hf", "tiny-llama", dtype="float32", batch_size=4)
    reqs = [Request((1, 40, 41), SamplingParams(n=4, temperature=0.7, max_tokens=2, seed=5), "a"),
            Request((1, 70), SamplingParams(n=2, temperature=0.7, max_tokens=2, seed=9), "b")]
    rollouts = hf.generate(reqs)
    # was 4*4 + 2*2 = 20 entries; now one per row
    assert sum(len(r.meta.get("seed_batch", ())) for r in rollouts) == 6
    by_key = {(r.request_id, r.sample_index): r for r in rollouts}
    for r in rollouts:  # every row finds its batch, and itself in it, through its head
        head = by_key[tuple(r.meta["seed_batch_head"])]
        assert head.meta["seed_batch"][r.meta["seed_batch_row"]] == [r.request_id, r.sample_index]
        assert r.meta["sample_seed"] == head.meta["sample_seed"]
    assert [r.meta["seed_batch_head"] for r in rollouts] == [["a", 0]] * 4 + [["b", 0]] * 2
    assert by_key[("b", 0)].meta["seed_batch"] == [["b", 0], ["b", 1]]


# --- 4. a UTF-8 BOM before the first line ----------------------------------------------------------


def test_a_jsonl_file_with_a_bom_reads(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes('\ufeff{"a": 1}\n{"b": 2}\n'.encode())
    assert list(read_jsonl(path)) == [(f"{path}:1", {"a": 1}), (f"{path}:2", {"b": 2})]
    inside = tmp_path / "joined.jsonl"  # a BOM inside (two files concatenated) is still refused
    inside.write_bytes('{"a": 1}\n\ufeff{"b": 2}\n'.encode())
    with pytest.raises(InputError, match=r"joined.jsonl:2: invalid JSON"):
        list(read_jsonl(inside))
