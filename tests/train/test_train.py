"""Training the tiny Clover: objectives (block diffusion, next-token), determinism, evaluators, shipped default."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from clover_export.tiny import TRAINED_DIR, tiny_config_dict
from clover_export.tiny import tokenizer_assets as tok
from clover_export.train import tasks
from clover_export.train.data import ChatCodec, encode, make_batch, make_causal_batch
from clover_export.train.evaluate import (
    NO_CONTROLS,
    call_is_correct,
    generate,
    generate_ar,
    load_for_eval,
    percent_correct_by_items,
    score,
    score_ar,
    score_tools,
)
from clover_export.train.trainer import Batches, TrainSettings, ar_loss, block_loss, new_model, train

SMALL = dict(hidden_size=64, num_hidden_layers=4,
             layer_types=["linear_attention"] * 3 + ["full_attention"], block_size=24)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models step fastest on one thread, and the machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    with tempfile.TemporaryDirectory() as tmp:
        tok.build_tokenizer_files(Path(tmp))
        return ChatCodec(tmp)


def fixed_batch(codec, n=8, block=24):
    exs = tasks.heldout_examples(n)
    prompts, targets = encode(codec, exs, [i % 2 == 0 for i in range(n)], block)
    return make_batch(prompts, targets, codec.mask, codec.eot, torch.Generator().manual_seed(0)), prompts


def test_batch_layout(codec):
    batch, prompts = fixed_batch(codec)
    N = batch.targets.shape[1]
    C = batch.input_ids.shape[1] - N
    block = batch.input_ids[:, C:]
    assert batch.n_causal.tolist() == [len(p) for p in prompts]
    for i, p in enumerate(prompts):
        assert batch.input_ids[i, :len(p)].tolist() == p  # causal rows left-aligned
    assert ((block == codec.mask) == batch.masked).all()
    assert (block[~batch.masked] == batch.targets[~batch.masked]).all()
    counts = batch.masked.sum(1)
    assert counts.min() >= 1 and counts.max() <= N
    for row, ex in zip(batch.targets.tolist(), tasks.heldout_examples(len(prompts))):
        end = row.index(codec.im_end)
        assert set(row[end + 1:]) <= {codec.eot}
        assert codec.tokenizer.decode(row[:end]).strip().endswith(ex.answer)


def causal_batch(codec, n=8, block=24):
    exs = tasks.heldout_examples(n)
    thinking = [i % 2 == 0 for i in range(n)]
    prompts = [codec.prompt_ids(ex.prompt, t) for ex, t in zip(exs, thinking)]
    responses = [codec.response_ids(ex.answer, t) for ex, t in zip(exs, thinking)]
    return make_causal_batch(prompts, responses, codec.im_end, codec.mask, codec.eot, block), prompts, responses


def test_causal_batch_layout(codec):
    """Teacher forcing: prompt + response + <|im_end|> as causal rows, row t's target is token t + 1, the
    loss rows are exactly those predicting the response and its end token, the block is all masks."""
    batch, prompts, responses = causal_batch(codec)
    N = 24
    C = batch.input_ids.shape[1] - N
    assert (batch.input_ids[:, C:] == codec.mask).all()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = p + r + [codec.im_end]
        assert batch.n_causal[i] == len(seq) and batch.input_ids[i, :len(seq)].tolist() == seq
        assert batch.targets[i, :len(seq) - 1].tolist() == seq[1:]
        assert batch.targets[i][batch.scored[i]].tolist() == r + [codec.im_end]
        assert batch.scored[i].nonzero().flatten().tolist() == list(range(len(p) - 1, len(seq) - 1))


def test_ar_weight_leaves_the_block_batches_alone(codec):
    """The next-token batch takes no random draws: the block batches are those of ar_weight 0, which is the
    block-diffusion objective alone (no causal forward)."""
    held = {ex.prompt for ex in tasks.heldout_examples()}
    plain = Batches(codec, TrainSettings(batch_size=6, seed=5, ar_weight=0.0), 24, held)
    mixed = Batches(codec, TrainSettings(batch_size=6, seed=5), 24, held)
    for _ in range(3):
        a, b = plain.next(), mixed.next()
        assert a.causal is None and b.causal is not None
        for f in ("input_ids", "n_causal", "targets", "masked"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_tool_cases_offer_the_tasks_own_tool_fixed_by_the_prompt():
    """Every tool case offers its task's tool (alone or beside the other, either order), the same case for the
    same prompt, and the call's arguments are the prompt's list as written."""
    cases = [tasks.tool_case(ex) for ex in tasks.heldout_examples()]
    assert {c.tools for c in cases} == {("sort",), ("reverse",), ("sort", "reverse"), ("reverse", "sort")}
    for c in cases:
        assert c.example.task in c.tools and tasks.tool_case(c.example) == c
        assert c.arguments == {"digits": c.example.prompt.split(": ")[1]}
        assert [t["function"]["name"] for t in c.tool_specs()] == [tasks.TOOL_NAMES[t] for t in c.tools]


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_turns_are_what_the_template_renders(codec, thinking):
    """The tool task's prompts are transformers' rendering of the conversation (the independent reference:
    tools, then the call sent back, then the tool's result), and the call the model learns to write is the
    text the template writes for that call in an assistant turn."""
    transformers = pytest.importorskip("transformers")
    with tempfile.TemporaryDirectory() as tmp:
        tok.build_tokenizer_files(Path(tmp))
        reference = transformers.AutoTokenizer.from_pretrained(tmp)
    case = tasks.tool_case(tasks.make_example("reverse", [4, 0, 7]))
    (first, call), (second, answer) = codec.tool_turns(case, thinking)
    sent = {"id": "call_0", "type": "function",
            "function": {"name": "reverse_digits", "arguments": {"digits": "4 0 7"}}}
    user = {"role": "user", "content": "Reverse: 4 0 7"}
    turns = ([user], [user, {"role": "assistant", "content": "", "tool_calls": [sent]},
                      {"role": "tool", "content": "7 0 4"}])
    for ids, messages in zip((first, second), turns):
        want = reference.apply_chat_template(messages, tools=case.tool_specs(), tokenize=False,
                                             add_generation_prompt=True, enable_thinking=thinking)
        assert codec.decode(ids) == want
    assert call == ("<tool_call>\n<function=reverse_digits>\n<parameter=digits>\n4 0 7\n</parameter>\n"
                    "</function>\n</tool_call>")
    assert "<|im_start|>assistant\n" + call + "<|im_end|>" in codec.decode(second) and answer == "7 0 4"


def test_a_long_response_is_trained_block_by_block(codec):
    """block_at: block j's causal rows are the prompt and the response's first j blocks; the blocks' targets
    put together are the response, `<|im_end|>`, then `<|endoftext|>` to the last block's end."""
    N = 24
    case = tasks.tool_case(tasks.make_example("sort", [9, 1, 8, 2, 7, 3, 6, 4]))
    prompt, call = codec.tool_turns(case, True)[0]
    ids = codec.response_ids(call, True)
    assert len(ids) + 1 > 3 * N  # four blocks of 24
    joined = []
    for j in range(4):
        rows, target = codec.block_at(prompt, ids, N, j)
        assert rows == prompt + ids[:j * N] and len(target) == N
        joined += target
    assert joined == ids + [codec.im_end] + [codec.eot] * (4 * N - len(ids) - 1)
    with pytest.raises(ValueError, match="no block 4"):
        codec.block_at(prompt, ids, N, 4)


def test_tool_batches_hold_calls_and_answers(codec):
    """A tool batch: two calls to an answer, every block one of its response's blocks (rows = prompt plus
    the blocks before it), and its next-token batch the whole turns; the task batch is unchanged by it."""
    held = {ex.prompt for ex in tasks.heldout_examples()}
    s = TrainSettings(batch_size=4, tool_batch_size=6, seed=1)
    with_tools, alone = Batches(codec, s, 32, held), Batches(codec, TrainSettings(batch_size=4, seed=1), 32, held)
    a, b = with_tools.next(), alone.next()
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.masked, b.masked)
    batch = with_tools.next_tools()
    for i in range(6):
        whole = batch.causal.input_ids[i, :batch.causal.n_causal[i]].tolist()  # prompt + response + <|im_end|>
        prompt = whole[:batch.causal.scored[i].nonzero()[0].item() + 1]
        turn = codec.tokenizer.decode(whole[len(prompt):-1]).strip()
        if i % 3 != 2:
            assert turn.startswith("<tool_call>\n<function=") and turn.endswith("</tool_call>"), turn
        else:
            assert set(turn) <= set("0123456789 ") and turn, turn
        rows, target = batch.input_ids[i, :batch.n_causal[i]].tolist(), batch.targets[i].tolist()
        kept = target[:target.index(codec.im_end) + 1] if codec.im_end in target else target
        assert set(target[len(kept):]) <= {codec.eot}
        assert (rows + kept) == whole[:len(rows) + len(kept)] and (len(rows) - len(prompt)) % 32 == 0


def test_heldout_never_trained_on():
    held = {ex.prompt for ex in tasks.heldout_examples()}
    stream = tasks.training_stream(0, held)
    assert not any(next(stream).prompt in held for _ in range(5000))
    # and the exclusion is what keeps them apart: the raw sampler does produce held-out prompts
    raw = tasks.training_stream(0, set())
    assert any(next(raw).prompt in held for _ in range(50))


def every_prompt(n: int) -> set[str]:
    """All prompts of both tasks over lists of n digits (10 ** n each)."""
    lists = [" ".join(f"{v:0{n}d}") for v in range(10 ** n)]
    return {f"{task}: {listed}" for task in ("Sort", "Reverse") for listed in lists}


def test_every_length_is_trained_and_held_out():
    """Lists of 1 to 8 digits, each length both in the training stream and in the held-out set. Of the 10
    one-digit and 100 two-digit prompts per task, 3 and 15 are held out and all the others are trained on."""
    held = tasks.heldout_examples()
    by_length = {n: {ex.prompt for ex in held if ex.items == n} for n in range(1, 9)}
    assert all(len(ex.prompt.split(":")[1].split()) == ex.items for ex in held)
    assert [len(by_length[n]) for n in (1, 2)] == [2 * 3, 2 * 15]
    assert all(len(by_length[n]) >= 20 for n in range(3, 9)), {n: len(v) for n, v in by_length.items()}
    assert len(held) == len({ex.prompt for ex in held})
    stream = tasks.training_stream(0, {ex.prompt for ex in held})
    trained = {n: set() for n in range(1, 9)}
    for _ in range(40_000):
        ex = next(stream)
        trained[len(ex.prompt.split(":")[1].split())].add(ex.prompt)
    assert trained[1] == every_prompt(1) - by_length[1] and len(trained[1]) == 2 * 7
    assert trained[2] == every_prompt(2) - by_length[2] and len(trained[2]) == 2 * 85
    assert all(trained[n] for n in range(1, 9))
    # any prefix of the held-out set takes the lengths in turn: the first 48 (the training evals) cover all
    assert sorted(ex.items for ex in tasks.heldout_examples(48)) == sorted(list(range(1, 9)) * 6)


def test_stream_of_the_first_stages_is_reproducible():
    """`--min-items 3` is the stream the embedded default's first two stages were trained on (before lists
    of 1 and 2 digits were added): the same 3-8 digit held-out prompts (the first 200 distinct ones of
    their seed) and the same training prompts. The hashes were taken from that version of tasks.py."""
    import hashlib
    import itertools

    def digest(prompts):
        return hashlib.sha256("\n".join(prompts).encode()).hexdigest()

    held = tasks.heldout_examples()
    long = [ex.prompt for ex in held if ex.items >= 3]
    assert len(long) == 200
    assert digest(sorted(long)) == "8f89cdb21226485b88ca3c38dec9207a2361bd44a6c3bb516df369019c363de8"
    stream = tasks.training_stream(0, {ex.prompt for ex in held}, min_items=3)
    first = [ex.prompt for ex in itertools.islice(stream, 5000)]
    assert digest(first) == "f3f8ef73ae45e84cfad308563f467c665c9dbe92f700beb0e9be5a6dbecf4fbc"


def test_accuracy_per_length():
    """percent_correct_by_items: the share judged correct among the examples of each list length."""
    ex = [tasks.make_example("sort", d) for d in ([2, 1], [5, 2], [3], [9, 9, 1], [1, 2])]
    results = [(e, "", ok) for e, ok in zip(ex, [True, False, True, False, True])]
    assert percent_correct_by_items(results) == {1: 100.0, 2: pytest.approx(200 / 3), 3: 0.0}


def test_answers_checked_exactly():
    ex = tasks.make_example("sort", [7, 3, 9, 3])
    assert ex.answer == "3 3 7 9"
    assert tasks.make_example("reverse", [7, 3, 9]).answer == "9 3 7"
    assert tasks.is_correct(ex, "\n</think>\n\n3 3 7 9")
    assert tasks.is_correct(ex, "3 3 7 9 ")
    assert not tasks.is_correct(ex, "3 7 9")


def lowconf_step(logits, block, mask, threshold):
    """One step of the runtime's selector with the evaluator's settings (controls off)."""
    from clover_export.core.generation import GenerationSettings
    from clover_export.runtime.controls import RowParams, param_row
    from clover_export.runtime.selector import Controls, choose, fill

    p = RowParams(torch.tensor([param_row(GenerationSettings(threshold=threshold, **NO_CONTROLS))]))
    tok, conf = choose(logits, Controls.none(1, block.shape[1]), p, mask)
    return fill(block, tok, conf, p.threshold, mask)[0]


def test_lowconf_step_rule():
    """DECODING.md 2: fill every masked position with conf > threshold, else only the most confident."""
    mask, V = 5, 8
    logits = torch.full((1, 4, V), -20.0)
    logits[0, 0, 1] = 20.0  # confident
    logits[0, 1, 2], logits[0, 1, 3] = 0.5, 0.4  # unsure (p = 0.52)
    logits[0, 2, 3] = 20.0  # confident, but already filled below
    logits[0, 3, mask] = 50.0  # mask token must never be chosen
    logits[0, 3, 4], logits[0, 3, 6] = 1.0, 0.0  # p = 0.73 once the mask token is excluded
    block = torch.tensor([[mask, mask, 7, mask]])
    out = lowconf_step(logits, block, mask, threshold=0.9)
    assert out.tolist() == [[1, mask, 7, mask]]
    # nothing above the threshold: only the single most confident masked position (position 3 here)
    logits[0, 0, 1], logits[0, 0, 2] = 0.0, 0.0  # a tie: p = 0.5
    out = lowconf_step(logits, block, mask, threshold=0.9)
    assert out.tolist() == [[mask, mask, 7, 4]]


def test_evaluator_is_the_runtime_loop(tiny_dir):
    """train.evaluate decodes with the runtime: the same tokens and counts as Generator with the controls off."""
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.runtime.generator import Generator

    model, codec = load_for_eval(tiny_dir), ChatCodec(tiny_dir)
    exs = tasks.heldout_examples()[:3]
    prompts = [codec.prompt_ids(ex.prompt, False) for ex in exs]
    ends = [codec.im_end, codec.eot]
    outs = generate(model, prompts, 0.95, ends, max_new_tokens=40)
    gen = Generator(TorchBackend(model, tiny_dir), tiny_dir, max_slots=3, prefill_chunk=max(map(len, prompts)))
    res = gen.wait([gen.submit(prompt_ids=p, threshold=0.95, max_new_tokens=40, eos_token_id=ends, **NO_CONTROLS)
                    for p in prompts])
    assert [d.token_ids for d in outs] == [r.token_ids for r in res]
    assert [(d.steps, d.blocks) for d in outs] == [(r.denoise_steps, r.blocks) for r in res]
    assert [d.experts_per_block for d in outs] == pytest.approx([r.distinct_experts_per_block for r in res])


def loss_before_and_after_steps(model, batch, loss_fn, steps: int = 8) -> tuple[float, float]:
    """`loss_fn(model, batch)` before and after `steps` AdamW steps on it (lr 3e-3)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.no_grad():
        before = loss_fn(model, batch).item()
    for _ in range(steps):
        loss = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return before, loss_fn(model, batch).item()


def test_few_steps_reduce_loss_on_fixed_batch(codec):
    torch.manual_seed(0)
    model = new_model(tiny_config_dict(**SMALL), seed=0)
    batch, _ = fixed_batch(codec)
    before, after = loss_before_and_after_steps(model, batch, block_loss)
    assert after < 0.7 * before, (before, after)


def test_few_steps_reduce_ar_loss_on_fixed_batch(codec):
    """The next-token loss trains the causal rows: a few steps on it lower it (and no block rows are needed)."""
    torch.manual_seed(0)
    model = new_model(tiny_config_dict(**SMALL), seed=0)
    batch, _, _ = causal_batch(codec)
    before, after = loss_before_and_after_steps(model, batch, ar_loss)
    assert after < 0.7 * before, (before, after)


def test_train_lowers_ar_loss_only_with_ar_weight(codec):
    """train() adds ar_weight * ar_loss: from the same init and batches, the mixed run ends with a lower
    next-token loss on held-out prompts than the block-only run."""
    heldout = tasks.heldout_examples(8)
    batch, _, _ = causal_batch(codec)

    def run(weight):
        model = new_model(tiny_config_dict(**SMALL), seed=0)
        s = TrainSettings(steps=12, batch_size=8, warmup=1, lr=3e-3, seed=0, eval_every=0, ar_weight=weight)
        facts = train(model, codec, s, log=lambda *_: None, heldout=heldout)
        with torch.no_grad():
            return ar_loss(model, batch).item(), facts

    (plain, plain_facts), (mixed, mixed_facts) = run(0.0), run(1.0)
    assert mixed < 0.85 * plain, (plain, mixed)  # measured: 5.35 -> 3.93
    assert plain_facts["final_ar_loss_avg"] is None and mixed_facts["final_ar_loss_avg"] > 0
    (row,) = mixed_facts["loss_avg_every_25_steps"]["rows"]  # [step, block, ar] at the last step
    assert row[0] == 12 and row[2] == pytest.approx(mixed_facts["final_ar_loss_avg"], abs=1e-4)


def test_causal_rows_agree_with_the_step_and_the_greedy_loop(codec, tiny_dir):
    """ar_loss is the cross-entropy of the next-token logits the step graph returns (causal_logits at
    logit_rows) for the teacher-forced rows, and generate_ar's tokens are their argmax, one forward each."""
    from clover_export.core import names
    from clover_export.model.model import allocate_pools

    model = load_for_eval(tiny_dir)
    long = [ex for ex in tasks.heldout_examples() if ex.items >= 4][:3]
    prompts = [codec.prompt_ids(ex.prompt, False) for ex in long]
    outs = generate_ar(model, prompts, [codec.im_end, codec.eot], max_new_tokens=6, pad_id=codec.eot)
    assert all(len(o) == 6 for o in outs)  # the answers (4+ digits) are longer than 6 tokens
    batch = make_causal_batch(prompts, outs, codec.im_end, codec.mask, codec.eot, model.block_size)
    B, C = batch.targets.shape
    rows = torch.stack([r.nonzero().flatten() for r in batch.scored]).to(torch.int32)  # 6 + 1 (the end) each
    zeros = torch.zeros(B, dtype=torch.int32)
    inputs = {names.INPUT_IDS: batch.input_ids, names.N_CAUSAL: batch.n_causal, names.HAS_BLOCK: zeros,
              names.SLOT_IDS: torch.arange(B, dtype=torch.int32), names.PAST_LEN: zeros, names.LOGIT_ROWS: rows}
    with torch.no_grad():
        causal = model.step(inputs, allocate_pools(model.cfg, B, C)).causal_logits  # [B, 7, V]
        loss = ar_loss(model, batch)
    step_loss = torch.nn.functional.cross_entropy(causal.reshape(B * 7, -1), batch.targets[batch.scored])
    assert loss.item() == pytest.approx(step_loss.item(), rel=1e-5)
    causal[..., codec.mask] = float("-inf")
    assert causal[:, :6].argmax(-1).tolist() == outs


def test_training_is_deterministic_for_a_seed(codec):
    heldout = tasks.heldout_examples(8)

    def run(seed):
        model = new_model(tiny_config_dict(**SMALL), seed=seed)
        s = TrainSettings(steps=2, batch_size=4, warmup=1, seed=seed, eval_every=0)
        train(model, codec, s, log=lambda *_: None, heldout=heldout)
        return model.state_dict()

    a, b, c = run(3), run(3), run(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_batches_use_both_chat_modes(codec):
    s = TrainSettings(batch_size=16, seed=0)
    batch = Batches(codec, s, 32, set()).next()
    think = codec.tokenizer.token_to_id("</think>")
    heads = batch.input_ids[:, -32:]
    # thinking-mode targets start with the empty think section; the others start with the answer
    starts = {int((batch.targets[i] == think).any()) for i in range(16)}
    assert starts == {0, 1}
    assert heads.shape == (16, 32)


# --- the shipped embedded default ---------------------------------------------

def test_shipped_folder_matches_tiny_config():
    """tiny_config_dict() is the single source of the architecture: the shipped weights must follow it."""
    shipped = json.loads((TRAINED_DIR / "config.json").read_text())
    assert shipped == json.loads(json.dumps(tiny_config_dict()))
    gen = json.loads((TRAINED_DIR / "generation_config.json").read_text())
    assert gen["repetition_penalty"] == 1.0 and gen["presence_penalty"] == 0.0
    from clover_export.core.checkpoint import locate_tensors

    locs = locate_tensors(TRAINED_DIR)
    assert {loc.dtype for loc in locs.values()} == {"BF16"}
    assert sum(loc.length for loc in locs.values()) < 8 * 1024**2


def test_shipped_default_answers_heldout_prompts(tiny_dir):
    """The embedded default (as `resolve_model_dir('tiny')` gives it) solves held-out prompts it never saw,
    several tokens per forward (target: >= 3 at threshold 0.95)."""
    model = load_for_eval(tiny_dir)
    exs = tasks.heldout_examples(32)  # every length, 4 each
    for thinking in (False, True):
        sc = score(model, ChatCodec(tiny_dir), exs, threshold=0.95, enable_thinking=thinking)
        wrong = [(ex.prompt, text) for ex, text, ok in sc.results if not ok]
        assert not wrong, wrong
        assert sc.tokens_per_forward >= 3.0
    facts = json.loads((tiny_dir / "training.json").read_text())
    assert facts["heldout_at_0.95"]["thinking=False"]["accuracy"] >= 95


def test_shipped_default_answers_heldout_prompts_next_token(tiny_dir):
    """The embedded default also decodes autoregressively: greedy next-token decoding from the last causal
    row (generate_ar, no runtime) solves held-out prompts it never saw, in both chat modes."""
    model, codec = load_for_eval(tiny_dir), ChatCodec(tiny_dir)
    exs = tasks.heldout_examples(32)  # every length, 4 each
    for thinking in (False, True):
        sc = score_ar(model, codec, exs, enable_thinking=thinking)
        wrong = [(ex.prompt, text) for ex, text, ok in sc.results if not ok]
        assert not wrong, wrong
    facts = json.loads((tiny_dir / "training.json").read_text())
    assert facts["settings"]["ar_weight"] > 0
    for mode in ("thinking=False", "thinking=True"):
        assert facts["heldout_ar"][mode]["accuracy"] >= 95, mode


def test_shipped_default_calls_its_tool_and_answers_the_result(tiny_dir):
    """The embedded default's tool task on held-out prompts, every length, both chat modes, through the runtime
    loop at threshold 0.95: the call (read by the server's parser) and the answer after the tool's result are
    right, but for at most two of 16; training.json records the full held-out set's figures (>= 95 %)."""
    model, codec = load_for_eval(tiny_dir), ChatCodec(tiny_dir)
    exs = tasks.heldout_examples(16)  # every length, 2 each
    for thinking in (False, True):
        sc = score_tools(model, codec, exs, threshold=0.95, enable_thinking=thinking)
        wrong = [(c.example.prompt, c.tools, call, answer) for c, call, answer, a, b in sc.results if not (a and b)]
        assert len(wrong) <= 2, (thinking, wrong)  # ~95 % of the held-out set has both turns right
    facts = json.loads((tiny_dir / "training.json").read_text())
    assert facts["settings"]["tool_batch_size"] > 0
    for mode in ("thinking=False", "thinking=True"):
        tools = facts["heldout_tools_at_0.95"][mode]
        assert tools["call_accuracy"] >= 95 and tools["answer_accuracy"] >= 95, (mode, tools)


def test_a_call_is_judged_by_the_servers_parser():
    """call_is_correct: the task's tool with the prompt's list, alone; a wrong name, list or extra content fails."""
    case = tasks.tool_case(tasks.make_example("sort", [3, 1]))
    good = tasks.tool_call_text("sort_digits", {"digits": "3 1"})
    assert call_is_correct(case, good) and call_is_correct(case, "\n</think>\n\n" + good)
    for bad in (good.replace("sort_digits", "reverse_digits"), good.replace("3 1", "1 3"), "ok " + good,
                good + good, good.replace("</function>", "")[:-5]):
        assert not call_is_correct(case, bad), bad


SHORT_LISTS = [("sort", [2, 1]), ("sort", [5, 2]), ("reverse", [3]), ("sort", [7]), ("reverse", [4, 9]),
               ("sort", [0, 0]), ("reverse", [6, 1])]


@pytest.mark.parametrize("decoding", ["low_confidence", "ar"])
def test_shipped_default_answers_one_and_two_digit_lists(decoding):
    """Lists of one and two digits, through the runtime as `clover-export generate` runs it (the embedded
    default, its generation defaults): block diffusion and next-token decoding, both chat renderings. The
    expected answers are the task's reference (tasks.make_example)."""
    from clover_export.runtime import Generator

    gen = Generator.load(None, "torch", max_slots=len(SHORT_LISTS))
    examples = [tasks.make_example(task, digits) for task, digits in SHORT_LISTS]
    assert examples[0].answer == "1 2" and examples[2].answer == "3"
    for thinking in (False, True):
        res = gen.wait([gen.submit(ex.prompt, decoding=decoding, enable_thinking=thinking, max_new_tokens=32)
                        for ex in examples])
        wrong = [(ex.prompt, r.text) for ex, r in zip(examples, res) if not tasks.is_correct(ex, r.text)]
        assert not wrong, (thinking, wrong)


@pytest.mark.parametrize("args", [[], ["--decoding", "ar"]])
def test_cli_sorts_two_digits(args):
    """`clover-export generate --prompt "Sort: 2 1"` prints 1 2 (the default's first stages answered 1 2 2)."""
    from click.testing import CliRunner

    from clover_export.cli import main

    for ex in (tasks.make_example("sort", [2, 1]), tasks.make_example("sort", [5, 2])):
        r = CliRunner().invoke(main, ["generate", "--prompt", ex.prompt, "--json", *args])
        assert r.exit_code == 0, r.output
        text = json.loads(r.output.strip().splitlines()[-1])["text"]
        assert tasks.is_correct(ex, text), (ex.prompt, text)


def test_shipped_default_is_scored_per_length(tiny_dir):
    """training.json reports held-out accuracy per list length, 1 to 8 digits, for block diffusion and
    next-token decoding in both chat renderings, each length at 100 %; the held-out counts per length are
    those of tasks.heldout_examples."""
    from collections import Counter

    facts = json.loads((tiny_dir / "training.json").read_text())
    counts = Counter(ex.items for ex in tasks.heldout_examples())
    assert facts["items"] == [1, 8] and facts["heldout_items"] == {str(n): counts[n] for n in range(1, 9)}
    for table in ("heldout_at_0.95", "heldout_ar"):
        for mode in ("thinking=False", "thinking=True"):
            by_items = facts[table][mode]["accuracy_by_items"]
            assert by_items == {str(n): 100.0 for n in range(1, 9)}, (table, mode, by_items)


def test_train_reports_accuracy_per_length(codec):
    """train()'s evals carry accuracy per list length for both decoding modes, over every length of the
    held-out prompts scored (2 each here, so the overall accuracy is their mean)."""
    heldout = tasks.heldout_examples(16)
    model = new_model(tiny_config_dict(**SMALL), seed=0)
    s = TrainSettings(steps=1, batch_size=4, warmup=1, seed=0, eval_every=1, eval_count=16)
    (ev,) = train(model, codec, s, log=lambda *_: None, heldout=heldout)["evals"]
    for key, overall in (("accuracy_by_items", "accuracy"), ("ar_accuracy_by_items", "ar_accuracy")):
        assert list(ev[key]) == [str(n) for n in range(1, 9)], key
        assert sum(ev[key].values()) / 8 == pytest.approx(ev[overall], abs=0.01), key


def test_init_from_takes_a_trained_folder_of_the_shipped_architecture(tmp_path):
    from clover_export.core.errors import CloverError
    from clover_export.train.__main__ import initial_model

    model, earlier = initial_model(TRAINED_DIR, tiny_config_dict())
    assert earlier == json.loads((TRAINED_DIR / "training.json").read_text())
    shipped = load_for_eval(TRAINED_DIR).state_dict()
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(v, shipped[k]) for k, v in model.state_dict().items())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(tiny_config_dict(**SMALL)))
    with pytest.raises(CloverError, match="not the trained architecture"):
        initial_model(other, tiny_config_dict())


def test_tiny_version_names_the_shipped_weights():
    """ensure_tiny keeps its copy of the shipped folder in the user's cache under TINY_VERSION: other weights
    shipped under the same version would leave earlier installs on their old copy. Each version's weights."""
    import hashlib

    from clover_export.tiny import TINY_VERSION

    weights = {3: "70de262e51eb21142e37d31eafe8eb9e5b605b4000921e780c1771f7717def0d",  # lists of 3-8 digits
               4: "a60089d31a080a05a3682e1f4f8aefd70349bb64eb06fe8d3821229d96da2676",  # 1-8 digits
               5: "a60089d31a080a05a3682e1f4f8aefd70349bb64eb06fe8d3821229d96da2676",  # 4's, tool template
               6: "6e608fcea0c9f3703df0eb6ff85670ccbb75b692b6d3d91448367547098f1eeb"}  # the tool task
    shipped = (TRAINED_DIR / "model-00001-of-00001.safetensors").read_bytes()
    assert hashlib.sha256(shipped).hexdigest() == weights.get(TINY_VERSION), "bump TINY_VERSION with the weights"


def test_embedded_default_is_the_shipped_folder(tiny_dir):
    for name in ("model-00001-of-00001.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (tiny_dir / name).read_bytes() == (TRAINED_DIR / name).read_bytes(), name


def test_missing_shipped_weights_is_a_clear_error(tmp_path, monkeypatch):
    import clover_export.tiny as tiny
    from clover_export.core.errors import CloverError

    monkeypatch.setattr(tiny, "TRAINED_DIR", tmp_path / "nowhere")
    monkeypatch.setenv("CLOVER_EXPORT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CloverError, match="trained weights are missing"):
        tiny.ensure_tiny()


def test_a_copy_finished_first_by_another_process_is_kept(tmp_path, monkeypatch):
    """Test workers and servers started together each copy the embedded default into an empty cache: the copy
    that finishes second must give way (no error, no leftover temp folder), whatever the order."""
    import clover_export.core.atomic as atomic
    import clover_export.tiny as tiny

    monkeypatch.setenv("CLOVER_EXPORT_CACHE", str(tmp_path / "cache"))
    real_publish = atomic.publish_dir

    def other_process_finishes_first(tmp, final):
        shutil.copytree(TRAINED_DIR, final, ignore=shutil.ignore_patterns("__pycache__"))
        return real_publish(tmp, final)

    monkeypatch.setattr(atomic, "publish_dir", other_process_finishes_first)
    target = tiny.ensure_tiny()
    assert (target / "config.json").read_bytes() == (TRAINED_DIR / "config.json").read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_processes_copying_the_default_at_once_all_get_it(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "CLOVER_EXPORT_CACHE": str(tmp_path / "cache")}
    code = "from clover_export.tiny import ensure_tiny; print(ensure_tiny())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(6)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in results), [err for _, err, rc in results if rc]
    assert len({out for out, _, _ in results}) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(results[0][0].strip()).name]
