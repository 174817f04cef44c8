//! Port plan and the check that refuses a taken port before anything starts.
//!
//! Default layout from one base port `B` (`--base-port`, `make demo PORT=B`, default
//! [`DEFAULT_BASE_PORT`]): Envoy's listener `B`, the filter's ingest listener `B+1`,
//! kvroute-cp's own HTTP server `B+2`, backend *i* `B+10+i`. Each can be overridden
//! (`--listen-port`, `--ingest-port`, `--cp-port`, `--backend-port`). Port 0 means
//! "any free port" (tests use it); Envoy's listeners then get [`kvroute_integration::harness::free_port`],
//! chosen again when Envoy finds one taken at start (`gateway::start_envoy`).
//! Envoy's admin interface always binds an OS-chosen port.

use super::DemoError;

/// Default base port of the demo (unprivileged, outside the usual 8000/8080/9090 range).
pub const DEFAULT_BASE_PORT: u16 = 18000;
/// Offset of the first backend from the base port.
pub const BACKEND_OFFSET: u16 = 10;

/// The ports one demo stack binds on 127.0.0.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortPlan {
    /// Envoy's main listener (clients send requests here).
    pub listen: u16,
    /// The filter's snapshot ingest listener (kvroute-cp pushes here).
    pub ingest: u16,
    /// kvroute-cp's `/metrics`, `/v1/snapshot`, `/healthz`.
    pub cp: u16,
    /// First backend port; backend *i* binds `backend_base + i` (0: each any free port).
    pub backend_base: u16,
}

impl PortPlan {
    /// The default layout from `base` (see the module docs). Errors when the backends'
    /// ports would pass 65535.
    pub fn from_base(base: u16, backends: usize) -> Result<Self, DemoError> {
        let too_high = || DemoError::Option {
            option: "--base-port",
            value: base.to_string(),
            reason: format!("base + {BACKEND_OFFSET} + {backends} backends passes port 65535"),
        };
        let backend_base = base.checked_add(BACKEND_OFFSET).ok_or_else(too_high)?;
        let n = u16::try_from(backends).map_err(|_| too_high())?;
        backend_base.checked_add(n).ok_or_else(too_high)?;
        Ok(Self {
            listen: base,
            ingest: base.saturating_add(1),
            cp: base.saturating_add(2),
            backend_base,
        })
    }

    /// Every port of this plan with `backends` backends, its role and its flag (0s left out).
    pub fn uses(&self, backends: usize) -> Vec<PortUse> {
        let mut v = vec![
            PortUse::new(
                self.listen,
                "Envoy listener",
                "--listen-port / --base-port (make demo PORT=...)",
            ),
            PortUse::new(
                self.ingest,
                "Envoy snapshot ingest listener",
                "--ingest-port / --base-port (make demo PORT=...)",
            ),
            PortUse::new(
                self.cp,
                "kvroute-cp HTTP server",
                "--cp-port / --base-port (make demo PORT=...)",
            ),
        ];
        if self.backend_base != 0 {
            for i in 0..backends {
                let p = u16::try_from(i)
                    .ok()
                    .and_then(|i| self.backend_base.checked_add(i))
                    .unwrap_or(0);
                v.push(PortUse {
                    port: p,
                    role: format!("backend {i}"),
                    flag: "--backend-port / --base-port (make demo PORT=...)",
                });
            }
        }
        v.retain(|u| u.port != 0);
        v
    }
}

/// One port the demo wants, with its role and the flag that changes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortUse {
    /// The port.
    pub port: u16,
    /// What it is for.
    pub role: String,
    /// Flag / Makefile variable to change it.
    pub flag: &'static str,
}

impl PortUse {
    fn new(port: u16, role: &str, flag: &'static str) -> Self {
        Self {
            port,
            role: role.to_owned(),
            flag,
        }
    }
}

/// Bind each port on 127.0.0.1 once (and release it) to prove it is free; the first taken
/// port is an error naming the port, its role and the flag to change. Also refuses a port
/// given to two roles.
pub fn check_ports(uses: &[PortUse]) -> Result<(), DemoError> {
    for (i, u) in uses.iter().enumerate() {
        if let Some(other) = uses.iter().take(i).find(|o| o.port == u.port) {
            return Err(DemoError::Option {
                option: u.flag,
                value: u.port.to_string(),
                reason: format!("port used twice: {} and {}", other.role, u.role),
            });
        }
        if let Err(os_error) = std::net::TcpListener::bind(("127.0.0.1", u.port)) {
            return Err(DemoError::PortInUse {
                port: u.port,
                role: u.role.clone(),
                flag: u.flag,
                os_error,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn default_layout_from_base() {
        let p = PortPlan::from_base(18000, 4).unwrap();
        assert_eq!(
            p,
            PortPlan {
                listen: 18000,
                ingest: 18001,
                cp: 18002,
                backend_base: 18010
            }
        );
        let ports: Vec<u16> = p.uses(4).iter().map(|u| u.port).collect();
        assert_eq!(ports, vec![18000, 18001, 18002, 18010, 18011, 18012, 18013]);
        assert!(PortPlan::from_base(65530, 4).is_err());
    }

    #[test]
    fn taken_port_is_refused_with_its_role_and_flag() {
        let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let plan = PortPlan {
            listen: port,
            ingest: 0,
            cp: 0,
            backend_base: 0,
        };
        let err = check_ports(&plan.uses(2)).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("port {port} (Envoy listener) is already in use: ")),
            "{err}"
        );
        assert!(
            err.ends_with(
                "Free it or pick other ports with --listen-port / --base-port (make demo PORT=...)"
            ),
            "{err}"
        );
        drop(l);
        check_ports(&plan.uses(2)).unwrap();
    }

    #[test]
    fn a_port_given_twice_is_refused() {
        let plan = PortPlan {
            listen: 1,
            ingest: 1,
            cp: 0,
            backend_base: 0,
        };
        let err = check_ports(&plan.uses(0)).unwrap_err().to_string();
        assert!(
            err.contains("port used twice: Envoy listener and Envoy snapshot ingest listener"),
            "{err}"
        );
    }
}
