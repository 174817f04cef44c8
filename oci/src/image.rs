//! kvroute-cp as a runnable Linux image, built without a container daemon.
//!
//! The daemonless counterpart of `control-plane/Dockerfile` for machines with no container
//! engine: the same static binary, user, entrypoint, command and port, on no base image
//! (distroless `static` adds Debian's CA bundle, tzdata and a home directory). One layer
//! holds the binary and the two files a non-root image needs, nothing else (no shell, no
//! libc, no package manager):
//!
//! | path | mode | why |
//! |---|---|---|
//! | `/usr/local/bin/kvroute-cp` | 0755 | the binary, static (`x86_64-unknown-linux-musl`; [`check_static_elf`] refuses a dynamically linked one, which would fail in the container with a bare "no such file or directory") |
//! | `/etc/passwd`, `/etc/group` | 0644 | user and group `nonroot` = 65532, distroless' non-root id, so `ps`, audit logs and `runAsNonRoot` checks see a named user |
//! | `/tmp` | 1777 | the one writable scratch directory every Linux image has |
//!
//! The config: `User: 65532:65532`, `Entrypoint: [/usr/local/bin/kvroute-cp]`,
//! `Cmd: [--config, /etc/kvroute/kvroute-cp.yaml]`, `ExposedPorts: 9090/tcp`, `os: linux`,
//! `architecture: amd64`. No CA bundle is included: kvroute-cp's Kubernetes client uses the
//! service account's `ca.crt`, and `https://` scrapes and pushes need `tls.ca_file` in this
//! image (the system trust store is empty).

use crate::{sha256_hex, write_layout, Built, OciError, TarEntry};
use object::elf;
use object::read::elf::{FileHeader, ProgramHeader};
use oci_spec::image::{Arch, ConfigBuilder, ImageConfigurationBuilder, Os};
use std::path::Path;

/// The binary's path in the image (without the leading `/`, as tar stores it).
pub const BINARY_PATH: &str = "usr/local/bin/kvroute-cp";
/// `User` of the image config: distroless' `nonroot` uid:gid.
pub const USER: &str = "65532:65532";
/// `Cmd`: the config file the Kubernetes manifests mount.
pub const CMD: [&str; 2] = ["--config", "/etc/kvroute/kvroute-cp.yaml"];
/// `ExposedPorts`: kvroute-cp's HTTP listener (`listen`, default `0.0.0.0:9090`).
pub const EXPOSED_PORT: &str = "9090/tcp";
/// `/etc/passwd`: root (owner of every file) and the user the process runs as.
pub const PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\n\
                          nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin\n";
/// `/etc/group`, matching [`PASSWD`].
pub const GROUP: &str = "root:x:0:\nnonroot:x:65532:\n";
/// `Env`: the usual Linux `PATH` (Docker's default for Linux images).
pub const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Accept only what runs in an image with no libc: an x86-64 ELF executable (`ET_EXEC`, or
/// `ET_DYN` for static-pie, the musl target's default) without a program interpreter
/// (`PT_INTERP`, which a dynamically linked binary names, e.g. `/lib64/ld-linux-x86-64.so.2`).
/// Errors: [`OciError::NotStaticElf`] saying which check failed.
pub fn check_static_elf(binary: &[u8]) -> Result<(), OciError> {
    let bad = |why: String| OciError::NotStaticElf(why);
    let header = elf::FileHeader64::<object::Endianness>::parse(binary)
        .map_err(|e| bad(format!("no 64-bit ELF header ({e})")))?;
    let endian = header.endian().map_err(|e| bad(e.to_string()))?;
    let machine = header.e_machine(endian);
    if machine != elf::EM_X86_64 {
        return Err(bad(format!(
            "machine {machine}, not x86-64 ({})",
            elf::EM_X86_64
        )));
    }
    let kind = header.e_type(endian);
    if kind != elf::ET_EXEC && kind != elf::ET_DYN {
        return Err(bad(format!("ELF type {kind}, not an executable")));
    }
    let headers = header
        .program_headers(endian, binary)
        .map_err(|e| bad(format!("program headers unreadable ({e})")))?;
    if headers.iter().any(|p| p.p_type(endian) == elf::PT_INTERP) {
        return Err(bad(
            "dynamically linked (it names a program interpreter, PT_INTERP); \
             build --target x86_64-unknown-linux-musl"
                .into(),
        ));
    }
    Ok(())
}

/// Write the kvroute-cp image layout for `binary` into `dir`, tagged `tag`. Returns the
/// layout's digests and the binary's hex sha256. Errors: [`OciError::NotStaticElf`]; I/O.
pub fn build_layout(binary: &[u8], dir: &Path, tag: &str) -> Result<(Built, String), OciError> {
    check_static_elf(binary)?;
    let run = ConfigBuilder::default()
        .user(USER)
        .env(vec![PATH_ENV.to_string()])
        .entrypoint(vec![format!("/{BINARY_PATH}")])
        .cmd(CMD.map(String::from).to_vec())
        .exposed_ports(vec![EXPOSED_PORT.to_string()])
        .build()?;
    let config = ImageConfigurationBuilder::default()
        .architecture(Arch::Amd64)
        .os(Os::Linux)
        .config(run)
        .build()?;
    let dir_entry = |path| TarEntry {
        path,
        mode: 0o755,
        data: None,
    };
    let entries = [
        dir_entry("etc/"),
        TarEntry {
            path: "etc/group",
            mode: 0o644,
            data: Some(GROUP.as_bytes()),
        },
        TarEntry {
            path: "etc/passwd",
            mode: 0o644,
            data: Some(PASSWD.as_bytes()),
        },
        TarEntry {
            path: "tmp/",
            mode: 0o1777,
            data: None,
        },
        dir_entry("usr/"),
        dir_entry("usr/local/"),
        dir_entry("usr/local/bin/"),
        TarEntry {
            path: BINARY_PATH,
            mode: 0o755,
            data: Some(binary),
        },
    ];
    let built = write_layout(dir, tag, &entries, config, None)?;
    Ok((built, sha256_hex(binary)))
}
