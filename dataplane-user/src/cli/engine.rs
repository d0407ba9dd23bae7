//! Flags choosing what serves enrolled pods: this agent's own engine, or a
//! stock Istio ztunnel on the node that this agent feeds over ZDS (the part
//! istio-cni's node agent plays in Istio ambient) while its kernel programs
//! do the capture istio-cni does with iptables.

use std::{path::PathBuf, time::Duration};

use clap::{Args, ValueEnum};

use super::CaptureMode;
use crate::{agent::config::EngineConfig, zds::ZdsConfig};

/// Where ztunnel looks for its node agent by default.
pub const DEFAULT_ZDS_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// What serves enrolled pods' captured traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineMode {
    /// This agent's engine (HBONE, policy, telemetry): the default.
    Builtin,
    /// A stock Istio ztunnel on the node: the agent serves ZDS on
    /// `--zds-socket`, hands ztunnel each enrolled pod's network namespace
    /// and points the kernel programs at the listeners ztunnel opens in it.
    Ztunnel,
}

/// Engine settings.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// What serves enrolled pods' traffic: `builtin` (this agent) or
    /// `ztunnel` (a stock Istio ztunnel, fed over ZDS; this agent only
    /// captures).
    #[arg(long, env = "DATAPLANE_ENGINE", value_enum, default_value = "builtin")]
    pub engine: EngineMode,
    /// The ZDS socket served to ztunnel (`--engine ztunnel`); ztunnel's
    /// `INPOD_UDS` must name the same path.
    #[arg(long, env = "DATAPLANE_ZDS_SOCKET", default_value = DEFAULT_ZDS_SOCKET)]
    pub zds_socket: PathBuf,
    /// How long enrolling a pod waits for ztunnel to bind its listeners in
    /// the pod and acknowledge (`--engine ztunnel`). A pod not acknowledged
    /// in time stays enrolled and is handed over again.
    #[arg(long, env = "DATAPLANE_ZDS_ACK_TIMEOUT", default_value = "5s", value_parser = super::parse_positive_duration)]
    pub zds_ack_timeout: Duration,
}

/// Errors of the engine flags.
#[derive(Debug, thiserror::Error)]
pub enum EngineArgsError {
    /// `--engine ztunnel` with a flag it cannot work with.
    #[error("--engine ztunnel cannot run with {flag}: {why}")]
    Conflict {
        /// The conflicting flag.
        flag: &'static str,
        /// Why, and what to do instead.
        why: &'static str,
    },
}

impl EngineArgs {
    /// Checks the engine choice against the other flags.
    pub fn check(
        &self,
        capture: CaptureMode,
        takeover: bool,
        proxy_mark: u32,
    ) -> Result<(), EngineArgsError> {
        if self.engine == EngineMode::Builtin {
            return Ok(());
        }
        if capture != CaptureMode::Ebpf {
            return Err(EngineArgsError::Conflict {
                flag: "--capture iptables",
                why: "the agent replaces istio-cni's iptables with its kernel programs; \
                      run istio-cni instead, or use --capture ebpf",
            });
        }
        if takeover {
            return Err(EngineArgsError::Conflict {
                flag: "--takeover",
                why: "ztunnel owns the listening sockets; restart the agent with \
                      --on-exit keep instead (capture stays in place and ztunnel \
                      reconnects to the new agent)",
            });
        }
        if proxy_mark == 0 {
            return Err(EngineArgsError::Conflict {
                flag: "--proxy-mark 0",
                why: "ztunnel's own sockets must be exempt from capture; set \
                      --proxy-mark to ztunnel's PACKET_MARK (0x539 by default)",
            });
        }
        Ok(())
    }

    /// What serves enrolled pods, as the agent takes it.
    pub fn to_config(&self) -> EngineConfig {
        match self.engine {
            EngineMode::Builtin => EngineConfig::Builtin,
            EngineMode::Ztunnel => EngineConfig::Ztunnel {
                zds: ZdsConfig {
                    socket: self.zds_socket.clone(),
                    request_timeout: self.zds_ack_timeout,
                    ..ZdsConfig::default()
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(engine: EngineMode) -> EngineArgs {
        EngineArgs {
            engine,
            zds_socket: DEFAULT_ZDS_SOCKET.into(),
            zds_ack_timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn ztunnel_needs_ebpf_capture_no_takeover_and_a_mark() {
        let zt = args(EngineMode::Ztunnel);
        assert!(zt.check(CaptureMode::Ebpf, false, 0x539).is_ok());
        for (capture, takeover, mark, flag) in [
            (CaptureMode::Iptables, false, 0x539, "--capture iptables"),
            (CaptureMode::Ebpf, true, 0x539, "--takeover"),
            (CaptureMode::Ebpf, false, 0, "--proxy-mark 0"),
        ] {
            match zt.check(capture, takeover, mark) {
                Err(EngineArgsError::Conflict { flag: f, .. }) => assert_eq!(f, flag),
                other => panic!("{flag}: expected a conflict, got {other:?}"),
            }
        }
        // The builtin engine has none of these constraints here.
        assert!(
            args(EngineMode::Builtin)
                .check(CaptureMode::Iptables, true, 0)
                .is_ok()
        );
    }
}
