//! The agent's local control socket: enroll, unenroll and list pods, and
//! the operator's reports (status, configuration dump, certificates).
//!
//! A Unix stream socket at `<state dir>/<instance>/agent.sock` (mode 0600,
//! so only root reaches it), one JSON request per connection answered by one
//! JSON response. The CNI plugin and `dataplane pod ...` use it, and a new
//! agent taking over (`handOver`, the one request answered differently).

mod server;

use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

pub use server::{MAX_CLIENTS, REQUEST_TIMEOUT, StagedSocket, bind, serve};

use crate::enroll::{PodSpec, PodStatus};

/// Largest request accepted, in bytes.
pub const MAX_MESSAGE: u64 = 1 << 20;

/// Largest response a client reads, in bytes. A response comes from the
/// client's own agent, and a configuration dump holds the whole mesh
/// twice (ours and ztunnel's sections, see [`crate::inspect`]): 4,000
/// workloads already pass 1 MiB. As large as the xDS messages the agent
/// accepts from istiod (`xds::client`), so any mesh it holds can be dumped.
pub const MAX_RESPONSE: u64 = 64 << 20;

/// A request to the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase", deny_unknown_fields)]
pub enum Request {
    /// Enroll a pod (idempotent).
    Add {
        /// The pod.
        pod: Box<PodSpec>,
    },
    /// Unenroll a pod by uid or by network namespace path (idempotent).
    Remove {
        /// The pod's uid.
        #[serde(default)]
        uid: Option<String>,
        /// The pod's network namespace path.
        #[serde(default)]
        netns: Option<PathBuf>,
    },
    /// List enrolled pods.
    List,
    /// The status screen (`report`: an `inspect::StatusReport`).
    Status,
    /// The configuration dump (`report`: JSON, as admin `/config_dump`).
    ConfigDump,
    /// Workload certificates (`report`: a list of `inspect::CertInfo`).
    Certs,
    /// A new agent of this instance asks to take the pods over
    /// (`dataplane run --takeover`). Answered with `ok` and one end of the
    /// hand-over channel attached (`SCM_RIGHTS`); see [`crate::handover`].
    HandOver {
        /// The new agent's pid.
        pid: u32,
    },
}

/// The agent's answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Response {
    /// Whether the request succeeded.
    pub ok: bool,
    /// Why not, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Pods concerned: the one added, or every pod for `list`.
    #[serde(default)]
    pub pods: Vec<PodStatus>,
    /// For `remove`: whether a pod was enrolled and is now removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removed: Option<bool>,
    /// For `status`, `configDump` and `certs`: the report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<serde_json::Value>,
}

/// Errors talking to the agent.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket could not be reached.
    #[error(
        "cannot reach the agent at {path} (is `dataplane run` running with this --instance and --state-dir?)"
    )]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The exchange failed mid-way.
    #[error("talking to the agent at {path} failed")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The agent's answer is not a valid response.
    #[error("the agent at {path} sent an invalid response")]
    Protocol {
        /// The socket path.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The agent refused the request.
    #[error("the agent refused: {0}")]
    Refused(String),
}

/// Reads a request as the agent receives it: one JSON document of at most
/// [`MAX_MESSAGE`] bytes. The error is the refusal the client is sent.
pub fn read_request(body: &[u8]) -> Result<Request, String> {
    if body.len() as u64 > MAX_MESSAGE {
        return Err(format!("request larger than {MAX_MESSAGE} bytes"));
    }
    let invalid = |err: serde_json::Error| format!("invalid request: {err}");
    let request: Request = serde_json::from_slice(body).map_err(invalid)?;
    // serde ignores extra fields on the unit variants of an internally
    // tagged enum, `deny_unknown_fields` notwithstanding: a misspelt
    // argument (`{"op":"list","namespace":"x"}`) would pass unnoticed.
    if matches!(
        request,
        Request::List | Request::Status | Request::ConfigDump | Request::Certs
    ) {
        let fields: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).map_err(invalid)?;
        if let Some(extra) = fields.keys().find(|key| *key != "op") {
            return Err(format!(
                "invalid request: unknown field `{extra}`: this op takes no arguments"
            ));
        }
    }
    Ok(request)
}

/// Path of the control socket of an instance.
pub fn socket_path(state_dir: &Path, instance: &str) -> PathBuf {
    state_dir.join(instance).join("agent.sock")
}

/// Sends `request` and returns the agent's successful response.
pub fn call(path: &Path, request: &Request, timeout: Duration) -> Result<Response, ControlError> {
    let io_err = |source| ControlError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut stream = UnixStream::connect(path).map_err(|source| ControlError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    stream.set_read_timeout(Some(timeout)).map_err(io_err)?;
    stream.set_write_timeout(Some(timeout)).map_err(io_err)?;
    let body = serde_json::to_vec(request).map_err(|e| io_err(e.into()))?;
    stream.write_all(&body).map_err(io_err)?;
    stream.shutdown(std::net::Shutdown::Write).map_err(io_err)?;
    let mut reply = Vec::new();
    stream
        .take(MAX_RESPONSE)
        .read_to_end(&mut reply)
        .map_err(io_err)?;
    let response: Response =
        serde_json::from_slice(&reply).map_err(|source| ControlError::Protocol {
            path: path.to_path_buf(),
            source,
        })?;
    if response.ok {
        Ok(response)
    } else {
        Err(ControlError::Refused(
            response.error.unwrap_or_else(|| "no reason given".into()),
        ))
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;
    use crate::fuzz_seeds;

    /// What a client sends for `request`, read back as the agent reads it.
    fn round_trip(request: &Request) -> Request {
        let body = serde_json::to_vec(request).unwrap();
        fuzz_seeds::seed("control_request", &body);
        read_request(&body).unwrap()
    }

    #[test]
    fn every_request_reads_back_as_sent() {
        let pod = PodSpec {
            uid: "u1".into(),
            name: "web-0".into(),
            namespace: "shop".into(),
            service_account: "web".into(),
            trust_domain: "cluster.local".into(),
            netns: "/var/run/netns/web".into(),
            ips: vec!["10.1.0.5".parse().unwrap(), "fd00::5".parse().unwrap()],
            node_addr: Some("10.1.0.1".parse().unwrap()),
            exclusions: Default::default(),
            dns_capture: None,
            fast_path: Some(false),
        };
        for request in [
            Request::Add { pod: Box::new(pod) },
            Request::Remove {
                uid: Some("u1".into()),
                netns: None,
            },
            Request::Remove {
                uid: None,
                netns: Some("/var/run/netns/web".into()),
            },
            Request::List,
            Request::Status,
            Request::ConfigDump,
            Request::Certs,
            Request::HandOver { pid: 42 },
        ] {
            assert_eq!(round_trip(&request), request);
        }
    }

    #[test]
    fn refuses_what_is_not_a_request() {
        for (body, expected) in [
            (&br#"{"op":"list","extra":1}"#[..], "unknown field"),
            (br#"{"op":"reboot"}"#, "unknown variant"),
            (br#"{"op":"add"}"#, "missing field"),
            (br#"{"op":"add","pod":{"uid":"u"}}"#, "missing field"),
            (b"\xff\xfe", "invalid request"),
            (b"", "EOF"),
        ] {
            fuzz_seeds::seed("control_request", body);
            let err = read_request(body).unwrap_err();
            assert!(err.contains(expected), "{err}");
        }
        let huge = vec![b' '; MAX_MESSAGE as usize + 1];
        assert!(read_request(&huge).unwrap_err().contains("larger than"));
    }
}
