//! `kvroute-overhead` (`make bench-overhead`): plain Envoy vs a trivial body-buffering Wasm
//! filter vs kvroute, and kvroute as a native dynamic module when one is given, side by
//! side, alternating repetitions (see `kvroute_tools::overhead` and `docs/overhead.md`).
//!
//! ```text
//! kvroute-overhead --floor-wasm target/wasm32-wasip1/release/kvroute_floor_filter.wasm
//! kvroute-overhead --sizes 1024,16384 --reps 1 --duration 2   # a quick look
//! kvroute-overhead --dynmod target/dynmod/libkvroute_dynmod.so  # plus kvroute-native
//! kvroute-overhead --dynmod ... --floor-dynmod target/dynmod/libkvroute_floor_dynmod.so
//! kvroute-overhead --callgrind 300                               # instructions per request
//! kvroute-overhead --write-bodies target/decision-ops             # the bodies, for wasm-ops.py
//! ```
//! Prints one progress line per wrk run, then the Markdown tables. Exit code 1 on any setup
//! error (a failed snapshot push to a proxy included), non-2xx response or Wasm failure;
//! 130 on SIGINT or SIGTERM, after stopping every Envoy and wrk it started.

use clap::Parser;
use kvroute_integration::harness::{wasm_path, workspace_root};
use kvroute_tools::callgrind::{self, CallgrindOptions};
use kvroute_tools::demo::signal::shutdown_signal;
use kvroute_tools::overhead::{chat_body, prompts, run, DynModule, Options};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Data-plane overhead: plain Envoy, floor filter, kvroute (Wasm), and with modules
/// floor-native, floor-dynmod and kvroute-native.
#[derive(Debug, Parser)]
#[command(name = "kvroute-overhead", version)]
struct Args {
    /// Body sizes in bytes, comma-separated (default 1 KiB, 16 KiB, 256 KiB, 1 MiB).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,16384,262144,1048576"
    )]
    sizes: Vec<usize>,
    /// Repetitions per size and proxy (medians are reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seconds per wrk run.
    #[arg(long, default_value_t = 5)]
    duration: u64,
    /// wrk connections.
    #[arg(long, default_value_t = 8)]
    connections: u32,
    /// wrk binary.
    #[arg(long, env = "WRK", default_value = "wrk")]
    wrk: PathBuf,
    /// The floor filter's .wasm (`make wasm-floor`).
    #[arg(long, env = "KVROUTE_FLOOR_WASM")]
    floor_wasm: Option<PathBuf>,
    /// Shared test data (`../shared/data`).
    #[arg(long, env = "KVROUTE_SHARED_DATA")]
    data: Option<PathBuf>,
    /// Instead of the timed runs, count Envoy's instructions per request under callgrind
    /// (deterministic on a noisy machine): N requests in the shorter counted window.
    #[arg(long, value_name = "N")]
    callgrind: Option<usize>,
    /// Uncounted requests before counting (with --callgrind).
    #[arg(long, default_value_t = 1000)]
    callgrind_warmup: usize,
    /// valgrind binary (with --callgrind).
    #[arg(long, env = "VALGRIND", default_value = "valgrind")]
    valgrind: PathBuf,
    /// Proxies to count (with --callgrind; default all: plain, floor, kvroute, and
    /// floor-native and kvroute-native with --dynmod, floor-dynmod with --floor-dynmod too).
    #[arg(long, value_delimiter = ',')]
    callgrind_proxies: Vec<String>,
    /// Keep each counted window's callgrind dump in DIR (`<proxy>-<size>-<requests>.out`)
    /// for `callgrind_annotate` (with --callgrind).
    #[arg(long, value_name = "DIR")]
    callgrind_keep: Option<PathBuf>,
    /// callgrind_control script (with --callgrind).
    #[arg(long, env = "CALLGRIND_CONTROL", default_value = "callgrind_control")]
    callgrind_control: PathBuf,
    /// Answer every request with an event stream of N token events (and a `usage` event
    /// and `[DONE]`), each its own body chunk, instead of one non-streamed completion.
    #[arg(long, value_name = "N", default_value_t = 0)]
    stream_events: usize,
    /// Microseconds between a streamed response's chunks (with --stream-events).
    #[arg(long, value_name = "US", default_value_t = 200)]
    stream_gap_us: u64,
    /// JSON object of kvroute plugin settings laid over the benchmark's own (e.g.
    /// `'{"usage_sample_ms":0}'` to read every response's usage); keys of the filter's
    /// configuration reference (docs/filter.md).
    #[arg(long, value_name = "JSON")]
    plugin_config: Option<String>,
    /// Instead of running, write the benchmark's request bodies to DIR as
    /// `body-<size>.json`, one per size (`make bench-decision-ops` counts their decisions).
    #[arg(long, value_name = "DIR")]
    write_bodies: Option<PathBuf>,
    /// kvroute as a native Envoy dynamic module (`lib<name>.so`): adds the kvroute-native
    /// proxy, loaded by `DynamicModuleFilter` with the same configuration. Without it (or
    /// empty) that column is skipped.
    #[arg(long, env = "KVROUTE_DYNMOD", value_name = "PATH",
          value_parser = clap::builder::OsStringValueParser::new())]
    dynmod: Option<OsString>,
    /// The filter name the dynamic module implements (`DynamicModuleFilter.filter_name`).
    #[arg(long, value_name = "NAME", default_value = DynModule::FILTER_NAME)]
    dynmod_filter_name: String,
    /// Push no snapshot to the dynamic module's ingest listener: runs a module without the
    /// ingest role (it then routes without endpoint stats).
    /// (`KVROUTE_DYNMOD_SKIP_PUSH`: any value but empty, `0`, `false`, `no`, `off`, `n`, `f`.)
    #[arg(long, env = "KVROUTE_DYNMOD_SKIP_PUSH",
          value_parser = clap::builder::FalseyValueParser::new())]
    dynmod_skip_push: bool,
    /// `bench/floor-dynmod`'s module (`libkvroute_floor_dynmod.so`, with `--dynmod`): adds
    /// the floor-dynmod proxy, kvroute-native's config with that module instead, which
    /// buffers, copies the body and sets a fixed routing header: the cost of hosting a
    /// body-routing module. Without it (or empty) that column is skipped.
    #[arg(long, env = "KVROUTE_FLOOR_DYNMOD", value_name = "PATH",
          value_parser = clap::builder::OsStringValueParser::new())]
    floor_dynmod: Option<OsString>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let a = Args::parse();
    let mut work = Box::pin(overhead(a));
    tokio::select! {
        r = &mut work => match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("Error: {e:#}");
                ExitCode::from(1)
            }
        },
        sig = shutdown_signal() => {
            // Dropping the run kills and reaps every Envoy and wrk it started (their guards
            // and `kill_on_drop`) and removes their temp files.
            drop(work);
            eprintln!("kvroute-overhead: {sig}: stopped every process it started");
            ExitCode::from(130)
        }
    }
}

/// The benchmark as `a` asks (see the module doc).
async fn overhead(a: Args) -> anyhow::Result<()> {
    let kvroute_wasm = wasm_path();
    let floor_wasm = a.floor_wasm.unwrap_or_else(|| {
        kvroute_wasm
            .parent()
            .map(|d| d.join("kvroute_floor_filter.wasm"))
            .unwrap_or_default()
    });
    let opts = Options {
        sizes: a.sizes,
        reps: a.reps.max(1),
        duration: Duration::from_secs(a.duration.max(1)),
        connections: a.connections.max(1),
        wrk: a.wrk,
        floor_wasm,
        kvroute_wasm,
        data: a
            .data
            .unwrap_or_else(|| workspace_root().join("../shared/data")),
        stream_events: a.stream_events,
        stream_gap: Duration::from_micros(a.stream_gap_us),
        plugin_config: a.plugin_config,
        dynmod: a.dynmod.filter(|p| !p.is_empty()).map(|path| DynModule {
            path: path.into(),
            filter_name: a.dynmod_filter_name,
            push: !a.dynmod_skip_push,
        }),
        floor_dynmod: a
            .floor_dynmod
            .filter(|p| !p.is_empty())
            .map(|path| DynModule {
                path: path.into(),
                filter_name: "floor".into(),
                push: false,
            }),
    };
    if let Some(dir) = &a.write_bodies {
        let prompts = prompts(&opts.data)?;
        std::fs::create_dir_all(dir)?;
        for &size in &opts.sizes {
            let path = dir.join(format!("body-{size}.json"));
            std::fs::write(&path, chat_body(size, &prompts, opts.stream_events > 0))?;
            println!("{}", path.display());
        }
        return Ok(());
    }
    if let Some(requests) = a.callgrind {
        let cg = CallgrindOptions {
            requests,
            warmup: a.callgrind_warmup,
            idle: Duration::from_secs(6),
            valgrind: a.valgrind,
            control: a.callgrind_control,
            variants: a.callgrind_proxies,
            keep: a.callgrind_keep,
        };
        if let Some(dir) = &cg.keep {
            std::fs::create_dir_all(dir)?;
        }
        let rows = callgrind::run(&opts, &cg, |line| println!("{line}")).await?;
        println!();
        print!("{}", callgrind::markdown(&rows));
        return Ok(());
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average before: {}", load.trim());
    let report = run(&opts, |line| println!("{line}")).await?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average after: {}", load.trim());
    println!();
    print!("{}", report.markdown());
    Ok(())
}
