"""Weight pushes and the digests that verify them: the reference engine's in-place update, parity's
device-side digest, vLLM's layout of HF tensors, and which backends can take part in a sync."""

import pytest
import torch

from parity.backends import get_backend, weight_sync_missing
from parity.backends.vllm_weights import VOCAB_PADDING, vllm_layout
from parity.core.errors import InputError
from parity.core.types import Request, SamplingParams
from parity.models.loading import load_model, tensor_digest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tensor_digest_sees_every_bit_and_every_place():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert tensor_digest(x) == tensor_digest(x.clone())
    nudged = x.clone()
    nudged[3, 4] = torch.nextafter(nudged[3, 4], torch.tensor(1e9))
    assert tensor_digest(nudged) != tensor_digest(x)
    swapped = x.clone()
    swapped[[0, 1]] = x[[1, 0]]
    assert tensor_digest(swapped) != tensor_digest(x)
    assert tensor_digest(x.to(torch.bfloat16)) != tensor_digest(x)


def test_tensor_digest_sees_changes_that_keep_fletchers_two_sums():
    """+1 -1 -1 +1 ulp on four neighbouring bf16 words, and a swap 65,521 words apart, keep
    Fletcher's S1 and S2 (the digest's first two parts, the control); the third part sees them."""
    x = torch.randn(70_000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bits = x.view(torch.int16).clone()
    bits[100:104] += torch.tensor([1, -1, -1, 1], dtype=torch.int16)
    swapped = x.clone()
    swapped[[10, 10 + 65521]] = x[[10 + 65521, 10]]
    for changed in (bits.view(torch.bfloat16), swapped):
        before, after = tensor_digest(x).split(":"), tensor_digest(changed).split(":")
        assert before[:2] == after[:2] and before[2] != after[2]


def test_reference_update_is_in_place_private_and_verified():
    """A push changes this engine's weights only (load_model's shared model stays), its digests then
    match the pushed tensors', and its rollouts follow the new weights."""
    shared = load_model("tiny-llama")
    before = {n: p.detach().clone() for n, p in shared.model.named_parameters()}
    backend = get_backend("reference", "tiny-llama", dtype="float32")
    request = [Request(prompt_ids=(5, 6, 7), sampling=SamplingParams(n=2, max_tokens=6, seed=1),
                       request_id="r")]
    old = backend.generate(request)
    new = [(n, t * 1.01) for n, t in before.items()]
    assert backend.weight_checksums() != backend.expected_checksums(new)
    backend.update_weights(new)
    assert backend.weight_checksums() == backend.expected_checksums(new)
    assert all(torch.equal(p, before[n]) for n, p in shared.model.named_parameters())  # untouched
    fresh = backend.generate(request)
    assert [r.logprobs for r in fresh] != [r.logprobs for r in old]
    scores = backend.score(fresh, logprobs_mode="processed")  # the training forward on the pushed weights
    assert all(torch.equal(s, torch.tensor(r.logprobs, dtype=torch.float32)) for s, r in zip(scores, fresh))
    backend.close()


def test_reference_update_checks_names_and_shapes_first():
    backend = get_backend("reference", "tiny-llama", dtype="float32")
    digests = backend.weight_checksums()
    name, param = next(iter(backend._engine.lm.model.named_parameters()))
    with pytest.raises(InputError, match="no parameter 'nope'"):
        backend.update_weights([(name, param.detach() * 2), ("nope", torch.zeros(1))])
    with pytest.raises(InputError, match="shape"):
        backend.update_weights([(name, torch.zeros(1))])
    assert backend.weight_checksums() == digests  # nothing was copied
    backend.close()


def test_vllm_layout_packs_like_vllm():
    t = {f"model.layers.0.self_attn.{p}.weight": torch.full((2, 3), float(i)) for i, p in
         enumerate(("q_proj", "k_proj", "v_proj", "o_proj"))}
    t["model.layers.0.mlp.up_proj.weight"] = torch.full((4, 3), 6.0)
    t["model.layers.0.mlp.gate_proj.weight"] = torch.full((4, 3), 5.0)
    t["model.embed_tokens.weight"] = torch.ones(100, 3)
    t["model.layers.1.mlp.up_proj.weight"] = torch.ones(4, 3)  # its gate_proj is missing
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    out = vllm_layout(t, packed)
    qkv = out["model.layers.0.self_attn.qkv_proj.weight"]
    gate_up = out["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(qkv[:, 0], torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]))
    assert torch.equal(gate_up[:, 0], torch.tensor([5.0] * 4 + [6.0] * 4))
    assert out["model.layers.0.self_attn.o_proj.weight"] is t["model.layers.0.self_attn.o_proj.weight"]
    embed = out["model.embed_tokens.weight"]
    assert embed.shape[0] == VOCAB_PADDING * 2 and torch.equal(embed[100:], torch.zeros(28, 3))
    assert not any(k.startswith("model.layers.1.") for k in out)


def test_which_backends_can_sync_weights():
    assert weight_sync_missing("reference") is None
    assert weight_sync_missing("vllm") is None
    assert weight_sync_missing("vllm-server") is None
    assert "no weight-update API" in weight_sync_missing("hf")
    assert "no weight-update API" in weight_sync_missing("trtllm")
    assert "cannot report the weights" in weight_sync_missing("sglang")


@pytest.mark.slow
def test_the_worker_extension_digests_as_vllm_does():
    """vLLM 0.23's GPU worker has no compute_weight_checksums; parity's worker extension stands in.
    Its digests are vLLM's own (`compute_tensor_digests`) on a real model's parameters, and a changed
    bit changes one (a digest that ignored the bytes would fail)."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from parity.backends.vllm_weights import WeightDigestExtension

    model = load_model("tiny-llama").model
    worker = SimpleNamespace(rank=0, model_runner=SimpleNamespace(get_model=lambda: model))
    ours = WeightDigestExtension.parity_weight_checksums(worker)
    assert ours == {f"rank0:{name}": digest for name, digest in compute_tensor_digests(model).items()}
    small = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.ones(3))})
    changed = SimpleNamespace(rank=0, model_runner=SimpleNamespace(get_model=lambda: small))
    before = WeightDigestExtension.parity_weight_checksums(changed)
    with torch.no_grad():
        small["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert WeightDigestExtension.parity_weight_checksums(changed) != before


def test_ipc_without_its_module_is_refused_before_an_engine_starts(monkeypatch):
    import parity.backends.vllm_weights as weights
    from parity.core.errors import ConfigError

    def no_ray(name):
        raise ModuleNotFoundError("No module named 'ray'")

    monkeypatch.setattr(weights.importlib, "import_module", no_ray)
    refused = r"needs vLLM's vllm\.distributed\.weight_transfer\.ipc_engine.*'ray'.*weight_transfer='reload'"
    with pytest.raises(ConfigError, match=refused):
        weights.check_weight_transfer("ipc", on_cpu=False)
    weights.check_weight_transfer("reload", on_cpu=False)  # reload needs no such module
    # the control: with the module importable the same check passes
    monkeypatch.setattr(weights.importlib, "import_module", lambda name: object())
    weights.check_weight_transfer("ipc", on_cpu=False)
