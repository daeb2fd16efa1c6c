"""lm-evaluation-harness against a real server process, on a task the repository ships
(tests/serve/lm_eval_sort.jsonl: sort or reverse a few digits, three choices each; docs/serving.md, Echo).

- `local-completions`, multiple choice: each choice's log-likelihood comes from `echo` + `logprobs`, and
  equals the independent reference's (transformers' log-softmax of Qwen3_5MoeForCausalLM on the same
  weights, the continuation tokenised as the harness does);
- `local-completions` and `local-chat-completions`, generate_until: each answer equals the one the official
  `openai` client gets for the same prompt, stop strings and limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from clover_export.testing.server import start_server, stop_server

MODEL = "clover-tiny"
DATA = Path(__file__).with_name("lm_eval_sort.jsonl")
# the chat template's turn, thinking closed: the continuation is the answer itself
CHAT_TURN = "<|im_start|>user\n{{question}}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
TASKS = {
    "clover_sort_choice": {"output_type": "multiple_choice", "doc_to_text": CHAT_TURN, "target_delimiter": "",
                           "doc_to_choice": "{{choices}}", "doc_to_target": "answer",
                           "metric_list": [{"metric": "acc"}]},
    "clover_sort_until": {"output_type": "generate_until", "doc_to_text": CHAT_TURN, "doc_to_target": "target",
                          "generation_kwargs": {"until": ["<|im_end|>", "\n"], "max_gen_toks": 12},
                          "metric_list": [{"metric": "exact_match"}]},
    "clover_sort_chat": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "target",
                         "generation_kwargs": {"until": ["\n\n\n"], "max_gen_toks": 24},
                         "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory, monkeypatch_module):
    """lm_eval and a TaskManager holding the three tasks (YAML written beside nothing but the shipped JSONL)."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch_module.setenv(name, "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, spec in TASKS.items():
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA)}},
                  "test_split": "test", **spec}
        (folder / f"{name}.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
    return lm_eval, TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--log-level", "warning")
    yield url
    stop_server(proc)


def evaluate(harness, model: str, url: str, tiny_dir, tasks: list[str], **kw) -> dict:
    lm_eval, manager = harness
    args = {"model": MODEL, "base_url": url, "tokenizer": str(tiny_dir), "num_concurrent": 1, "max_retries": 1}
    return lm_eval.simple_evaluate(model=model, model_args={**args, **kw.pop("model_args", {})}, tasks=tasks,
                                   task_manager=manager, log_samples=True, batch_size=1, **kw)


def reference_loglikelihood(reference, context: str, continuation: str) -> float:
    """The harness's split (trailing whitespace of the context goes to the continuation; the continuation's
    tokens are the whole's after the context's), scored by transformers."""
    hf, tok, _ = reference
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tok(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        lsm = torch.log_softmax(hf(input_ids=torch.tensor([whole])).logits[0].double(), -1)
    return sum(float(lsm[i - 1, whole[i]]) for i in range(n, len(whole)))


def test_multiple_choice_loglikelihoods_are_transformers(harness, server, tiny_dir, reference):
    out = evaluate(harness, "local-completions", server + "/v1/completions", tiny_dir, ["clover_sort_choice"])
    samples = out["samples"]["clover_sort_choice"]
    assert len(samples) == 8
    for s in samples:
        context = CHAT_TURN.replace("{{question}}", s["doc"]["question"])
        got = [r[0][0] for r in s["resps"]]
        want = [reference_loglikelihood(reference, context, c) for c in s["doc"]["choices"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-3), s["doc"]
    # the default was trained on these tasks: its likeliest choice is the right one
    assert out["results"]["clover_sort_choice"]["acc,none"] >= 0.75


def test_generate_until_answers_are_the_servers(harness, server, tiny_dir):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = evaluate(harness, "local-completions", server + "/v1/completions", tiny_dir, ["clover_sort_until"])
    for s in out["samples"]["clover_sort_until"]:
        prompt = CHAT_TURN.replace("{{question}}", s["doc"]["question"])
        direct = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           stop=["<|im_end|>", "\n"], seed=1234)
        assert s["resps"][0][0] == direct.choices[0].text, s["doc"]
    chat = evaluate(harness, "local-chat-completions", server + "/v1/chat/completions", tiny_dir, ["clover_sort_chat"],
                    apply_chat_template=True, model_args={"tokenized_requests": False})
    for s in chat["samples"]["clover_sort_chat"]:
        messages = [{"role": "user", "content": s["doc"]["question"]}]
        direct = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                stop=["\n\n\n"], seed=1234)
        assert s["resps"][0][0] == direct.choices[0].message.content, s["doc"]
    # the default answers these tasks: the harness scores them right
    assert out["results"]["clover_sort_until"]["exact_match,none"] >= 0.75
    assert chat["results"]["clover_sort_chat"]["exact_match,none"] >= 0.75
