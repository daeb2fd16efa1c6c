"""Logprobs and `n` at a real server process, through the official `openai` client (docs/serving.md, Logprobs,
Choices).

- `ar` and `self_spec` logprobs are the causal model's: equal to transformers' log-softmax of
  Qwen3_5MoeForCausalLM loaded with the embedded default's own weights (its Clover block tensors left out),
  token by token along the same continuation; `top_logprobs` sorted, the greedy token first; chat and
  completions shapes; streamed logprobs equal the non-streamed ones; low_confidence's are labelled "block".
- `n`: n choices indexed 0..n-1, choice i with seed + i (equal to a one-choice request with that seed), greedy
  choices equal, usage the prompt once and the choices' tokens summed; streamed chunks carry their index.
- Bad input: one 400 naming the field.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from clover_export.testing.server import start_server, stop_server

MODEL = "clover-tiny"
# neutral controls: the greedy token is the raw causal argmax (the mask token aside), as the reference takes it
PLAIN = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
CHAT = dict(PLAIN, chat_template_kwargs={"enable_thinking": False})
PROMPT = "sort: 5 3 9 1 7 2"
MESSAGES = [{"role": "user", "content": "reverse: a b c d"}]


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--log-level", "warning")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference_greedy(reference, ids: list[int], steps: int, k: int) -> list[tuple[int, float, list[int]]]:
    """Per step: (greedy token, its log-probability, the top k ids) of the log-softmax of the last row's logits
    of a cache-free forward over the whole sequence (the mask token never chosen)."""
    hf, _, mask = reference
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            lsm = torch.log_softmax(hf(input_ids=torch.tensor([seq])).logits[0, -1].double(), -1)
            choice = lsm.clone()
            choice[mask] = -float("inf")
            tok = int(choice.argmax())
            out.append((tok, float(lsm[tok]), lsm.topk(k).indices.tolist()))
            seq.append(tok)
    return out


def chat_ids(reference, messages) -> list[int]:
    _, tok, _ = reference
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("decoding", ["ar", "self_spec"])
def test_completion_logprobs_are_transformers_log_softmax(client, reference, decoding):
    _, tok, _ = reference
    ids = tok(PROMPT)["input_ids"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=3,
                                    extra_body=dict(PLAIN, decoding=decoding))
    lp = out.choices[0].logprobs
    want = reference_greedy(reference, ids, len(lp.tokens), 3)
    assert len(lp.tokens) == 8 and out.usage.completion_tokens == 8
    assert lp.tokens == [tok.decode([t]) for t, _, _ in want]
    assert lp.token_logprobs == pytest.approx([v for _, v, _ in want], abs=2e-4)
    for top, (t, _, top_ids) in zip(lp.top_logprobs, want):
        assert list(top) == list(dict.fromkeys(tok.decode([i]) for i in top_ids))  # the reference's top 3, in order
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(8)]
    assert out.model_extra["clover"]["logprobs"] == "causal"


@pytest.mark.parametrize("decoding", ["ar", "self_spec"])
def test_chat_logprobs_are_transformers_log_softmax_and_stream_the_same(client, reference, decoding):
    _, tok, _ = reference
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=4,
              extra_body=dict(CHAT, decoding=decoding))
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    want = reference_greedy(reference, chat_ids(reference, MESSAGES), len(content), 4)
    assert len(content) == out.usage.completion_tokens
    for got, (t, v, top_ids) in zip(content, want):
        assert got.token == tok.decode([t]) and got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(v, abs=2e-4)
        assert [x.token for x in got.top_logprobs] == [tok.decode([i]) for i in top_ids]
        assert got.top_logprobs[0].token == got.token  # greedy: the chosen token is the likeliest
        assert [x.logprob for x in got.top_logprobs] == sorted((x.logprob for x in got.top_logprobs), reverse=True)
    streamed = [item for chunk in client.chat.completions.create(stream=True, **kw)
                for choice in chunk.choices if choice.logprobs is not None for item in choice.logprobs.content]
    assert [(x.token, x.logprob, [y.logprob for y in x.top_logprobs]) for x in streamed] == \
        [(x.token, x.logprob, [y.logprob for y in x.top_logprobs]) for x in content]



@pytest.mark.parametrize("decoding", ["ar", "low_confidence"])
def test_echo_gives_the_prompt_tokens_transformers_log_softmax(client, reference, decoding):
    """`echo` with `logprobs`: the prompt's text and tokens first (the first token's logprob null), each prompt
    token's log-probability given the tokens before it, as lm-evaluation-harness reads them ([[ids]], max_tokens 1)."""
    hf, tok, _ = reference
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        lsm = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    out = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True,
                                    extra_body=dict(PLAIN, decoding=decoding))
    choice, n = out.choices[0], len(ids)
    lp = choice.logprobs
    assert choice.text.startswith(tok.decode(ids)) and len(lp.tokens) == n + 1 and out.usage.prompt_tokens == n
    assert lp.tokens[:n] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([float(lsm[i - 1, ids[i]]) for i in range(1, n)], rel=1e-4, abs=2e-4)
    assert [list(t) for t in lp.top_logprobs[1:n]] == [[tok.decode([int(lsm[i - 1].argmax())])] for i in range(1, n)]
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(n + 1)]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                      extra_body=dict(PLAIN, decoding=decoding))
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body=dict(PLAIN, decoding=decoding))
    assert plain.choices[0].text == PROMPT + alone.choices[0].text and plain.choices[0].logprobs is None
    # streamed: the prompt's chunk first, then the completion's; joined, the same text and logprobs
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True,
                                      extra_body=dict(PLAIN, decoding=decoding))
    chunks = [c for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                   logprobs=2, echo=True, stream=True,
                                                   extra_body=dict(PLAIN, decoding=decoding)) if c.choices]
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    joined = [(t, v) for c in chunks if c.choices[0].logprobs
              for t, v in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)]
    assert joined == list(zip(whole.choices[0].logprobs.tokens, whole.choices[0].logprobs.token_logprobs))

def test_low_confidence_logprobs_are_labelled_the_block_distribution(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body=dict(CHAT, decoding="low_confidence"))
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(x.logprob <= 0 for x in content)
    assert out.model_extra["clover"]["logprobs"] == "block"
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                           extra_body=dict(CHAT, decoding="low_confidence"))
    assert plain.choices[0].logprobs is None and "logprobs" not in plain.model_extra["clover"]
    assert plain.choices[0].message.content == out.choices[0].message.content  # asking changes no token


def texts(out) -> list[str]:
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.text for c in out.choices]


def test_n_choices_sample_with_seed_plus_i_and_sum_the_usage(client):
    kw = dict(model=MODEL, prompt="reverse: q w e r t y", max_tokens=12, temperature=2.0, logprobs=0,
              extra_body=dict(top_k=40, decoding="self_spec"))
    four = client.completions.create(n=4, seed=21, **kw)
    assert texts(four) == texts(client.completions.create(n=4, seed=21, **kw))  # reproducible
    singles = [client.completions.create(n=1, seed=21 + i, **kw) for i in range(4)]
    assert texts(four) == [s.choices[0].text for s in singles]  # choice i samples with seed + i
    assert len(set(texts(four))) > 1  # sampled: the choices differ
    assert four.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counted once
    assert four.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) \
        == sum(len(c.logprobs.tokens) for c in four.choices)
    greedy = client.completions.create(model=MODEL, prompt="sort: 4 2 8", max_tokens=8, temperature=0, n=2)
    assert texts(greedy)[0] == texts(greedy)[1]


def test_streamed_choices_carry_their_index_and_usage(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.5, seed=3, n=3,
              extra_body=dict(CHAT, decoding="ar"))
    whole = client.chat.completions.create(**kw)
    parts, usage, finished = {}, None, set()
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert finished == {0, 1, 2}
    assert [parts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"n": 9}, "n"),
    ("/v1/chat/completions", {"n": 0}, "n"),
])
def test_bad_logprobs_and_n_are_one_400_naming_the_field(server, path, body, param):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    r = httpx.post(server + path, json={**base, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def running_requests(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running")


def test_a_client_leaving_a_stream_of_choices_cancels_every_choice(server):
    """Four long choices streamed (seconds of steps each); the client reads a few chunks and leaves: every choice
    leaves the batch at once, long before they could have finished."""
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "n": 4, "stream": True, "decoding": "ar"}
    seen = set()
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                seen.add(json.loads(line[5:])["choices"][0]["index"])
            if len(seen) == 4:
                break
    left = time.monotonic()
    while running_requests(server) and time.monotonic() - left < 3:
        time.sleep(0.1)
    assert running_requests(server) == 0
