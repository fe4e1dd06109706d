#!/usr/bin/env python3
"""How often the chat template and the tokenizer reproduce a generated answer's token ids.

A multi-turn client sends the previous answer back as text: the next turn's prompt is the
template rendered over [user, assistant(answer text), user] and tokenized again. The decode
worker's cache names the answer's blocks by the ids it generated (docs/kv_cache.md,
"Multi-turn"), so the next turn hits them only as far as the re-tokenized prompt repeats
those ids. For N conversations against a running cluster this prints how many answers came
back whole, and the share of the answers' full KV blocks the next turn could hit.

usage: scripts/multiturn-roundtrip.py URL MODEL_DIR [N] [MAX_TOKENS] [TEMPERATURE] [json]
  json: answers constrained to a JSON object (response_format), valid UTF-8 by construction
  e.g. scripts/multiturn-roundtrip.py http://127.0.0.1:8000 models/small 50 64 1.0
Loopback only; needs build/bin/pdserve (for `pdserve tokenize --chat`).
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import urllib.request

BLOCK = 16  # engine.block_size of the shipped configs


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def tokenize(pdserve, model, messages, generation_prompt):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"messages": messages}, f)
        path = f.name
    try:
        args = [pdserve, "tokenize", "--model", model, "--chat", path, "--json"]
        if not generation_prompt:
            args.append("--no-generation-prompt")
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        return json.loads(out)["ids"]
    finally:
        os.unlink(path)


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    url, model = sys.argv[1].rstrip("/"), sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 50
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    temperature = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0
    constrained = len(sys.argv) > 6 and sys.argv[6] == "json"
    pdserve = os.path.join(os.path.dirname(__file__), "..", "build", "bin", "pdserve")
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        served = json.load(r)["data"][0]["id"]
    rng = random.Random(0)
    whole = 0
    answer_tokens = kept_tokens = 0
    answer_blocks = kept_blocks = 0
    for i in range(n):
        question = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(200))
        first = [{"role": "user", "content": question}]
        body = {"model": served, "messages": first, "max_tokens": max_tokens, "temperature": temperature,
                "seed": i, "return_token_ids": True}
        if constrained:
            body["response_format"] = {"type": "json_object"}
        reply = post(url, body)
        choice = reply["choices"][0]
        generated = choice["token_ids"]
        text = choice["message"]["content"] or ""
        prompt1 = tokenize(pdserve, model, first, True)
        history = prompt1 + generated
        turn2 = tokenize(pdserve, model, first + [{"role": "assistant", "content": text},
                                                  {"role": "user", "content": "and then?"}], True)
        same = 0
        while same < min(len(history), len(turn2)) and history[same] == turn2[same]:
            same += 1
        kept = max(0, same - len(prompt1))
        whole += kept >= len(generated)
        answer_tokens += len(generated)
        kept_tokens += min(kept, len(generated))
        # The answer's full blocks the decode worker names (the last token's KV is never
        # computed) against those the next turn's prompt repeats.
        named = (len(history) - 1) // BLOCK - len(prompt1) // BLOCK
        hit = min(same, len(history) - 1) // BLOCK - len(prompt1) // BLOCK
        answer_blocks += max(0, named)
        kept_blocks += max(0, min(hit, named))
    print(f"{n} answers of up to {max_tokens} tokens at temperature {temperature}"
          f"{' (JSON object)' if constrained else ''}: "
          f"{whole} reproduced whole ({100 * whole / n:.0f}%); "
          f"{kept_tokens} of {answer_tokens} answer tokens kept ({100 * kept_tokens / max(1, answer_tokens):.1f}%); "
          f"{kept_blocks} of {answer_blocks} answer blocks hittable "
          f"({100 * kept_blocks / max(1, answer_blocks):.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
