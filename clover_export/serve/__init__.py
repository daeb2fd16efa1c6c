"""`clover-export serve`: an OpenAI-compatible HTTP server on the runtime (SERVING.md).

Layout (the API/engine split of vLLM's and SGLang's servers):
- `protocol.py`: the OpenAI request schema and error bodies (pydantic).
- `adapter.py`: the one place OpenAI parameters become `Generator.submit`
  arguments, and runtime results become OpenAI responses.
- `engine.py`: one batch-loop thread per process owning the `Generator`; HTTP
  requests join its continuous batch.
- `doors/`: the other front doors (Anthropic Messages, OpenAI Responses,
  /tokenize and /detokenize), one module each, mapped onto the chat path.
- `metrics.py`: Prometheus figures (`metrics_vllm.py`: vLLM's names beside them); `app.py`: the FastAPI app; `cli.py`:
  the `serve` command; `ray_app.py` (+ `ray_serve.yaml`): Ray Serve replicas.
"""
