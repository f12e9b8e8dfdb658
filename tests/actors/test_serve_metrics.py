"""``ReplicaMetrics`` (actors/serve.py): a replica's engine stats as Ray Serve metrics with model and
version tags, counters advanced by what happened since the last update (no Ray: a recording
stand-in for ``ray.serve.metrics``); the Prometheus text of /metrics carries the replica label."""

from types import SimpleNamespace

from serve_support import random_dflash_export

from specray.actors.serve import ReplicaMetrics
from specray.serving.engine import Engine
from specray.serving.openai_api import _prometheus
from specray.serving.sampling import SamplingParams


class _Metric:
    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.values = name, tuple(tag_keys), {}

    def _key(self, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        return tuple(sorted(tags.items()))

    def set(self, value, tags):
        self.values[self._key(tags)] = value

    def inc(self, value, tags):
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0) + value


FAKE = SimpleNamespace(Gauge=_Metric, Counter=_Metric)


def _value(metric, version):
    return metric.values.get((("model", "debug"), ("version", version)))


def test_engine_stats_become_tagged_serve_metrics(debug_target, tmp_path):
    engine = Engine(debug_target, None, max_batch=2, max_len=128, speculation="static")
    metrics = ReplicaMetrics(engine, "debug", metrics=FAKE)
    engine.generate(["Hi", "Hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    metrics.update()
    assert _value(metrics.counters["tokens_generated"], "ar") == 8
    assert _value(metrics.counters["requests_served"], "ar") == 2 and _value(metrics.gauges["tau"], "ar") == 1.0
    metrics.update()  # nothing new: the counters stay
    assert _value(metrics.counters["tokens_generated"], "ar") == 8

    assert engine.load_drafter(str(random_dflash_export(debug_target, tmp_path / "export")), 7).result(timeout=60) == 7
    engine.step()  # activates it: the next request runs on it
    engine.generate(["Hi"], SamplingParams(max_tokens=5, ignore_eos=True))
    metrics.update()
    assert _value(metrics.counters["tokens_generated"], "7") == 5 and _value(metrics.counters["tokens_generated"], "ar") == 8
    assert _value(metrics.gauges["version_tau"], "ar") == 1.0 and _value(metrics.gauges["version_tau"], "7") >= 1.0
    assert _value(metrics.gauges["tau"], "7") == engine.stats()["tau"]

    text = _prometheus(engine.stats(), "debug", replica="r-9")
    assert 'specray_tokens_generated_total{model="debug",replica="r-9"} 13' in text
    assert 'specray_version_tau{model="debug",replica="r-9",version="ar"} 1.0' in text
    assert 'specray_version_tau{model="debug",replica="r-9",version="7"}' in text
