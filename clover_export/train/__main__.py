"""`python -m clover_export.train`: train the tiny Clover and write a model folder."""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from collections import Counter
from pathlib import Path

import click
import torch

from clover_export.cli import OneLineErrors
from clover_export.core.atomic import atomic_write
from clover_export.train.trainer import TrainSettings, by_items, new_model, save_trained, train


def trained_config_dict() -> dict:
    """The architecture trained and shipped: the embedded default's config (tiny_config_dict)."""
    from clover_export.tiny import tiny_config_dict

    return tiny_config_dict()


def trained_generation_config() -> dict:
    """The tiny generation config with the repetition controls off.

    DECODING.md's defaults (presence 0.9, repetition 1.05) push down every
    token already in the response; the task answers repeat digits and spaces
    by design, so the shipped folder sets both to neutral (1.0, 0.0).
    """
    from clover_export.tiny import generation_config_dict

    return {**generation_config_dict(), "repetition_penalty": 1.0, "presence_penalty": 0.0}


def initial_model(model_dir: Path, cfg_dict: dict):
    """(fp32 model holding a trained folder's weights, that folder's training.json or None) for --init-from.

    The folder must have the shipped architecture (its config.json equal to `cfg_dict`)."""
    from clover_export.core.errors import CloverError
    from clover_export.train.evaluate import load_for_eval

    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CloverError("train", f"--init-from {model_dir}: cannot read config.json ({e})") from None
    if cfg != json.loads(json.dumps(cfg_dict)):
        raise CloverError("train", f"--init-from {model_dir}: config.json is not the trained architecture",
                          "start from a folder written by `python -m clover_export.train`")
    facts = model_dir / "training.json"
    earlier = json.loads(facts.read_text()) if facts.is_file() else None
    return load_for_eval(model_dir), earlier  # fp32 parameters, trainable


def heldout_counts(heldout) -> dict[str, int]:
    """How many held-out prompts there are of each list length."""
    counts = Counter(ex.items for ex in heldout)
    return {str(n): counts[n] for n in sorted(counts)}


class _Command(OneLineErrors, click.Command):
    """Errors as in `clover-export` (cli.py): one line on stderr, exit status 1."""


@click.command(cls=_Command)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Model folder to write: new or empty, or an earlier training output with --force.")
@click.option("--steps", default=TrainSettings.steps, show_default=True, help="Optimizer steps.")
@click.option("--batch-size", default=TrainSettings.batch_size, show_default=True)
@click.option("--lr", default=TrainSettings.lr, show_default=True, help="Peak learning rate (AdamW).")
@click.option("--warmup", default=TrainSettings.warmup, show_default=True, help="Linear warmup steps.")
@click.option("--ar-weight", default=TrainSettings.ar_weight, show_default=True,
              help="Weight of the next-token loss on causal rows (0: block diffusion alone).")
@click.option("--init-from", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Start from this trained model folder's weights (same architecture) instead of a random init.")
@click.option("--min-items", default=TrainSettings.min_items, show_default=True,
              help="Shortest list the training stream draws (3: the stream of the embedded default's first stages).")
@click.option("--tool-batch-size", default=TrainSettings.tool_batch_size, show_default=True,
              help="Tool-task turns a step, in a batch of their own (0: no tool task; see train/tasks.py).")
@click.option("--seed", default=TrainSettings.seed, show_default=True, help="Seeds init, data and masks.")
@click.option("--threads", default=1, show_default=True, help="torch CPU threads (results depend on it).")
@click.option("--eval-every", default=TrainSettings.eval_every, show_default=True,
              help="Score held-out prompts every N steps (0: never).")
@click.option("--eval-count", default=TrainSettings.eval_count, show_default=True)
@click.option(
    "--force", is_flag=True, help="Replace OUT when it holds an earlier training output (never any other folder)."
)
def main(out_dir, steps, batch_size, lr, warmup, ar_weight, init_from, min_items, tool_batch_size, seed, threads,
         eval_every, eval_count, force):
    """Train a tiny Clover for block diffusion and next-token decoding on the synthetic tasks, CPU only.

    The objective and data are described in clover_export/train/trainer.py;
    the folder written is a complete model folder (BF16 safetensors, config,
    generation config, tokenizer) plus training.json with the training facts.
    """
    from clover_export.artifact.outdir import claim_dir
    from clover_export.tiny import tokenizer_assets as tok
    from clover_export.train import tasks
    from clover_export.train.data import ChatCodec
    from clover_export.train.evaluate import load_for_eval, score, score_ar, score_tools

    sources = [init_from] if init_from is not None else []
    out_dir = claim_dir(out_dir, "train", command="train", force=force,  # before training, not after
                        model_dirs=sources)
    torch.set_num_threads(threads)
    settings = TrainSettings(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, seed=seed,
                             eval_every=eval_every, eval_count=eval_count, ar_weight=ar_weight,
                             min_items=min_items, tool_batch_size=tool_batch_size)
    cfg_dict = trained_config_dict()
    with tempfile.TemporaryDirectory() as tmp:
        tok.build_tokenizer_files(Path(tmp))
        codec = ChatCodec(tmp)
    model, earlier = new_model(cfg_dict, seed), None
    if init_from is not None:
        model, earlier = initial_model(init_from, cfg_dict)
    heldout = tasks.heldout_examples()
    facts = train(model, codec, settings, heldout=heldout)
    facts = {"command": "python -m clover_export.train " + " ".join(sys.argv[1:]), **facts}
    if init_from is not None:
        facts["init_from"] = {"path": str(init_from), "training": earlier}
    facts.update({"threads": threads, "torch": torch.__version__, "machine": platform.machine(),
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "tasks": list(tasks.TASKS), "items": [min_items, tasks.MAX_ITEMS],
                  "heldout_seed": tasks.HELDOUT_SEED, "heldout_items": heldout_counts(heldout)})
    claim_dir(out_dir, "train", command="train", force=force, model_dirs=sources)  # OUT may have changed
    save_trained(model, cfg_dict, out_dir, facts, trained_generation_config())
    # final figures on the full held-out set, from the saved BF16 weights
    saved = load_for_eval(out_dir)
    final = {}
    for thinking in (False, True):
        sc = score(saved, codec, heldout, threshold=0.95, enable_thinking=thinking)
        final[f"thinking={thinking}"] = {"accuracy": sc.accuracy, "tokens_per_forward": round(sc.tokens_per_forward, 3),
                                         "accuracy_by_items": by_items(sc.accuracy_by_items)}
        click.echo(f"held-out ({len(heldout)}), thinking={thinking}, threshold 0.95: {sc.line()}")
    facts["heldout_at_0.95"] = final
    ar = {}
    for thinking in (False, True):
        sc = score_ar(saved, codec, heldout, enable_thinking=thinking)
        ar[f"thinking={thinking}"] = {"accuracy": sc.accuracy, "accuracy_by_items": by_items(sc.accuracy_by_items)}
        click.echo(f"held-out ({len(heldout)}), thinking={thinking}, next-token greedy: acc={sc.accuracy:.1f}%")
    facts["heldout_ar"] = ar
    tools = {}
    for thinking in (False, True):
        sc = score_tools(saved, codec, heldout, threshold=0.95, enable_thinking=thinking)
        tools[f"thinking={thinking}"] = {"call_accuracy": sc.call_accuracy, "answer_accuracy": sc.answer_accuracy,
                                         "accuracy": sc.accuracy, "tokens_per_forward": round(sc.tokens_per_forward, 3)}
        click.echo(f"held-out ({len(heldout)}), thinking={thinking}, threshold 0.95: {sc.line()}")
    facts["heldout_tools_at_0.95"] = tools
    atomic_write(out_dir / "training.json", (json.dumps(facts, indent=2) + "\n").encode())


if __name__ == "__main__":
    main()
