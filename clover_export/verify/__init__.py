"""Verification: an exported graph against the model it came from (STEP_GRAPH.md 1, 3, 4), shaped like
Polygraphy's comparator, running apart from judging.

- `scenario`: the steps played, their feeds and cache pools, `play` (a runner through the steps, pools carried);
- `runners`: adapters over the runtime's torch and ort backends, and `onnx.reference`;
- `compare`: tolerances, per-output errors, the report;
- `polygraphy_io`: `validate --save-io` in Polygraphy's JSON format;
- `validate`: `clover-export validate` (all of the above on one artifact);
- `slice`: the same at full width on one layer of each kind, for models too large to validate whole;
- `agreement`: an FP8 graph against the graph it was quantized from (top-1 agreement, logit error);
- `twins`: the FP8 graph TensorRT builds from is its measured twin up to dtype.
"""
