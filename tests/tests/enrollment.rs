//! Enrollment through the agent's enrollment actor: a changed pod is
//! re-enrolled make-before-break (its listening sockets never close, so no
//! connection is refused), and a pod that leaves takes its certificate with
//! it.

use std::{
    net::{SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use dataplane_tests::{
    Agent,
    topology::{Node, Pod},
};
use dataplane_user::{control::Request, inspect::CertInfo};

/// The inode of the socket listening on `port` inside the pod, from
/// `/proc/net/tcp6` as the pod's namespace shows it to a thread inside it (the engine's inbound
/// and HBONE listeners are dual-stack `[::]` sockets).
fn listener_inode(pod: &Pod, port: u16) -> anyhow::Result<u64> {
    let table = pod
        .netns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/tcp6"))??;
    let local_suffix = format!(":{port:04X}");
    for line in table.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // local_address, rem_address, st (0A = LISTEN), ..., inode at 9.
        if fields.len() > 9 && fields[1].ends_with(&local_suffix) && fields[3] == "0A" {
            return Ok(fields[9].parse()?);
        }
    }
    anyhow::bail!("nothing listens on port {port} in the pod:\n{table}")
}

fn certificates(agent: &Agent) -> anyhow::Result<Vec<String>> {
    let response = agent.call(&Request::Certs)?;
    anyhow::ensure!(response.ok, "certs refused: {:?}", response.error);
    let certs: Vec<CertInfo> = serde_json::from_value(response.report.unwrap_or_default())?;
    Ok(certs.into_iter().map(|c| c.identity).collect())
}

#[test]
fn re_enrolling_a_changed_pod_keeps_its_listening_sockets_and_refuses_nothing() -> anyhow::Result<()>
{
    let mut node = Node::new("enrmbb", 1)?;
    let pod = node.add_pod("enrmbb")?;
    let stranger = node.add_pod("enrmbb")?;
    let agent = Agent::start("enrmbb", &node, &[])?;
    let mut spec = Agent::spec_for(&pod, "server");
    let added = agent.enroll(spec.clone())?;
    anyhow::ensure!(added.ok, "enroll refused: {:?}", added.error);
    let before = [listener_inode(&pod, 15006)?, listener_inode(&pod, 15008)?];

    // A pod outside the mesh connects to the pod's HBONE port in a loop
    // while the pod is re-enrolled with another identity, over and over.
    let stop = Arc::new(AtomicBool::new(false));
    let (attempts, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let target = SocketAddr::new(pod.ip4.into(), 15008);
    let prober = {
        let (stop, attempts, refused) = (
            Arc::clone(&stop),
            Arc::clone(&attempts),
            Arc::clone(&refused),
        );
        let netns = stranger.netns.path().to_path_buf();
        std::thread::spawn(move || {
            dataplane_user::netns::run_in_netns(&netns, move || {
                while !stop.load(Ordering::Relaxed) {
                    attempts.fetch_add(1, Ordering::Relaxed);
                    if TcpStream::connect_timeout(&target, Duration::from_secs(5)).is_err() {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
    };
    let mut accounts = Vec::new();
    for round in 0..20 {
        spec.service_account = format!("sa-{round}");
        accounts.push(spec.service_account.clone());
        let response = agent.enroll(spec.clone())?;
        anyhow::ensure!(response.ok, "re-enroll refused: {:?}", response.error);
    }
    stop.store(true, Ordering::Relaxed);
    prober
        .join()
        .map_err(|_| anyhow::anyhow!("prober panicked"))??;

    let after = [listener_inode(&pod, 15006)?, listener_inode(&pod, 15008)?];
    assert_eq!(
        before, after,
        "re-enrollment replaced the pod's listening sockets"
    );
    assert_eq!(
        refused.load(Ordering::Relaxed),
        0,
        "connections refused during re-enrollment (of {})",
        attempts.load(Ordering::Relaxed)
    );
    // Only the identity in force keeps a certificate.
    let held = certificates(&agent)?;
    assert_eq!(
        held,
        vec!["spiffe://cluster.local/ns/test/sa/sa-19".to_owned()],
        "certificates of identities no pod has any more must go"
    );
    Ok(())
}

#[test]
fn a_pod_that_leaves_takes_its_certificate_but_not_a_shared_one() -> anyhow::Result<()> {
    let mut node = Node::new("enrcert", 1)?;
    let a = node.add_pod("enrcert")?;
    let b = node.add_pod("enrcert")?;
    let c = node.add_pod("enrcert")?;
    let agent = Agent::start("enrcert", &node, &[])?;
    // a and b share the default service account; c has its own.
    agent.enroll(Agent::spec_for(&a, "a"))?;
    agent.enroll(Agent::spec_for(&b, "b"))?;
    let mut c_spec = Agent::spec_for(&c, "c");
    c_spec.service_account = "own".into();
    agent.enroll(c_spec)?;
    let shared = "spiffe://cluster.local/ns/test/sa/default".to_owned();
    let own = "spiffe://cluster.local/ns/test/sa/own".to_owned();
    let mut held = certificates(&agent)?;
    held.sort();
    assert_eq!(held, vec![shared.clone(), own.clone()]);

    for uid in ["uid-c", "uid-a"] {
        let removed = agent.call(&Request::Remove {
            uid: Some(uid.into()),
            netns: None,
        })?;
        anyhow::ensure!(
            removed.removed == Some(true),
            "{uid} not removed: {removed:?}"
        );
    }
    assert_eq!(
        certificates(&agent)?,
        vec![shared],
        "b still uses the shared identity; c's went with it"
    );
    agent.call(&Request::Remove {
        uid: Some("uid-b".into()),
        netns: None,
    })?;
    assert!(certificates(&agent)?.is_empty());
    Ok(())
}
