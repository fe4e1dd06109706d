// Structured outputs through the official OpenAI Node SDK (npm `openai`, pinned in tests/npm)
// against a real local cluster started with `pdserve up` (one prefill and one decode worker,
// the random-weight `small` model): every answer under response_format json_schema validates
// against its schema, with n = 2, on the colocated route (a short prompt) and the
// disaggregated one (a long prompt: the prefill worker samples the first token under the
// constraint, the decode worker continues it), streamed and not; json_object, guided_choice
// and guided_regex on completions; and the refusals by name (docs/serving.md "Structured
// outputs").
//
// usage: node --test tests/client/structured_outputs.test.mjs   (env PDSERVE_BIN_DIR, PDSERVE_WORK_DIR)
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { startLocalCluster } from './local_cluster.mjs';

const require = createRequire(new URL('../npm/package.json', import.meta.url));
const { default: OpenAI } = await import(require.resolve('openai'));

const binDir = process.env.PDSERVE_BIN_DIR ?? 'build/bin';
const work = process.env.PDSERVE_WORK_DIR ?? 'build/test_structured';
const key = 'sk-pdserve-test';
let cluster, client;

before(async () => {
  cluster = await startLocalCluster({ binDir, work, key });
  const { port } = cluster;
  client = new OpenAI({ apiKey: key, baseURL: `http://127.0.0.1:${port}/v1`, maxRetries: 0, timeout: 120000 });
});

after(async () => {
  await cluster?.stop();
});

// An independent check of a value against the schema subset pdserve implements (the same
// rules as tests/unit/constraint/json_validate.h): returns '' or what failed.
function invalid(v, s, root = s, at = '#') {
  if (s === true) return '';
  if (s.$ref) return invalid(v, root.$defs[s.$ref.split('/').pop()], root, at);
  if ('const' in s && JSON.stringify(v) !== JSON.stringify(s.const)) return `${at}: const`;
  if (s.enum && !s.enum.some((e) => JSON.stringify(e) === JSON.stringify(v))) return `${at}: enum`;
  const branches = s.anyOf ?? s.oneOf;
  if (branches && branches.every((b) => invalid(v, b, root, at) !== '')) return `${at}: anyOf`;
  if (s.type) {
    const types = Array.isArray(s.type) ? s.type : [s.type];
    const is = (t) => ({
      object: v !== null && typeof v === 'object' && !Array.isArray(v), array: Array.isArray(v),
      string: typeof v === 'string', integer: Number.isInteger(v), number: typeof v === 'number',
      boolean: typeof v === 'boolean', null: v === null })[t];
    if (!types.some(is)) return `${at}: type ${s.type}`;
  }
  if (v !== null && typeof v === 'object' && !Array.isArray(v)) {
    for (const k of s.required ?? []) if (!(k in v)) return `${at}: required ${k}`;
    for (const [k, sub] of Object.entries(v)) {
      if (s.properties && k in s.properties) {
        const why = invalid(sub, s.properties[k], root, `${at}/${k}`);
        if (why) return why;
      } else if (s.additionalProperties === false) {
        return `${at}: additional property ${k}`;
      }
    }
  }
  if (Array.isArray(v)) {
    if (v.length < (s.minItems ?? 0) || v.length > (s.maxItems ?? Infinity)) return `${at}: items count`;
    for (const [i, e] of v.entries()) {
      const why = s.items ? invalid(e, s.items, root, `${at}/${i}`) : '';
      if (why) return why;
    }
  }
  if (typeof v === 'string' && ([...v].length < (s.minLength ?? 0) || [...v].length > (s.maxLength ?? Infinity)))
    return `${at}: length`;
  return '';
}

// A tool-call-like schema whose every string is bounded, so even a random-weight model's
// answer ends within max_tokens (finish_reason stop).
const weather = {
  type: 'object',
  properties: {
    city: { type: 'string', maxLength: 12 },
    unit: { type: 'string', enum: ['celsius', 'fahrenheit'] },
    days: { type: 'integer' },
    hourly: { type: 'boolean' },
    at: { anyOf: [{ type: 'null' }, { $ref: '#/$defs/point' }] },
    tags: { type: 'array', items: { type: 'string', maxLength: 4 }, maxItems: 3 },
  },
  required: ['city', 'unit', 'days', 'hourly', 'at', 'tags'],
  additionalProperties: false,
  $defs: { point: { type: 'object', properties: { lat: { type: 'number' }, lon: { type: 'number' } },
                    required: ['lat', 'lon'], additionalProperties: false } },
};
const responseFormat = { type: 'json_schema', json_schema: { name: 'weather', strict: true, schema: weather } };
const longContent = 'Tell me the weather as JSON. '.repeat(12);  // > 64 tokens: disaggregated

function checkAnswer(text, finish, label) {
  let value;
  assert.doesNotThrow(() => { value = JSON.parse(text); }, `${label}: not JSON: ${JSON.stringify(text)}`);
  assert.equal(invalid(value, weather), '', `${label}: ${text}`);
  assert.equal(finish, 'stop', `${label}: ${text}`);
  return value;
}

for (const [route, content] of [['colocated', 'weather?'], ['disaggregated', longContent]]) {
  test(`json_schema answers validate, n = 2, ${route}`, async () => {
    const r = await client.chat.completions.create({
      model: 'small', messages: [{ role: 'user', content }], response_format: responseFormat, n: 2,
      temperature: 1, seed: 11, max_completion_tokens: 500, logprobs: true, top_logprobs: 2 });
    assert.equal(r.choices.length, 2);
    for (const c of r.choices) {
      checkAnswer(c.message.content, c.finish_reason, `choice ${c.index}`);
      assert.ok(c.logprobs.content.length > 0);
    }
    assert.equal(r.usage.pdserve_timing.route, route);
  });

  test(`json_schema answers validate when streamed, n = 2, ${route}`, async () => {
    // Another prompt than the test above: a cached prefix would route it colocated.
    const stream = await client.chat.completions.create({
      model: 'small', messages: [{ role: 'user', content: `Streamed. ${content}` }], response_format: responseFormat, n: 2,
      temperature: 0.9, top_p: 0.9, max_completion_tokens: 500, stream: true, stream_options: { include_usage: true } });
    const text = ['', ''], finish = [null, null];
    let usage;
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        text[c.index] += c.delta?.content ?? '';
        finish[c.index] = c.finish_reason ?? finish[c.index];
      }
      if (chunk.usage) usage = chunk.usage;
    }
    for (const i of [0, 1]) checkAnswer(text[i], finish[i], `streamed choice ${i}`);
    assert.equal(usage.pdserve_timing.route, route);
  });
}

test('the SDK parse() helper reads the structured answer', async () => {
  const r = await client.chat.completions.parse({
    model: 'small', messages: [{ role: 'user', content: 'weather?' }], response_format: responseFormat,
    temperature: 0, max_completion_tokens: 500 });
  const m = r.choices[0].message;
  assert.deepEqual(m.parsed, checkAnswer(m.content, r.choices[0].finish_reason, 'parse()'));
});

test('max_tokens still cuts a constrained answer (finish_reason length)', async () => {
  const r = await client.chat.completions.create({
    model: 'small', messages: [{ role: 'user', content: 'weather?' }], response_format: responseFormat,
    temperature: 0, max_completion_tokens: 12 });
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 12);
  // The small model's tokens are bytes: 12 of them are the first property's opening and two more.
  assert.ok(r.choices[0].message.content.startsWith('{"city": "'), r.choices[0].message.content);
});

test('json_object, guided_choice and guided_regex on completions', async () => {
  const choice = await client.completions.create({
    model: 'small', prompt: 'Pick one:', guided_choice: ['red', 'green', 'blue'], max_tokens: 20, n: 2, seed: 3 });
  for (const c of choice.choices) {
    assert.ok(['red', 'green', 'blue'].includes(c.text), c.text);
    assert.equal(c.finish_reason, 'stop');
  }
  const regex = await client.completions.create({
    model: 'small', prompt: 'A date:', guided_regex: '20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]', max_tokens: 20,
    temperature: 1, seed: 4 });
  assert.match(regex.choices[0].text, /^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$/);
  const obj = await client.completions.create({
    model: 'small', prompt: 'JSON:', response_format: { type: 'json_object' }, max_tokens: 8, temperature: 0 });
  assert.ok(obj.choices[0].text.startsWith('{'), obj.choices[0].text);
  const so = await client.completions.create({
    model: 'small', prompt: 'yes or no?', structured_outputs: { choice: ['yes', 'no'] }, max_tokens: 5 });
  assert.ok(['yes', 'no'].includes(so.choices[0].text));
});

test('unimplemented schema keywords and constructs are a BadRequestError naming them', async () => {
  const refused = (param, words) => (e) =>
    e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === param && e.message.includes(words);
  const messages = [{ role: 'user', content: 'x' }];
  const withKeyword = (extra) => ({ type: 'json_schema', json_schema: { name: 'w', schema: {
    type: 'object', properties: { a: { type: 'string', ...extra } } } } });
  await assert.rejects(client.chat.completions.create({
    model: 'small', messages, response_format: withKeyword({ pattern: '^a+$' }) }), refused('response_format', "'pattern'"));
  await assert.rejects(client.chat.completions.create({
    model: 'small', messages, response_format: withKeyword({ format: 'email' }) }), refused('response_format', "'format'"));
  await assert.rejects(client.completions.create({ model: 'small', prompt: 'x', guided_regex: '(?=a)a' }),
                       refused('guided_regex', 'lookaround'));
  await assert.rejects(client.completions.create({ model: 'small', prompt: 'x', guided_grammar: 'root ::= "a"' }),
                       refused('guided_grammar', 'not supported'));
});
