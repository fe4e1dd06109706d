#!/usr/bin/env bash
# pdserve make-model + generate end to end: the CLI writes a model, generates greedily from
# token ids, and its logits file agrees with the NumPy reference.
# usage: model_cli_test.sh PDSERVE_BINARY WORK_DIR SOURCE_DIR
set -euo pipefail
pdserve=$1 work=$2 src=$3
rm -rf "$work" && mkdir -p "$work"
"$pdserve" make-model --preset tiny --out "$work/m" --seed 4 --qkv-bias --tie-embeddings --dtype bf16 >/dev/null
grep -q Qwen2ForCausalLM "$work/m/config.json"
prompt=256,72,101,108,108,111,44,32,119,111,114,108,100
# check_against_numpy DIR: 6 greedy ids and their logits from `generate` agree with the reference.
check_against_numpy() {
  local m=$1
  ids=$("$pdserve" generate --model "$m" --prompt-ids $prompt --max-tokens 6 --ignore-eos \
          --logits-out "$work/logits.bin" 2>/dev/null)
  n=$(echo "$ids" | tr ',' '\n' | grep -c .)
  [ "$n" = 6 ] || { echo "expected 6 ids, got '$ids'"; exit 1; }
  [ "$(stat -c %s "$work/logits.bin")" = $((6 * 259 * 4)) ] || { echo "logits file has the wrong size"; exit 1; }
  /usr/bin/python3 "$src/tests/reference/llama_reference.py" --model "$m" \
    --tokens "$prompt,$(echo "$ids" | cut -d, -f1-5)" --first 13 --out "$work/ref.bin"
  /usr/bin/python3 - "$work" "$ids" <<'PY'
import sys
import numpy as np
work, ids = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
a = np.fromfile(work + "/logits.bin", dtype="<f4").reshape(-1, 259)
b = np.fromfile(work + "/ref.bin", dtype="<f4").reshape(-1, 259)
err = np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)
assert (err < 1e-4).all(), err
assert list(b.argmax(axis=1)) == ids, (list(b.argmax(axis=1)), ids)
print("generate matches NumPy: max rel err", err.max())
PY
}
check_against_numpy "$work/m"
# Quantized weights (engine.weight_format): the first token's logits stay within 2e-2 (max
# abs difference over max abs logit) of f32's, an unknown format is refused by name.
for f in bf16 q8_0; do
  "$pdserve" generate --model "$work/m" --prompt-ids $prompt --max-tokens 1 --weight-format $f \
    --logits-out "$work/logits_$f.bin" >/dev/null 2>&1
  /usr/bin/python3 - "$work" $f <<'PY'
import sys
import numpy as np
work, f = sys.argv[1], sys.argv[2]
a = np.fromfile(work + "/logits_" + f + ".bin", dtype="<f4")
b = np.fromfile(work + "/logits.bin", dtype="<f4")[:259]
err = np.abs(a - b).max() / np.abs(b).max()
assert err < 2e-2, err
# this checkpoint is bf16: only q8_0 must change the weights (bf16 may give f32's bits)
assert f != "q8_0" or err > 0, err
print(f, "weights: first-token logits within", err, "of f32")
PY
done
if "$pdserve" generate --model "$work/m" --prompt-ids 1 --weight-format int4 2>"$work/err"; then exit 1; fi
grep -q 'unknown weightFormat "int4"' "$work/err"
# An FP8 block-scaled checkpoint (projections F8_E4M3 with 128x128 F32 scales, the rest bf16):
# pdserve dequantizes it at load, the reference dequantizes it itself.
"$pdserve" make-model --preset small --out "$work/fp8" --seed 5 --dtype bf16 --quantization fp8 >/dev/null
grep -q '"quant_method": "fp8"' "$work/fp8/config.json"
check_against_numpy "$work/fp8"
if "$pdserve" make-model --preset tiny --quantization int4 --out "$work/x" 2>/dev/null; then exit 1; fi
# The Qwen3 small preset (per-head q/k RMSNorm, head_dim 128 with hidden 512 and 8 heads).
"$pdserve" make-model --preset small --arch qwen3 --out "$work/q3" --seed 6 >/dev/null
grep -q Qwen3ForCausalLM "$work/q3/config.json"
grep -q '"head_dim": 128' "$work/q3/config.json"
check_against_numpy "$work/q3"
# The DeepSeek small preset (multi-head latent attention with YaRN, 32 group-routed experts,
# a shared expert, layer 0 dense); its multi-token-prediction layer is skipped with a log line.
"$pdserve" make-model --preset small --arch deepseek_v3 --out "$work/ds" --seed 6 >/dev/null
grep -q DeepseekV3ForCausalLM "$work/ds/config.json"
check_against_numpy "$work/ds"
"$pdserve" generate --model "$work/ds" --prompt-ids 1,2,3 --max-tokens 1 2>"$work/err" >/dev/null
grep -q "multi-token-prediction layer(s) (num_nextn_predict_layers) ignored" "$work/err"
if "$pdserve" generate --model "$work/ds" --prompt-ids 1 --weight-format bf16 2>"$work/err"; then exit 1; fi
grep -q "weight_format bf16 is not implemented for DeepseekV3ForCausalLM" "$work/err"
if "$pdserve" make-model --preset tiny --arch qwen4 --out "$work/x" 2>/dev/null; then exit 1; fi
# Usage errors exit 2 with a message.
if "$pdserve" generate --model "$work/m" --prompt-ids 1,x 2>/dev/null; then exit 1; fi
if "$pdserve" generate --model "$work/missing" --prompt-ids 1 2>"$work/err"; then exit 1; fi
grep -q "config.json" "$work/err"
