"""Prompts from where users keep them: text, chat messages through the model's own chat template,
and dataset files (verl's RL layout, text and token-id columns) with limit and seed; errors name
the file, the row and the column."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import parity
from parity.core.errors import ConfigError, InputError
from parity.models import resolve_model
from parity.workload.cases import load_case
from parity.workload.prompts import Dataset, DatasetShortWarning, check_prompt, encode_prompts, tokenizer

#: a minimal chat template: each message as "<|role|>content\n", then the open assistant turn.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Say <script>alert(1)</script>"}],
]


def byte_ids(text: str) -> tuple[int, ...]:
    """The built-in tokenizer: one token per byte, id = byte + 3."""
    return tuple(b + 3 for b in text.encode())


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """tiny-llama with a chat template in its tokenizer config (the tiny checkpoints have none)."""
    path = tmp_path_factory.mktemp("chat") / "tiny-llama-chat"
    shutil.copytree(resolve_model("tiny-llama"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(path)


def verl_rows(chats):
    """Rows of verl's preprocessed RL dataset (gsm8k): chat messages in `prompt`, and its other columns."""
    return [{"data_source": "openai/gsm8k", "prompt": chat, "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"split": "train", "index": i}} for i, chat in enumerate(chats)]


def test_text_ids_and_chat_messages_encode_with_the_models_tokenizer(chat_model):
    items = [("a", "hi!"), ("b", [5, 6]), ("c", CHATS[1])]
    text, ids, chat = encode_prompts(chat_model, items)
    assert text == byte_ids("hi!") and ids == (5, 6)
    assert chat == byte_ids("<|system|>Be brief.\n<|user|>Name a prime.\n<|assistant|>")
    rendered = tokenizer(chat_model).apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
    assert chat == byte_ids(rendered)  # the model's own template, with the assistant turn opened


def test_chat_messages_without_a_template_are_a_clear_error():
    with pytest.raises(ConfigError, match=r"prompts\[0\]: chat messages need a chat template, and the "
                                          r"tokenizer of model 'tiny-llama' has none"):
        encode_prompts("tiny-llama", [("prompts[0]", CHATS[0])])


@pytest.mark.parametrize(("value", "match"), [
    ("", "the prompt text is empty"),
    ([], "a prompt is token ids, a string or a non-empty list of chat messages"),
    ([1, -2], "got list"),
    ([{"role": "user"}], "message 0 needs a string 'content', got None"),
    ([{"role": "user", "content": [{"type": "image"}]}], "message 0 needs a string 'content'"),
    (3.5, "got float 3.5"),
])
def test_malformed_prompts_name_where(value, match):
    with pytest.raises(InputError, match=match) as info:
        check_prompt(value, "data.jsonl:3, column 'prompt'")
    assert str(info.value).startswith("data.jsonl:3, column 'prompt': ")


def test_verl_parquet_chat_dataset_with_limit_and_seed(tmp_path, chat_model):
    path = tmp_path / "train.parquet"
    chats = [[{"role": "user", "content": f"question {i}"}] for i in range(20)]
    pq.write_table(pa.Table.from_pylist(verl_rows(chats)), str(path))
    rows = Dataset(path).rows()
    assert [p for _, p in rows] == chats and rows[3][0] == f"{path} row 4, column 'prompt'"
    assert [p for _, p in Dataset(path, limit=3).rows()] == chats[:3]
    drawn = [p for _, p in Dataset(path, limit=5, seed=1).rows()]
    assert drawn == [p for _, p in Dataset(path, limit=5, seed=1).rows()]  # seeded: reproducible
    assert drawn != chats[:5] and len(drawn) == 5 and all(p in chats for p in drawn)
    assert drawn == sorted(drawn, key=chats.index)  # kept in file order
    assert drawn != [p for _, p in Dataset(path, limit=5, seed=2).rows()]
    assert encode_prompts(chat_model, Dataset(path, limit=1).rows()) == [
        byte_ids("<|user|>question 0\n<|assistant|>")]


def test_jsonl_text_and_token_id_columns(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"question": "hi!", "ids": [7, 8]}, {"question": "yo", "ids": [9]}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    texts = encode_prompts("tiny-llama", Dataset(path, column="question").rows())
    assert texts == [byte_ids("hi!"), byte_ids("yo")]
    assert [p for _, p in Dataset(path, column="ids").rows()] == [[7, 8], [9]]


def test_dataset_errors_name_the_file_row_and_column(tmp_path):
    path = tmp_path / "bad.parquet"
    rows = verl_rows([CHATS[0], [{"role": "user", "content": None}], CHATS[0]])
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    with pytest.raises(InputError, match=r"bad\.parquet row 2, column 'prompt': message 0 needs a string "
                                         r"'content', got None"):
        Dataset(path).rows()
    assert len(Dataset(path, limit=1).rows()) == 1  # rows past the limit are not read
    with pytest.raises(InputError, match=r"bad\.parquet row 1: no column 'question' \(columns: \['ability'"):
        Dataset(path, column="question").rows()
    with pytest.raises(InputError, match="no such file"):
        Dataset(tmp_path / "missing.jsonl").rows()
    with pytest.raises(ConfigError, match="give limit with it"):
        Dataset(path, seed=3)
    with pytest.raises(ConfigError, match="limit must be an integer >= 1"):
        Dataset(path, limit=0)


@pytest.mark.parametrize("seed", [None, 4])
def test_a_limit_beyond_the_file_says_how_many_rows_it_used(tmp_path, seed, recwarn):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"prompt": [5 + i, 6]}) + "\n" for i in range(3)))
    said = r"small\.jsonl: limit 64 but the dataset holds 3 rows; all 3 are used"
    with pytest.warns(DatasetShortWarning, match=said):
        rows = Dataset(path, limit=64, seed=seed).rows()
    assert [p for _, p in rows] == [[5, 6], [6, 6], [7, 6]]
    Dataset(path, limit=3).rows()
    Dataset(path).rows()
    # a limit that fits says nothing
    assert not [w for w in recwarn if issubclass(w.category, DatasetShortWarning)]
    case = write_case(tmp_path, f'model = "tiny-llama"\n[prompts.dataset]\npath = "{path}"\nlimit = 10\n')
    with pytest.warns(DatasetShortWarning, match="limit 10 but the dataset holds 3 rows"):
        assert len(load_case(case).requests) == 3


def write_case(tmp_path, body, name="case.toml"):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_case_files_take_messages_and_datasets(tmp_path, chat_model):
    pq.write_table(pa.Table.from_pylist(verl_rows(CHATS)), str(tmp_path / "train.parquet"))
    case = load_case(write_case(tmp_path, f"""
model = "{chat_model}"
[prompts.dataset]
path = "train.parquet"
limit = 2
[sampling]
max_tokens = 4
"""))
    assert [r.prompt_ids for r in case.requests] == encode_prompts(chat_model, [("", c) for c in CHATS[:2]])
    messages = load_case(write_case(tmp_path, f"""
model = "{chat_model}"
[prompts]
messages = [[{{ role = "user", content = "What is 2 + 3?" }}]]
""", name="messages.toml"))
    assert messages.requests[0].prompt_ids == byte_ids("<|user|>What is 2 + 3?\n<|assistant|>")


@pytest.mark.parametrize(("body", "match"), [
    ('[prompts]\nmessages = [[{ role = "user", content = "hi" }]]\n',
     r"case\.toml: prompts\.messages\[0\]: chat messages need a chat template"),
    ('[prompts]\nmessages = [["hi"]]\n', r"case\.toml: prompts\.messages: must be a list of prompts"),
    ('[prompts.dataset]\npath = "train.parquet"\n',
     r"case\.toml: prompts\.dataset: .*train\.parquet row 2, column 'prompt': message 0 needs a string "
     r"'role'"),
    ('[prompts.dataset]\npath = "train.parquet"\nlimit = 1\nseed = -1\n',
     r"prompts\.dataset: dataset seed must be an integer >= 0"),
    ('[prompts.dataset]\npath = "train.parquet"\nrows = 1\n', r"prompts\.dataset\.rows: unknown field"),
])
def test_bad_case_prompts_name_the_file_and_field(tmp_path, body, match):
    rows = verl_rows([CHATS[0], [{"content": "no role"}]])
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    with pytest.raises((ConfigError, InputError), match=match):
        load_case(write_case(tmp_path, 'model = "tiny-llama"\n' + body))


@pytest.mark.slow
def test_compare_takes_chat_prompts_and_datasets(tmp_path, chat_model):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in verl_rows(CHATS)))
    report = parity.compare(chat_model, "reference", prompts=path, sampling={"max_tokens": 4})
    chats = parity.compare(chat_model, "reference", prompts=CHATS, sampling={"max_tokens": 4})
    np_equal = [a == b for a, b in zip(report.sequences, chats.sequences)]
    assert all(np_equal) and report.summary == chats.summary and report.passed
    assert [s["prompt_len"] for s in report.sequences] == [len(encode_prompts(chat_model, [("", c)])[0])
                                                          for c in CHATS]
    with pytest.raises(InputError, match=r"prompts\[1\]: message 0 needs a string 'role'"):
        parity.compare(chat_model, "reference", prompts=[CHATS[0], [{"content": "x"}]])
    with pytest.raises(ConfigError, match="chat messages need a chat template"):
        parity.compare("tiny-llama", "reference", prompts=CHATS)
