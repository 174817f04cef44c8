// Runs a wasm32-wasip1 binary (e.g. a `cargo test --target wasm32-wasip1` test harness) under
// Node's built-in WASI (Node >= 20). Cargo calls it as the target runner
// (.cargo/config.toml): `node scripts/wasi-run.mjs <file.wasm> [args...]`.
//
// The guest sees the host's environment (so KVROUTE_SHARED_DATA reaches the tests) and the
// host file system under `/` (absolute paths work unchanged), and its exit status becomes ours.
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import { argv, env, exit, stderr } from 'node:process';

const [, , wasmPath, ...args] = argv;
if (!wasmPath) {
  stderr.write('usage: node scripts/wasi-run.mjs <file.wasm> [args...]\n');
  exit(2);
}
const wasi = new WASI({
  version: 'preview1',
  args: [wasmPath, ...args],
  env,
  preopens: { '/': '/' },
  returnOnExit: true,
});
const mod = await WebAssembly.compile(await readFile(wasmPath));
const inst = await WebAssembly.instantiate(mod, wasi.getImportObject());
exit(wasi.start(inst));
