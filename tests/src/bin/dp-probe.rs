//! `dp-probe`: the test client the integration tests run inside pods
//! (network namespaces and cgroups), so that the kernel programs see a real
//! process's `connect()`.
//!
//! Usage: `dp-probe connect ADDR PAYLOAD [--mark N]`
//! Connects to ADDR (optionally setting SO_MARK first), sends PAYLOAD,
//! half-closes, prints everything received to stdout, and exits 0. Any
//! failure is printed to stderr with exit code 1.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    os::fd::{FromRawFd, OwnedFd},
    process::ExitCode,
    time::Duration,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dp-probe: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    match args {
        [cmd, addr, payload, rest @ ..] if cmd == "connect" => {
            let addr: SocketAddr = addr
                .parse()
                .map_err(|e| format!("bad address {addr}: {e}"))?;
            let mark = match rest {
                [] => None,
                [flag, value] if flag == "--mark" => Some(parse_mark(value)?),
                _ => return Err(format!("unexpected arguments {rest:?}")),
            };
            let mut stream = connect(addr, mark).map_err(|e| format!("connect {addr}: {e}"))?;
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .map_err(|e| e.to_string())?;
            stream
                .write_all(payload.as_bytes())
                .map_err(|e| format!("write: {e}"))?;
            stream
                .shutdown(Shutdown::Write)
                .map_err(|e| format!("shutdown: {e}"))?;
            let mut reply = Vec::new();
            stream
                .read_to_end(&mut reply)
                .map_err(|e| format!("read: {e}"))?;
            std::io::stdout()
                .write_all(&reply)
                .map_err(|e| e.to_string())?;
            Ok(())
        }
        _ => Err("usage: dp-probe connect ADDR PAYLOAD [--mark N]".into()),
    }
}

fn parse_mark(value: &str) -> Result<u32, String> {
    match value.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => value.parse(),
    }
    .map_err(|e| format!("bad mark {value}: {e}"))
}

/// A blocking TCP connect, with SO_MARK set before `connect()` when asked.
fn connect(addr: SocketAddr, mark: Option<u32>) -> std::io::Result<TcpStream> {
    let Some(mark) = mark else {
        return TcpStream::connect(addr);
    };
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2); the fd is owned immediately.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    nix::sys::socket::setsockopt(&owned, nix::sys::socket::sockopt::Mark, &mark)?;
    let sockaddr = nix::sys::socket::SockaddrStorage::from(addr);
    nix::sys::socket::connect(fd, &sockaddr)?;
    Ok(TcpStream::from(owned))
}
