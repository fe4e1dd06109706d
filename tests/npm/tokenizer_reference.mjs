// Reference outputs for pdserve's tokenizer tests, from pinned JavaScript implementations:
// @lenml/tokenizers (a fork of transformers.js' tokenizers) and @huggingface/jinja.
//
//   node tokenizer_reference.mjs encode MODEL_DIR CORPUS.json OUT.json
//       OUT = [{ids, decoded, decodedSkip}] per corpus string (one process for the corpus)
//   node tokenizer_reference.mjs chat MODEL_DIR CONVERSATIONS.json OUT.json [TEMPLATE_FILE]
//       OUT = [{prompt}] per conversation ({messages, add_generation_prompt})
//   node tokenizer_reference.mjs bench MODEL_DIR TEXT_FILE
//       prints {seconds, cpuSeconds, tokens, bytes} for encoding the file once, line by line
import { readFileSync, writeFileSync } from "node:fs";
import { TokenizerLoader } from "@lenml/tokenizers";
import { Template } from "@huggingface/jinja";

const [mode, modelDir, inPath, outPath, templatePath] = process.argv.slice(2);
const tokenizerJSON = JSON.parse(readFileSync(`${modelDir}/tokenizer.json`, "utf8"));
let tokenizerConfig = {};
try {
  tokenizerConfig = JSON.parse(readFileSync(`${modelDir}/tokenizer_config.json`, "utf8"));
} catch {}

if (mode === "encode") {
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
  const corpus = JSON.parse(readFileSync(inPath, "utf8"));
  const out = corpus.map((text) => {
    const ids = tok.encode(text);
    // decode() refuses an empty list; its answer for it would be "".
    const dec = (opts) => (ids.length ? tok.decode(ids, opts) : "");
    return { ids, decoded: dec({}), decodedSkip: dec({ skip_special_tokens: true }) };
  });
  writeFileSync(outPath, JSON.stringify(out));
} else if (mode === "chat") {
  const source = templatePath ? readFileSync(templatePath, "utf8") : tokenizerConfig.chat_template;
  const template = new Template(source);
  const tokenOf = (k) => {
    const v = tokenizerConfig[k];
    return typeof v === "object" && v !== null ? v.content : v;
  };
  const convs = JSON.parse(readFileSync(inPath, "utf8"));
  const out = convs.map((c) => {
    const ctx = { messages: c.messages, add_generation_prompt: c.add_generation_prompt };
    if (tokenOf("bos_token")) ctx.bos_token = tokenOf("bos_token");
    if (tokenOf("eos_token")) ctx.eos_token = tokenOf("eos_token");
    Object.assign(ctx, c.extra ?? {});
    try {
      return { prompt: template.render(ctx) };
    } catch (e) {
      return { error: String(e?.message ?? e) };  // raise_exception and the like
    }
  });
  writeFileSync(outPath, JSON.stringify(out));
} else if (mode === "bench") {
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
  const text = readFileSync(inPath, "utf8");
  const lines = text.split("\n");
  const t0 = process.hrtime.bigint();
  const c0 = process.cpuUsage();
  let tokens = 0;
  for (const line of lines) tokens += tok.encode(line, { add_special_tokens: false }).length;
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  const c = process.cpuUsage(c0);
  // CPU seconds include node's GC threads: the reference gets no less than its due.
  const cpuSeconds = (c.user + c.system) / 1e6;
  console.log(JSON.stringify({ seconds: s, cpuSeconds, tokens, bytes: Buffer.byteLength(text) }));
} else {
  console.error("usage: tokenizer_reference.mjs encode|chat|bench MODEL_DIR IN [OUT]");
  process.exit(2);
}
