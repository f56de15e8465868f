"""Scale-out on Ray Serve: the application's wiring (always), and 2 replicas of a tiny model serving
greedy requests equal to ``model.generate`` (slow; skipped, with the reason, when Ray cannot
start here)."""
from __future__ import annotations

import json
import socket
import urllib.request

import pytest
import torch

serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'specgraph[ray]')")

from specgraph.serving.launch import ServeConfig  # noqa: E402
from specgraph.serving.ray_app import SpecgraphReplica, build_app, deployment  # noqa: E402
from tiny_models import tiny_causal_lm  # noqa: E402


def test_application_wiring():
    """Without starting Ray: N replicas of the replica class, bound to the config as a dict."""
    cfg = ServeConfig(model="some/folder", draft=None, max_batch_size=2, backend="eager")
    app = build_app(cfg, replicas=2)
    dep = deployment(2)
    assert dep.num_replicas == 2 and dep.name == "specgraph"
    assert issubclass(dep.func_or_class, SpecgraphReplica) and hasattr(dep.func_or_class, "__serve_build_asgi_app__")
    bound = app._bound_deployment
    assert bound.init_args[0]["model"] == "some/folder" and bound.init_args[0]["max_batch_size"] == 2
    assert ServeConfig(**bound.init_args[0]) == cfg  # a replica rebuilds the same config
    with pytest.raises(ValueError, match="replicas"):
        deployment(0)


def _tiny_folder(path, char_tokenizer):
    model = tiny_causal_lm(eos=2)  # the character tokenizer's </s>
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return model


@pytest.mark.slow
def test_two_replicas_serve_greedy_equal_to_generate(tmp_path, char_tokenizer):
    import ray

    folder = tmp_path / "tiny"
    model = _tiny_folder(folder, char_tokenizer)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - a sandbox without the resources Ray needs
        pytest.skip(f"Ray cannot start here: {type(e).__name__}: {e}")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ServeConfig(model=str(folder), draft="ngram", max_batch_size=2, max_seq_len=256, backend="eager",
                          progress=False, served_model_name="tiny")
        serve.run(build_app(cfg, replicas=2, cpus_per_replica=0), route_prefix="/", name="specgraph")
        status = serve.status().applications["specgraph"].deployments["specgraph"]
        assert sum(status.replica_states.values()) == 2
        prompts = ["abcabcabc", "hello hello", "xyz xyz", "the cat the cat", "1 2 1 2 1 2", "qq"]
        tok = char_tokenizer()
        for p in prompts:
            body = json.dumps({"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            got = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["token_ids"]
            ids = tok(p).input_ids
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
            assert got == want[: len(got)] and len(got) >= 1
    finally:
        serve.shutdown()
        ray.shutdown()
