//! Instructions per request inside Envoy, counted by callgrind: the deterministic companion
//! of [`crate::overhead`]'s timed runs (`kvroute-overhead --callgrind`, `docs/overhead.md`).
//!
//! On a shared or throttled machine, req/s and CPU time per request move by tens of percent
//! from one run to the next; the number of instructions Envoy executes per request does not
//! (a few percent). Each proxy of [`Options::variants`] (floor-native and kvroute-native
//! too, with a dynamic module; its snapshot push as in the timed runs) is started alone under
//! `valgrind --tool=callgrind --instr-atstart=no` (instrumentation off until asked), with
//! the same configs, backend and bodies as the timed benchmark. Requests go one at a time
//! over one keep-alive HTTP/1.1 connection. For each proxy:
//! 1. `warmup` requests, uncounted (V8 compiles and tiers up the Wasm module);
//! 2. an idle window of `idle` seconds, counted: instructions per second with no traffic
//!    (timers, stats flushes, snapshot pushes);
//! 3. windows of `n` and of `2n` requests, counted.
//!
//! Instructions per request = (I(2n) − I(n) − idle rate × (T(2n) − T(n))) / n: what one more
//! request costs, with start-up, per-window and time-driven work taken out. Counting is
//! switched on and off with `callgrind_control -i`, and each window is dumped with
//! `callgrind_control -d`; the totals are read from the dump files' `totals:` lines
//! (<https://valgrind.org/docs/manual/cl-manual.html>).
//!
//! kvroute runs with `affinity_sync_ms: 60000` (default 100 ms) and
//! `picker.stale_after_ms: 3600000` (default 2 s), and its snapshot is pushed once, not once
//! a second: under valgrind a request takes ~50× longer, so time-driven work (ten journal
//! syncs a second, a snapshot decode after each push) would be charged to each request many
//! times over what it costs at real request rates, and it would vary with the machine's
//! speed. Both are per-tick or per-push costs, not per-request ones; the idle rate is
//! reported beside the per-request figure. For the same reason `usage_sample_ms` is an
//! hour: the responses whose `usage` the filter reads are chosen by a per-model token bucket
//! refilled 200 times a second (`kvroute_core::usage_sample`), so at the timed benchmark's
//! thousands of requests per second 4–7 % are read, while at valgrind's speed every one
//! would be. With an hour, the bucket's first 100 reads fall in the warm-up and no counted
//! response is read; `--plugin-config '{"usage_sample_ms":0}'` counts reading every one.
//! Likewise `inflight_share_ms` is 10 s (default 20 ms): a worker publishes its in-flight
//! table, and reads the other workers', at most once per interval, which at 3,000 requests
//! a second is once per ~60 requests but at valgrind's speed would be every few; the tick
//! still publishes what changed every 100 ms. `--plugin-config '{"inflight_share_ms":0}'`
//! counts a publication and a read at every request.

use crate::overhead::{chat_body, prompts, push_to, start_backend, start_proxy, Options};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How to count.
#[derive(Debug, Clone)]
pub struct CallgrindOptions {
    /// Requests in the shorter counted window (`n`; the longer one is `2n`).
    pub requests: usize,
    /// Uncounted requests first.
    pub warmup: usize,
    /// Length of the counted idle window.
    pub idle: Duration,
    /// The `valgrind` binary.
    pub valgrind: PathBuf,
    /// The `callgrind_control` script (shipped with valgrind).
    pub control: PathBuf,
    /// Which of [`Options::variants`] to count (all when empty).
    pub variants: Vec<String>,
    /// Keep each counted window's dump here, as `<proxy>-<size>-<requests>.out` (the idle
    /// window's as `...-0.out`), for `callgrind_annotate`: the functions behind a proxy's
    /// count are the `2n` window's minus the `n` window's. `None`: dumps are deleted.
    pub keep: Option<PathBuf>,
}

/// One proxy at one body size.
#[derive(Debug, Clone, PartialEq)]
pub struct CallgrindRow {
    /// Body size, bytes.
    pub size: usize,
    /// One of [`Options::variants`].
    pub variant: &'static str,
    /// Instructions per request (see the module doc).
    pub per_request: f64,
    /// Instructions per second with no traffic.
    pub idle_per_s: f64,
}

/// kvroute's plugin configuration under callgrind: [`crate::overhead::PLUGIN_CONFIG`] with
/// the journal sync slowed to once a minute and the snapshot fresh for an hour, so that
/// one snapshot push serves the whole run, `usage_sample_ms` an hour, so that no response
/// is read for `usage` after the first 100 (all in the warm-up): at full speed the
/// benchmark's thousands of requests per second read 200, and `inflight_share_ms` 10 s,
/// so that the in-flight publication and the read of the other workers' tables are as rare
/// per request as at full speed (see the module doc).
pub const CALLGRIND_PLUGIN_CONFIG: &str = r#"{"mode":"cluster","affinity_sync_ms":60000,"picker":{"stale_after_ms":3600000},"usage_sample_ms":3600000,"inflight_share_ms":10000}"#;

/// Envoy under valgrind starts in tens of seconds, not one.
const READY_WITHIN: Duration = Duration::from_secs(300);
/// How long a `callgrind_control` command may take to be picked up: valgrind polls for
/// commands, so each switch is followed by this pause (inside the window for `on`, outside
/// for `off`; the idle rate accounts for it).
const SETTLE: Duration = Duration::from_millis(1500);

async fn control(cg: &CallgrindOptions, args: &[&str], pid: u32) -> anyhow::Result<()> {
    let out = tokio::process::Command::new(&cg.control)
        .kill_on_drop(true)
        .args(args)
        .arg(pid.to_string())
        .output()
        .await
        .map_err(|e| anyhow::anyhow!("{}: {e} (install valgrind)", cg.control.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "callgrind_control {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Sum of the `totals:` lines of the dump files `<base>.<n>`, which are then removed, or
/// moved to `keep` (the first as `keep` itself, further ones with `.<n>` appended).
fn take_dumps(base: &Path, keep: Option<&Path>) -> anyhow::Result<u64> {
    let dir = base.parent().unwrap_or(Path::new("."));
    let name = base
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned();
    let mut total = 0u64;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let file = entry.file_name();
        let Some(rest) = file
            .to_str()
            .and_then(|f| f.strip_prefix(name.as_str()))
            .and_then(|r| r.strip_prefix('.'))
        else {
            continue;
        };
        if rest.parse::<u32>().is_err() {
            continue;
        }
        let text = std::fs::read_to_string(entry.path())?;
        for line in text.lines() {
            if let Some(v) = line.strip_prefix("totals:") {
                total += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
        match keep {
            Some(keep) => {
                let mut to = keep.to_path_buf();
                if to.exists() {
                    to = keep.with_extension(format!("out.{rest}"));
                }
                std::fs::rename(entry.path(), to)?;
            }
            None => std::fs::remove_file(entry.path())?,
        }
    }
    Ok(total)
}

/// One keep-alive HTTP/1.1 connection that POSTs the same body again and again.
struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    port: u16,
    body: Bytes,
}

impl Client {
    async fn connect(port: u16, body: &[u8]) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self {
            sender,
            port,
            body: Bytes::copy_from_slice(body),
        })
    }

    async fn send(&mut self, n: usize) -> anyhow::Result<()> {
        for _ in 0..n {
            let req = hyper::Request::builder()
                .method("POST")
                .uri("/v1/chat/completions")
                .header("host", format!("127.0.0.1:{}", self.port))
                .header("content-type", "application/json")
                .body(Full::new(self.body.clone()))?;
            self.sender.ready().await?;
            let resp = self.sender.send_request(req).await?;
            let status = resp.status();
            resp.into_body().collect().await?;
            anyhow::ensure!(status == 200, "port {}: answered {status}", self.port);
        }
        Ok(())
    }
}

/// Count one counted window: instructions and its length.
async fn window(
    cg: &CallgrindOptions,
    pid: u32,
    base: &Path,
    client: &mut Client,
    requests: usize,
) -> anyhow::Result<(u64, f64)> {
    take_dumps(base, None)?;
    let t0 = Instant::now();
    control(cg, &["-i", "on"], pid).await?;
    tokio::time::sleep(SETTLE).await;
    if requests == 0 {
        tokio::time::sleep(cg.idle).await;
    } else {
        client.send(requests).await?;
    }
    control(cg, &["-i", "off"], pid).await?;
    let secs = t0.elapsed().as_secs_f64();
    tokio::time::sleep(SETTLE).await;
    control(cg, &["-d"], pid).await?;
    // The dump is written by valgrind's own thread after it sees the command.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        tokio::time::sleep(SETTLE).await;
        let keep = cg.keep.as_ref().map(|dir| {
            let stem = base.file_stem().and_then(|s| s.to_str()).unwrap_or("proxy");
            dir.join(format!("{stem}-{requests}.out"))
        });
        let got = take_dumps(base, keep.as_deref())?;
        if got > 0 || Instant::now() > deadline {
            return Ok((got, secs));
        }
    }
}

/// Count every size × proxy; `progress` gets one line per proxy.
pub async fn run(
    opts: &Options,
    cg: &CallgrindOptions,
    mut progress: impl FnMut(&str),
) -> anyhow::Result<Vec<CallgrindRow>> {
    let prompts = prompts(&opts.data)?;
    let config =
        crate::overhead::plugin_config(CALLGRIND_PLUGIN_CONFIG, opts.plugin_config.as_deref())?;
    // Removed when dropped, however the run ends.
    let scratch = tempfile::Builder::new()
        .prefix("kvroute-callgrind-")
        .tempdir()?;
    let dir = scratch.path();
    let mut rows = Vec::new();
    let n = cg.requests.max(1);
    for &size in &opts.sizes {
        let body = chat_body(size, &prompts, opts.stream_events > 0);
        let (_backend, backend) = start_backend(opts).await?;
        for variant in opts.variants() {
            if !cg.variants.is_empty() && !cg.variants.iter().any(|v| v == variant) {
                continue;
            }
            let base = dir.join(format!("{variant}-{size}.cg"));
            let wrapper = [
                cg.valgrind.display().to_string(),
                "--tool=callgrind".into(),
                "--instr-atstart=no".into(),
                // V8 writes and rewrites its JIT code.
                "--smc-check=all-non-file".into(),
                format!("--callgrind-out-file={}", base.display()),
            ];
            let (proxy, [port, ingest]) =
                start_proxy(variant, opts, &backend, &config, &wrapper, READY_WITHIN).await?;
            if let Some(ingest) = opts.push_port(variant, ingest) {
                // Once: fresh for the whole run (see CALLGRIND_PLUGIN_CONFIG).
                push_to(variant, ingest, crate::overhead::now_ms(), &backend).await?;
            }
            let result = async {
                let mut client = Client::connect(port, &body).await?;
                client.send(cg.warmup).await?;
                let pid = proxy.pid();
                let (idle, t_idle) = window(cg, pid, &base, &mut client, 0).await?;
                let (a, ta) = window(cg, pid, &base, &mut client, n).await?;
                let (b, tb) = window(cg, pid, &base, &mut client, 2 * n).await?;
                let rate = idle as f64 / t_idle.max(1e-3);
                let per_request = (b as f64 - a as f64 - rate * (tb - ta)) / n as f64;
                anyhow::Ok(CallgrindRow {
                    size,
                    variant,
                    per_request,
                    idle_per_s: rate,
                })
            }
            .await;
            drop(proxy);
            let row = result?;
            progress(&format!(
                "{size:>8} B  {variant:<14} {:>10.0} instructions/request  (idle {:.1} M/s)",
                row.per_request,
                row.idle_per_s / 1e6
            ));
            rows.push(row);
        }
    }
    Ok(rows)
}

/// The Markdown table: per size and proxy, instructions per request, the extra over plain
/// Envoy, kvroute's (and kvroute-native's) extra over the floor's, and plain ÷ proxy (the throughput ratio a
/// CPU-bound Envoy would reach).
pub fn markdown(rows: &[CallgrindRow]) -> String {
    let mut s = String::from(
        "| body | proxy | instructions/request | extra over plain | plain ÷ proxy |\n|---|---|---|---|---|\n",
    );
    let find = |size: usize, v: &str| {
        rows.iter()
            .find(|r| r.size == size && r.variant == v)
            .map(|r| r.per_request)
    };
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.dedup();
    for &size in &sizes {
        let plain = find(size, "plain").unwrap_or(0.0);
        for r in rows.iter().filter(|r| r.size == size) {
            let ratio = if r.per_request > 0.0 {
                plain / r.per_request
            } else {
                0.0
            };
            s.push_str(&format!(
                "| {} | {} | {:.0} k | {:+.0} k | {:.2} |\n",
                crate::overhead::size_label(size),
                r.variant,
                r.per_request / 1e3,
                (r.per_request - plain) / 1e3,
                ratio
            ));
        }
    }
    let mut ratios = String::new();
    for &size in &sizes {
        let plain = find(size, "plain").unwrap_or(0.0);
        for variant in ["kvroute", crate::overhead::NATIVE] {
            if let (Some(f), Some(k)) = (find(size, "floor"), find(size, variant)) {
                let floor = f - plain;
                let ratio = if floor > 0.0 {
                    (k - plain) / floor
                } else {
                    0.0
                };
                ratios.push_str(&format!(
                    "| {} | {variant} | {ratio:.1} |\n",
                    crate::overhead::size_label(size)
                ));
            }
        }
    }
    if !ratios.is_empty() {
        s.push_str("\n| body | proxy | extra ÷ floor extra |\n|---|---|---|\n");
        s.push_str(&ratios);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dumps_are_summed_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("kvroute-1024.cg");
        std::fs::write(
            dir.path().join("kvroute-1024.cg.1"),
            "events: Ir\ntotals: 1200\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("kvroute-1024.cg.2"),
            "summary: 5\ntotals: 34\n",
        )
        .unwrap();
        // Not a dump of this base: the final dump at exit, another proxy's, a stray file.
        std::fs::write(&base, "totals: 999\n").unwrap();
        std::fs::write(dir.path().join("plain-1024.cg.1"), "totals: 7\n").unwrap();
        std::fs::write(dir.path().join("kvroute-1024.cg.x"), "totals: 7\n").unwrap();
        assert_eq!(take_dumps(&base, None).unwrap(), 1234);
        assert!(!dir.path().join("kvroute-1024.cg.1").exists());
        assert!(base.exists());
        assert_eq!(take_dumps(&base, None).unwrap(), 0);
    }

    #[test]
    fn kept_dumps_are_moved_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("kvroute-1024.cg");
        std::fs::write(dir.path().join("kvroute-1024.cg.1"), "totals: 20\n").unwrap();
        std::fs::write(dir.path().join("kvroute-1024.cg.2"), "totals: 22\n").unwrap();
        let keep = dir.path().join("kvroute-1024-100.out");
        assert_eq!(take_dumps(&base, Some(&keep)).unwrap(), 42);
        assert!(!dir.path().join("kvroute-1024.cg.1").exists());
        assert!(!dir.path().join("kvroute-1024.cg.2").exists());
        let mut kept: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.contains(".out"))
            .collect();
        kept.sort();
        assert_eq!(kept.len(), 2, "{kept:?}");
        let text: Vec<String> = kept
            .iter()
            .map(|n| std::fs::read_to_string(dir.path().join(n)).unwrap())
            .collect();
        let mut totals: Vec<&str> = text.iter().map(|t| t.trim()).collect();
        totals.sort();
        assert_eq!(totals, ["totals: 20", "totals: 22"]);
    }

    #[test]
    fn the_table_gives_extras_and_ratios() {
        let row = |variant, per_request| CallgrindRow {
            size: 1024,
            variant,
            per_request,
            idle_per_s: 0.0,
        };
        let t = markdown(&[
            row("plain", 170_000.0),
            row("floor", 205_000.0),
            row("kvroute", 345_000.0),
        ]);
        assert!(t.contains("| 1 KiB | plain | 170 k | +0 k | 1.00 |"), "{t}");
        assert!(
            t.contains("| 1 KiB | floor | 205 k | +35 k | 0.83 |"),
            "{t}"
        );
        assert!(
            t.contains("| 1 KiB | kvroute | 345 k | +175 k | 0.49 |"),
            "{t}"
        );
        assert!(t.contains("| 1 KiB | kvroute | 5.0 |"), "{t}");
        assert!(!t.contains("kvroute-native"), "{t}");
        let t = markdown(&[
            row("plain", 170_000.0),
            row("floor", 205_000.0),
            row("kvroute", 345_000.0),
            row("kvroute-native", 240_000.0),
        ]);
        assert!(
            t.contains("| 1 KiB | kvroute-native | 240 k | +70 k | 0.71 |"),
            "{t}"
        );
        assert!(t.contains("| 1 KiB | kvroute-native | 2.0 |"), "{t}");
        // Without the floor: no ratio table.
        let t = markdown(&[row("plain", 170_000.0), row("kvroute", 345_000.0)]);
        assert!(!t.contains("floor extra"), "{t}");
    }
}
