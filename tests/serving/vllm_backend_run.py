"""The vLLM serving backend end to end on a loopback Ray cluster, run by
tests/serving/test_vllm_backend.py inside the vLLM venv (``make vllm-env``):

    .venv-vllm/bin/python tests/serving/vllm_backend_run.py REQUEST.json RESULT.json

REQUEST: ``{"root": dir, "registry": dir (version 1 published), "next": export (published as
version 2 under load), "corrupt": export (published as version 3 under load), "prompts": [[ids],
...], "max_tokens": n, "k": k}``. It checks ``serves_without_drafter`` on a good and a bad
configuration, serves ``backend: vllm`` replicas of the embedded target, then:

1. ``greedy``: each prompt's greedy completion text on version 1, and ``/metrics`` after them;
2. ``rollout``: clients send requests while version 2 is published; the replicas roll to it
   (``VersionRollout``); every answer's ``system_fingerprint``, the failures, then the prompts'
   greedy texts on version 2;
3. ``corrupt``: the same while version 3 is published: its rejection and what serves after it;
4. ``records``: the recorded traffic's lines;
5. ``autoscaling``: a second application with 1-2 replicas under 6 clients: the replicas seen
   running while loaded, and after.

RESULT holds what each phase saw (and ``error``, the one that failed); the test asserts on it.
"""

import glob
import json
import os
import sys
import threading
import time
import urllib.request

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from specray.actors.serve import start_serving  # noqa: E402
from specray.capture.target import load_target  # noqa: E402
from specray.pipeline.config import ServeJobConfig, load_config  # noqa: E402
from specray.serving.poller import rejection_scope  # noqa: E402
from specray.serving.registry import DrafterRegistry  # noqa: E402
from specray.serving.vllm_engine import serves_without_drafter  # noqa: E402

TARGET = "embedded:smollm2-135m-instruct"


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(1)
    return time.monotonic() - start


class Load:
    """``n`` clients sending short greedy completions until stopped; what they got back."""

    def __init__(self, client, model: str, n: int, max_tokens: int = 16):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.fingerprints, self.errors = [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                reply = self.client.completions.create(model=self.model, prompt=f"Count to {i + 3}:", temperature=0,
                                                       max_tokens=self.max_tokens)
                self.fingerprints.append(reply.system_fingerprint)
            except Exception as e:  # noqa: BLE001 - every failure is reported to the test
                self.errors.append(repr(e))

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)


def _greedy(client, model: str, prompts, max_tokens: int) -> list[str]:
    return [client.completions.create(model=model, prompt=p, temperature=0, max_tokens=max_tokens).choices[0].text
            for p in prompts]


def main(request_path: str, result_path: str) -> None:
    result = {}
    try:
        run(json.load(open(request_path)), result)
    except BaseException as e:  # the phases done are still reported; the test names the one that failed
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        json.dump(result, open(result_path, "w"))


def run(request: dict, result: dict) -> None:
    root, k, max_tokens, prompts = request["root"], request["k"], request["max_tokens"], request["prompts"]
    target = load_target(TARGET, weights="none")
    result["config_check"] = {  # what tells a drafter vLLM refuses from a configuration it refuses
        "good": serves_without_drafter(target, max_batch=4, max_len=1024, engine_args={"dtype": "float32"}),
        "too_long": serves_without_drafter(target, max_batch=4, max_len=10**7, engine_args={"dtype": "float32"})}
    ray.init(address="local", num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}})
    base = ["backend=vllm", f"target.name={TARGET}", "registry.poll_interval_s=1", "engine.max_batch=4",
            "engine.max_len=1024", f"engine.num_speculative_tokens={k}", "engine.speculation=static",
            "vllm.dtype=float32", "vllm.kv_cache_memory_gib=1", "vllm.enforce_eager=true", "replica.num_cpus=1"]
    registry = DrafterRegistry(request["registry"])
    scope = rejection_scope(target.target_fingerprint)
    cfg = load_config(ServeJobConfig, None, base + [
        "name=vllm-backend", f"registry.uri={request['registry']}", f"http.port={request['port']}",
        f"record.uri={root}/records", "record.flush_interval_s=1", f"output.run_dir={root}/serve"])
    handle = start_serving(cfg, timeout_s=900)
    try:
        client = openai.OpenAI(base_url=handle.base_url, api_key="unused", timeout=300, max_retries=0)
        result["greedy"] = {"texts": _greedy(client, handle.model, prompts, max_tokens),
                            "metrics": _get(f"{handle.url}/metrics"),
                            "prometheus": urllib.request.urlopen(f"{handle.url}/metrics?format=prometheus",
                                                                 timeout=30).read().decode()}
        stream = client.chat.completions.create(model=handle.model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, stream=True, temperature=0)
        result["stream"] = [c.choices[0].delta.content or "" for c in stream if c.choices]
        try:
            client.chat.completions.create(model=handle.model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8, temperature=0.7)
        except openai.BadRequestError as e:
            result["sampled"] = {"status": e.status_code, "message": e.message}

        with Load(client, handle.model, 2) as load:
            _wait(lambda: len(load.fingerprints) >= 2, 300, "answers under load")
            assert registry.publish(request["next"]) == 2
            took = _wait(lambda: _get(f"{handle.url}/health")["drafter_version"] == 2, 900, "the roll to version 2")
            seen = len(load.fingerprints)
            _wait(lambda: len(load.fingerprints) >= seen + 4, 300, "answers after the roll")
        result["rollout"] = {"seconds": took, "fingerprints": load.fingerprints, "errors": load.errors,
                             "texts": _greedy(client, handle.model, prompts, max_tokens),
                             "metrics": _get(f"{handle.url}/metrics")}

        with Load(client, handle.model, 2) as load:
            assert registry.publish(request["corrupt"]) == 3
            _wait(lambda: 3 in registry.rejected_for(scope), 900, "version 3's rejection")
            _wait(lambda: handle.rollout.version == 2 and serve.status().applications[cfg.name].status == "RUNNING",
                  300, "the application back on version 2")
            seen = len(load.fingerprints)
            _wait(lambda: len(load.fingerprints) >= seen + 4, 300, "answers after the rejection")
        result["corrupt"] = {"rejection": registry.rejected_for(scope)[3].reason, "fingerprints": load.fingerprints,
                             "errors": load.errors, "health": _get(f"{handle.url}/health"),
                             "rollout_error": handle.rollout.last_error,
                             "replicas": [r.get("version") for r in registry.replicas()]}
        time.sleep(3)  # the recorder's flush interval
    finally:
        handle.stop()
    result["records"] = [json.loads(line) for path in sorted(glob.glob(f"{root}/records/**/*.jsonl", recursive=True))
                         for line in open(path)]

    cfg = load_config(ServeJobConfig, None, base + [
        "name=vllm-autoscale", f"registry.uri={request['registry']}", f"http.port={request['port'] + 1}",
        "autoscaling.min_replicas=1", "autoscaling.max_replicas=2", "autoscaling.target_ongoing_requests=1",
        "autoscaling.upscale_delay_s=0", "autoscaling.downscale_delay_s=1", f"output.run_dir={root}/autoscale"])
    handle = start_serving(cfg, timeout_s=900)

    def running() -> int:
        app = serve.status().applications.get(cfg.name)
        return app.deployments["VllmReplica"].replica_states.get("RUNNING", 0) if app else 0

    try:
        client = openai.OpenAI(base_url=handle.base_url, api_key="unused", timeout=300, max_retries=0)
        with Load(client, handle.model, 6, max_tokens=48) as load:
            up = _wait(lambda: running() == 2, 900, "2 replicas under 6 clients")
            seen = len(load.fingerprints)
            _wait(lambda: len(load.fingerprints) >= seen + 6, 300, "answers with 2 replicas")
        down = _wait(lambda: running() == 1, 300, "back to 1 replica once idle")
        result["autoscaling"] = {"up_s": up, "down_s": down, "answered": len(load.fingerprints),
                                 "errors": load.errors}
    finally:
        handle.stop()
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
