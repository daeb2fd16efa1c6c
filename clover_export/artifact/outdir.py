"""Where commands write: an OUT folder (or file) is replaced only when it is our own earlier output of
the same kind: a user's files are never lost. One policy for `export`, `build`, `train`, `validate --save-io`
and the FP8 rewrite:

  - OUT missing, or an empty folder: written.
  - OUT holds an earlier artifact of the same kind (recognised by its marker: an export's manifest.json,
    a build's build.json, a trained folder's training.json, Polygraphy's RunResults JSON): replaced only
    with --force (`build` reuses its own folder without --force: re-running it is incremental).
  - anything else non-empty (a user's folder, another kind of artifact, a file where a folder goes):
    refused with the first few entries named; --force never overrides this.
  - the working directory, the home folder, `/`, their ancestors, and the model folder (or anything
    around or inside it) are never OUT, --force or not.

Writes themselves go to a temporary sibling and are renamed into place (`clover_export.core.atomic`);
`commit_dir` re-checks OUT just before that rename.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from clover_export.core.atomic import replace_dir
from clover_export.core.errors import CloverError

SHOWN_ENTRIES = 4  # entries of a refused folder named in the error


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _manifest(folder: Path) -> dict | None:
    from clover_export.artifact.manifest import FORMAT, MANIFEST

    m = _json(folder / MANIFEST)
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


def _is_export(folder: Path) -> bool:
    m = _manifest(folder)
    return m is not None and "quantization" not in m


def _is_fp8(folder: Path) -> bool:
    m = _manifest(folder)
    return m is not None and "quantization" in m


def _is_build(folder: Path) -> bool:
    from clover_export.artifact.manifest import BUILD_FILE

    b = _json(folder / BUILD_FILE)
    return isinstance(b, dict) and isinstance(b.get("stages"), dict)


def _is_trained(folder: Path) -> bool:
    t = _json(folder / "training.json")
    return isinstance(t, dict) and "command" in t and (folder / "config.json").is_file()


def _is_polygraphy_io(path: Path) -> bool:
    """`validate --save-io`'s pair: Polygraphy RunResults, and its input data list (a list of dicts)."""
    r = _json(path)
    if isinstance(r, list):
        return all(isinstance(x, dict) for x in r)
    return isinstance(r, dict) and r.get("polygraphy_class") == "RunResults"


@dataclass(frozen=True)
class Kind:
    what: str  # "an export (manifest.json)": said in errors
    recognise: Callable[[Path], bool]
    reuse: bool = False  # an earlier one is written into without --force (incremental builds)


KINDS = {
    "export": Kind("an export (manifest.json of clover-export)", _is_export),
    "fp8": Kind("an FP8 graph (manifest.json with a quantization entry)", _is_fp8),
    "build": Kind("a build folder (build.json)", _is_build, reuse=True),
    "train": Kind("a trained model folder (training.json)", _is_trained),
    "validate-io": Kind("a Polygraphy JSON file of `validate --save-io`", _is_polygraphy_io),
}


def _entries(folder: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    shown = ", ".join(names[:SHOWN_ENTRIES])
    return shown + (f", ... ({len(names)} entries)" if len(names) > SHOWN_ENTRIES else "")


def _protected(out: Path, model_dirs: Iterable[Path]) -> str | None:
    """Why OUT may never be replaced, or None. Paths are compared resolved (symlinks, `..`)."""
    o = out.resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    for p, name in ((cwd, "the working directory"), (home, "the home folder")):
        if o == p or o in p.parents:
            return f"is {name}" if o == p else f"contains {name} ({p})"
    if o == Path(o.anchor):
        return "is the filesystem root"
    for m in model_dirs:
        m = Path(m).resolve()
        if o == m:
            return f"is the model folder {m}"
        if o in m.parents:
            return f"contains the model folder {m}"
        if m in o.parents:
            return f"lies inside the model folder {m}"
    return None


def _require_writable(out: Path, command: str, option: str) -> None:
    """OUT's nearest existing ancestor takes a new folder (probed: permission bits say nothing to root)."""
    parent = next(p for p in out.parents if p.exists())
    if not parent.is_dir():
        raise CloverError(command, f"{option} {out}: {parent} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".clover-probe-", dir=parent))
    except OSError as e:
        raise CloverError(command, f"{option} {out}: cannot create a folder in {parent} ({e.strerror or e})",
                          "choose a writable location") from None


def claim_dir(out: str | Path, kind: str, *, command: str, force: bool = False, option: str = "--out",
              model_dirs: Iterable[Path] = ()) -> Path:
    """Check that folder OUT may be written as `kind` (see the module docstring); returns it absolute.

    Call it before any long work, so that a refusal costs nothing."""
    k = KINDS[kind]
    out = Path(out).absolute()
    why = _protected(out, model_dirs)
    if why:
        raise CloverError(command, f"{option} {out} {why}; it is never written over",
                          "choose a new folder for the output")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CloverError(command, f"{option} {out} is a {'link' if out.is_symlink() else 'file'}, not a folder",
                          "choose a new folder for the output")
    if not out.exists():
        _require_writable(out, command, option)
        return out
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise CloverError(command, f"{option} {out}: cannot read the folder ({e.strerror or e})") from None
    if empty:
        return out
    if k.recognise(out):
        if force or k.reuse:
            return out
        raise CloverError(command, f"{option} {out} holds an earlier output: {k.what}",
                          "pass --force to replace it, or choose a new folder")
    raise CloverError(command, f"{option} {out} is not empty and is not {k.what}; it holds {_entries(out)}",
                      "choose a new or empty folder; --force only replaces an earlier output of this command")


def claim_file(path: str | Path, kind: str, *, command: str, force: bool = False, option: str,
               model_dirs: Iterable[Path] = ()) -> Path:
    """The same policy for a file OUT: a missing file, or our earlier file of `kind` with --force."""
    k = KINDS[kind]
    path = Path(path).absolute()
    why = _protected(path, model_dirs)
    if why:
        raise CloverError(command, f"{option} {path} {why}; it is never written over")
    if not path.parent.is_dir():
        raise CloverError(command, f"{option} {path}: folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise CloverError(command, f"{option} {path}: folder {path.parent} is not writable")
    if path.is_dir():
        raise CloverError(command, f"{option} {path} is a folder, not a file", "name a file")
    if not path.exists() and not path.is_symlink():
        return path
    if k.recognise(path) and not path.is_symlink():
        if force:
            return path
        raise CloverError(command, f"{option} {path} exists: {k.what} from an earlier run",
                          "pass --force to replace it, or choose a new file name")
    raise CloverError(command, f"{option} {path} exists and is not {k.what}",
                      "choose a new file name; --force only replaces an earlier output of this command")


def commit_dir(tmp: Path, out: Path, kind: str, *, command: str, force: bool = False, option: str = "--out",
               model_dirs: Iterable[Path] = ()) -> None:
    """Re-check OUT (it may have changed during the work), then rename the finished `tmp` into place."""
    claim_dir(out, kind, command=command, force=force, option=option, model_dirs=model_dirs)
    replace_dir(tmp, out)
