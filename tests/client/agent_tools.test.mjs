// Agent traffic through the official OpenAI Node SDK (npm `openai`, pinned in tests/npm)
// against a real local cluster (`pdserve up`): tool calls with tool_choice required and a
// named function, not streamed and streamed, n = 2, on the colocated and the disaggregated
// path, whose arguments must validate against the tool's schema even from the random-weight
// model (the constraint forces the call); a tool-call history; the Responses API
// (responses.create, not streamed and streamed, with a function tool); and the refusals
// (endpoints not served, store / previous_response_id).
//
// usage: node --test tests/client/agent_tools.test.mjs   (env PDSERVE_BIN_DIR, PDSERVE_WORK_DIR)
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { startLocalCluster } from './local_cluster.mjs';

const require = createRequire(new URL('../npm/package.json', import.meta.url));
const { default: OpenAI } = await import(require.resolve('openai'));
// An agent framework's client: the AI SDK (npm `ai`) with its OpenAI provider, whose default
// model speaks the Responses API.
const { generateObject, generateText, streamText, tool } = await import(require.resolve('ai'));
const { createOpenAI } = await import(require.resolve('@ai-sdk/openai'));
const { z } = await import(require.resolve('zod'));

const binDir = process.env.PDSERVE_BIN_DIR ?? 'build/bin';
const work = process.env.PDSERVE_WORK_DIR ?? 'build/test_agent_tools';
const key = 'sk-pdserve-test';
let cluster, client, aiProvider;

before(async () => {
  // The small model's template shows no tool-call syntax: the parser is named.
  cluster = await startLocalCluster({ binDir, work, key, router: 'requests: {tool_call_parser: hermes}' });
  const { port } = cluster;
  client = new OpenAI({ apiKey: key, baseURL: `http://127.0.0.1:${port}/v1`, maxRetries: 0, timeout: 120000 });
  aiProvider = createOpenAI({ apiKey: key, baseURL: `http://127.0.0.1:${port}/v1` });
});

after(async () => {
  await cluster?.stop();
});

// Bounded strings, so that even random weights finish the call within max_tokens.
const weatherParams = {
  type: 'object',
  properties: {
    city: { type: 'string', maxLength: 8 },
    unit: { type: 'string', enum: ['celsius', 'fahrenheit'] },
  },
  required: ['city', 'unit'],
  additionalProperties: false,
};
const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'The weather in a city', parameters: weatherParams } },
  { type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: { zone: { type: 'string', maxLength: 8 } }, required: ['zone'], additionalProperties: false } } },
];
const schemaOf = { get_weather: weatherParams, get_time: tools[1].function.parameters };

// The JSON-schema subset the tests' tools use, checked the way a client would.
function validate(value, schema, at = '$') {
  if (schema.enum) assert.ok(schema.enum.includes(value), `${at}: ${JSON.stringify(value)} not in enum`);
  if (schema.type === 'string') {
    assert.equal(typeof value, 'string', `${at}: expected a string`);
    if (schema.maxLength !== undefined) assert.ok([...value].length <= schema.maxLength, `${at}: too long`);
  } else if (schema.type === 'integer') {
    assert.ok(Number.isInteger(value), `${at}: expected an integer, got ${JSON.stringify(value)}`);
  } else if (schema.type === 'object') {
    assert.ok(value && typeof value === 'object' && !Array.isArray(value), `${at}: expected an object`);
    for (const k of schema.required ?? []) assert.ok(k in value, `${at}.${k}: required`);
    for (const [k, v] of Object.entries(value)) {
      assert.ok(schema.properties[k], `${at}.${k}: not in the schema`);
      validate(v, schema.properties[k], `${at}.${k}`);
    }
  }
}

function checkCall(call, wantName) {
  assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
  assert.equal(call.type, 'function');
  if (wantName) assert.equal(call.function.name, wantName);
  assert.ok(schemaOf[call.function.name], `unknown function ${call.function.name}`);
  validate(JSON.parse(call.function.arguments), schemaOf[call.function.name]);
}

const user = (text) => [{ role: 'user', content: text }];
const shortPrompt = user('What is the weather in Oslo?');
// Over router.routing.short_prompt_tokens: disaggregated. Each test its own words, so no
// prefix-cache hit on the decode worker turns it colocated.
let longPrompts = 0;
const longPrompt = () => { const k = ++longPrompts; return user(Array.from({ length: 120 }, (_, i) => `w${k}x${i}`).join(' ') + ' Weather?'); };

for (const route of ['colocated', 'disaggregated']) {
  for (const choice of ['required', { type: 'function', function: { name: 'get_weather' } }]) {
    const label = typeof choice === 'string' ? choice : 'named';
    const prompt = () => (route === 'colocated' ? shortPrompt : longPrompt());
    test(`tool call, ${label}, not streamed, n=2, ${route}`, async () => {
      const { data: r, response } = await client.chat.completions.create({
        model: 'small', messages: prompt(), tools, tool_choice: choice, n: 2, max_tokens: 200, temperature: 1, seed: 7,
      }).withResponse();
      assert.ok(response.headers.get('x-pdserve-route').startsWith(route), response.headers.get('x-pdserve-route'));
      assert.equal(r.choices.length, 2);
      for (const c of r.choices) {
        assert.equal(c.finish_reason, 'tool_calls', JSON.stringify(c));
        assert.equal(c.message.tool_calls.length, 1);
        checkCall(c.message.tool_calls[0], label === 'named' ? 'get_weather' : undefined);
      }
      assert.ok(r.usage.completion_tokens > 0);
    });

    test(`tool call, ${label}, streamed, n=2, ${route}`, async () => {
      const { data: stream, response } = await client.chat.completions.create({
        model: 'small', messages: prompt(), tools, tool_choice: choice, n: 2, max_tokens: 200, stream: true,
      }).withResponse();
      assert.ok(response.headers.get('x-pdserve-route').startsWith(route));
      const calls = [new Map(), new Map()];
      const finish = [];
      for await (const chunk of stream) {
        for (const c of chunk.choices) {
          for (const d of c.delta.tool_calls ?? []) {
            const have = calls[c.index].get(d.index);
            if (!have) {
              // A call's first delta: its id, type and name; arguments follow.
              assert.ok(d.id && d.function.name, JSON.stringify(d));
              calls[c.index].set(d.index, { id: d.id, type: d.type, function: { name: d.function.name, arguments: d.function.arguments ?? '' } });
            } else {
              assert.equal(d.id, undefined);
              have.function.arguments += d.function.arguments ?? '';
            }
          }
          if (c.finish_reason) finish[c.index] = c.finish_reason;
        }
      }
      for (let i = 0; i < 2; ++i) {
        assert.equal(finish[i], 'tool_calls');
        assert.equal(calls[i].size, 1);
        checkCall(calls[i].get(0), label === 'named' ? 'get_weather' : undefined);
      }
    });
  }
}

test('tool_choice auto and none answer; a tool-call history renders', async () => {
  const auto = await client.chat.completions.create({ model: 'small', messages: shortPrompt, tools, max_tokens: 8 });
  const m = auto.choices[0].message;
  // Random weights: text or a call, never a half-made call.
  if (m.tool_calls) m.tool_calls.forEach((c) => checkCall(c));
  else assert.equal(typeof m.content, 'string');
  const none = await client.chat.completions.create({ model: 'small', messages: shortPrompt, tools, tool_choice: 'none', max_tokens: 4, ignore_eos: true });
  assert.equal(none.choices[0].message.tool_calls, undefined);
  assert.equal(none.choices[0].finish_reason, 'length');
  const history = await client.chat.completions.create({
    model: 'small', tools, max_tokens: 4,
    messages: [...shortPrompt,
      { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo","unit":"celsius"}' } }] },
      { role: 'tool', tool_call_id: 'call_1', content: '21 C, sunny' }],
  });
  assert.ok(history.usage.prompt_tokens > auto.usage.prompt_tokens);
});

test('tools are refused by name where they are wrong', async () => {
  await assert.rejects(client.chat.completions.create({ model: 'small', messages: shortPrompt, tools: [{ type: 'web_search' }] }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'tools');
  await assert.rejects(client.chat.completions.create({ model: 'small', messages: shortPrompt, tools, tool_choice: { type: 'function', function: { name: 'nope' } } }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'tool_choice');
});

test('responses.create, not streamed: text, usage, and a forced function call', async () => {
  const r = await client.responses.create({ model: 'small', input: 'Say hi.', instructions: 'Be brief.', max_output_tokens: 6, temperature: 0 });
  assert.match(r.id, /^resp_/);
  assert.equal(r.object, 'response');
  assert.equal(r.output[0].type, 'message');
  assert.equal(typeof r.output_text, 'string');
  assert.equal(r.usage.output_tokens, 6);
  assert.equal(r.usage.total_tokens, r.usage.input_tokens + 6);
  assert.equal(r.status, 'incomplete');
  assert.equal(r.incomplete_details.reason, 'max_output_tokens');
  assert.equal(r.instructions, 'Be brief.');

  // text.format: the structured outputs of chat, flat as the Responses API has them.
  const place = {
    type: 'object', additionalProperties: false, required: ['zone', 'city'],
    properties: { zone: { type: 'string', maxLength: 4 }, city: { type: 'string', maxLength: 6 } },
  };
  const structured = await client.responses.create({
    model: 'small', input: 'Where?', max_output_tokens: 200,
    text: { format: { type: 'json_schema', name: 'place', schema: place, strict: true } },
  });
  assert.equal(structured.status, 'completed', JSON.stringify(structured.output));
  validate(JSON.parse(structured.output_text), place);
  // Properties come in the schema's order (zone first), not sorted.
  assert.match(structured.output_text, /^\{"zone": /);

  const call = await client.responses.create({
    model: 'small', input: [{ role: 'user', content: 'Weather in Oslo?' }], max_output_tokens: 200,
    tools: [{ type: 'function', name: 'get_weather', parameters: weatherParams, strict: true }],
    tool_choice: { type: 'function', name: 'get_weather' },
  });
  const fc = call.output.filter((o) => o.type === 'function_call');
  assert.equal(fc.length, 1, JSON.stringify(call.output));
  assert.equal(fc[0].name, 'get_weather');
  assert.match(fc[0].call_id, /^call_/);
  validate(JSON.parse(fc[0].arguments), weatherParams);
  // The next turn sends the call and its output back as items.
  const next = await client.responses.create({
    model: 'small', max_output_tokens: 4,
    input: [{ role: 'user', content: 'Weather in Oslo?' }, fc[0],
            { type: 'function_call_output', call_id: fc[0].call_id, output: '21 C' }],
  });
  // Random weights may end early (EOS); the call and its output are in the prompt either way.
  assert.ok(next.usage.input_tokens > call.usage.input_tokens + 10, JSON.stringify(next.usage));
  if (next.status === 'incomplete') assert.equal(next.usage.output_tokens, 4);
  else assert.equal(next.status, 'completed');
});

test('responses.create, streamed: the documented event sequence', async () => {
  const stream = await client.responses.create({ model: 'small', input: 'Hello', max_output_tokens: 8, stream: true, temperature: 0, });
  const types = [];
  let text = '', done = '', seq = -1, final;
  for await (const ev of stream) {
    types.push(ev.type);
    assert.equal(ev.sequence_number, seq + 1);
    seq = ev.sequence_number;
    if (ev.type === 'response.output_text.delta') text += ev.delta;
    if (ev.type === 'response.output_text.done') done = ev.text;
    if (ev.type === 'response.completed' || ev.type === 'response.incomplete') final = ev.response;
  }
  assert.deepEqual(types.slice(0, 2), ['response.created', 'response.in_progress']);
  const body = types.slice(2, -1).filter((t) => t !== 'response.output_text.delta');
  assert.deepEqual(body, ['response.output_item.added', 'response.content_part.added', 'response.output_text.done',
                          'response.content_part.done', 'response.output_item.done']);
  assert.ok(types.includes('response.output_text.delta'));
  assert.equal(types.at(-1), 'response.incomplete');  // max_output_tokens ended it
  assert.equal(text, done);
  assert.equal(final.output[0].content[0].text, text);
  assert.equal(final.usage.output_tokens, 8);

  const calls = await client.responses.create({
    model: 'small', input: 'Time in Oslo?', max_output_tokens: 200, stream: true,
    tools: [{ type: 'function', name: 'get_time', parameters: tools[1].function.parameters }], tool_choice: 'required',
  });
  let args = '', argsDone, item;
  for await (const ev of calls) {
    if (ev.type === 'response.function_call_arguments.delta') args += ev.delta;
    if (ev.type === 'response.function_call_arguments.done') argsDone = ev.arguments;
    if (ev.type === 'response.output_item.done' && ev.item.type === 'function_call') item = ev.item;
  }
  assert.equal(args, argsDone);
  assert.equal(item.name, 'get_time');
  validate(JSON.parse(argsDone), tools[1].function.parameters);
});

test('refusals: endpoints not served, store and previous_response_id', async () => {
  await assert.rejects(client.embeddings.create({ model: 'small', input: 'x' }),
                       (e) => e instanceof OpenAI.NotFoundError && e.code === 'not_served' && /\/v1\/embeddings/.test(e.message));
  await assert.rejects(client.images.generate({ prompt: 'x' }),
                       (e) => e instanceof OpenAI.NotFoundError && e.code === 'not_served');
  await assert.rejects(client.responses.create({ model: 'small', input: 'x', previous_response_id: 'resp_1' }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'previous_response_id');
  await assert.rejects(client.responses.create({ model: 'small', input: 'x', store: true }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'store');
  await assert.rejects(client.responses.create({ model: 'small', input: 'x', reasoning: { effort: 'high' } }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'reasoning');
  await assert.rejects(client.chat.completions.create({ model: 'small', messages: user('x '.repeat(5000)) }),
                       (e) => e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded');
});

test('AI SDK: generateText and streamText over the Responses API, text and a required tool call', async () => {
  const text = await generateText({ model: aiProvider('small'), prompt: 'Say hi.', maxOutputTokens: 6, temperature: 0, maxRetries: 0 });
  assert.equal(typeof text.text, 'string');
  assert.equal(text.usage.outputTokens, 6);
  assert.equal(text.finishReason, 'length');
  const weather = tool({
    description: 'The weather in a city',
    inputSchema: z.object({ city: z.string().max(8), unit: z.enum(['celsius', 'fahrenheit']) }),
  });
  const called = await generateText({
    model: aiProvider('small'), prompt: 'Weather in Oslo?', tools: { get_weather: weather }, toolChoice: 'required',
    maxOutputTokens: 200, maxRetries: 0,
  });
  assert.equal(called.toolCalls.length, 1, JSON.stringify(called.content));
  assert.equal(called.toolCalls[0].toolName, 'get_weather');
  validate(called.toolCalls[0].input, weatherParams);
  assert.equal(called.finishReason, 'tool-calls');
  // Streamed, through the chat completions model of the same provider, a named tool.
  const streamed = streamText({
    model: aiProvider.chat('small'), prompt: 'Weather in Oslo?', tools: { get_weather: weather },
    toolChoice: { type: 'tool', toolName: 'get_weather' }, maxOutputTokens: 200, maxRetries: 0,
  });
  const calls = await streamed.toolCalls;
  assert.equal(calls.length, 1);
  validate(calls[0].input, weatherParams);
  assert.equal(await streamed.finishReason, 'tool-calls');
});

test('AI SDK: generateObject over the Responses API and chat completions answers what its zod schema accepts', async () => {
  // zod's .int() bounds every integer to the safe range: the schema carries minimum/maximum.
  const schema = z.object({
    city: z.string().max(12),
    days: z.number().int().min(1).max(14),
    low: z.number().min(-60).max(60),
    sunny: z.boolean(),
    tags: z.array(z.enum(['rain', 'wind', 'snow'])).max(2),
  });
  for (const model of [aiProvider('small'), aiProvider.chat('small')]) {
    const r = await generateObject({ model, schema, prompt: 'A forecast for Oslo.', maxOutputTokens: 300, maxRetries: 0 })
      .catch((e) => { throw new Error(`${e.message} finish=${e.finishReason} text=${e.text} cause=${e.cause}`); });
    assert.equal(schema.safeParse(r.object).success, true, JSON.stringify(r.object));
    assert.equal(r.finishReason, 'stop');
  }
});
