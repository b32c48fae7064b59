"""Case files and `parity.compare` arguments that were accepted while meaning something other than
what was written; each is now refused before any engine starts (no test here starts one: the
engine start is replaced by a sentinel that fails the test if reached when it should not be).

- `compare(model=..., case=...)` with a model other than the case's ran the other model on prompts
  encoded by the case's model's tokenizer;
- `compare(lora=..., case=...)` with another adapter than the case's ran it silently;
- `compare(tolerance={...}, case=...)` dropped the case's own limits for the backend's defaults;
- a case's `sampling.top_k_logprobs` on a backend that returns no top-k lost the distribution
  drift without a word (the `top_k_logprobs=` argument was refused);
- a turn's stop ids or injected ids outside the vocabulary (a stop that never fires);
- a generated turn that cannot fit the response's max_tokens (cut, or never sampled);
- `label` on a lone `[sampling]` table, dropped;
- `parity lifecycle`, `parity attribute` and `parity.loop` with a model other than their case's.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import parity
import parity.compare
from parity.backends.base import Backend
from parity.core.errors import ConfigError
from parity.core.top_k import TopKError
from parity.core.turns import Generate, Inject
from parity.drift.tolerance import Tolerance
from parity.workload.cases import load_case

MODEL = "tiny-llama"  # 512 tokens
COMPARE = sys.modules["parity.compare"]


class EngineStarted(Exception):
    """Raised where compare would start (or use) an engine: every check has passed."""


@pytest.fixture
def no_engine(monkeypatch):
    def start(*args, **kwargs):
        raise EngineStarted

    monkeypatch.setattr(COMPARE, "_resolve_backend", start)


class NoTopK(Backend):
    """A running backend that returns no top-k logprobs (`Backend.top_k_limit` is 0); sampling fails."""

    name = "no-top-k"

    def generate(self, requests):
        raise EngineStarted

    def _score(self, pairs, sampling):
        raise NotImplementedError

    def close(self) -> None:
        pass


def write(tmp_path: Path, body: str, name: str = "case.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


TOKENS = 'model = "tiny-llama"\n[prompts]\ntoken_ids = [[3, 4, 5], [6, 7]]\n'


def test_a_model_other_than_the_cases_is_refused(tmp_path, no_engine):
    case = write(tmp_path, TOKENS)
    with pytest.raises(ConfigError, match=r"case 'case' names model 'tiny-llama', not model 'tiny-qwen3'; "
                                          r"drop model \(--model\)"):
        parity.compare("tiny-qwen3", "reference", case=case)
    with pytest.raises(ConfigError, match="not model 'tiny-qwen3'"):
        parity.audit("tiny-qwen3", "reference", case=case, device="cpu")
    with pytest.raises(EngineStarted):  # the case's own model, by name or by its checkpoint directory
        parity.compare(MODEL, "reference", case=case)
    from parity.models import resolve_model
    with pytest.raises(EngineStarted):
        parity.compare(str(resolve_model(MODEL)), "reference", case=case)


def test_an_adapter_other_than_the_cases_is_refused(no_engine):
    case = Path(__file__).parent.parent / "cases" / "lora.toml"
    with pytest.raises(ConfigError, match=r"lora 'tiny-llama-lora-r64' is not the adapter case 'lora' names "
                                          r"\('tiny-llama-lora-r8'\)"):
        parity.compare(None, "hf", case=case, lora="tiny-llama-lora-r64")
    with pytest.raises(EngineStarted):
        parity.compare(None, "hf", case=case, lora="tiny-llama-lora-r8")


def test_a_tolerance_dict_overrides_the_cases_limits_not_the_defaults(tmp_path, monkeypatch, no_engine):
    case = write(tmp_path, TOKENS + "[tolerance]\nk3_kl_max = 0.5\n"
                                    "[tolerance.hf]\nmean_abs_logprob_diff = 0.3\n")
    used = []
    resolve = Tolerance.resolve.__func__

    def spy(cls, *args, **kwargs):
        used.append(resolve(cls, *args, **kwargs))
        return used[-1]

    monkeypatch.setattr(Tolerance, "resolve", classmethod(spy))
    loose = {"max_abs_logprob_diff": 1.0}
    with pytest.raises(EngineStarted):
        parity.compare(None, "hf", case=case, dtype="float32", tolerance=loose)
    got = used[-1]
    assert (got.max_abs_logprob_diff, got.mean_abs_logprob_diff, got.k3_kl_max) == (1.0, 0.3, 0.5)
    with pytest.raises(EngineStarted):  # without a case, a dict overrides the backend's default
        parity.compare(MODEL, "hf", prompts=[[3, 4]], dtype="float32", tolerance=loose)
    assert used[-1] == Tolerance(**{**Tolerance.for_backend("hf", "float32").to_dict(), **loose})


def test_a_cases_top_k_logprobs_is_checked_against_the_backend(tmp_path):
    case = write(tmp_path, TOKENS + "[sampling]\ntop_k_logprobs = 4\nmax_tokens = 4\n")
    backend = NoTopK(MODEL, dtype="float32")
    with pytest.raises(TopKError, match=r"returns no top-k logprobs yet; drop the case's "
                                        r"sampling.top_k_logprobs"):
        parity.compare(None, backend, case=case, dtype="float32")
    with pytest.raises(EngineStarted):  # without top-k asked, the same backend samples
        parity.compare(None, backend, case=write(tmp_path, TOKENS, "plain.toml"), dtype="float32")


@pytest.mark.parametrize("backend", ["no-such-backend", 7, None])
def test_top_k_logprobs_with_a_backend_that_is_no_backend_is_a_config_error(backend):
    with pytest.raises(ConfigError, match="backend"):
        parity.compare(MODEL, backend, prompts=[[3, 4]], top_k_logprobs=3)


TRAJECTORY = 'kind = "trajectory"\n' + TOKENS


@pytest.mark.parametrize(("turns", "field", "says"), [
    ("[[turns]]\ngenerate = 4\nstop_token_ids = [600]\n", "turns[0].stop_token_ids", "token id 600, outside"),
    ("[[turns]]\ngenerate = 2\n[[turns]]\ninject = [3, 700]\n[[turns]]\ngenerate = 2\n", "turns[1].inject",
     "token id 700, outside"),
    # the default max_tokens (16) is the whole response: a 24-token turn never gets its 24
    ("[[turns]]\ngenerate = 24\n[[turns]]\ninject = [5, 6, 7]\n[[turns]]\ngenerate = 24\n",
     "turns[0].generate", "raise sampling.max_tokens to at least 24"),
    # one token, then 15 injected: the last turn would never be sampled
    ("[[turns]]\ngenerate = 4\n[[turns]]\ninject = [" + ", ".join(["5"] * 15) + "]\n"
     "[[turns]]\ngenerate = 4\n", "turns[2].generate", "the turns before it take at least 16"),
])
def test_turns_that_cannot_be_what_they_say_are_refused(tmp_path, turns, field, says):
    path = write(tmp_path, TRAJECTORY + turns)
    with pytest.raises(ConfigError) as info:
        load_case(path)
    message = str(info.value)
    assert str(path) in message and f"{field}: " in message and says in message, message


def test_turns_that_fit_still_load_and_each_sweep_block_is_checked(tmp_path):
    fits = "[[turns]]\ngenerate = 12\n[[turns]]\ntool = \"length\"\n[[turns]]\ngenerate = 12\n"
    case = load_case(write(tmp_path, TRAJECTORY + fits + "[sampling]\nmax_tokens = 13\n"))
    assert [type(t).__name__ for t in case.requests[0].turns] == ["Generate", "Inject", "Generate"]
    sweep = "[[sampling]]\nmax_tokens = 40\n[[sampling]]\ntemperature = 0.5\nmax_tokens = 12\n"
    with pytest.raises(ConfigError, match=r"turns\[2\]\.generate: 12 tokens do not fit in "
                                          r"sampling\[1\]\.max_tokens = 12"):
        load_case(write(tmp_path, TRAJECTORY + fits + sweep, "sweep.toml"))


def test_compare_checks_the_turns_it_is_given(no_engine):
    prompts, sampling = [[3, 4], [5]], {"max_tokens": 6}
    for turns, says in [
            ([Generate(8)], r"prompts\[0\]: turns\[0\]\.generate: 8 tokens do not fit"),
            ([Generate(2, stop_token_ids=(600,))], r"turns\[0\]\.stop_token_ids: has token id 600"),
            ([Generate(2), Inject((3, 700)), Generate(1)], r"turns\[1\]\.inject: has token id 700")]:
        with pytest.raises(ConfigError, match=says):
            parity.compare(MODEL, "reference", prompts=prompts, sampling=sampling, turns=turns)
    with pytest.raises(EngineStarted):
        parity.compare(MODEL, "reference", prompts=prompts, sampling=sampling,
                       turns=[Generate(2), Inject(name="calculator"), Generate(3)])


def test_a_label_on_a_lone_sampling_table_is_refused_not_dropped(tmp_path):
    for sampling in ('[sampling]\nlabel = "hot"\ntemperature = 1.5\n', '[[sampling]]\nlabel = "hot"\n'):
        with pytest.raises(ConfigError, match=r"sampling\.label: names a block of a sweep"):
            load_case(write(tmp_path, TOKENS + sampling))
    sweep = load_case(write(tmp_path, TOKENS + '[[sampling]]\nlabel = "hot"\n'
                                               '[[sampling]]\ntemperature = 0.5\n'))
    assert [r.request_id for r in sweep.requests] == ["hot/0", "hot/1", "t0.5/0", "t0.5/1"]


@pytest.mark.parametrize("argv", [
    ["lifecycle", "--backend", "reference", "--model", "tiny-qwen2", "--case", "smoke"],
    ["attribute", "--model", "tiny-qwen2", "--case", "smoke"],
    ["attribute", "--backend", "vllm", "--model", "tiny-qwen2", "--case", "smoke"],
], ids=["lifecycle", "attribute", "attribute-engine"])
def test_the_other_commands_refuse_a_model_other_than_the_cases(argv, capsys):
    """`parity lifecycle` and `parity attribute` (both paths) ran the other model on the case's
    prompts as compare did; they now exit 2 naming both models, before any engine."""
    from parity.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "names model 'tiny-llama', not model 'tiny-qwen2'" in err and "--model" in err, err


def test_the_loop_refuses_a_case_of_another_model():
    with pytest.raises(ConfigError, match="names model 'tiny-llama', not model 'tiny-qwen2'"):
        parity.loop("tiny-qwen2", steps=1, case="smoke")
