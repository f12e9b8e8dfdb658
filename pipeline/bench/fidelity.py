"""Train→serve fidelity: where a drafter's teacher-forced accuracy and its served acceptance part.

    specray bench fidelity EXPORT --dataset mtbench --num-prompts 16 --max-tokens 64 \\
        [--heldout MANIFEST] [--json FILE]

Under greedy decoding the first draft of a served round and the teacher-forced position-1
prediction at the same anchor, over the same context, answer one question: is the drafter's
token the target's next token? So on the target's own greedy answers the two must agree, and
what separates the training metric from served acceptance decomposes into named parts:

| row | what | differs from the row above by |
|---|---|---|
| ``live`` | the serving engine, batch 1, greedy, every round verifies the worker's largest chain | – |
| ``tf_live_fp32`` | teacher-forced at the anchors the live rounds used, features in fp32 | a train/serve mismatch (context rows, positions, template): must be 0 up to float rounding |
| ``tf_live_<dtype>`` | the same with features rounded to the capture dtype (what training reads) | feature dtype |
| ``tf_all_<dtype>`` | every answer position an anchor (what training metrics average over) | anchor selection: a round starts where the previous one stopped |
| ``heldout`` | the held-out manifest's own prompts and answers (``--heldout``) | data shift (prompts, answer style) |

Features are the capture path's (``capture/server.py``'s decoder-layer hooks on the HF model) over
the exact token ids served: the prompt as the engine encoded it and the answer as it was
generated (no re-tokenisation). ``template_equal`` counts the answers whose rendering by the
capture's chat renderer (the text of prompt and answer) gives those same ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from specray.capture.contract import STORAGE_DTYPES, get_contract_spec
from specray.capture.data import ChatRenderer, Conversation, load_conversations
from specray.capture.server import decoder_layer_outputs
from specray.capture.target import Target
from specray.drafters.format import load_drafter, read_drafter_config
from specray.serving.engine import Engine
from specray.serving.live_eval import KV_SLACK
from specray.serving.requests import encode_prompt
from specray.serving.sampling import SamplingParams
from specray.trainer.evaluate import evaluate_batches
from specray.trainer.loader import TrainBatch
from specray.trainer.strategies import get_strategy


@dataclass
class Trace:
    """One greedy generation: the ids served and, per speculative round, its anchor and acceptance."""

    prompt_ids: list[int]
    output_ids: list[int]
    anchors: list[int] = field(default_factory=list)  # absolute position of each round's anchor token
    accepted: list[int] = field(default_factory=list)  # r of each round (drafts accepted, before any stop)
    num_drafts: list[int] = field(default_factory=list)  # drafts each round verified


class _TracingWorker:
    """The worker protocol, forwarded; records where each speculative round starts and what it accepts."""

    def __init__(self, worker):
        self._worker = worker
        self.traces: dict[int, Trace] = {}  # by slot, from prefill
        self._emitted: dict[int, int] = {}

    def __getattr__(self, name: str):
        return getattr(self._worker, name)

    def prefill(self, slots, prompts, *args, **kwargs):
        logits = self._worker.prefill(slots, prompts, *args, **kwargs)
        for slot, prompt in zip(slots, prompts):
            self.traces[slot] = Trace(list(prompt), [])
            self._emitted[slot] = 1  # the engine samples the first token from the prefill's logits
        return logits

    def step(self, slots, anchors, params, generators, size, *args, **kwargs):
        out = self._worker.step(slots, anchors, params, generators, size, *args, **kwargs)
        for b, slot in enumerate(slots):
            trace = self.traces[slot]
            if out.speculative and out.num_drafts[b] > 0:
                trace.anchors.append(len(trace.prompt_ids) + self._emitted[slot] - 1)
                trace.accepted.append(out.accepted[b])
                trace.num_drafts.append(out.num_drafts[b])
            self._emitted[slot] += len(out.tokens[b])
        return out


def trace_live(engine: Engine, prompts: list[list[int]], *, max_tokens: int) -> list[Trace]:
    """Greedy generations of ``prompts`` (token ids) one at a time on ``engine`` (one slot,
    speculation "static": every round the worker's largest)."""
    tracer = _TracingWorker(engine.worker)
    engine.worker = tracer
    traces = []
    try:
        for ids in prompts:
            out = engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
            (trace,) = tracer.traces.values()
            tracer.traces.clear()
            trace.output_ids = list(out.token_ids)
            traces.append(trace)
    finally:
        engine.worker = tracer._worker
    return traces


def live_summary(traces: list[Trace], depth: int) -> dict:
    """Acceptance by position (rounds accepting at least j drafts / rounds), tau (drafts accepted up
    to the answer's end, + 1, per round) and the position-1 rate."""
    rounds = [(a, r, len(t.prompt_ids) + len(t.output_ids)) for t in traces for a, r in zip(t.anchors, t.accepted)]
    n = max(1, len(rounds))
    accept = [sum(r >= j for _, r, _ in rounds) / n for j in range(1, depth + 1)]
    tau = 1 + sum(min(r, end - a - 1) for a, r, end in rounds) / n
    return {"rounds": len(rounds), "acc_by_pos": accept, "pos1": accept[0] if accept else 0.0, "tau": tau}


def _features(target: Target, ids: torch.Tensor, layer_ids: list[int], last_hidden: bool):
    """Capture-path features of one sequence [T] in the target's dtype: hidden [1, T, L*D], last [1, T, D] | None."""
    with torch.inference_mode():
        out = decoder_layer_outputs(target.model, ids[None], torch.ones_like(ids[None], dtype=torch.bool),
                                    layer_ids, last_hidden=last_hidden)
    return torch.cat([out[i] for i in layer_ids], dim=-1), out["norm"] if last_hidden else None


class TeacherForcing:
    """A drafter's strategy on the traces' served ids: the drafter loaded and each trace's target
    features computed once, then rounded to whichever feature dtype a measurement asks for."""

    def __init__(self, target: Target, drafter_dir: str, traces: list[Trace]):
        config = read_drafter_config(drafter_dir)
        self.model = load_drafter(drafter_dir, embed_tokens=target.model.model.embed_tokens,
                                  lm_head=target.model.lm_head, target_fingerprint=target.target_fingerprint,
                                  template_fingerprint=target.template_fingerprint)
        strategy_cls = get_strategy(config["algorithm"])
        objective = dict(strategy_cls.evaluation)
        if "num_anchors" in strategy_cls.objective.model_fields:  # every allowed anchor, none sampled away
            objective["num_anchors"] = max(len(t.prompt_ids) + len(t.output_ids) for t in traces)
        self.strategy = strategy_cls(strategy_cls.objective.model_validate(objective))
        layer_ids = list(config["architecture"]["target_layer_ids"])
        last_hidden = get_contract_spec(config["algorithm"]).needs_last_hidden
        self.traces = traces
        self._ids = [torch.tensor(t.prompt_ids + t.output_ids, dtype=torch.long) for t in traces]  # [T] each
        self._features = [_features(target, ids, layer_ids, last_hidden) for ids in self._ids]

    def batches(self, dtype: torch.dtype, at_live: bool) -> list[TrainBatch]:
        """One batch per trace: the answer supervised, features rounded to ``dtype``, blocks at the live
        anchors only (``at_live``) or at every answer position."""
        batches = []
        for i, (t, ids, (hidden, last)) in enumerate(zip(self.traces, self._ids, self._features)):
            loss_mask = torch.zeros(len(ids), dtype=torch.bool)
            loss_mask[len(t.prompt_ids):] = True  # the answer: what training supervises
            anchor_mask = None
            if at_live:
                anchor_mask = torch.zeros(1, len(ids), dtype=torch.bool)
                anchor_mask[0, t.anchors] = True
            batches.append(TrainBatch(
                ids[None], loss_mask[None], torch.ones_like(loss_mask[None]), hidden.to(dtype).float(),
                None if last is None else last.to(dtype).float(), [f"trace-{i}"], len(ids), anchor_mask))
        return batches

    def metrics(self, dtype: torch.dtype, at_live: bool) -> dict:
        """The strategy's teacher-forced metrics: at the live anchors or at every answer position."""
        result = evaluate_batches(self.model, self.model.config, self.strategy, self.batches(dtype, at_live))
        return {**result, "pos1": result["acc_by_pos"][0]}

    def position1_by_round(self, dtype: torch.dtype = torch.float32) -> list[list[bool]]:
        """Position-1 correctness at each live round's anchor, one block at a time (per trace, per
        round: compare with ``accepted >= 1``)."""
        correct = []
        for trace, batch in zip(self.traces, self.batches(dtype, at_live=True)):
            outcomes = []
            for anchor in trace.anchors:
                only = torch.zeros_like(batch.anchor_mask)
                only[0, anchor] = True
                result = evaluate_batches(self.model, self.model.config, self.strategy,
                                          [replace(batch, anchor_mask=only)])
                outcomes.append(result["acc_by_pos"][0] == 1.0)
            correct.append(outcomes)
        return correct


def teacher_forced(target: Target, drafter_dir: str, traces: list[Trace], *, dtype: torch.dtype,
                   at_live: bool) -> dict:
    """``TeacherForcing(...).metrics`` for one measurement."""
    return TeacherForcing(target, drafter_dir, traces).metrics(dtype, at_live)


def position1_by_round(target: Target, drafter_dir: str, traces: list[Trace], *,
                       dtype: torch.dtype = torch.float32) -> list[list[bool]]:
    """``TeacherForcing(...).position1_by_round`` for one measurement."""
    return TeacherForcing(target, drafter_dir, traces).position1_by_round(dtype)


def template_equal(target: Target, traces: list[Trace], prompts: list[Conversation]) -> int:
    """How many answers the capture's renderer turns (as text, with their prompt) into the served ids."""
    renderer = ChatRenderer(target.tokenizer, max_length=1 << 20)
    equal = 0
    for trace, conversation in zip(traces, prompts):
        answer = target.tokenizer.decode(trace.output_ids, skip_special_tokens=True)
        sample = renderer.render(Conversation(conversation.id, (*conversation.messages, ("assistant", answer))))
        served = trace.prompt_ids + trace.output_ids
        equal += sample is not None and sample.input_ids[: len(served)].tolist() == served
    return equal


def fidelity(target: Target, drafter_dir: str, *, dataset: str = "mtbench", num_prompts: int = 16,
             max_tokens: int = 64, num_speculative_tokens: int | None = None, capture_dtype: str = "bfloat16",
             heldout: str | None = None, endpoint_url: str | None = None) -> dict:
    """The decomposition table's rows (module doc) for one export."""
    conversations = list(load_conversations(dataset, purpose="eval", limit=num_prompts))
    prompts = [encode_prompt(target.tokenizer, c.as_chat()) for c in conversations]  # what the chat endpoint serves
    engine = Engine(target, drafter_dir, max_batch=1, max_len=max(map(len, prompts)) + max_tokens + KV_SLACK,
                    speculation="static", num_speculative_tokens=num_speculative_tokens, max_waiting=None)
    traces = trace_live(engine, prompts, max_tokens=max_tokens)
    depth = max((n for t in traces for n in t.num_drafts), default=0)
    dtype = STORAGE_DTYPES[capture_dtype]
    forced = TeacherForcing(target, drafter_dir, traces)
    rows = {
        "live": live_summary(traces, depth),
        "tf_live_fp32": forced.metrics(torch.float32, at_live=True),
        f"tf_live_{capture_dtype}": forced.metrics(dtype, at_live=True),
        f"tf_all_{capture_dtype}": forced.metrics(dtype, at_live=False),
    }
    if heldout is not None:
        from specray.pipeline.jobs.train import evaluate_export

        result = evaluate_export(drafter_dir, heldout, target_name=target.name, endpoint_url=endpoint_url)
        rows["heldout"] = {**result, "pos1": result["acc_by_pos"][0]}
    return {
        "export": str(drafter_dir), "dataset": dataset, "prompts": len(traces), "max_tokens": max_tokens,
        "answer_tokens": sum(len(t.output_ids) for t in traces), "depth": depth,
        "template_equal": template_equal(target, traces, conversations), "rows": rows,
        "traces": [asdict(t) for t in traces],
    }


def fidelity_table(result: dict) -> str:
    """The rows with position-1 accuracy, tau and the step from the row above."""
    lines = [f"{result['export']} on {result['prompts']} {result['dataset']} prompts "
             f"({result['answer_tokens']} answer tokens), chain of {result['depth']}; "
             f"template equal {result['template_equal']}/{result['prompts']}",
             f"{'row':<20} {'pos-1':>7} {'step':>7} {'tau':>6}  anchors"]
    previous = None
    for name, row in result["rows"].items():
        tau = row.get("tau", row.get("tau_tf"))
        step = "" if previous is None else f"{row['pos1'] - previous:+.3f}"
        count = row.get("rounds", row.get("blocks"))
        lines.append(f"{name:<20} {row['pos1']:>7.3f} {step:>7} {tau:>6.3f}  {count}")
        previous = row["pos1"]
    return "\n".join(lines)

