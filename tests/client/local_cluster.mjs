// One local cluster for the client tests: `pdserve up` with one prefill and one decode worker
// serving the random-weight `small` model (made once per work folder), an API key, tcp KV
// transfer and prompts over 64 tokens routed disaggregated. Resolves once pdserve up prints
// the port it serves on (the router binds an OS-chosen one), or rejects after 120 s.
//
//   const cluster = await startLocalCluster({ binDir, work, key, router: 'requests: {...}' });
//   cluster.port; await cluster.stop();
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { mkdirSync, writeFileSync, existsSync } from 'node:fs';
import path from 'node:path';

// router: extra keys of the router section, as YAML flow text (e.g. 'requests: {...}').
export async function startLocalCluster({ binDir, work, key, router = '' }) {
  mkdirSync(work, { recursive: true });
  const model = path.resolve(work, 'small');
  if (!existsSync(path.join(model, 'config.json'))) {
    const made = spawnSync(path.join(binDir, 'pdserve'), ['make-model', '--preset', 'small', '--out', model]);
    assert.equal(made.status, 0, String(made.stderr));
  }
  const config = path.join(work, 'cluster.yaml');
  writeFileSync(config, [
    `model: {path: ${model}, name: small}`,
    `router: {routing: {short_prompt_tokens: 64}, http: {api_keys: [${key}]},`,
    `         workers: {load_report_interval_ms: 50}${router ? `, ${router}` : ''}}`,
    'pools: {prefill: {replicas: 1}, decode: {replicas: 1}}',
    'engine: {threads: 2, kv_cache_bytes: 67108864}',
    'kv_transfer: {transports: [tcp]}',
    'logging: {level: warn}', ''].join('\n'));
  const child = spawn(path.join(binDir, 'pdserve'), ['up', '--config', config, '--port', '0', '--control-port', '0'],
                      { stdio: ['ignore', 'pipe', 'inherit'] });
  const port = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('pdserve up did not come up within 120 s')), 120000);
    let out = '';
    child.stdout.on('data', (d) => {
      out += d;
      const up = out.match(/pdserve is up: http:\/\/127\.0\.0\.1:(\d+)\//);
      if (up) { clearTimeout(timer); resolve(Number(up[1])); }
    });
    child.on('exit', (code) => { clearTimeout(timer); reject(new Error(`pdserve up exited with ${code}`)); });
  });
  return {
    port,
    // SIGINT: pdserve up drains and stops every process it started.
    async stop() {
      if (child.exitCode !== null || child.signalCode !== null) return;
      const exited = new Promise((resolve) => child.on('exit', resolve));
      child.kill('SIGINT');
      await exited;
    },
  };
}
