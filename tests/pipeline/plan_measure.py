"""Measure the peak memory of a real trainer-rank step, for ``test_plan.py`` (run as a subprocess).

    MALLOC_MMAP_THRESHOLD_=65536 python tests/pipeline/plan_measure.py '{"target": "debug", "algorithm": "eagle3",
        "micro_batch": 4, "seq_len": 256, "drafter": {}, "objective": {}}'

Prints one JSON line: ``peak_bytes`` — the process's peak resident memory while it builds a rank
(``trainer/assembly.py::build_rank``: the target's heads, the drafter, its optimizer) and runs two
optimizer steps on a synthetic batch of ``micro_batch`` × ``seq_len`` supervised tokens, above
its resident memory before the rank was built. On the CPU the heads are views of the mapped
safetensors file, resident once read: every page of them is read first. The peak of loading is
left out: the peak is reset (``/proc/self/clear_refs``) once the rank is built, so it is the
rank's resident state plus the steps' peak. glibc returns large
blocks to the system at once with a fixed mmap threshold (the environment above), so resident
memory follows the live tensors.
"""

import gc
import json
import sys
from pathlib import Path

import torch


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def peak() -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def capture(args: dict) -> dict:
    """Peak of a capture actor: the target loaded, then one batch of ``max_batch_tokens`` padded tokens
    (sequences of ``max_length``) captured into a file store, above the memory before the load."""
    import tempfile

    from specray.capture.contract import build_contract
    from specray.capture.data import RenderedSample
    from specray.capture.server import CaptureServer
    from specray.capture.store import FeatureStore
    from specray.capture.target import load_target

    def samples(n: int, length: int) -> list[RenderedSample]:  # one shorter: the batch is padded, as batches are
        generator = torch.Generator().manual_seed(0)
        lengths = [length] * (n - 1) + [length - 1]
        return [RenderedSample(f"s{i}", torch.randint(3, 200, (n_i,), generator=generator),
                               torch.ones(n_i, dtype=torch.bool), False) for i, n_i in enumerate(lengths)]

    before = rss()
    target = load_target(args["target"])
    for p in target.model.parameters():
        p.sum()  # resident once read (the weights may map the safetensors file)
    contract = build_contract(args["algorithm"], target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, dtype=args.get("dtype", "bfloat16"))
    with tempfile.TemporaryDirectory() as tmp:
        server = CaptureServer(target, contract, FeatureStore(Path(tmp).as_uri()))
        server.capture(samples(2, 16))  # first use of the forward's libraries
        gc.collect()
        length = args["max_length"]
        batch = samples(args["max_batch_tokens"] // length, length)
        Path("/proc/self/clear_refs").write_text("5")
        server.capture(batch)
        server.close()
    return {"peak_bytes": peak() - before}


def main(args: dict) -> dict:
    torch.set_num_threads(1)
    if args.get("stage") == "capture":
        return capture(args)
    from specray.capture.contract import build_contract
    from specray.capture.target import load_target
    from specray.pipeline.config import TrainJobConfig, load_config
    from specray.trainer.assembly import build_rank
    from specray.trainer.loader import TrainBatch
    from specray.trainer.vocab import DraftVocabulary

    algorithm = args["algorithm"]
    overrides = [f"target.name={args['target']}", "data.manifest=null", f"drafter.algorithm={algorithm}",
                 f"optim.micro_batch_size={args['micro_batch']}", "live_eval.enabled=false", "trainer.device=cpu",
                 *[f"drafter.{k}={json.dumps(v)}" for k, v in args.get("drafter", {}).items()],
                 *[f"objective.{k}={json.dumps(v)}" for k, v in args.get("objective", {}).items()]]
    cfg = load_config(TrainJobConfig, None, overrides)
    spec = cfg.train_spec()
    described = load_target(args["target"], weights="none")
    contract = build_contract(algorithm, target_fingerprint=described.target_fingerprint,
                              template_fingerprint=described.template_fingerprint,
                              num_target_layers=described.num_layers, hidden_size=described.hidden_size,
                              dtype="bfloat16")
    V_d = cfg.drafter.draft_vocab_size
    vocab = None if V_d is None else DraftVocabulary(list(range(V_d)), 1.0, 0, "synthetic")
    widths = contract.tensor_widths()

    def batch(B: int, T: int) -> TrainBatch:
        generator = torch.Generator().manual_seed(0)
        return TrainBatch(
            input_ids=torch.randint(3, described.vocab_size, (B, T), generator=generator),
            loss_mask=torch.ones(B, T, dtype=torch.bool), attention_mask=torch.ones(B, T, dtype=torch.bool),
            hidden_states=torch.randn(B, T, widths["hidden_states"][0], generator=generator),
            last_hidden_states=(torch.randn(B, T, described.hidden_size, generator=generator)
                                if "last_hidden_states" in widths else None),
            sample_ids=[f"s{i}" for i in range(B)], num_tokens=B * T)

    # A first rank and a tiny step: the libraries' first-use state (modules imported, oneDNN, the
    # autograd engine, AdamW) then belongs to the baseline, not to the measured rank.
    warm = build_rank(spec, contract, draft_vocab=vocab)
    warm.core.train_step([batch(1, 16)], 0)
    del warm
    gc.collect()
    before = rss()
    parts = build_rank(spec, contract, draft_vocab=vocab)
    for module in (parts.target.model.model.embed_tokens, parts.target.model.model.norm, parts.target.model.lm_head):
        module.weight.sum()  # read every page: on the CPU the heads map the safetensors file, resident once read
    step_batch = batch(args["micro_batch"], args["seq_len"])
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: the loading transient is left out
    for step in range(2):
        parts.core.train_step([step_batch], step)
    return {"peak_bytes": peak() - before, "resident_after": rss() - before}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
