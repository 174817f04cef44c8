//! `kvroute-cp`: command-line entry point. Loads and validates the config, starts the
//! control plane, reloads on SIGHUP or when the config file changes, and shuts down
//! gracefully on SIGTERM/SIGINT.

use anyhow::Context;
use clap::Parser;
use kvroute_cp::{Config, ControlPlane};
use std::io::IsTerminal;
use std::path::PathBuf;
use tokio::signal::unix::{signal, SignalKind};
use tracing_subscriber::EnvFilter;

/// mimalloc instead of glibc malloc: per scrape, hyper allocates and frees a 16 KiB read
/// buffer per read, and glibc's large-chunk paths (`malloc_consolidate`) were about a fifth
/// of the control plane's CPU at 1,000 endpoints (README, control-plane benchmark).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Quiet time after a config-file event before reloading.
const FILE_DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(200);

/// kvroute control plane: scrapes model servers' /metrics and pushes KV stats to every Envoy.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Config file (YAML).
    #[arg(long, env = "KVROUTE_CP_CONFIG")]
    config: PathBuf,
    /// Override `listen` (own HTTP server address, ip:port).
    #[arg(long, env = "KVROUTE_CP_LISTEN")]
    listen: Option<std::net::SocketAddr>,
    /// Log format.
    #[arg(long, env = "KVROUTE_CP_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Validate the config, print what it will do (token found and where from, defaulted
    /// clusters) and exit: 0 when fine, 2 on an error.
    #[arg(long)]
    check: bool,
    /// With --check: an Envoy config to cross-check (plugin configs, clusters, ingest token,
    /// ingest port and path; a buffer limit too small for the analysis is a note).
    #[arg(long, requires = "check")]
    envoy_config: Option<PathBuf>,
    /// Do not watch the config file for changes (SIGHUP still reloads).
    #[arg(long, env = "KVROUTE_CP_NO_WATCH")]
    no_watch: bool,
}

fn load(args: &Args) -> Result<Config, kvroute_cp::ConfigError> {
    let mut c = Config::load(&args.config)?;
    if let Some(l) = args.listen {
        c.listen = l;
    }
    Ok(c)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if args.log_format == "json" {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        // Colour only on a terminal: a log redirected to a file or collected by a
        // container runtime gets plain text, not ANSI escapes.
        tracing_subscriber::fmt()
            .with_ansi(std::io::stdout().is_terminal())
            .with_env_filter(filter)
            .init();
    }
    let config = match load(&args) {
        Ok(c) => c,
        Err(e) if args.check => std::process::exit(check_failed(e)),
        Err(e) => {
            eprintln!("kvroute-cp: {e}");
            std::process::exit(2);
        }
    };
    if args.check {
        std::process::exit(run_check(&args, &config));
    }
    // One worker: the work is I/O-bound (about a quarter of one core at 1,000 endpoints a
    // second), and a second worker mostly adds futex/eventfd wake-ups between threads
    // (README "Benchmark"). Parsing is bounded by `scrape.max_body_bytes`.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    rt.block_on(run(args, config))
}

/// `--check` stopped by `e` before its report (the file, a token or the Envoy config could
/// not be read): the error on stderr, the closing line every check ends with on stdout;
/// returns the exit code, 2.
fn check_failed(e: impl std::fmt::Display) -> i32 {
    eprintln!("kvroute-cp: {e}");
    println!("config NOT ok: 1 error(s)");
    2
}

/// `--check`: print the report, return the exit code.
fn run_check(args: &Args, config: &Config) -> i32 {
    // The tokens are read at start and on reload; check them too (never printed).
    let (token, scrape_token) = match (config.push.read_token(), config.scrape.token().read()) {
        (Ok(t), Ok(s)) => (t, s),
        (Err(e), _) | (_, Err(e)) => return check_failed(e),
    };
    let mut pool_tokens = std::collections::BTreeMap::new();
    for (pool, settings) in &config.scrape.pool_tokens {
        match settings.read() {
            Ok(t) => pool_tokens.insert(pool.clone(), t),
            Err(e) => return check_failed(e),
        };
    }
    let raw = match Config::load_raw(&args.config) {
        Ok((raw, _)) => raw,
        Err(e) => return check_failed(e),
    };
    let envoy = match &args.envoy_config {
        Some(p) => {
            match kvroute_cp::files::read_regular_text(p, kvroute_cp::files::MAX_CONFIG_BYTES) {
                Ok(t) => Some(t),
                Err(e) => {
                    return check_failed(format!("cannot read Envoy config {}: {e}", p.display()))
                }
            }
        }
        None => None,
    };
    let report = kvroute_cp::check::check(
        &raw,
        config,
        token.as_deref(),
        scrape_token.as_deref(),
        &pool_tokens,
        envoy.as_deref(),
    );
    let errors = report.errors();
    for f in &report.findings {
        println!("{f}");
    }
    if errors > 0 {
        println!("config NOT ok: {errors} error(s)");
        return 2;
    }
    let envoy_ok = if envoy.is_some() {
        kvroute_cp::check::envoy_ok_suffix(&report.envoy_matched)
    } else {
        String::new()
    };
    // What is watched, when anything is: the endpoints and targets of a Kubernetes config
    // come from its watches, so "0 endpoints, 0 targets" alone would say nothing.
    let k = &config.kubernetes;
    let watches = if k.is_empty() {
        String::new()
    } else {
        format!(
            ", watches {} InferencePools and {} gateway pod sets",
            k.pools.len(),
            k.gateways.len()
        )
    };
    println!(
        "config ok: {} endpoints, {} targets{watches}, listen {}{envoy_ok}",
        config.endpoints.len(),
        config.targets.len(),
        config.listen
    );
    0
}

async fn run(args: Args, config: Config) -> anyhow::Result<()> {
    let cp = ControlPlane::start(config).await?;
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
    let (file_tx, mut file_rx) = tokio::sync::mpsc::channel::<()>(1);
    let _watcher = if args.no_watch {
        None
    } else {
        watch_file(&args.config, file_tx)
    };
    loop {
        let why = tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => "SIGHUP",
            Some(()) = file_rx.recv() => {
                // Debounce: editors and `write` truncate then write; wait for 200 ms of quiet
                // so a half-written file is never loaded.
                while let Ok(Some(())) =
                    tokio::time::timeout(FILE_DEBOUNCE, file_rx.recv()).await
                {}
                "file change"
            }
        };
        match load(&args) {
            Ok(c) => {
                if let Err(e) = cp.reload(c).await {
                    tracing::error!(error = %e, trigger = why, "reload failed; keeping the running config");
                    cp.hub().telemetry.reload_failures.inc();
                }
            }
            Err(e) => {
                tracing::error!(error = %e, trigger = why, "invalid config; keeping the running config");
                cp.hub().telemetry.reload_failures.inc();
            }
        }
    }
    tracing::info!("shutting down");
    cp.shutdown().await;
    Ok(())
}

/// Watch the config file's directory (editors and Kubernetes ConfigMaps replace the file);
/// any event naming the file triggers a reload.
fn watch_file(
    path: &std::path::Path,
    tx: tokio::sync::mpsc::Sender<()>,
) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let name = path.file_name()?.to_owned();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut w = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if let Ok(ev) = ev {
            let relevant = ev.kind.is_modify() || ev.kind.is_create();
            if relevant
                && ev
                    .paths
                    .iter()
                    .any(|p| p.file_name() == Some(name.as_os_str()))
            {
                let _ = tx.try_send(());
            }
        }
    })
    .map_err(|e| tracing::warn!(error = %e, "cannot watch the config file; SIGHUP still reloads"))
    .ok()?;
    w.watch(&dir, notify::RecursiveMode::NonRecursive)
        .map_err(|e| tracing::warn!(error = %e, "cannot watch the config directory"))
        .ok()?;
    Some(w)
}
