"""Round 16, workload: case input that is contradictory or ambiguous is refused before any engine starts.

Each test failed on the code before its fix (the old behaviour is named in the test's docstring).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import parity.workload.prompts as prompts_module
from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, SamplingParams
from parity.workload.cases import Case, load_case
from parity.workload.prompts import encode_prompts
from parity.workload.resolve import resolve_workload, with_logprobs_mode

CASES = Path(__file__).resolve().parents[1] / "cases"
HEAD = 'model = "tiny-llama"\n'


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- a case's logprobs_mode against its requests' --------------------------------------------------

def test_a_case_logprobs_mode_its_requests_do_not_sample_in_is_refused() -> None:
    """Old: Case(logprobs_mode="raw") over processed requests loaded; engines returned processed
    logprobs while the case (its hash, its reports) said raw."""
    with pytest.raises(ConfigError, match=r"logprobs_mode is 'raw' but request '0' samples 'processed'"):
        Case(name="x", model="tiny-llama", requests=(Request((5, 6)),), logprobs_mode="raw")
    raw = SamplingParams(logprobs_mode="raw")
    with pytest.raises(ConfigError, match="request '1' samples 'raw'"):
        Case(name="x", model="tiny-llama", requests=(Request((5, 6)), Request((7,), raw, request_id="1")))


def test_cases_whose_requests_agree_with_their_mode_still_load() -> None:
    raw = Case(name="x", model="tiny-llama", requests=(Request((5, 6), SamplingParams(logprobs_mode="raw")),),
               logprobs_mode="raw")
    assert raw.requests[0].sampling.logprobs_mode == "raw"
    switched = with_logprobs_mode(load_case(CASES / "smoke.toml"), "raw")
    assert {r.sampling.logprobs_mode for r in switched.requests} == {"raw"}
    assert resolve_workload("tiny-llama", None, [[5, 6]], {"logprobs_mode": "raw"}).logprobs_mode == "raw"


# -- two requests that are one ---------------------------------------------------------------------

def test_two_identical_requests_are_refused() -> None:
    """Old: two requests with one prompt, sampling and seed loaded; the seed fixes the noise, so they
    sample the same tokens and every metric counts them twice."""
    same = SamplingParams(seed=1)
    with pytest.raises(ConfigError, match="requests 'a' and 'b' have the same prompt, sampling and seed"):
        Case(name="x", model="tiny-llama", requests=(Request((5, 6), same, "a"), Request((5, 6), same, "b")))


def test_a_sweep_block_repeating_another_is_refused(tmp_path: Path) -> None:
    """Old: two [[sampling]] blocks differing only in their label loaded as 2x the same requests."""
    path = write(tmp_path, HEAD + '[prompts]\ntoken_ids = [[5, 6, 7], [8, 9]]\n'
                 '[[sampling]]\nlabel = "a"\nseed = 3\n[[sampling]]\nlabel = "b"\nseed = 3\n')
    with pytest.raises(ConfigError, match="requests 'a/0' and 'b/0' have the same prompt"):
        load_case(path)


def test_a_prompt_given_twice_and_a_sweep_sharing_seeds_still_load(tmp_path: Path) -> None:
    twice = load_case(write(tmp_path, HEAD + '[prompts]\ntoken_ids = [[5, 6], [5, 6]]\n'))
    assert twice.seeds == [0, 1]
    sweep = load_case(CASES / "sampling-sweep.toml")  # the same seeds under other parameters: on purpose
    assert len(set(sweep.seeds)) < len(sweep.seeds)
    one_seed = SamplingParams(seed=1)
    other_prompts = (Request((5, 6), one_seed, "a"), Request((7,), one_seed, "b"))
    assert Case(name="x", model="tiny-llama", requests=other_prompts).seeds == [1, 1]


# -- an injected text that encodes to nothing -------------------------------------------------------

TRAJECTORY = HEAD + ('kind = "trajectory"\n[prompts]\ntoken_ids = [[5, 6]]\n[sampling]\nmax_tokens = 20\n'
                     '[[turns]]\ngenerate = 4\n[[turns]]\ninject = {inject}\n[[turns]]\ngenerate = 4\n')


def test_an_injected_text_without_tokens_is_refused(tmp_path: Path) -> None:
    """Old: inject = "" loaded as Inject((), name="text"), an unbound tool: hashed as {"tool": "text"}
    and failing with "has no function bound" only mid-run, after the engines started."""
    with pytest.raises(ConfigError, match=r"turns\[1\]\.inject: the text '' encodes to no tokens"):
        load_case(write(tmp_path, TRAJECTORY.format(inject='""')))


def test_an_injected_text_with_tokens_still_loads(tmp_path: Path) -> None:
    case = load_case(write(tmp_path, TRAJECTORY.format(inject='"ok"')))
    injected = case.requests[0].turns[1]
    assert injected.token_ids and injected.to_dict() == {"inject": list(injected.token_ids)}


# -- a lognormal length whose median is outside its clip range ------------------------------------

def lognormal(median: float) -> str:
    return (HEAD + '[prompts.generate]\nkind = "random"\ncount = 4\n'
            f'length = {{ distribution = "lognormal", min = 4, max = 8, median = {median}, sigma = 0.5 }}\n')


@pytest.mark.parametrize("median", [100, 2])
def test_a_lognormal_median_outside_min_max_is_refused(tmp_path: Path, median: int) -> None:
    """Old: median 100 with max 8 loaded; every prompt was clipped to 8 tokens (median 2, min 4: most
    to 4), a length distribution other than the one written."""
    with pytest.raises(ConfigError, match=r"length\.median: .* outside \[min, max\] = \[4, 8\]"):
        load_case(write(tmp_path, lognormal(median)))


def test_a_lognormal_median_inside_min_max_still_loads(tmp_path: Path) -> None:
    lengths = {len(r.prompt_ids) for r in load_case(write(tmp_path, lognormal(6))).requests}
    assert lengths <= set(range(4, 9))
    load_case(CASES / "fp16-vs-bf16.toml")


# -- text prompts: a second BOS ---------------------------------------------------------------------

class FakeTokenizer:
    """A tokenizer that adds BOS (id 1, "<s>") to text, parses "<s>" in text, and has a chat template."""

    bos_token, bos_token_id, chat_template = "<s>", 1, "{{ messages }}"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [1] if add_special_tokens else []
        if text.startswith("<s>"):
            ids, text = [*ids, 1], text[3:]
        return {"input_ids": ids + [ord(c) % 200 + 3 for c in text]}

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
        return "<s>" + "".join(m["content"] for m in messages)


@pytest.fixture
def fake_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompts_module, "tokenizer", lambda model, where="prompt": FakeTokenizer())


def test_text_starting_with_bos_is_refused_where_the_tokenizer_adds_one(fake_tokenizer: None) -> None:
    """Old: "<s>hello" (a prompt already rendered by a chat template) encoded to [1, 1, ...]: two BOS
    tokens, another prompt than the one meant, on every engine alike."""
    with pytest.raises(InputError, match=r"row 3: the text starts with the BOS token '<s>'"):
        encode_prompts("tiny-llama", [("row 3", "<s>hello")])


def test_text_and_chat_prompts_with_one_bos_still_encode(fake_tokenizer: None) -> None:
    (text,), (chat,) = encode_prompts("tiny-llama", [("p", "hello")]), \
        encode_prompts("tiny-llama", [("p", [{"role": "user", "content": "hello"}])])
    assert text[:2] == (1, ord("h") % 200 + 3) and chat == text


def test_text_mixed_with_token_ids_still_encodes(fake_tokenizer: None) -> None:
    assert encode_prompts("tiny-llama", [("a", "hi"), ("b", [7, 8])])[1] == (7, 8)
