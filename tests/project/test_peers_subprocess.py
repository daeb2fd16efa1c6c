"""bench/peers.py's subprocess side, without llama.cpp or vLLM installed: the GGUF conversion labels a
tokenizer llama.cpp's converter does not list and keeps the label of one it does; a peer whose engine died
reports the engine's own error, not just that it died."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clover_export.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "bench" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    return load_script(PEERS)


def converter(tmp_path: Path, known: bool) -> Path:
    """A source tree shaped as llama.cpp's: `convert_hf_to_gguf.py` beside its `conversion` package, whose
    `TextModel.get_vocab_base_pre` refuses an unlisted tokenizer as llama.cpp's does. The script writes the
    label it got and its arguments."""
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    (tmp_path / "conversion" / "base.py").write_text(textwrap.dedent(f"""
        class TextModel:
            def get_vocab_base_pre(self, tokenizer):
                if {known!r}:
                    return "qwen35"
                raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")
    """))
    (tmp_path / "convert_hf_to_gguf.py").write_text(textwrap.dedent("""
        import sys
        from pathlib import Path
        from conversion.base import TextModel

        out = Path(sys.argv[sys.argv.index("--outfile") + 1])
        out.write_text(TextModel().get_vocab_base_pre(None) + " " + " ".join(sys.argv[1:]))
    """))
    return tmp_path / "convert_hf_to_gguf.py"


@pytest.mark.parametrize("known", [False, True], ids=["unlisted tokenizer", "listed tokenizer"])
def test_the_conversion_labels_only_a_tokenizer_the_converter_does_not_list(peers, tmp_path, known):
    (tmp_path / "src").mkdir()
    convert = converter(tmp_path / "src", known)
    out = tmp_path / "model.gguf"
    p = subprocess.run([sys.executable, str(PEERS), "--gguf-convert", str(convert), "/hf", "--outfile", str(out),
                        "--no-mtp"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    label = "qwen35" if known else peers.FALLBACK_PRE_TOKENIZER
    assert out.read_text() == f"{label} /hf --outfile {out} --no-mtp"


def test_a_dead_peer_engine_reports_the_engines_own_error(peers, tmp_path):
    """vLLM runs its engine in processes of its own: the worker sees only that it died; the reason is the first
    exception they log as an ERROR."""
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        print("(Worker pid=1) INFO 12-05 01:07:04 [gpu_model_runner.py:1] loading", flush=True)
        print("(Worker pid=1) ERROR 12-05 01:07:04 [multiproc_executor.py:1063] Traceback (most recent call last):")
        print("(Worker pid=1) ERROR 12-05 01:07:04 [multiproc_executor.py:1063] RuntimeError: Unexpected head "
              "dim size, 32", flush=True)
        print("(EngineCore pid=2) ERROR 12-05 01:07:04 [core.py:1512] RuntimeError: Worker failed with error "
              "'Unexpected head dim size, 32', please check the stack trace above for the root cause",
              file=sys.stderr)
        print('PEER {{"error": "vllm generate failed: EngineDeadError: EngineCore encountered an issue."}}')
    """))
    fake.chmod(0o755)
    answer = peers.peer_subprocess("vllm", str(fake), dict(threads=1), timeout=60)
    assert answer["error"] == ("vllm generate failed: EngineDeadError: EngineCore encountered an issue. "
                               "(the engine's: RuntimeError: Unexpected head dim size, 32)")
    fake.write_text(f"#!{sys.executable}\nprint('PEER {{\"1\": {{\"tokens\": [[1]], \"seconds\": 1.0}}}}')\n")
    assert peers.peer_subprocess("vllm", str(fake), dict(threads=1), timeout=60) == {"1": {"tokens": [[1]],
                                                                                         "seconds": 1.0}}


def test_a_peer_python_that_does_not_exist_is_one_line(peers, tmp_path):
    answer = peers.peer_subprocess("llama.cpp", str(tmp_path / "nope"), dict(threads=1), timeout=60)
    assert answer == {"error": f"llama.cpp: cannot run {tmp_path / 'nope'}: No such file or directory"}
