"""SGLang greedy generation with a drafter in our SGLang export format, run by
tests/drafters/test_sglang_peer.py inside a Python that has SGLang 0.5.23 and a CUDA GPU (it need
not import specray):

    $SGLANG_PYTHON tests/drafters/sglang_peer_run.py REQUEST.json RESULT.json

REQUEST: ``{"target": HF directory, "drafter": SGLang draft dir or null (plain decoding), "algorithm":
"EAGLE3" | "DFLASH" | "DSPARK" | "DFLASH2", "num_speculative_tokens": k, "prompts": [[token ids], ...],
"max_tokens": n, "eos": id}``. RESULT: ``{"token_ids": [[...], ...] (EOS cut), "accept_length": mean
tokens per verify round over all prompts (1.0 without a drafter), "meta_info": the first output's}``.
"""

import json
import sys

import sglang


def main(request_path: str, result_path: str) -> None:
    request = json.load(open(request_path))
    k = request["num_speculative_tokens"]
    options = dict(model_path=request["target"], skip_tokenizer_init=True, dtype="float32", random_seed=0,
                   attention_backend="triton", disable_cuda_graph=True, mem_fraction_static=0.5)
    if request["drafter"]:  # k drafts per round: EAGLE-3 a chain of k steps, the DFlash family a block of k + 1
        options.update(speculative_algorithm=request["algorithm"], speculative_draft_model_path=request["drafter"],
                       speculative_num_draft_tokens=k + 1)
        if request["algorithm"] == "EAGLE3":
            options.update(speculative_num_steps=k, speculative_eagle_topk=1)
    engine = sglang.Engine(**options)
    params = {"temperature": 0.0, "max_new_tokens": request["max_tokens"], "stop_token_ids": [request["eos"]]}
    outputs = engine.generate(input_ids=request["prompts"], sampling_params=params)
    engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    rounds = sum(o["meta_info"].get("spec_verify_ct", o["meta_info"]["completion_tokens"]) for o in outputs)
    result = {"token_ids": [[t for t in o["output_ids"] if t != request["eos"]] for o in outputs],
              "accept_length": tokens / max(rounds, 1), "meta_info": outputs[0]["meta_info"]}
    json.dump(result, open(result_path, "w"), default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
