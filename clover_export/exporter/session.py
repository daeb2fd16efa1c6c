"""An exported folder in ONNX Runtime: one session, with the weights of `map` mode fed from the checkpoint
and the fp32 graph of a bf16 checkpoint run through its lean casts (`lean_casts.py`)."""

from __future__ import annotations

from pathlib import Path

from clover_export.artifact.manifest import Artifact, read_weight_map
from clover_export.core.errors import CloverError


def ort_session(artifact: Artifact, providers: list | None = None, session_options=None,
                fed_weights: dict | None = None):
    """An `onnxruntime.InferenceSession` for the artifact's step graph.

    providers: as for ONNX Runtime (default: CUDA EP when available, then CPU).
    `map` weights mode: the graph's initializers point at files that are not in
    the folder; their bytes are memory-mapped from the checkpoint shards named
    in `weights.json` and handed to ONNX Runtime with
    `SessionOptions.add_external_initializers` (zero copy on CPU; the arrays
    stay referenced by the session as `session._clover_weights`).
    Feeds / fetches use `artifact.input_names` / `artifact.output_names`.
    An fp32 graph of a bf16 checkpoint runs as `lean_casts.lean_graph` rewrites it (in memory; the file is
    left as exported); `fed_weights` (name -> (ONNX elem type, shape): weight values of such a graph) become
    inputs that every run must feed (`lean_casts.feed_weights`).
    """
    import onnx
    import onnxruntime as ort

    from clover_export.exporter.lean_casts import feed_weights, lean_graph

    if providers is None:
        avail = ort.get_available_providers()
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]
    so = session_options or ort.SessionOptions()
    model = str(artifact.graph_path)
    proto = onnx.load(model, load_external_data=False)
    gone: list[str] = []
    if lean_graph(proto):  # fp32 graph of a bf16 checkpoint: the copy ONNX Runtime runs (lean_casts)
        gone = feed_weights(proto, fed_weights or {})
        model = proto.SerializeToString()
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(artifact.dir))
    elif fed_weights:
        raise CloverError("artifact", f"{artifact.graph_path}: no fp32 casts of stored weights to feed")
    del proto
    keep = []
    if artifact.weights_mode == "map":
        names, values, keep = _mapped_initializers(artifact, skip=set(gone))
        so.add_external_initializers(names, values)
    try:
        sess = ort.InferenceSession(model, sess_options=so, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types
        raise CloverError("artifact", f"{artifact.graph_path}: ONNX Runtime cannot load the graph ({e})") from None
    sess._clover_weights = keep
    return sess


def _mapped_initializers(art: Artifact, skip: set[str] = frozenset()):
    """(names, OrtValues, arrays to keep alive) for every weight-map entry that lives outside the folder."""
    import numpy as np
    from onnxruntime import OrtValue

    from clover_export.exporter.weights import onnx_elem_type, storage_dtype

    names, values, keep = [], [], []
    for name, e in read_weight_map(art).items():
        path = Path(e["file"])
        if not path.is_absolute() or name in skip:
            continue  # in-folder files (converted tensors) are read by ONNX Runtime itself
        if not path.exists():
            raise CloverError(
                "artifact",
                f"{art.weight_map_path}: tensor '{name}' lives in {path}, which is gone",
                "the map mode references the checkpoint in place; export again or use --weights link/copy",
            )
        arr = np.memmap(path, dtype=storage_dtype(e["dtype"]), mode="r", offset=e["offset"], shape=tuple(e["shape"]))
        values.append(OrtValue.ortvalue_from_numpy_with_onnx_type(arr, onnx_elem_type(e["dtype"])))
        names.append(name)
        keep.append(arr)
    return names, values, keep
