//! The `kvroute-sim` binary out of file descriptors: `accept` fails at once for as long as a
//! connection waits in the backlog, and the accept loop must back off rather than spin a
//! core, then serve again once descriptors are free.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvroute-sim");

struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// utime + stime of process `pid`, clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the `(comm)`, which may hold spaces: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

async fn metrics_status(port: u16) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut head = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut head))
        .await
        .ok()?
        .ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

#[tokio::test]
async fn accept_errors_back_off_instead_of_spinning() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -n 64 && exec "$0" --replicas 1 --port "$1""#)
        .arg(BIN)
        .arg(port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let guard = Guard(child);
    let pid = guard.0.id();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metrics_status(port).await != Some(200) {
        assert!(Instant::now() < deadline, "kvroute-sim did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // More idle connections than its descriptor limit: the last ones wait in the backlog.
    let mut held = Vec::new();
    for _ in 0..100 {
        held.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = cpu_ticks(pid);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu_ticks(pid) - before;
    // A spinning loop burns about one tick per 10 ms of the 2 s; a backing-off one ~0.
    assert!(
        used < 40,
        "{used} CPU ticks in 2 s while out of descriptors"
    );
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics_status(port).await != Some(200) {
        assert!(
            Instant::now() < deadline,
            "no /metrics once connections closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
