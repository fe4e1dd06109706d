#!/usr/bin/python3
"""Independent NumPy reference for the decoder architectures pdserve's engine runs.

Reads a Hugging Face model directory itself (config.json, model.safetensors or shards with
model.safetensors.index.json; F32/F16/BF16, and FP8 block-scaled checkpoints: F8_E4M3
weights times their weight_scale_inv blocks per quantization_config) and runs a full, cache-free causal forward pass
in float64 over a token sequence. Supports LlamaForCausalLM (incl. rope_scaling llama3),
MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias, tied embeddings) and Qwen3ForCausalLM
(RMSNorm over each q and k head before RoPE; head_dim independent of hidden_size), with GQA,
and the mixture-of-experts MixtralForCausalLM and Qwen3MoeForCausalLM (softmax router, top-k,
norm_topk_prob, decoder_sparse_step, mlp_only_layers): every token runs its experts densely.
DeepseekV3ForCausalLM (DeepSeek-V3, Kimi K2) follows the published modeling_deepseek.py
definition in its plain (non-absorbed) form: low-rank q and kv projections, per-head k_nope
and v expanded from the latent by kv_b_proj, interleaved RoPE on the shared k_pe part (YaRN
frequencies and mscale), group-limited sigmoid routing with the correction bias, shared
experts, routed_scaling_factor and the first dense layers.

Usage:
  llama_reference.py --model DIR --tokens 1,2,3,... --first N --out FILE
Writes float32 logits for positions [N-1, len(tokens)) (row-major, little endian) to FILE:
row 0 is the logits after the prompt of N tokens, row i those after token N-1+i.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np


def e4m3_values():
    """float8_e4m3fn's 256 values from the format's definition (S.1111.111 is NaN)."""
    c = np.arange(256)
    s, e, m = c >> 7, (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * np.exp2(e - 7.0))
    mag[(e == 15) & (m == 7)] = np.nan
    return np.where(s == 1, -mag, mag)


E4M3 = e4m3_values()


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[base + b:base + e]
        dt = info["dtype"]
        if dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif dt == "F16":
            arr = np.frombuffer(raw, dtype="<f2")
        elif dt == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F8_E4M3":
            arr = E4M3[np.frombuffer(raw, dtype=np.uint8)]
        else:
            raise SystemExit(f"{path}: unsupported dtype {dt} for {name}")
        out[name] = arr.astype(np.float64).reshape(info["shape"])
    return out


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        w = {}
        for fn in files:
            w.update(read_safetensors(os.path.join(model_dir, fn)))
        return w
    return read_safetensors(os.path.join(model_dir, "model.safetensors"))


def dequantize_fp8(cfg, w):
    """Each X.weight with an X.weight_scale_inv: the codes times their block's scale."""
    qc = cfg.get("quantization_config")
    if not qc:
        return w
    br, bc = qc["weight_block_size"]
    for name in [n for n in w if n.endswith("_scale_inv")]:
        scales = w.pop(name)
        target = name[:-len("_scale_inv")]
        rows, cols = w[target].shape
        full = np.repeat(np.repeat(scales, br, axis=0), bc, axis=1)[:rows, :cols]
        w[target] = w[target] * full
    return w


def inv_frequencies(cfg, head_dim):
    theta = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rs = cfg.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            factor = rs["factor"]
            low, high = rs["low_freq_factor"], rs["high_freq_factor"]
            orig = rs["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            smooth = (orig / wavelen - low) / (high - low)
            blended = (1 - smooth) * inv / factor + smooth * inv
            inv = np.where(wavelen > orig / low, inv / factor,
                           np.where(wavelen < orig / high, inv, blended))
        elif kind != "default":
            raise SystemExit(f"rope_scaling {kind} not supported by the reference")
    return inv


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate(x, cos, sin):
    # HF rotate_half convention: pairs (i, i + d/2).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def is_moe_layer(cfg, arch, layer):
    if arch == "MixtralForCausalLM":
        return True
    if arch != "Qwen3MoeForCausalLM":
        return False
    step = cfg.get("decoder_sparse_step", 1) or 1
    return layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def moe(cfg, arch, w, p, h):
    """Softmax over every expert, the top k per token (ties to the lower id), renormalised when
    norm_topk_prob (Mixtral always); each token's experts run as plain SwiGLU MLPs."""
    mixtral = arch == "MixtralForCausalLM"
    pre = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    k = cfg["num_experts_per_tok"]
    norm = True if mixtral else cfg.get("norm_topk_prob", False)
    logits = h @ w[pre + "gate.weight"].T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = sorted(range(probs.shape[1]), key=lambda e: (-probs[t, e], e))[:k]
        wts = probs[t, top]
        if norm:
            wts = wts / wts.sum()
        for e, g in zip(top, wts):
            ep = f"{pre}experts.{e}."
            gate = h[t] @ w[ep + names[0] + ".weight"].T
            up = h[t] @ w[ep + names[1] + ".weight"].T
            out[t] += g * ((gate / (1 + np.exp(-gate)) * up) @ w[ep + names[2] + ".weight"].T)
    return out


def yarn_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def deepseek_rope(cfg, dim, T):
    """cos, sin [T][dim/2] for the rope part, YaRN applied as DeepseekV3YarnRotaryEmbedding."""
    base = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    mscale = 1.0
    rs = cfg.get("rope_scaling")
    if rs:
        kind = rs.get("type", rs.get("rope_type"))
        if kind != "yarn":
            raise SystemExit(f"rope_scaling {kind} not supported by the reference for DeepSeek")
        factor = rs["factor"]
        orig = rs["original_max_position_embeddings"]
        beta_fast, beta_slow = rs.get("beta_fast", 32), rs.get("beta_slow", 1)

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extra_mask = 1.0 - ramp
        inv = (inv / factor) * (1 - extra_mask) + inv * extra_mask
        mscale = yarn_mscale(factor, rs.get("mscale", 1)) / yarn_mscale(factor, rs.get("mscale_all_dim", 0))
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang) * mscale, np.sin(ang) * mscale


def rotate_interleaved(x, cos, sin):
    # modeling_deepseek.py: de-interleave (x0, x2, ..., x1, x3, ...), then rotate_half.
    d = x.shape[-1]
    x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return rotate(x, cos, sin)


def deepseek_moe(cfg, w, p, h):
    """MoEGate noaux_tc + DeepseekV3MoE: every token's experts run one by one."""
    pre = p + "mlp."
    k = cfg["num_experts_per_tok"]
    E = cfg["n_routed_experts"]
    G, TG = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    scores = 1.0 / (1.0 + np.exp(-(h @ w[pre + "gate.weight"].T)))
    choice = scores + w[pre + "gate.e_score_correction_bias"]
    per = E // G
    out = np.zeros_like(h)

    def mlp(prefix, x):
        gate = x @ w[prefix + "gate_proj.weight"].T
        up = x @ w[prefix + "up_proj.weight"].T
        return (gate / (1 + np.exp(-gate)) * up) @ w[prefix + "down_proj.weight"].T

    for t in range(h.shape[0]):
        gs = [sum(sorted(choice[t, g * per:(g + 1) * per])[-2:]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: (-gs[g], g))[:TG]
        cands = [e for g in groups for e in range(g * per, (g + 1) * per)]
        top = sorted(cands, key=lambda e: (-choice[t, e], e))[:k]
        wts = scores[t, top]
        if k > 1 and cfg.get("norm_topk_prob", False):
            wts = wts / (wts.sum() + 1e-20)
        wts = wts * cfg.get("routed_scaling_factor", 1.0)
        for e, g in zip(top, wts):
            out[t] += g * mlp(f"{pre}experts.{e}.", h[t])
    if cfg.get("n_shared_experts"):
        out += mlp(pre + "shared_experts.", h)
    return out


def deepseek_forward(cfg, w, tokens):
    eps = cfg.get("rms_norm_eps", 1e-6)
    H = cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    R = cfg["kv_lora_rank"]
    qh = nope + rope
    T = len(tokens)
    scale = qh ** -0.5
    rs = cfg.get("rope_scaling")
    if rs and rs.get("mscale_all_dim"):
        m = yarn_mscale(rs["factor"], rs["mscale_all_dim"])
        scale = scale * m * m
    cos, sin = deepseek_rope(cfg, rope, T)
    cos, sin = cos[:, None, :], sin[:, None, :]
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    first_dense = cfg.get("first_k_dense_replace", 0)
    freq = cfg.get("moe_layer_freq", 1)
    x = w["model.embed_tokens.weight"][np.array(tokens)]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        a = p + "self_attn."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        if cfg.get("q_lora_rank"):
            q = rms_norm(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps) @ w[a + "q_b_proj.weight"].T
        else:
            q = h @ w[a + "q_proj.weight"].T
        q = q.reshape(T, H, qh)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        ckv = h @ w[a + "kv_a_proj_with_mqa.weight"].T
        c, k_pe = ckv[:, :R], ckv[:, R:].reshape(T, 1, rope)
        kv = (rms_norm(c, w[a + "kv_a_layernorm.weight"], eps) @ w[a + "kv_b_proj.weight"].T).reshape(T, H, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_pe = rotate_interleaved(q_pe, cos, sin)
        k_pe = rotate_interleaved(k_pe, cos, sin)
        qs = np.concatenate([q_nope, q_pe], axis=-1)
        ks = np.concatenate([k_nope, np.repeat(k_pe, H, axis=1)], axis=-1)
        scores = np.einsum("qhd,khd->hqk", qs, ks) * scale + mask
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(T, H * vd)
        x = x + attn @ w[a + "o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if cfg.get("n_routed_experts") and l >= first_dense and l % freq == 0:
            x = x + deepseek_moe(cfg, w, p, h)
            continue
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T


def forward(cfg, w, tokens):
    arch = cfg["architectures"][0]
    if arch == "DeepseekV3ForCausalLM":
        return deepseek_forward(cfg, w, tokens)
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        raise SystemExit(f"unsupported architecture {arch}")
    hidden = cfg["hidden_size"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_heads)
    head_dim = cfg.get("head_dim") or hidden // n_heads
    eps = cfg.get("rms_norm_eps", 1e-6)
    qkv_bias = arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False)
    o_bias = arch != "Qwen2ForCausalLM" and cfg.get("attention_bias", False)
    T = len(tokens)

    x = w["model.embed_tokens.weight"][np.array(tokens)]
    pos = np.arange(T, dtype=np.float64)
    ang = pos[:, None] * inv_frequencies(cfg, head_dim)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = h @ w[p + "self_attn.q_proj.weight"].T
        k = h @ w[p + "self_attn.k_proj.weight"].T
        v = h @ w[p + "self_attn.v_proj.weight"].T
        if qkv_bias:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q = q.reshape(T, n_heads, head_dim)
        k = k.reshape(T, n_kv, head_dim)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rotate(q, cos, sin)
        k = rotate(k, cos, sin)
        v = v.reshape(T, n_kv, head_dim)
        rep = n_heads // n_kv
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim) + mask
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(T, n_heads * head_dim)
        o = attn @ w[p + "self_attn.o_proj.weight"].T
        if o_bias:
            o = o + w[p + "self_attn.o_proj.bias"]
        x = x + o
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if is_moe_layer(cfg, arch, l):
            x = x + moe(cfg, arch, w, p, h)
            continue
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--first", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    tokens = [int(t) for t in a.tokens.split(",")]
    logits = forward(cfg, dequantize_fp8(cfg, load_weights(a.model)), tokens)
    logits[a.first - 1:].astype("<f4").tofile(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
