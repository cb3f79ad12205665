"""Checks tiny-llama's generated tokens from outside, with Hugging Face's transformers: each
token, teacher-forced, must be transformers' argmax, or lose to it only by rounding (less than
1e-3 of the logits' scale).

As a script: `check_tokens.py MODEL_DIR REPORT.json...` checks every request of each report
(`cargo xtask demo --model tiny-llama --json-out REPORT.json --save-model MODEL_DIR`, or the
kv-model example's output), and exits non-zero if transformers disagrees with any token, or a
report holds no tokens to check."""

import json
import sys

import torch


def load(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def disagreements(model, requests):
    """(request, position, token, transformers' argmax) for each generated token transformers
    would not have chosen, beyond rounding."""
    found = []
    for r in requests:
        prompt, generated = r["prompt_ids"], r["generated_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated[:-1]])).logits[0]
        for j, token in enumerate(generated):
            row = logits[len(prompt) - 1 + j]
            best = int(row.argmax())
            if best != token and float(row[best] - row[token]) >= 1e-3 * float(row.abs().max()):
                found.append((r.get("request", prompt[:3]), j, token, best))
    return found


def requests_of(report):
    """The requests of a demo report (its `model` object) or of the example's output, those
    with generated tokens."""
    requests = (report.get("model") or report)["requests"]
    return [r for r in requests if r.get("generated_ids")]


def main(model_dir, paths):
    model = load(model_dir)
    failed = False
    for path in paths:
        with open(path) as f:
            requests = requests_of(json.load(f))
        bad = disagreements(model, requests)
        tokens = sum(len(r["generated_ids"]) for r in requests)
        print(f"{path}: transformers agrees with {tokens - len(bad)} of {tokens} tokens of {len(requests)} requests")
        if bad or not requests:
            print(f"  disagreements (request, position, token, transformers' argmax): {bad}")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
