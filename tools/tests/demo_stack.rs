//! The full simulated stack of `make demo`: 200 Mooncake requests through real Envoy with the
//! kvroute filter, kvroute-cp and 3 kvroute-sim replicas, then through Envoy round robin on
//! fresh replicas; plus the demo's cleanup on Ctrl-C and its refusal of a taken port.
//! Needs the built `.wasm` and the PyPI Envoy (`make test-demo` builds both).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_core::picker::PolicyKind;
use kvroute_integration::harness::free_port;
use kvroute_tools::demo::gateway::Routing;
use kvroute_tools::demo::ports::PortPlan;
use kvroute_tools::demo::run::{run_demo, run_once, Arms, DemoOptions, Fleet};
use kvroute_tools::demo::sim::{SimOptions, DEFAULT_SIM_MODEL};
use kvroute_tools::replay::{
    default_trace_path, load_workload, ReplayRequest, RunOptions, TraceSource, WorkloadOptions,
};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Simulated seconds per wall second, and the trace compression that matches it.
const TIME_SCALE: f64 = 10.0;
/// Half the trace's arrival rate: 3 replicas take the load without filling their KV cache
/// (the trace was recorded on a much larger cluster).
const RATE_SCALE: f64 = 0.5;
/// Output cap: keeps the streamed token rate (one SSE event per token, through Envoy and
/// the filter) within what a debug build on 2 shared cores sustains at 10x.
const MAX_OUTPUT_TOKENS: u32 = 32;

/// The policy under test: kvroute's default.
const POLICY: PolicyKind = PolicyKind::Hybrid;

/// Requests in the full-stack slice.
const N_REQUESTS: usize = 200;

/// Slice start, trace seconds. Mooncake reuses little inside a 200-request window; the one
/// from second 132 has the most conversation continuations (14, against 8–9 from second
/// 390), so it shows prefix affinity best.
const START_S: f64 = 132.0;

/// Heavy tests run one at a time (2 cores).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn mooncake(n: usize) -> Vec<ReplayRequest> {
    let mut w = WorkloadOptions::new(TraceSource::Mooncake(default_trace_path("mooncake")));
    w.max_requests = Some(n);
    w.time_scale = TIME_SCALE;
    w.rate_scale = RATE_SCALE;
    w.start_s = START_S;
    w.max_output_tokens = Some(MAX_OUTPUT_TOKENS);
    w.model = DEFAULT_SIM_MODEL.into();
    w.sim_extension = true;
    let reqs = load_workload(&w).unwrap();
    assert_eq!(reqs.len(), n);
    reqs
}

fn options(replicas: usize, ports: PortPlan) -> DemoOptions {
    DemoOptions {
        fleet: Fleet::Sim(SimOptions {
            replicas,
            model: DEFAULT_SIM_MODEL.into(),
            time_scale: TIME_SCALE,
            seed: 1,
            base_port: 0,
        }),
        model: DEFAULT_SIM_MODEL.into(),
        policy: POLICY,
        ports,
        envoy_concurrency: 1,
        run: RunOptions::new("", ""),
        out: None,
        arms: Arms::Both,
        verbose: true,
    }
}

fn any_ports() -> PortPlan {
    PortPlan {
        listen: 0,
        ingest: 0,
        cp: 0,
        backend_base: 0,
    }
}

#[test]
fn mooncake_200_through_the_full_stack_keeps_conversations_on_their_replica(
) -> Result<(), Box<dyn std::error::Error>> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(mooncake_200())
}

/// Mooncake block ids of a request (the `kvroute_sim.prefix_block_ids` the workload attached).
fn block_ids(r: &ReplayRequest) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    v["kvroute_sim"]["prefix_block_ids"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap()).collect())
        .unwrap_or_default()
}

/// Affinity follows: of the requests whose block chain shares at least [`MIN_SHARED_BLOCKS`]
/// leading blocks with an earlier request of the slice, how many went to the backend that
/// served the earlier request with the longest shared prefix. Returns (followed, eligible).
/// Every Mooncake chain starts with block 0 (a shared system prompt), so one shared block
/// says nothing about a conversation.
fn affinity_follows(
    reqs: &[ReplayRequest],
    run: &kvroute_tools::demo::run::RunOutcome,
) -> (usize, usize) {
    let backend: std::collections::HashMap<u64, &str> = run
        .report
        .records
        .iter()
        .filter_map(|r| Some((r.id, r.backend.as_deref()?)))
        .collect();
    let chains: Vec<Vec<u64>> = reqs.iter().map(block_ids).collect();
    let (mut followed, mut eligible) = (0, 0);
    for (i, c) in chains.iter().enumerate() {
        let best = (0..i)
            .map(|j| {
                let shared = c.iter().zip(&chains[j]).take_while(|(a, b)| a == b).count();
                (shared, j)
            })
            .max_by_key(|&(shared, j)| (shared, j));
        if let Some((shared, j)) = best {
            if shared >= MIN_SHARED_BLOCKS {
                eligible += 1;
                if backend.get(&reqs[i].id) == backend.get(&reqs[j].id) {
                    followed += 1;
                }
            }
        }
    }
    (followed, eligible)
}

/// Leading blocks a request must share with an earlier one to count as a continuation.
const MIN_SHARED_BLOCKS: usize = 2;

/// The stack's failures (a start, the replay) come back as errors, not panics: the test
/// prints them without a backtrace, so CI's excerpt of the output keeps them.
async fn mooncake_200() -> Result<(), Box<dyn std::error::Error>> {
    let reqs = mooncake(N_REQUESTS);
    let out_dir = tempfile::tempdir()?;
    let mut opts = options(3, any_ports());
    opts.out = Some(out_dir.path().to_path_buf());
    let out = run_demo(&reqs, &opts).await?;
    println!("{}", out.table);
    let (kv, rr) = (&out.runs[0], &out.runs[1]);
    assert_eq!(kv.summary.label, "kvroute-hybrid");
    assert_eq!(rr.summary.label, "envoy-round-robin");
    for run in [kv, rr] {
        assert_eq!(run.summary.requests, N_REQUESTS, "{}", run.summary.label);
        let errors: Vec<_> = run
            .report
            .records
            .iter()
            .filter(|r| r.error.is_some())
            .collect();
        assert!(errors.is_empty(), "{}: {errors:#?}", run.summary.label);
        assert_eq!(run.summary.errors, 0);
        // Every response names one of this run's 3 backends.
        let addrs: Vec<String> = run.backends.iter().map(|b| b.address.to_string()).collect();
        for r in &run.report.records {
            let b = r.backend.as_deref().unwrap_or("none");
            assert!(
                addrs.iter().any(|a| a == b),
                "request {} served by {b}, not in {addrs:?}",
                r.id
            );
        }
    }
    // Every request was routed by the filter: 200 decisions by the policy, none fell open,
    // none took the default route.
    assert_eq!(
        kv.gateway.filter_decisions, N_REQUESTS as u64,
        "{:?}",
        kv.gateway
    );
    assert_eq!(kv.gateway.fail_open, 0);
    assert_eq!(kv.gateway.default_route, 0);
    // The snapshot reached the filter and stayed fresh while serving.
    let max_age = kv
        .gateway
        .max_snapshot_age_ms
        .expect("snapshot age sampled");
    assert!(max_age < 1000, "snapshot age reached {max_age} ms");
    assert!(kv.gateway.snapshot_age_ms.unwrap() < 1000);
    // Round robin ran without the filter.
    assert_eq!(rr.gateway.filter_decisions, 0);
    // The kvroute run explained every pick: the filter's decision record, one access-log
    // line per request in <out>/decisions_kvroute-hybrid.log; round robin has none.
    let d = kv
        .decisions
        .as_ref()
        .expect("decision log of the kvroute run");
    assert_eq!(d.path, out_dir.path().join("decisions_kvroute-hybrid.log"));
    assert_eq!(d.records.len(), N_REQUESTS);
    for r in &d.records {
        assert!(
            r.starts_with("policy:hybrid;endpoint=demo/sim-") && r.contains(";top=demo/sim-"),
            "{r}"
        );
    }
    assert_eq!(d.examples(3).len(), 3);
    println!(
        "decision records, for example:\n  {}",
        d.examples(3).join("\n  ")
    );
    assert!(rr.decisions.is_none());
    // Prefix-aware routing keeps a conversation on the replica that holds its prefix. The
    // slice has 14 continuations (requests sharing at least 2 leading blocks with an earlier
    // one); 6 release runs kept 11–14 of them on the earlier request's replica, round robin
    // 3–6 (a third by chance). The debug build of `make test` on 2 shared cores kept 8–14
    // (16 runs, 2026-12-04; 8 once, 10 three times): `hybrid` trades affinity for load, and
    // a 2-block continuation's prefix term (its 16 KiB rendering shares ~110 of 256 blocks
    // with the holder, ~55 with every replica: block 0) is outweighed by a full swing of a
    // min-max normalised load term, which the real-time run's timing decides. So the bound
    // is more than half, and more than round robin.
    let (kf, ke) = affinity_follows(&reqs, kv);
    let (rf, re) = affinity_follows(&reqs, rr);
    println!("continuations kept on their replica: kvroute {kf}/{ke}, round robin {rf}/{re}");
    assert_eq!((ke, re), (14, 14), "continuations in the slice");
    assert!(kf * 2 > ke, "kvroute kept only {kf}/{ke} continuations");
    assert!(kf > rf, "kvroute kept {kf}/{ke}, round robin {rf}/{re}");
    // The token-weighted hit rate is printed, not compared: on 200 requests it turns on 4
    // continuations of 20k–81k tokens, and whether the simulated replica still holds their
    // prefix after ~80 requests of other traffic (its LRU cache fills). Measured: kvroute
    // 5.7–9.3 %, round robin 3.7–9.0 % (docs/demo.md).
    println!(
        "prefix-cache hit rate: kvroute {:.4}, round robin {:.4}",
        kv.summary.prefix_hit_rate, rr.summary.prefix_hit_rate
    );
    // Round robin spreads evenly over the 3 replicas (Envoy's RR, one worker).
    assert_eq!(rr.summary.backend_share.len(), 3);
    Ok(())
}

#[tokio::test]
async fn a_taken_port_is_refused_before_anything_starts() {
    let taken = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = taken.local_addr().unwrap().port();
    let mut ports = any_ports();
    ports.ingest = port;
    let err = run_once(
        &mooncake(1),
        &options(2, ports),
        Routing::Kvroute(PolicyKind::Hybrid),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with(&format!(
            "port {port} (Envoy snapshot ingest listener) is already in use: "
        )),
        "{err}"
    );
    assert!(
        err.ends_with("with --ingest-port / --base-port (make demo PORT=...)"),
        "{err}"
    );
}

fn demo_bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvroute-demo"));
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[test]
fn the_binary_refuses_a_taken_port_naming_the_flag() {
    let taken = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = demo_bin()
        .args([
            "--max-requests",
            "5",
            "--backend-port",
            "0",
            "--cp-port",
            "0",
            "--ingest-port",
            "0",
        ])
        .args(["--listen-port", &port.to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "kvroute-demo: error: port {port} (Envoy listener) is already in use: "
        )),
        "{err}"
    );
    assert!(
        err.contains("--listen-port / --base-port (make demo PORT=...)"),
        "{err}"
    );
}

/// Child processes of `pid` (Linux `/proc/<pid>/task/*/children`).
fn children(pid: u32) -> Vec<u32> {
    let mut v = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let s = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        v.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    v
}

fn alive(pid: u32) -> bool {
    // A zombie is dead for our purpose; it is reaped by whoever adopted it.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

#[test]
fn ctrl_c_mid_replay_stops_envoy_cp_and_sims() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (listen, ingest, cp) = (
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
    );
    let out = tempfile::tempdir().unwrap();
    // Real time and a long slice: the replay is still running when SIGINT arrives.
    let mut child = demo_bin()
        .args([
            "--backends",
            "2",
            "--time-scale",
            "1",
            "--rate-scale",
            "1",
            "--duration",
            "600",
        ])
        .args(["--max-requests", "100", "--envoy-concurrency", "1"])
        .args([
            "--listen-port",
            &listen.to_string(),
            "--ingest-port",
            &ingest.to_string(),
        ])
        .args(["--cp-port", &cp.to_string(), "--backend-port", "0"])
        .arg("--out")
        .arg(out.path())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains("replaying") => break,
            Ok(l) => seen.push(l),
            Err(_) => {
                let _ = child.kill();
                panic!("no `replaying` line within 120 s: {seen:#?}");
            }
        }
    }
    // The replay is under way: Envoy is a child, cp and the sims answer on their ports.
    std::thread::sleep(Duration::from_millis(500));
    let kids = children(pid);
    assert!(!kids.is_empty(), "no child process (Envoy) found");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", cp)).is_ok(),
        "kvroute-cp not listening"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", listen)).is_ok(),
        "Envoy not listening"
    );
    let st = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvroute-demo still running 20 s after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
    let rest: Vec<String> = rx.try_iter().collect();
    assert!(
        rest.iter()
            .any(|l| l.contains("SIGINT: stopped every process it started")),
        "{rest:#?}"
    );
    for k in kids {
        assert!(!alive(k), "child {k} still alive after the demo exited");
    }
    // Every port is free again.
    for p in [listen, ingest, cp] {
        std::net::TcpListener::bind(("127.0.0.1", p))
            .unwrap_or_else(|e| panic!("port {p} still taken: {e}"));
    }
}
