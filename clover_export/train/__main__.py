"""`python -m clover_export.train`: train the tiny Clover and write a model folder."""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

import click
import torch

from clover_export.cli import OneLineErrors
from clover_export.core.atomic import atomic_write
from clover_export.train.trainer import TrainSettings, new_model, save_trained, train


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


class _Command(OneLineErrors, click.Command):
    """Errors as in `clover-export` (cli.py): one line on stderr, exit status 1."""


@click.command(cls=_Command)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Model folder to write: new or empty, or an earlier training output with --force.")
@click.option("--steps", default=TrainSettings.steps, show_default=True, help="Optimizer steps.")
@click.option("--batch-size", default=TrainSettings.batch_size, show_default=True)
@click.option("--lr", default=TrainSettings.lr, show_default=True, help="Peak learning rate (AdamW).")
@click.option("--seed", default=TrainSettings.seed, show_default=True, help="Seeds init, data and masks.")
@click.option("--threads", default=1, show_default=True, help="torch CPU threads (results depend on it).")
@click.option("--eval-every", default=TrainSettings.eval_every, show_default=True,
              help="Score held-out prompts every N steps (0: never).")
@click.option("--eval-count", default=TrainSettings.eval_count, show_default=True)
@click.option(
    "--force", is_flag=True, help="Replace OUT when it holds an earlier training output (never any other folder)."
)
def main(out_dir, steps, batch_size, lr, seed, threads, eval_every, eval_count, force):
    """Train a tiny Clover for block diffusion on the synthetic tasks, CPU only.

    The objective and data are described in clover_export/train/trainer.py;
    the folder written is a complete model folder (BF16 safetensors, config,
    generation config, tokenizer) plus training.json with the training facts.
    """
    from clover_export.artifact.outdir import claim_dir
    from clover_export.tiny import tokenizer_assets as tok
    from clover_export.train import tasks
    from clover_export.train.data import ChatCodec
    from clover_export.train.evaluate import load_for_eval, score

    out_dir = claim_dir(out_dir, "train", command="train", force=force)  # before training, not after
    torch.set_num_threads(threads)
    settings = TrainSettings(steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                             eval_every=eval_every, eval_count=eval_count)
    cfg_dict = trained_config_dict()
    with tempfile.TemporaryDirectory() as tmp:
        tok.build_tokenizer_files(Path(tmp))
        codec = ChatCodec(tmp)
    model = new_model(cfg_dict, seed)
    heldout = tasks.heldout_examples()
    facts = train(model, codec, settings, heldout=heldout)
    facts = {"command": "python -m clover_export.train " + " ".join(sys.argv[1:]), **facts}
    facts.update({"threads": threads, "torch": torch.__version__, "machine": platform.machine(),
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "tasks": list(tasks.TASKS), "items": [tasks.MIN_ITEMS, tasks.MAX_ITEMS],
                  "heldout_seed": tasks.HELDOUT_SEED})
    claim_dir(out_dir, "train", command="train", force=force)  # OUT may have changed while training
    save_trained(model, cfg_dict, out_dir, facts, trained_generation_config())
    # final figures on the full held-out set, from the saved BF16 weights
    saved = load_for_eval(out_dir)
    final = {}
    for thinking in (False, True):
        sc = score(saved, codec, heldout, threshold=0.95, enable_thinking=thinking)
        final[f"thinking={thinking}"] = {"accuracy": sc.accuracy, "tokens_per_forward": round(sc.tokens_per_forward, 3)}
        click.echo(f"held-out ({len(heldout)}), thinking={thinking}, threshold 0.95: {sc.line()}")
    facts["heldout_at_0.95"] = final
    atomic_write(out_dir / "training.json", (json.dumps(facts, indent=2) + "\n").encode())


if __name__ == "__main__":
    main()
