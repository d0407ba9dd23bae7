//! Istio-style in-pod iptables capture, the incumbent design the benchmarks
//! compare against: the same rules Istio's CNI installs in ambient pods,
//! feeding the same engine (`dataplane run --capture iptables`), which reads
//! each original destination back with `SO_ORIGINAL_DST` from conntrack.
//!
//! - outbound (nat OUTPUT): TCP REDIRECT to 15001, except sockets carrying
//!   the proxy mark (the engine's own, `0x539/0xfff`), traffic leaving on
//!   loopback and loopback destinations;
//! - inbound (nat PREROUTING): TCP to the pod's IP REDIRECT to 15006, except
//!   port 15008 (HBONE reaches its listener untouched), the engine's own
//!   ports and the node-side address (kubelet probes).
//!
//! The rules live in the pod's network namespace only, and go with it.

use std::{
    io::Write,
    net::Ipv4Addr,
    process::{Command, Stdio},
};

use crate::netns::Netns;

/// `iptables-restore` front ends, most preferred first. Both work inside
/// network namespaces on this kernel; nft is Debian 12's default.
const BACKENDS: &[&str] = &[
    "iptables-nft-restore",
    "iptables-legacy-restore",
    "iptables-restore",
];

/// The rules for a pod at `pod_ip` whose node-side address is `node_side`.
pub fn rules(pod_ip: Ipv4Addr, node_side: Ipv4Addr, proxy_mark: u32) -> String {
    format!(
        "*nat
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-A OUTPUT -p tcp -j ISTIO_OUTPUT
-A PREROUTING -p tcp -j ISTIO_PRERT
-A ISTIO_OUTPUT -m mark --mark {proxy_mark:#x}/0xfff -j RETURN
-A ISTIO_OUTPUT -o lo -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.0/8 -j RETURN
-A ISTIO_OUTPUT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_PRERT -p tcp --dport 15008 -j RETURN
-A ISTIO_PRERT -s {node_side}/32 -j RETURN
-A ISTIO_PRERT -d {pod_ip}/32 -p tcp -m multiport ! --dports 15001,15006,15008 -j REDIRECT --to-ports 15006
COMMIT
"
    )
}

/// Installs `rules` in `netns` with the first backend that accepts them;
/// returns the backend's name.
pub fn install(netns: &Netns, rules: &str) -> anyhow::Result<&'static str> {
    let mut failures = Vec::new();
    for backend in BACKENDS {
        let child = Command::new("ip")
            .args(["netns", "exec", netns.name(), backend])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            Err(e) => {
                failures.push(format!("{backend}: {e}"));
                continue;
            }
        };
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(rules.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if out.status.success() {
            return Ok(backend);
        }
        failures.push(format!(
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    anyhow::bail!(
        "cannot install iptables rules in {} ({}); run `cargo xtask setup` (it installs iptables)",
        netns.name(),
        failures.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_exempt_the_proxy_mark_hbone_and_probes() {
        let text = rules(
            Ipv4Addr::new(10, 1, 0, 11),
            Ipv4Addr::new(10, 1, 0, 1),
            0x539,
        );
        assert!(text.contains("--mark 0x539/0xfff -j RETURN"));
        assert!(text.contains("--dport 15008 -j RETURN"));
        assert!(text.contains("-s 10.1.0.1/32 -j RETURN"));
        assert!(text.contains("-d 10.1.0.11/32"));
        assert!(text.ends_with("COMMIT\n"));
    }
}
