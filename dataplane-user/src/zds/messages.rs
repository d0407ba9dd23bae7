//! The ZDS messages this server sends and reads, as bytes.

use prost::Message as _;

use super::{MAX_DATAGRAM, ZdsError, types::ZdsPod};
use crate::istio_api::zds::{
    AddWorkload, DelWorkload, SnapshotSent, Version, WorkloadInfo, WorkloadRequest,
    WorkloadResponse, ZdsHello, workload_request::Payload, workload_response,
};

/// `AddWorkload` for `pod`, refused if ztunnel could not read it whole.
pub(super) fn add(pod: &ZdsPod) -> Result<Vec<u8>, ZdsError> {
    if pod.uid.is_empty() {
        return Err(ZdsError::InvalidPod {
            uid: pod.uid.clone(),
            reason: "the uid is empty (ztunnel's Del needs it)".into(),
        });
    }
    let bytes = request(Payload::Add(AddWorkload {
        uid: pod.uid.clone(),
        workload_info: Some(WorkloadInfo {
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            service_account: pod.service_account.clone(),
        }),
    }));
    if bytes.len() > MAX_DATAGRAM {
        return Err(ZdsError::InvalidPod {
            uid: pod.uid.clone(),
            reason: format!(
                "its AddWorkload is {} bytes, over the {MAX_DATAGRAM} ztunnel reads",
                bytes.len()
            ),
        });
    }
    Ok(bytes)
}

/// `DelWorkload{uid}`, refused if ztunnel could not read it whole.
pub(super) fn del(uid: &str) -> Result<Vec<u8>, ZdsError> {
    let bytes = request(Payload::Del(DelWorkload { uid: uid.into() }));
    if bytes.len() > MAX_DATAGRAM {
        return Err(ZdsError::InvalidPod {
            uid: uid.into(),
            reason: format!("the uid is over the {MAX_DATAGRAM} bytes ztunnel reads"),
        });
    }
    Ok(bytes)
}

/// `SnapshotSent`.
pub(super) fn snapshot_sent() -> Vec<u8> {
    request(Payload::SnapshotSent(SnapshotSent {}))
}

fn request(payload: Payload) -> Vec<u8> {
    WorkloadRequest {
        payload: Some(payload),
    }
    .encode_to_vec()
}

/// Checks a hello datagram: a `ZdsHello` announcing V1.
pub(super) fn check_hello(data: &[u8], peer_pid: i32) -> Result<(), ZdsError> {
    let hello = ZdsHello::decode(data).map_err(|e| ZdsError::Protocol {
        step: "reading the hello",
        peer_pid,
        what: format!("{} bytes that are not a ZdsHello ({e})", data.len()),
    })?;
    if hello.version != Version::V1 as i32 {
        return Err(ZdsError::UnsupportedVersion {
            peer_pid,
            version: hello.version,
        });
    }
    Ok(())
}

/// The error text of an ack datagram (empty = success).
pub(super) fn ack_error(
    data: &[u8],
    peer_pid: i32,
    step: &'static str,
) -> Result<String, ZdsError> {
    let response = WorkloadResponse::decode(data).map_err(|e| ZdsError::Protocol {
        step,
        peer_pid,
        what: format!("{} bytes that are not a WorkloadResponse ({e})", data.len()),
    })?;
    match response.payload {
        Some(workload_response::Payload::Ack(ack)) => Ok(ack.error),
        None => Err(ZdsError::Protocol {
            step,
            peer_pid,
            what: "a WorkloadResponse without an ack".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name_len: usize) -> ZdsPod {
        ZdsPod {
            uid: "uid-1".into(),
            name: "n".repeat(name_len),
            namespace: "default".into(),
            service_account: "sa".into(),
            ips: vec![],
            netns: std::fs::File::open("/dev/null").expect("/dev/null").into(),
        }
    }

    #[test]
    fn an_add_ztunnel_cannot_read_whole_is_refused() {
        assert!(add(&pod(253)).is_ok_and(|b| b.len() <= MAX_DATAGRAM));
        let err = add(&pod(MAX_DATAGRAM)).expect_err("too long");
        assert!(err.to_string().contains("over the 1024"), "{err}");
    }

    #[test]
    fn hello_must_be_v1() {
        let v1 = ZdsHello { version: 1 }.encode_to_vec();
        assert!(check_hello(&v1, 7).is_ok());
        let v2 = ZdsHello { version: 2 }.encode_to_vec();
        assert!(matches!(
            check_hello(&v2, 7),
            Err(ZdsError::UnsupportedVersion { version: 2, .. })
        ));
        // The zero value (no version field at all) is NOT_USED.
        assert!(check_hello(&[], 7).is_err());
        assert!(check_hello(&[0xff, 0xff, 0xff], 7).is_err());
    }

    #[test]
    fn a_response_without_ack_is_a_protocol_error() {
        let empty = WorkloadResponse { payload: None }.encode_to_vec();
        assert!(ack_error(&empty, 7, "test").is_err());
    }
}
