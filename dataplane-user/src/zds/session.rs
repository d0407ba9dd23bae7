//! One ztunnel connection, start to end: the hello, the snapshot, then the
//! callers' requests one at a time, nacked Adds re-sent with backoff, and
//! an eye on the idle socket (ztunnel never speaks unasked, so anything
//! readable then is the end or a protocol error).

use std::{collections::HashMap, os::fd::AsFd, sync::Arc, time::Duration};

use tokio::{
    sync::mpsc,
    time::{Instant, sleep_until, timeout},
};
use tracing::{info, warn};

use super::{
    ZdsError, messages,
    registry::{Command, RegisteredPod, Registry},
    seqpacket::{MAX_DATAGRAM, Received, SeqpacketConn},
    types::{AddOutcome, ZdsConfig, ZdsObserver, ZtunnelPeer},
};

/// A nacked Add waiting to be re-sent.
struct Retry {
    pod: Arc<RegisteredPod>,
    due: Instant,
}

/// What woke an idle connection.
enum Event {
    Command(Option<Command>),
    Unsolicited(std::io::Result<Received>),
    RetryDue,
}

/// Serves one accepted connection until it ends, then forgets it and
/// tells the observer.
pub(super) async fn run(
    conn: SeqpacketConn,
    queue: mpsc::Receiver<Command>,
    registry: Arc<Registry>,
    observer: Arc<dyn ZdsObserver>,
    config: Arc<ZdsConfig>,
) {
    let peer = conn.peer();
    let mut session = Session {
        conn,
        peer,
        registry,
        observer,
        config,
        retries: HashMap::new(),
    };
    let result = session.serve(queue).await;
    let had_hello = session.registry.close_connection(peer.connection);
    match result {
        Ok(()) => info!(
            peer_pid = peer.pid,
            connection = peer.connection,
            "ztunnel connection closed by the agent"
        ),
        Err(ZdsError::Closed { step, .. }) => info!(
            peer_pid = peer.pid,
            connection = peer.connection,
            step,
            "ztunnel disconnected"
        ),
        Err(error) => warn!(
            peer_pid = peer.pid,
            connection = peer.connection,
            %error,
            "dropped ztunnel connection"
        ),
    }
    if had_hello {
        session.observer.disconnected(&peer);
    }
}

struct Session {
    conn: SeqpacketConn,
    peer: ZtunnelPeer,
    registry: Arc<Registry>,
    observer: Arc<dyn ZdsObserver>,
    config: Arc<ZdsConfig>,
    /// By pod uid.
    retries: HashMap<String, Retry>,
}

impl Session {
    async fn serve(&mut self, mut queue: mpsc::Receiver<Command>) -> Result<(), ZdsError> {
        let hello = self.recv("reading the hello").await?;
        messages::check_hello(&hello, self.peer.pid)?;
        let snapshot = self.registry.hello(self.peer.connection);
        info!(
            peer_pid = self.peer.pid,
            peer_uid = self.peer.uid,
            connection = self.peer.connection,
            pods = snapshot.len(),
            "ztunnel said hello (V1); sending the snapshot"
        );
        for pod in &snapshot {
            self.add(pod).await?;
        }
        let error = self
            .request(&messages::snapshot_sent(), None, "sending SnapshotSent")
            .await?;
        if !error.is_empty() {
            warn!(peer_pid = self.peer.pid, %error, "ztunnel answered SnapshotSent with an error");
        }
        loop {
            let next_retry = self.retries.values().map(|r| r.due).min();
            let event = tokio::select! {
                command = queue.recv() => Event::Command(command),
                received = self.conn.recv() => Event::Unsolicited(received),
                () = sleep_until_some(next_retry) => Event::RetryDue,
            };
            match event {
                // The server stopped.
                Event::Command(None) => return Ok(()),
                Event::Command(Some(command)) => self.execute(command).await?,
                Event::Unsolicited(received) => return Err(self.unsolicited(received)),
                Event::RetryDue => self.retry_due().await?,
            }
        }
    }

    async fn execute(&mut self, command: Command) -> Result<(), ZdsError> {
        match command {
            Command::Add { pod, reply } => match self.add(&pod).await {
                Ok(outcome) => {
                    let _ = reply.send(outcome);
                    Ok(())
                }
                Err(error) => {
                    let _ = reply.send(outcome_of(&error));
                    Err(error)
                }
            },
            Command::Del {
                request,
                uid,
                reply,
            } => {
                self.retries.remove(&uid);
                match self.request(&request, None, "sending DelWorkload").await {
                    Ok(error) if error.is_empty() => {
                        info!(uid, peer_pid = self.peer.pid, "ztunnel removed the pod");
                        let _ = reply.send(Ok(()));
                        Ok(())
                    }
                    Ok(error) => {
                        warn!(uid, peer_pid = self.peer.pid, %error, "ztunnel answered DelWorkload with an error");
                        let _ = reply.send(Err(error));
                        Ok(())
                    }
                    Err(error) => {
                        let _ = reply.send(Err(error.to_string()));
                        Err(error)
                    }
                }
            }
        }
    }

    /// Sends one Add and records the answer. An error is the connection's
    /// end (the stream can no longer be trusted to pair acks).
    async fn add(&mut self, pod: &Arc<RegisteredPod>) -> Result<AddOutcome, ZdsError> {
        let uid = pod.pod.uid.as_str();
        let answer = self
            .request(
                &pod.request,
                Some(pod.pod.netns.as_fd()),
                "sending AddWorkload",
            )
            .await;
        let error = match answer {
            Ok(error) => error,
            Err(fatal) => {
                self.registry.failed(pod, &fatal.to_string());
                return Err(fatal);
            }
        };
        if error.is_empty() {
            self.retries.remove(uid);
            info!(
                uid,
                name = pod.pod.name,
                namespace = pod.pod.namespace,
                peer_pid = self.peer.pid,
                "ztunnel acked the pod: its listeners are bound"
            );
            if self.registry.acked(pod, self.peer) {
                self.observer.acked(uid, &self.peer);
            }
            return Ok(AddOutcome::Acked { peer: self.peer });
        }
        match self.registry.failed(pod, &error) {
            Some(attempts) => {
                self.observer.refused(uid, &self.peer, &error, attempts);
                let delay = backoff(&self.config, attempts);
                warn!(
                    uid,
                    name = pod.pod.name,
                    namespace = pod.pod.namespace,
                    peer_pid = self.peer.pid,
                    %error,
                    attempts,
                    retry_in = ?delay,
                    "ztunnel could not set the pod up"
                );
                self.retries.insert(
                    uid.to_owned(),
                    Retry {
                        pod: Arc::clone(pod),
                        due: Instant::now() + delay,
                    },
                );
            }
            None => {
                self.retries.remove(uid);
            }
        }
        Ok(AddOutcome::Nacked { error })
    }

    async fn retry_due(&mut self) -> Result<(), ZdsError> {
        let now = Instant::now();
        let due: Vec<String> = self
            .retries
            .iter()
            .filter(|(_, r)| r.due <= now)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in due {
            let Some(retry) = self.retries.remove(&uid) else {
                continue;
            };
            if self.registry.should_retry(&retry.pod, self.peer.connection) {
                self.add(&retry.pod).await?;
            }
        }
        Ok(())
    }

    /// Sends one request and waits for its answer: the ack's error text.
    async fn request(
        &self,
        data: &[u8],
        fd: Option<std::os::fd::BorrowedFd<'_>>,
        step: &'static str,
    ) -> Result<String, ZdsError> {
        let peer_pid = self.peer.pid;
        match timeout(self.config.io_timeout, self.conn.send(data, fd)).await {
            Err(_) => {
                return Err(ZdsError::Timeout {
                    step,
                    peer_pid,
                    after: self.config.io_timeout,
                });
            }
            Ok(Err(source)) => {
                return Err(ZdsError::Io {
                    step,
                    peer_pid,
                    source,
                });
            }
            Ok(Ok(())) => {}
        }
        let answer = self.recv(step).await?;
        messages::ack_error(&answer, peer_pid, step)
    }

    /// Waits for one datagram the peer owes.
    async fn recv(&self, step: &'static str) -> Result<Vec<u8>, ZdsError> {
        let peer_pid = self.peer.pid;
        match timeout(self.config.io_timeout, self.conn.recv()).await {
            Err(_) => Err(ZdsError::Timeout {
                step,
                peer_pid,
                after: self.config.io_timeout,
            }),
            Ok(Err(source)) => Err(ZdsError::Io {
                step,
                peer_pid,
                source,
            }),
            Ok(Ok(Received::Datagram(data))) => Ok(data),
            Ok(Ok(other)) => Err(self.bad_datagram(step, other)),
        }
    }

    /// Something readable while the peer should be silent.
    fn unsolicited(&self, received: std::io::Result<Received>) -> ZdsError {
        let step = "idle";
        match received {
            Err(source) => ZdsError::Io {
                step,
                peer_pid: self.peer.pid,
                source,
            },
            Ok(Received::Datagram(data)) => ZdsError::Protocol {
                step,
                peer_pid: self.peer.pid,
                what: format!("an unrequested {}-byte datagram", data.len()),
            },
            Ok(other) => self.bad_datagram(step, other),
        }
    }

    fn bad_datagram(&self, step: &'static str, received: Received) -> ZdsError {
        let peer_pid = self.peer.pid;
        let what = match received {
            Received::End => return ZdsError::Closed { step, peer_pid },
            Received::Truncated => format!("a datagram over {MAX_DATAGRAM} bytes"),
            Received::Descriptors => "file descriptors (ztunnel sends none)".into(),
            Received::Datagram(data) => format!("an unexpected {}-byte datagram", data.len()),
        };
        ZdsError::Protocol {
            step,
            peer_pid,
            what,
        }
    }
}

/// The delay before re-sending after `attempts` failures.
fn backoff(config: &ZdsConfig, attempts: u32) -> Duration {
    let factor = 1u32 << attempts.saturating_sub(1).min(16);
    config
        .retry_first
        .saturating_mul(factor)
        .min(config.retry_max)
}

/// What a caller whose Add was in flight learns when the connection ends.
fn outcome_of(error: &ZdsError) -> AddOutcome {
    match error {
        ZdsError::Timeout { .. } => AddOutcome::TimedOut,
        other => AddOutcome::ConnectionLost {
            reason: other.to_string(),
        },
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let config = ZdsConfig {
            retry_first: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
            ..ZdsConfig::default()
        };
        let delays: Vec<u64> = (1..=7).map(|a| backoff(&config, a).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(backoff(&config, u32::MAX), Duration::from_secs(30));
    }
}
