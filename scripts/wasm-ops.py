#!/usr/bin/env python3
"""Wasm operations of one routing decision (`make bench-decision-ops`, docs/overhead.md).

    wasm-ops.py DECISION_OPS.wasm BODY.json [BODY.json ...]

Runs core's `decision_ops` example (built for wasm32-wasip1) under Wasmtime with fuel
metering (one unit of fuel per Wasm operation, scalar or SIMD) for N = 1 and N = 3
decisions on each body, in both modes (`route`: Router::route; `analysis`: the request
analysis alone), and prints one Markdown row per body: (fuel(3) - fuel(1)) / 2, so start-up
and file reading cancel out. Deterministic: the same .wasm and body give the same counts
on any machine. Exit status 1 when a run fails (the example exits 1 when a decision does
not route).
"""
import os
import sys
from typing import NoReturn

import wasmtime

FUEL = 10**13


def fail(message: str) -> NoReturn:
    print(f"wasm-ops: {message}", file=sys.stderr)
    raise SystemExit(1)


def fuel(wasm: str, mode: str, n: int, body: str) -> int:
    config = wasmtime.Config()
    config.consume_fuel = True
    engine = wasmtime.Engine(config)
    store = wasmtime.Store(engine)
    store.set_fuel(FUEL)
    wasi = wasmtime.WasiConfig()
    wasi.argv = ["decision_ops", mode, str(n), "/bodies/" + os.path.basename(body)]
    wasi.preopen_dir(os.path.dirname(os.path.abspath(body)), "/bodies")
    wasi.inherit_stderr()
    store.set_wasi(wasi)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    instance = linker.instantiate(store, wasmtime.Module.from_file(engine, wasm))
    try:
        instance.exports(store)["_start"](store)
    except wasmtime.ExitTrap as e:
        if e.code != 0:
            fail(f"{body}: decision_ops {mode} exited {e.code} (see its message above)")
    return FUEL - store.get_fuel()


def per_decision(wasm: str, mode: str, body: str) -> int:
    return (fuel(wasm, mode, 3, body) - fuel(wasm, mode, 1, body)) // 2


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    # Every file checked before the table starts: a missing one is a message, not a
    # traceback under half a table.
    for path in sys.argv[1:]:
        if not os.path.isfile(path):
            fail(f"{path}: no such file (the .wasm: `make bench-decision-ops` builds it; bodies: `kvroute-overhead --write-bodies DIR`)")
    wasm, bodies = sys.argv[1], sorted(sys.argv[2:], key=os.path.getsize)
    rows = []
    for body in bodies:
        route = per_decision(wasm, "route", body)
        analysis = per_decision(wasm, "analysis", body)
        if route <= 0 or analysis <= 0:
            fail(f"{body}: no operations counted")
        rows.append(f"| {os.path.basename(body)} | {os.path.getsize(body)} | {route} | {analysis} |")
    print("| body | bytes | Router::route, Wasm ops | request analysis, Wasm ops |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
