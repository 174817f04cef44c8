// Runs a wasm32-wasip1 test binary under Node's built-in WASI (placeholder; core owner completes).
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import { argv, env, exit } from 'node:process';
const [, , wasmPath, ...args] = argv;
const wasi = new WASI({ version: 'preview1', args: [wasmPath, ...args], env, preopens: { '/': '/' }, returnOnExit: true });
const mod = await WebAssembly.compile(await readFile(wasmPath));
const inst = await WebAssembly.instantiate(mod, wasi.getImportObject());
exit(wasi.start(inst));
