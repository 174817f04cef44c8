//! The demo flow: for each routing (kvroute with the chosen policy, then Envoy round
//! robin), start a fresh stack, replay the same requests, collect the report and Envoy's
//! stats, stop the stack; then print the side-by-side table and write the report.

use super::gateway::{
    Backend, Gateway, GatewayOptions, Routing, STAT_DECISIONS, STAT_DEFAULT_ROUTE, STAT_FAIL_OPEN,
    STAT_SNAPSHOT_AGE_MS,
};
use super::llama::{LlamaOptions, LlamaServer};
use super::ports::{check_ports, PortPlan};
use super::sim::{start_sims, SimOptions};
use super::{DemoError, BACKEND_HEADER};
use crate::replay::{self, ReplayRequest, ReportFiles, RunOptions, RunReport, Summary};
use kvroute_core::picker::PolicyKind;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The model servers of a demo.
#[derive(Debug, Clone)]
pub enum Fleet {
    /// In-process kvroute-sim replicas.
    Sim(SimOptions),
    /// llama-server children, started with these options (ports from the plan).
    Llama {
        /// Number of servers.
        servers: usize,
        /// Per-server options (`port` is replaced by the plan's).
        opts: LlamaOptions,
    },
}

/// Which stacks [`run_demo`] replays the trace through, one after the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arms {
    /// kvroute, then Envoy's own round robin (the comparison).
    #[default]
    Both,
    /// kvroute alone.
    KvrouteOnly,
    /// Envoy round robin alone (e.g. to run the two arms in parallel on a large machine).
    RoundRobinOnly,
}

/// Options of [`run_demo`].
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// The backends.
    pub fleet: Fleet,
    /// Model the backends serve.
    pub model: String,
    /// The kvroute picker policy of the first run.
    pub policy: PolicyKind,
    /// Ports.
    pub ports: PortPlan,
    /// Envoy `--concurrency`.
    pub envoy_concurrency: u32,
    /// Replay settings of both runs (`url`, `label`, `backend_header`, `kv_sample` are set
    /// per run).
    pub run: RunOptions,
    /// Where [`replay::write_report`] writes (`None`: no files).
    pub out: Option<PathBuf>,
    /// Which runs: kvroute then Envoy round robin (the default), or one of them.
    pub arms: Arms,
    /// Print progress lines to stderr.
    pub verbose: bool,
}

/// Envoy's view of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GatewayStats {
    /// Filter decisions by the configured policy.
    pub filter_decisions: u64,
    /// Filter internal errors that fell open.
    pub fail_open: u64,
    /// Requests that took the default route (no filter decision).
    pub default_route: u64,
    /// Age of the snapshot of the last decision, ms (the filter's gauge; `None` in
    /// round-robin mode).
    pub snapshot_age_ms: Option<u64>,
    /// Largest snapshot age seen while sampling during the run, ms.
    pub max_snapshot_age_ms: Option<u64>,
}

/// The filter's decision records of a kvroute run (with [`DemoOptions::out`] set): Envoy's
/// access log, one line per request, in `<out>/decisions_<label>.log`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionLog {
    /// The file.
    pub path: PathBuf,
    /// Every record, in the order the requests started (`-`: none recorded).
    pub records: Vec<String>,
}

/// Records that matched a prefix (`;prefix=<matched>/<hashed>` with `matched` > 0).
fn prefix_matched(record: &str) -> bool {
    record
        .split(';')
        .find_map(|f| f.strip_prefix("prefix="))
        .and_then(|v| v.split_once('/'))
        .and_then(|(m, _)| m.parse::<u32>().ok())
        .is_some_and(|m| m > 0)
}

impl DecisionLog {
    /// Up to `n` records to show: the first one, then the first that followed a cached
    /// prefix (the affinity behind the pick), then the next ones in order.
    pub fn examples(&self, n: usize) -> Vec<&str> {
        let recorded: Vec<&str> = self
            .records
            .iter()
            .map(String::as_str)
            .filter(|r| *r != "-")
            .collect();
        let mut out: Vec<&str> = Vec::new();
        let first = recorded.first().copied();
        let matched = recorded.iter().copied().find(|r| prefix_matched(r));
        for r in first
            .into_iter()
            .chain(matched)
            .chain(recorded.iter().copied())
        {
            if out.len() >= n {
                break;
            }
            if !out.contains(&r) {
                out.push(r);
            }
        }
        out
    }
}

/// One run's results.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The replay report.
    pub report: RunReport,
    /// Its summary.
    pub summary: Summary,
    /// Envoy / filter stats after the run.
    pub gateway: GatewayStats,
    /// Backends of the run (addresses = values of [`BACKEND_HEADER`]).
    pub backends: Vec<Backend>,
    /// The filter's decision records (kvroute runs with [`DemoOptions::out`] set).
    pub decisions: Option<DecisionLog>,
}

/// Both runs, the table and the files.
#[derive(Debug, Clone)]
pub struct DemoOutcome {
    /// The runs [`DemoOptions::arms`] asked for: kvroute first, then round robin.
    pub runs: Vec<RunOutcome>,
    /// [`replay::render_table`] of the summaries.
    pub table: String,
    /// The report files (when `out` was set).
    pub files: Option<ReportFiles>,
}

/// The running backends (stopped on drop, or by [`Servers::stop`]).
enum Servers {
    Sim(kvroute_sim::server::FleetHandle),
    Llama(Vec<LlamaServer>),
}

impl Servers {
    fn stop(self) {
        match self {
            Servers::Sim(f) => f.shutdown(),
            Servers::Llama(v) => drop(v),
        }
    }
}

async fn start_fleet(opts: &DemoOptions) -> Result<(Servers, Vec<Backend>), DemoError> {
    match &opts.fleet {
        Fleet::Sim(s) => {
            let mut s = s.clone();
            s.base_port = opts.ports.backend_base;
            let (f, b) = start_sims(&s).await?;
            Ok((Servers::Sim(f), b))
        }
        Fleet::Llama { servers, opts: lo } => {
            let mut v = Vec::new();
            let mut b = Vec::new();
            for i in 0..*servers {
                let mut o = lo.clone();
                o.port = if opts.ports.backend_base == 0 {
                    0
                } else {
                    u16::try_from(i)
                        .ok()
                        .and_then(|i| opts.ports.backend_base.checked_add(i))
                        .unwrap_or(0)
                };
                let s = LlamaServer::start(&o).await?;
                b.push(s.backend(&format!("llama-{i}")));
                v.push(s);
            }
            Ok((Servers::Llama(v), b))
        }
    }
}

fn backends_count(f: &Fleet) -> usize {
    match f {
        Fleet::Sim(s) => s.replicas,
        Fleet::Llama { servers, .. } => *servers,
    }
}

/// Sample the filter's snapshot age every 200 ms until `stop` flips; returns the maximum.
async fn watch_snapshot_age(
    admin: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Option<u64> {
    let mut max: Option<u64> = None;
    loop {
        if let Ok(r) = kvroute_integration::harness::http::request(
            "GET",
            &format!("http://{admin}/stats?filter=snapshot_age_ms"),
            &[],
            b"",
        )
        .await
        {
            for line in r.text().lines() {
                if let Some(v) = line
                    .strip_prefix(STAT_SNAPSHOT_AGE_MS)
                    .and_then(|rest| rest.strip_prefix(": "))
                    .and_then(|v| v.trim().parse::<u64>().ok())
                {
                    max = Some(max.map_or(v, |m| m.max(v)));
                }
            }
        }
        tokio::select! {
            _ = stop.changed() => return max,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}

/// One run on a fresh stack: check ports, start backends and gateway, replay, read stats,
/// stop everything.
pub async fn run_once(
    reqs: &[ReplayRequest],
    opts: &DemoOptions,
    routing: Routing,
) -> Result<RunOutcome, DemoError> {
    check_ports(&opts.ports.uses(backends_count(&opts.fleet)))?;
    run_stack(reqs, opts, routing).await
}

/// [`run_once`] without the port check (the ports of a run that just stopped may take a
/// moment to be released; [`start_sims`] retries binding them).
async fn run_stack(
    reqs: &[ReplayRequest],
    opts: &DemoOptions,
    routing: Routing,
) -> Result<RunOutcome, DemoError> {
    let t0 = Instant::now();
    let (servers, backends) = start_fleet(opts).await?;
    let mut gw_opts = GatewayOptions::new(routing, opts.ports, &opts.model);
    gw_opts.concurrency = opts.envoy_concurrency;
    if let (Routing::Kvroute(_), Some(dir)) = (routing, &opts.out) {
        gw_opts.decision_log = Some(dir.join(format!(
            "decisions_{}.log",
            replay::report::file_stem(&routing.label())
        )));
    }
    let gw = Gateway::start(&backends, &gw_opts).await?;
    if opts.verbose {
        eprintln!(
            "kvroute-demo: [{}] {} backends up, Envoy pid {} on 127.0.0.1:{}{} ({:.1} s); replaying {} requests",
            routing.label(),
            backends.len(),
            gw.envoy.pid(),
            gw.listen_port,
            gw.cp_addr().map(|a| format!(", kvroute-cp on {a}")).unwrap_or_default(),
            t0.elapsed().as_secs_f64(),
            reqs.len()
        );
    }
    let mut ro = opts.run.clone();
    ro.url = gw.chat_url();
    ro.label = routing.label();
    ro.backend_header = Some(BACKEND_HEADER.to_owned());
    ro.kv_sample = backends.iter().map(Backend::kv_target).collect();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let watcher = matches!(routing, Routing::Kvroute(_))
        .then(|| tokio::spawn(watch_snapshot_age(gw.envoy.admin().to_owned(), stop_rx)));
    let report = replay::run(reqs, &ro).await;
    let _ = stop_tx.send(true);
    let max_age = match watcher {
        Some(w) => w.await.ok().flatten(),
        None => None,
    };
    let report = report?;
    let stats = gw.envoy.stats().await?;
    let get = |k: &str| stats.get(k).copied().unwrap_or(0);
    let gateway = GatewayStats {
        filter_decisions: get(STAT_DECISIONS),
        fail_open: get(STAT_FAIL_OPEN),
        default_route: if matches!(routing, Routing::Kvroute(_)) {
            get(STAT_DEFAULT_ROUTE)
        } else {
            0
        },
        snapshot_age_ms: stats.get(STAT_SNAPSHOT_AGE_MS).copied(),
        max_snapshot_age_ms: max_age,
    };
    let decisions = match &gw.decision_log {
        Some(path) => Some(DecisionLog {
            path: path.clone(),
            records: gw.decision_records(reqs.len()).await?,
        }),
        None => None,
    };
    gw.shutdown().await;
    servers.stop();
    let summary = report.summary();
    Ok(RunOutcome {
        report,
        summary,
        gateway,
        backends,
        decisions,
    })
}

/// Check every port once, then replay `reqs` through kvroute (`opts.policy`) and through
/// Envoy round robin, each on a fresh stack (cold prefix caches), and write the report.
pub async fn run_demo(
    reqs: &[ReplayRequest],
    opts: &DemoOptions,
) -> Result<DemoOutcome, DemoError> {
    let routings = match opts.arms {
        Arms::Both => vec![Routing::Kvroute(opts.policy), Routing::RoundRobin],
        Arms::KvrouteOnly => vec![Routing::Kvroute(opts.policy)],
        Arms::RoundRobinOnly => vec![Routing::RoundRobin],
    };
    check_ports(&opts.ports.uses(backends_count(&opts.fleet)))?;
    let mut runs = Vec::new();
    for r in routings {
        runs.push(run_stack(reqs, opts, r).await?);
    }
    let summaries: Vec<Summary> = runs.iter().map(|r| r.summary.clone()).collect();
    let table = replay::render_table(&summaries);
    let files = match &opts.out {
        Some(dir) => {
            let reports: Vec<RunReport> = runs.iter().map(|r| r.report.clone()).collect();
            Some(replay::write_report(dir, &reports)?)
        }
        None => None,
    };
    Ok(DemoOutcome { runs, table, files })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(records: &[&str]) -> DecisionLog {
        DecisionLog {
            path: PathBuf::from("decisions.log"),
            records: records.iter().map(|r| (*r).to_owned()).collect(),
        }
    }

    #[test]
    fn examples_are_the_first_record_then_a_prefix_match_then_the_rest() {
        let l = log(&[
            "-",
            "policy:hybrid;endpoint=demo/sim-0;prefix=0/3;top=a",
            "policy:hybrid;endpoint=demo/sim-1;prefix=0/2;top=b",
            "policy:hybrid;endpoint=demo/sim-0;prefix=2/3;top=c",
        ]);
        assert_eq!(
            l.examples(3),
            [
                "policy:hybrid;endpoint=demo/sim-0;prefix=0/3;top=a",
                "policy:hybrid;endpoint=demo/sim-0;prefix=2/3;top=c",
                "policy:hybrid;endpoint=demo/sim-1;prefix=0/2;top=b",
            ]
        );
        assert_eq!(l.examples(1).len(), 1);
        assert!(log(&["-", "-"]).examples(3).is_empty());
        assert!(!prefix_matched("policy:hybrid;endpoint=e;top=x"));
        assert!(prefix_matched("policy:hybrid;endpoint=e;prefix=12/16"));
    }
}
