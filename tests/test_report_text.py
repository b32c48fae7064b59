"""Reports speak text: worst tokens decoded in context with the start of their prompt, a per-request
drift table, "all N tokens identical" where nothing drifted, everything HTML-escaped (a prompt
holding <script> stays text in headless Chromium), and a stored report renders without torch."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from browser import chromium, console_lines, needs_chromium
from test_report import make_report

import parity
from parity.core.types import Rollout, SamplingParams
from parity.models import resolve_model
from parity.render import report_html
from parity.report.document import ParityReport, format_worst_tokens
from parity.report.text import PROMPT_TOKENS, prompt_start, report_text
from parity.workload.prompts import encode_prompts, tokenizer

ROOT = Path(__file__).resolve().parent.parent
#: markup a decoded token or prompt may hold; if it ever reached the page unescaped, it would run
SCRIPT = "<script>document.title='pwned'</script>"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def with_text(report: ParityReport) -> ParityReport:
    """`report` with decoded text: token t reads "t<id>", token 300 holds markup, prompts end in it."""
    ids = np.unique(report.token_ids[report.mask])
    tokens = {str(i): f" t{i}" for i in ids}
    tokens[str(report.token_ids[0, 1])] = SCRIPT
    prompts = {s["request_id"]: f"Q{i}: {SCRIPT}" for i, s in enumerate(report.sequences)}
    report.extras["text"] = {"tokens": tokens, "prompts": prompts}
    return report


def test_worst_tokens_come_with_their_context_and_prompt():
    report = with_text(make_report(scale=0.3, rows=3, width=10))
    for row in report.worst_tokens(30):
        r, c = row["sequence"], row["position"]
        ids = report.token_ids[r]
        n = int(report.mask[r].sum())
        token = report.extras["text"]["tokens"]
        assert row["text"] == token[str(ids[c])]
        assert row["before"] == "".join(token[str(t)] for t in ids[max(c - 4, 0):c])
        assert row["after"] == "".join(token[str(t)] for t in ids[c + 1:min(c + 5, n)])  # never padding
        assert row["prompt"] == f"Q{r}: {SCRIPT}"
    table = format_worst_tokens(report.worst_tokens(3), report.num_tokens)
    assert table.splitlines()[0].split()[-3:] == ["token", "in", "context"]
    assert re.search(r"\[ t\d+\]", table)


def test_no_drift_reads_all_tokens_identical():
    exact = make_report(scale=0.0)
    assert exact.worst_tokens(5) == []
    assert format_worst_tokens([], exact.num_tokens) == f"all {exact.num_tokens} tokens identical"
    page = report_html(exact)
    assert f"all {exact.num_tokens} tokens identical" in page
    for row in exact.request_drift():
        assert row["identical"] and f"all {row['tokens']} tokens identical" in page


def test_request_drift_table_groups_samples_by_request():
    report = make_report(scale=0.2, rows=4)
    report.sequences[1]["request_id"] = report.sequences[0]["request_id"]  # two samples of "r0"
    report.train_logprobs[2] = report.rollout_logprobs[2]  # request "r2" did not drift
    rows = {r["request_id"]: r for r in report.request_drift()}
    assert list(rows) == ["r0", "r2", "r3"] and rows["r0"]["samples"] == 2
    assert rows["r0"]["tokens"] == int(report.mask[:2].sum())
    diff = np.abs(report.train_logprobs[:2].astype(np.float64) - report.rollout_logprobs[:2])[report.mask[:2]]
    assert rows["r0"]["max_abs_logprob_diff"] == diff.max()
    assert rows["r0"]["mean_abs_logprob_diff"] == diff.mean()
    assert rows["r2"]["identical"] and not rows["r0"]["identical"]
    assert f"all {rows['r2']['tokens']} tokens identical" in report_html(report)


def test_markup_in_tokens_and_prompts_is_escaped():
    page = report_html(with_text(make_report(scale=0.3, rows=3, width=10)))
    assert "<script" not in page
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page
    assert "<mark>" in page and "Drift per request" in page


@needs_chromium
def test_the_page_shows_the_text_and_runs_no_markup_in_chromium(tmp_path):
    report = with_text(make_report(scale=0.3, rows=3, width=10))
    page = tmp_path / "report.html"
    page.write_text(report_html(report), encoding="utf-8")
    dom = chromium(page, tmp_path, "--dump-dom")
    assert dom.returncode == 0 and console_lines(dom) == []
    title = re.search(r"<title>(.*?)</title>", dom.stdout)[1]
    assert title.startswith("parity:") and "pwned" not in title  # the markup did not run
    assert dom.stdout.count("<script") == 0
    assert "Q0: &lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom.stdout  # shown as text
    assert re.search(r"<mark>(&lt;script&gt;document.title='pwned'&lt;/script&gt;| t\d+)</mark>", dom.stdout)
    # the negative control: the same page with the escaping undone runs the markup
    raw = tmp_path / "raw.html"
    unescaped = page.read_text().replace("&lt;script&gt;", "<script>").replace("&lt;/script&gt;", "</script>")
    raw.write_text(unescaped.replace("&#x27;", "'"), encoding="utf-8")
    assert "pwned" in re.search(r"<title>(.*?)</title>", chromium(raw, tmp_path, "--dump-dom").stdout)[1]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "tiny-llama-chat"
    shutil.copytree(resolve_model("tiny-llama"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(path)


@pytest.mark.slow
def test_compare_stores_decoded_text_and_a_stored_report_renders_without_torch(chat_model, tmp_path):
    chat = [[{"role": "user", "content": f"Say {SCRIPT}"}], [{"role": "user", "content": "hello"}]]
    report = parity.compare(chat_model, "hf", prompts=chat, sampling={"max_tokens": 6, "n": 2},
                            dtype="bfloat16")
    text = report.extras["text"]
    # the first PROMPT_TOKENS tokens (bytes, for the built-in tokenizer), cut with an ellipsis
    assert text["prompts"]["prompt-0"] == f"<|user|>Say {SCRIPT}\n<|assistant|>"[:PROMPT_TOKENS] + "…"
    assert text["prompts"]["prompt-1"] == "<|user|>hello\n<|assistant|>"
    assert set(text["tokens"]) == {str(t) for t in report.token_ids[report.mask]}
    assert all(v == bytes([int(k) - 3]).decode("utf-8", "replace") for k, v in text["tokens"].items()
               if 3 <= int(k) < 131)  # the byte tokenizer: token id = byte + 3
    worst = report.worst_tokens(1)[0]
    assert worst["prompt"].startswith("<|user|>") and worst["text"] == text["tokens"][str(worst["token_id"])]
    stored = tmp_path / "report.json"
    stored.write_text(report.to_json())
    probe = textwrap.dedent(f"""
        import sys
        from parity.render import report_html
        from parity.report.document import ParityReport
        page = report_html(ParityReport.from_json(open({str(stored)!r}).read()))
        assert "&lt;script&gt;" in page and "<script" not in page and "Drift per request" in page
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_prompt_starts_show_the_user_message_not_the_shared_system_prompt(chat_model):
    """Every prompt of a chat dataset opens with one system prompt; each row shows where its user
    message starts. Prompts without the template's system-to-user text (no system turn, token
    ids) still show their first tokens."""
    system = {"role": "system", "content": "You are a careful assistant. " * 8}
    chats = [[system, {"role": "user", "content": "What is 12*7?"}],
             [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "Name a prime."}],
             [{"role": "user", "content": "no system turn"}], [5, 6, 7]]
    ids = encode_prompts(chat_model, [(str(i), c) for i, c in enumerate(chats)])
    rollouts = [Rollout(f"p{i}", 0, p, (9,), (-1.0,), "length", "x", sampling=SamplingParams())
                for i, p in enumerate(ids)]
    prompts = report_text(chat_model, rollouts)["prompts"]
    assert prompts["p0"] == "What is 12*7?\n<|assistant|>"
    assert prompts["p1"] == "Name a prime.\n<|assistant|>"  # the last user message
    assert prompts["p2"] == "<|user|>no system turn\n<|assistant|>"
    assert not any(p.startswith("<|system|>You are") for p in prompts.values())
    # negative control: the first tokens, as every row showed before, are the system prompt
    assert "You are a careful" in prompt_start(tokenizer(chat_model), ids[0], None)


def test_no_tokenizer_means_no_text_not_an_error(tmp_path):
    path = tmp_path / "no-tokenizer"
    shutil.copytree(resolve_model("tiny-llama"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    rollout = Rollout("a", 0, (5, 6), (7,), (-1.0,), "length", "x", sampling=SamplingParams())
    assert report_text(str(path), [rollout]) is None
