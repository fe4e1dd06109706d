// The official OpenAI Node SDK (npm `openai`, pinned in tests/npm) against a real local
// cluster started with `pdserve up`: completions and chat, streaming and not, the usage
// chunk, stop strings, n=2, logprobs, penalties and logit_bias, refused fields, error classes,
// and aborting a stream mid-way (its KV blocks come back on both workers, as the router's
// per-worker gauges show).
//
// usage: node --test tests/client/openai_sdk.test.mjs   (env PDSERVE_BIN_DIR, PDSERVE_WORK_DIR)
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { startLocalCluster } from './local_cluster.mjs';

const require = createRequire(new URL('../npm/package.json', import.meta.url));
const { default: OpenAI } = await import(require.resolve('openai'));

const binDir = process.env.PDSERVE_BIN_DIR ?? 'build/bin';
const work = process.env.PDSERVE_WORK_DIR ?? 'build/test_client';
const key = 'sk-pdserve-test';
let cluster, client, port;

async function metrics() {
  const r = await fetch(`http://127.0.0.1:${port}/metrics`, { headers: { Authorization: `Bearer ${key}` } });
  return r.text();
}

function gauge(text, name, worker) {
  const m = text.match(new RegExp(`^${name}\\{[^}]*worker="${worker}"[^}]*\\} (\\S+)$`, 'm'));
  return m ? Number(m[1]) : NaN;
}

before(async () => {
  cluster = await startLocalCluster({ binDir, work, key });
  port = cluster.port;
  client = new OpenAI({ apiKey: key, baseURL: `http://127.0.0.1:${port}/v1`, maxRetries: 0, timeout: 60000 });
});

after(async () => {
  await cluster?.stop();
});

const longPrompt = Array.from({ length: 300 }, (_, i) => 32 + (i * 7) % 90);  // token ids: disaggregated

test('models lists the served model', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), ['small']);
});

test('completions, not streamed', async () => {
  const r = await client.completions.create({ model: 'small', prompt: 'Hello', max_tokens: 5, temperature: 0, ignore_eos: true });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 5);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 5);
});

test('completions, streamed with the usage chunk, equal to the non-streamed text', async () => {
  const body = { model: 'small', prompt: longPrompt, max_tokens: 8, temperature: 0, ignore_eos: true };
  const whole = await client.completions.create(body);
  const stream = await client.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.choices.length) {
      text += chunk.choices[0].text;
      finish = chunk.choices[0].finish_reason ?? finish;
    } else {
      usage = chunk.usage;
    }
  }
  assert.ok(chunks >= 3);
  assert.equal(text, whole.choices[0].text);
  assert.equal(finish, 'length');
  const { pdserve_timing: timing, ...counts } = usage;
  // The same prompt a moment before: its 18 full blocks (of 16 tokens) come from the prefix
  // cache, which OpenAI's cached_tokens reports.
  assert.deepEqual(counts, { prompt_tokens: 300, completion_tokens: 8, total_tokens: 308,
                             prompt_tokens_details: { cached_tokens: 288 } });
  // pdserve's TTFT split (docs/metrics.md) reaches the SDK user as an extra usage key.
  assert.ok(['colocated', 'disaggregated'].includes(timing.route), JSON.stringify(timing));
  let phases = 0;
  for (const [k, v] of Object.entries(timing)) {
    if (k === 'route' || k === 'ttft_ms') continue;
    assert.ok(v >= 0, k);
    phases += v;
  }
  assert.ok(timing.ttft_ms > 0 && phases <= timing.ttft_ms + 0.01, JSON.stringify(timing));
});

test('chat, streamed and not', async () => {
  const body = { model: 'small', messages: [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'hi' }],
                 max_completion_tokens: 6, temperature: 0, ignore_eos: true };
  const r = await client.chat.completions.create(body);
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.usage.completion_tokens, 6);
  const stream = await client.chat.completions.create({ ...body, stream: true });
  const deltas = [];
  for await (const chunk of stream) deltas.push(chunk.choices[0]?.delta ?? {});
  assert.equal(deltas[0].role, 'assistant');
  assert.equal(deltas.map((d) => d.content ?? '').join(''), r.choices[0].message.content);
});

test('a stop string ends the text before it and cancels the worker', async () => {
  const body = { model: 'small', prompt: longPrompt, max_tokens: 24, temperature: 0, ignore_eos: true };
  const full = (await client.completions.create(body)).choices[0].text;
  const chars = [...full];
  assert.ok(chars.length >= 8, `need some text to cut, got ${JSON.stringify(full)}`);
  const stop = chars.slice(5, 7).join('');
  const cut = await client.completions.create({ ...body, stop: [stop] });
  assert.equal(cut.choices[0].text, full.slice(0, full.indexOf(stop)));
  assert.equal(cut.choices[0].finish_reason, 'stop');
  assert.ok(cut.usage.completion_tokens < 24);
});

test('n=2 returns two choices', async () => {
  const r = await client.completions.create({ model: 'small', prompt: 'Hi', max_tokens: 4, n: 2, seed: 5, ignore_eos: true });
  assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1]);
  assert.equal(r.usage.completion_tokens, 8);
});

test('logprobs of the chosen tokens and top alternatives', async () => {
  const r = await client.completions.create({ model: 'small', prompt: 'Hi', max_tokens: 4, temperature: 0, logprobs: 2, ignore_eos: true });
  const lp = r.choices[0].logprobs;
  assert.equal(lp.tokens.length, 4);
  assert.equal(lp.token_logprobs.length, 4);
  for (let i = 0; i < 4; i++) {
    assert.ok(lp.token_logprobs[i] <= 0);
    const top = Object.values(lp.top_logprobs[i]);
    assert.ok(top.length >= 1 && top.length <= 2);
    // Greedy: the chosen token is the most likely one.
    assert.ok(Math.abs(Math.max(...top) - lp.token_logprobs[i]) < 1e-4);
  }
});

test('penalties, logit_bias and min_tokens pass through the SDK, on both routes', async () => {
  // logit_bias +100 on one token: greedy picks it every time, also for the first token that
  // the prefill worker samples (the 300-token prompt is disaggregated).
  for (const prompt of ['Hello', longPrompt]) {
    const r = await client.completions.create({
      model: 'small', prompt, max_tokens: 4, temperature: 0, ignore_eos: true, return_token_ids: true,
      logit_bias: { 200: 100 }, presence_penalty: 0.5, frequency_penalty: 0.5, repetition_penalty: 1.2,
      min_tokens: 2 });
    assert.deepEqual(r.choices[0].token_ids, [200, 200, 200, 200]);
  }
  const chat = await client.chat.completions.create({
    model: 'small', messages: [{ role: 'user', content: 'Hi' }], max_completion_tokens: 3, temperature: 0,
    logit_bias: { 200: 100 }, response_format: { type: 'text' }, return_token_ids: true });
  assert.deepEqual(chat.choices[0].token_ids, [200, 200, 200]);
});

test('fields pdserve does not implement are a BadRequestError naming them', async () => {
  const refused = (param) => (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === param;
  await assert.rejects(client.completions.create({ model: 'small', prompt: 'x', suffix: 'y' }), refused('suffix'));
  await assert.rejects(client.completions.create({ model: 'small', prompt: 'x', best_of: 2 }), refused('best_of'));
  const messages = [{ role: 'user', content: 'x' }];
  // Tools are served (agent_tools.test.mjs); the deprecated `functions` and tool types other
  // than function are not.
  await assert.rejects(client.chat.completions.create({
    model: 'small', messages, functions: [{ name: 'f', parameters: { type: 'object', properties: {} } }] }),
  refused('functions'));
  await assert.rejects(client.chat.completions.create({ model: 'small', messages, tools: [{ type: 'web_search' }] }),
                       refused('tools'));
  await assert.rejects(client.chat.completions.create({ model: 'small', messages, response_format: {
    type: 'json_schema', json_schema: { name: 'n', schema: { type: 'string', pattern: '^a' } } } }),
  refused('response_format'));
});

test('errors arrive as the SDK error classes', async () => {
  await assert.rejects(client.completions.create({ model: 'small', prompt: 'x', temperature: 5 }),
                       (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'temperature');
  const stranger = new OpenAI({ apiKey: 'wrong', baseURL: `http://127.0.0.1:${port}/v1`, maxRetries: 0 });
  await assert.rejects(stranger.completions.create({ model: 'small', prompt: 'x' }),
                       (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  await assert.rejects(client.completions.create({ model: 'nope', prompt: 'x' }),
                       (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found');
  await assert.rejects(client.completions.create({ model: 'small', prompt: Array(5000).fill(65) }),
                       (e) => e instanceof OpenAI.BadRequestError && e.status === 400 &&
                             e.code === 'context_length_exceeded');
});

test('aborting a stream mid-way frees its blocks on both workers', async () => {
  const stream = await client.completions.create({ model: 'small', prompt: longPrompt, max_tokens: 1500,
                                                   ignore_eos: true, stream: true });
  let n = 0;
  for await (const chunk of stream) { if (++n === 3) break; }  // closes the connection
  let text = '';
  for (let i = 0; i < 100; i++) {
    text = await metrics();
    const free = ['decode-0', 'prefill-0'].map((w) => gauge(text, 'pdserve_worker_kv_free_blocks', w));
    const total = ['decode-0', 'prefill-0'].map((w) => gauge(text, 'pdserve_worker_kv_total_blocks', w));
    if (free[0] === total[0] && free[1] === total[1] && gauge(text, 'pdserve_worker_running', 'decode-0') === 0) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(gauge(text, 'pdserve_worker_kv_free_blocks', 'decode-0'), gauge(text, 'pdserve_worker_kv_total_blocks', 'decode-0'));
  assert.equal(gauge(text, 'pdserve_worker_kv_free_blocks', 'prefill-0'), gauge(text, 'pdserve_worker_kv_total_blocks', 'prefill-0'));
  assert.match(text, /pdserve_requests_finished_total\{finished_reason="abort"\} [1-9]/);
});
